"""Phi-3.5-MoE (phimoe) on the HF routes: LayerNorms with biases, q/k/v/o and lm_head biases, Mixtral-named experts.
An HF base with a PEFT adapter (attention and the experts through target_parameters) merges as PEFT's
merge_and_unload into a model transformers' PhimoeForCausalLM loads whole. Megatron checkpoints of it are refused by
name."""

from pathlib import Path

import pytest

from helpers import assert_merges_as_peft, random_hf_model, run_failing


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import PhimoeConfig

    return random_hf_model(PhimoeConfig(
        vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
        max_position_embeddings=64, architectures=["PhimoeForCausalLM"], bos_token_id=0, eos_token_id=1,
        dtype="bfloat16"), tmp_path_factory.mktemp("phimoe") / "base")


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig

    ours, _ = assert_merges_as_peft(hf_base, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), 7, tmp_path)
    assert "lm_head.bias" in ours and "model.norm.bias" in ours and "model.layers.0.self_attn.o_proj.bias" in ours


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: phimoe is merged from HF bases (with PEFT adapters) only")
