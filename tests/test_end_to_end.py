"""Merge each real Megatron fixture with the CLI, load the result with transformers, and compare its
logits with those of the real Megatron forward pass (stored by scripts/make_fixtures.py --family dense)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers import FIXTURE_NAMES, FIXTURES, fixture_info, merge_args
from lora_merge.cli import main


def hf_logits(out_dir, input_ids):
    model, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_merged_model_computes_what_megatron_with_lora_computes(name, merged_fixture):
    info = fixture_info(name)
    ref = torch.load(FIXTURES / name / "logits.pt", weights_only=True)
    logits = hf_logits(merged_fixture(name), ref["input_ids"])
    lora_diff = (logits - ref["logits_lora"]).abs().max().item()
    base_diff = (logits - ref["logits_base"]).abs().max().item()
    print(f"{name}: max |logits - megatron_lora| = {lora_diff:.3g}, vs base {base_diff:.3g}")
    # bf16: Megatron adds the LoRA path to bf16 base weights at run time, we round W + s*B*A once to bf16,
    # so the two differ by bf16 rounding of the weights (~1e-2 on these logits), not more.
    tolerance = 1e-4 if info["dtype"] == "float32" else 5e-2
    assert lora_diff <= tolerance
    assert base_diff > 0.5  # the LoRA really was applied (it moves these logits by ~1.8)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_output_files_and_dtype(name, merged_fixture):
    out = merged_fixture(name)
    info = fixture_info(name)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == info["dtype"]
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (FIXTURES / name / "hf_ref" / f).read_bytes()
    expected_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[info["dtype"]]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for key in f.keys():
            assert f.get_slice(key).get_dtype() == {torch.float32: "F32", torch.bfloat16: "BF16"}[expected_dtype]
        assert f.get_tensor("model.embed_tokens.weight").shape[0] == info["vocab_size"]
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def test_unfiltered_lora_with_separate_base_gives_the_same_model(tmp_path, merged_fixture):
    name = "tp2pp2_bf16_unfiltered"
    out = tmp_path / "with_base"
    assert main(merge_args(name, out, with_base=True)) == 0
    with safe_open(out / "model.safetensors", framework="pt") as a, \
            safe_open(merged_fixture(name) / "model.safetensors", framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_small_shards_load_the_same(tmp_path, merged_fixture, monkeypatch):
    from lora_merge import options

    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 0)  # the fixtures are far smaller than the 1MB minimum
    name = "tp2pp2_fp32_filtered"
    out = tmp_path / "sharded"
    assert main(merge_args(name, out) + ["--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    ref = torch.load(FIXTURES / name / "logits.pt", weights_only=True)
    assert torch.allclose(hf_logits(out, ref["input_ids"]), hf_logits(merged_fixture(name), ref["input_ids"]),
                          atol=0, rtol=0)


def test_dtype_override_writes_bf16_and_config_says_so(tmp_path):
    out = tmp_path / "bf16"
    assert main(merge_args("tp2_fp32_filtered", out) + ["--dtype", "bfloat16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    ref = torch.load(FIXTURES / "tp2_fp32_filtered" / "logits.pt", weights_only=True)
    assert (hf_logits(out, ref["input_ids"]) - ref["logits_lora"]).abs().max() < 5e-2


def test_lora_scale_override_changes_the_model(tmp_path):
    # A vanishing alpha turns the LoRA off (0 itself is refused as a likely mistake): the result must be the
    # base model that Megatron computed.
    out = tmp_path / "alpha0"
    assert main(merge_args("tp2_fp32_filtered", out) + ["--lora-alpha", "1e-12"]) == 0
    ref = torch.load(FIXTURES / "tp2_fp32_filtered" / "logits.pt", weights_only=True)
    assert (hf_logits(out, ref["input_ids"]) - ref["logits_base"]).abs().max() <= 1e-4


def test_lora_and_base_with_different_parallel_layouts(tmp_path):
    # The Qwen2 fixtures share one base model and one LoRA. Take the base from the TP=1 x PP=2 run
    # (unfiltered: base weights under .base_layer) and the LoRA from the TP=2 run: the merge must
    # still be the model Megatron computed.
    out = tmp_path / "cross"
    assert main(["--base", str(FIXTURES / "pp2_fp32_unfiltered" / "lora"),
                 "--lora", str(FIXTURES / "tp2_fp32_filtered" / "lora"),
                 "--hf-ref", str(FIXTURES / "tp2_fp32_filtered" / "hf_ref"), "--out", str(out), "--no-progress"]) == 0
    ref = torch.load(FIXTURES / "tp2_fp32_filtered" / "logits.pt", weights_only=True)
    assert (hf_logits(out, ref["input_ids"]) - ref["logits_lora"]).abs().max() <= 1e-4
