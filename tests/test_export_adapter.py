"""The exported adapter is a real PEFT adapter: PEFT loads it with no missing or unexpected keys, and the
adapted model computes what Megatron-with-LoRA computed and what our merged model computes."""

import json

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers import FIXTURE_NAMES, FIXTURES, fixture_info, fixture_root
from lora_merge.cli import main

# What vLLM's LoRA loader accepts (vllm/lora/models.py + utils.parse_fine_tuned_lora_name): one
# adapter_model.safetensors (no shards), keys ending in .lora_A.weight / .lora_B.weight only, no
# modules_to_save, no DoRA; for Llama/Qwen2 the packed modules are built from these HF names.
VLLM_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
VLLM_LLAMA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def export(name, out):
    root = FIXTURES / name
    return main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out)])


@pytest.fixture
def base_models(base_model):
    """The HF base model of each fixture (LoRA scaled to 0; the e2e tests check it against Megatron)."""
    return lambda name: base_model(name, "--dtype", "float32")


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
    # One weights file (vLLM reads no shards); README.md is the adapter's model card.
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
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


@pytest.mark.parametrize("hf_ref", ["reference", "merged"])
def test_a_peft_adapter_as_lora_is_refused_in_one_line(tmp_path, capsys, merged_fixture, hf_ref):
    """export-adapter reads a Megatron LoRA checkpoint; a PEFT adapter (here one it wrote) is named as such,
    whether or not --hf-ref holds weights."""
    name = "tp2_fp32_filtered"
    adapter = tmp_path / "adapter"
    assert export(name, adapter) == 0
    capsys.readouterr()
    ref = FIXTURES / name / "hf_ref" if hf_ref == "reference" else merged_fixture(name)
    out = tmp_path / "again"
    code = main(["export-adapter", "--lora", str(adapter), "--hf-ref", str(ref), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"lora-merge: error: {adapter}: a PEFT adapter (adapter_config.json), already what "
                      "export-adapter writes; expected a Megatron LoRA checkpoint dir (PEFT and vLLM load this "
                      "adapter as it is)")
    assert not out.exists()


def test_a_layer_without_lora_gets_zero_factors_with_allow_partial_lora(tmp_path, capsys, base_models):
    """Layer 1 lost its linear_fc2 LoRA: the export stops like the merge, or with --allow-partial-lora writes
    zero factors for that down_proj (PEFT targets down_proj in every layer) and computes what the partial
    merge computes."""
    from helpers import copy_fixture, rank_files, rewrite

    name = "tp2_fp32_filtered"
    root = copy_fixture(name, tmp_path)
    for rank_file in rank_files(root / "lora"):
        rewrite(rank_file, lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items()
                                                            if not k.startswith("decoder.layers.1.mlp.linear_fc2.")}))
    adapter = tmp_path / "adapter"
    args = ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(adapter)]
    assert main(args) == 2
    assert "pass --allow-partial-lora if that is intended" in capsys.readouterr().err and not adapter.exists()
    assert main(args + ["--allow-partial-lora"]) == 0
    err = capsys.readouterr().err
    assert "1 of the 28 modules the adapter targets have no LoRA in the checkpoint (layer 1 mlp.down_proj)" in err
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        assert not f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").any()

    merged = tmp_path / "merged"
    assert main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(merged), "--no-progress", "--allow-partial-lora"]) == 0
    base = AutoModelForCausalLM.from_pretrained(base_models(name), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(get_peft_model_state_dict(model))
    ids = torch.load(FIXTURES / name / "logits.pt", weights_only=True)["input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert (logits(model, ids) - logits(ours, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("name, expert_format", [("qwen3_tp2_fp32", "per-expert"), ("qwen3moe_tp2etp1_ep2", "per-expert"),
                                                 ("qwen3moe_tp2etp1_ep2", "fused"), ("deepseek_v3_ep2", "fused")])
def test_the_adapter_streams_one_layer_at_a_time_into_the_bytes_safetensors_writes(name, expert_format, tmp_path):
    """The adapter file is written as it is made, each layer's factors read once and released before the next
    layer's; its bytes are those safetensors' own save_file writes for the same tensors."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from lora_merge.peft_adapter import ADAPTER_FILE, AdapterPlan, plan_adapter
    from lora_merge.runs.inputs import open_inputs

    root = fixture_root(name)
    opts = SimpleNamespace(lora_r=None, lora_alpha=None, allow_partial_lora=False, warn=lambda message: None)
    inp = open_inputs(root / "hf_ref", None, root / "lora", opts, need_base=False)
    plan = plan_adapter(inp.lora, inp.shape, inp.arch, inp.settings, None, expert_format)
    made, held = [], []
    real_make = AdapterPlan._make

    def make(self, unit):
        made.append(unit)
        return real_make(self, unit)

    tensors = {}
    AdapterPlan._make = make
    try:
        produced = plan.produce()
        for tensor_name, tensor in produced:
            held.append(sum(t.nbytes for t in produced.gi_frame.f_locals["made"].values()))
            tensors[tensor_name] = tensor
    finally:
        AdapterPlan._make = real_make
    assert len(made) == len(set(made)) == len(plan.modules) > 1  # every unit made once
    largest_unit = max(sum(t.nbytes for t in plan.tensors if plan.units[t.name] == unit) for unit in made)
    assert max(held) < largest_unit <= plan.total_bytes // 2
    assert [t.name for t in plan.tensors] == list(tensors)
    assert [(t.shape, t.dtype) for t in plan.tensors] == [(tuple(v.shape), v.dtype) for v in tensors.values()]

    out = tmp_path / "adapter"
    args = ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out),
            "--expert-format", expert_format]
    assert main(args) == 0
    save_file(tensors, tmp_path / "oracle.safetensors", metadata={"format": "pt"})
    assert (out / ADAPTER_FILE).read_bytes() == (tmp_path / "oracle.safetensors").read_bytes()


def test_tp_shards_of_a_factor_in_two_dtypes_are_refused_in_one_line(tmp_path, capsys):
    """The adapter file is planned from headers, one dtype a factor: shards that disagree are refused before
    anything is written (with --dtype they are all converted and accepted)."""
    import shutil

    from helpers import rank_files, rewrite, run_failing

    root = tmp_path / "fixture"
    shutil.copytree(FIXTURES / "tp2_fp32_filtered", root)
    key = "decoder.layers.0.self_attention.linear_qkv.lora_B.default.weight"  # split over TP: each its own
    rewrite(rank_files(root / "lora")[1], lambda state: state["model"].__setitem__(key, state["model"][key].bfloat16()))
    args = ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(tmp_path / "a")]
    run_failing(args, capsys, "decoder.layers.0.self_attention.linear_qkv.lora_B differ in dtype (bfloat16, float32)")
    assert not (tmp_path / "a").exists()
    assert main(args + ["--dtype", "float32"]) == 0
