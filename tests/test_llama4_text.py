"""Llama-4 text (llama4_text) on the HF routes: MoE layers interleaved with dense ones, experts stored stacked
([E, hidden, 2·ffn], [E, ffn, hidden]) with a shared expert, dense MLPs of intermediate_size_mlp. An HF base with a
PEFT adapter (attention, the dense and shared MLPs, the stacked experts through target_parameters) merges as PEFT's
merge_and_unload into a model transformers' Llama4ForCausalLM loads whole. Megatron checkpoints of it are refused by
name."""

from pathlib import Path

import pytest

from helpers import assert_merges_as_peft, random_hf_model, run_failing


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import Llama4TextConfig

    return random_hf_model(Llama4TextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, max_position_embeddings=64, attention_chunk_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, architectures=["Llama4ForCausalLM"],
        bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16"), tmp_path_factory.mktemp("llama4") / "base")


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig

    ours, base = assert_merges_as_peft(hf_base, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]), 14, tmp_path)
    stacked = [k for k in ours if k.endswith("feed_forward.experts.gate_up_proj")]
    assert stacked and all((ours[k] - base[k]).abs().max() > 0 for k in stacked)
    assert "model.layers.0.feed_forward.gate_proj.weight" in ours  # a dense layer (interleave step 2)


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: llama4_text is merged from HF bases (with PEFT adapters) only")
