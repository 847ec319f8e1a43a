"""Seed-OSS (seed_oss) computes what a Qwen2-like Megatron model computes (GQA, q/k/v biases, no o_proj bias):
the qwen2 fixture merged against a Seed-OSS config gives the real Megatron forward's logits under
transformers' SeedOssForCausalLM; an HF Seed-OSS base with a PEFT adapter merges as PEFT's merge_and_unload.
(No copy of the published config.json was found: the configs here are transformers' own SeedOssConfig at the
fixture's size, with the published model's non-default keys: attention_bias true, attention_out_bias false.)"""

import json
from pathlib import Path

import torch

from helpers import reference_beside, run_failing, trained_peft_adapter
from lora_merge.cli import main

FIXTURE = Path(__file__).parent / "fixtures/tp2_fp32_filtered"


def seed_oss_reference(dest: Path, **changes) -> Path:
    from transformers import SeedOssConfig

    qwen2 = json.loads((FIXTURE / "hf_ref/config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    config = SeedOssConfig(**{k: qwen2[k] for k in keys if k in qwen2}, architectures=["SeedOssForCausalLM"],
                           head_dim=qwen2["hidden_size"] // qwen2["num_attention_heads"], attention_bias=True,
                           attention_out_bias=False, mlp_bias=False, rope_parameters=qwen2.get("rope_parameters"),
                           dtype="float32")
    return reference_beside(FIXTURE / "hf_ref", dest / "hf_ref", config, **changes)


def merge_args(hf: Path, out: Path) -> list[str]:
    return ["--base", str(FIXTURE / "base"), "--lora", str(FIXTURE / "lora"), "--hf-ref", str(hf), "--out", str(out),
            "--no-progress"]


def test_a_megatron_lora_merged_as_seed_oss_computes_megatrons_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = seed_oss_reference(tmp_path)
    assert main(merge_args(hf, tmp_path / "out")) == 0
    ref = torch.load(FIXTURE / "logits.pt", weights_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                       output_loading_info=True)
    assert type(model).__name__ == "SeedOssForCausalLM" and not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(ref["input_ids"]).logits
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1


def test_an_o_proj_bias_is_refused(tmp_path, capsys):
    hf = seed_oss_reference(tmp_path, attention_out_bias=True)
    run_failing(merge_args(hf, tmp_path / "out"), capsys, "attention_out_bias=true is not supported for seed_oss")
    assert not (tmp_path / "out").exists()


def test_an_hf_seed_oss_base_with_a_peft_adapter_merges_as_peft_does(tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    hf = seed_oss_reference(tmp_path, residual_dropout=0.0)  # training-only, accepted as any value
    base = tmp_path / "base"
    assert main(merge_args(hf, base)[:2] + ["--hf-ref", str(hf), "--out", str(base), "--no-progress"]) == 0
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"]),
                                      5, tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    assert main(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(hf), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert merged.keys() == expected.keys()
    assert max((merged[k] - expected[k]).abs().max().item() for k in merged) <= 1e-6
