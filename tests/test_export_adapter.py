"""The exported adapter is a real PEFT adapter: PEFT loads it with no missing or unexpected keys, and the
adapted model computes what Megatron-with-LoRA computed and what our merged model computes."""

import json

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import BASE_ONLY, FIXTURE_NAMES, FIXTURES, fixture_info, merge_args
from lora_merge.cli import main

# What vLLM's LoRA loader accepts (vllm/lora/models.py + utils.parse_fine_tuned_lora_name): one
# adapter_model.safetensors (no shards), keys ending in .lora_A.weight / .lora_B.weight only, no
# modules_to_save, no DoRA; for Llama/Qwen2 the packed modules are built from these HF names.
VLLM_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
VLLM_LLAMA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def export(name, out):
    root = FIXTURES / name
    return main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out)])


@pytest.fixture(scope="module")
def base_models(tmp_path_factory):
    """The HF base model of each fixture (LoRA scaled to 0; the e2e tests check it against Megatron)."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp("base") / name
            assert main(merge_args(name, out) + BASE_ONLY + ["--dtype", "float32"]) == 0
            cache[name] = out
        return cache[name]

    return get


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_peft_loads_adapter_and_computes_megatron_logits(name, tmp_path, base_models, merged_fixture):
    adapter = tmp_path / "adapter"
    assert export(name, adapter) == 0
    base = AutoModelForCausalLM.from_pretrained(base_models(name), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)

    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    expected = get_peft_model_state_dict(model)
    assert set(saved) == set(expected)  # nothing missing, nothing unexpected
    for key, tensor in saved.items():
        assert torch.equal(expected[key].to(tensor.dtype), tensor), key

    ref = torch.load(FIXTURES / name / "logits.pt", weights_only=True)
    adapted = logits(model, ref["input_ids"])
    merged = logits(AutoModelForCausalLM.from_pretrained(merged_fixture(name), dtype=torch.float32), ref["input_ids"])
    if fixture_info(name)["dtype"] == "float32":
        assert (adapted - ref["logits_lora"]).abs().max() <= 1e-4
        assert (adapted - merged).abs().max() <= 1e-4
    else:  # bf16 merged weights are rounded once; the unmerged adapter is not
        assert (adapted - ref["logits_lora"]).abs().max() <= 1e-4
        assert (adapted - merged).abs().max() <= 5e-2
    assert (adapted - ref["logits_base"]).abs().max() > 0.5


def test_adapter_follows_vllm_conventions(tmp_path):
    adapter = tmp_path / "adapter"
    assert export("tp2pp2_bf16_unfiltered", adapter) == 0
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 12
    assert config["use_dora"] is False and config["use_rslora"] is False and config["bias"] == "none"
    assert not config.get("modules_to_save")
    assert set(config["target_modules"]) == VLLM_LLAMA_TARGETS
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        keys = list(f.keys())
        assert all(k.startswith("base_model.model.model.layers.") and k.endswith(VLLM_SUFFIXES) for k in keys)
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert len(keys) == 4 * 7 * 2


def test_partial_targets_and_rank_note(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    assert export("tp2_llama_fp32_partial", adapter) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert "max-lora-rank" not in capsys.readouterr().out  # r=4 is within vLLM's default
