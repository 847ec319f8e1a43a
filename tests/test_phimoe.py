"""Phi-3.5-MoE (phimoe) on the HF routes: LayerNorms with biases, q/k/v/o and lm_head biases, Mixtral-named experts.
An HF base with a PEFT adapter (attention and the experts through target_parameters) merges as PEFT's
merge_and_unload into a model transformers' PhimoeForCausalLM loads whole. Megatron checkpoints of it are refused by
name."""

from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import run_failing, trained_peft_adapter


def quiet(message):
    pass


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, PhimoeConfig

    config = PhimoeConfig(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          attention_bias=True, lm_head_bias=True, max_position_embeddings=64,
                          architectures=["PhimoeForCausalLM"], bos_token_id=0, eos_token_id=1, dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # biases and LayerNorms random too
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1))
    out = tmp_path_factory.mktemp("phimoe") / "base"
    model.save_pretrained(out)
    return out


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    expected = trained_peft_adapter(model, lora, 7, tmp_path / "adapter").merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32", warn=quiet)
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys() and "lm_head.bias" in ours and "model.norm.bias" in ours
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: phimoe is merged from HF bases (with PEFT adapters) only")
