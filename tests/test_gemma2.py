"""Gemma 2 (gemma2) on the HF routes: an HF base with a PEFT adapter (attention and MLP) merges as PEFT's
merge_and_unload, into a model transformers' Gemma2ForCausalLM loads whole and runs as PEFT's merged one does;
the four norms, tied embeddings and the config (soft-capping, sliding windows, query_pre_attn_scalar) are kept
as published. Megatron checkpoints of it are refused by name, in and out: megatron-core has no model of it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import quiet, run_failing, trained_peft_adapter

TESTS = Path(__file__).parent



@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                          sliding_window=8, query_pre_attn_scalar=32, architectures=["Gemma2ForCausalLM"],
                          bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # norms too: Gemma stores the w of (1 + w), random here
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1))
    out = tmp_path_factory.mktemp("gemma2") / "base"
    model.save_pretrained(out)
    return out


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                          "down_proj"])
    expected = trained_peft_adapter(model, lora, 3, tmp_path / "adapter").merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32", warn=quiet)
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(merged).__name__ == "Gemma2ForCausalLM" and not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4
    published = json.loads((hf_base / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window", "query_pre_attn_scalar",
                "layer_types", "hidden_activation", "tie_word_embeddings"):
        assert written[key] == published[key], key


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    fixture = TESTS / "fixtures/tied_pp2_llama_fp32"
    hf_ref = tmp_path / "hf_ref"
    shutil.copytree(hf_base, hf_ref, ignore=shutil.ignore_patterns("*.safetensors"))
    run_failing(["--base", str(fixture / "base"), "--lora", str(fixture / "lora"), "--hf-ref", str(hf_ref), "--out",
                 str(tmp_path / "out")], capsys, "gemma2 is merged from HF bases (with PEFT adapters) only",
                "no post-attention or post-feedforward norm")
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: gemma2 is merged from HF bases (with PEFT adapters) only")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mg").exists()
