"""ERNIE-4.5-MoE (ernie4_5_moe) on the HF routes: a dense first layer, then routed experts with the aux-free bias
and a shared expert; an HF base with a PEFT adapter (attention, dense and shared MLPs, the experts through
target_parameters) merges as PEFT's merge_and_unload into a model transformers' Ernie4_5_MoeForCausalLM loads
whole, the router and the bias kept fp32. Megatron checkpoints of it are refused by name; use_bias is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import run_failing, trained_peft_adapter


def quiet(message):
    pass


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig

    config = Ernie4_5_MoeConfig(vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8,
                                moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, max_position_embeddings=64,
                                architectures=["Ernie4_5_MoeForCausalLM"], bos_token_id=0, eos_token_id=1,
                                dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8) * 0.05)
    out = tmp_path_factory.mktemp("ernie") / "base"
    model.save_pretrained(out)
    return out


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    expected = trained_peft_adapter(model, lora, 6, tmp_path / "adapter").merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32", warn=quiet)
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "bf16", warn=quiet)
    with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))} == {"F32"}
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == "BF16"


def test_megatron_checkpoints_and_biases_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: ernie4_5_moe is merged from HF bases (with PEFT adapters) only")
    biased = tmp_path / "biased"
    shutil.copytree(hf_base, biased)
    config = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    run_failing(["--base", str(biased), "--to", "megatron", "--out", str(tmp_path / "mg2")], capsys, "use_bias")
