"""ERNIE-4.5-MoE (ernie4_5_moe) on the HF routes: a dense first layer, then routed experts with the aux-free bias
and a shared expert; an HF base with a PEFT adapter (attention, the experts through target_parameters) merges as
PEFT's merge_and_unload into a model transformers' Ernie4_5_MoeForCausalLM loads whole, the router and the bias kept
fp32. Megatron checkpoints of it are refused by name; use_bias is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import assert_merges_as_peft, random_hf_model, run_failing


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import Ernie4_5_MoeConfig

    def bias(model):
        for layer in model.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8) * 0.05)

    return random_hf_model(Ernie4_5_MoeConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
        moe_layer_start_index=1, max_position_embeddings=64, architectures=["Ernie4_5_MoeForCausalLM"], bos_token_id=0,
        eos_token_id=1, dtype="bfloat16"), tmp_path_factory.mktemp("ernie") / "base", bias)


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors import safe_open

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert_merges_as_peft(hf_base, lora, 6, tmp_path)
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "bf16",
                     warn=lambda m: None)
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
