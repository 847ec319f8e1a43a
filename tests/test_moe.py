"""Mixture-of-Experts merges against the real Megatron forward pass (tests/fixtures_moe, made by
scripts/make_moe_fixtures.py with megatron-core 0.16.1 and PEFT 0.7.1 as MindSpeed-LLM calls it)."""

import json
from pathlib import Path

import pytest
import torch

from lora_merge.cli import main

MOE = Path(__file__).parent / "fixtures_moe"
NAMES = sorted(p.name for p in MOE.iterdir() if (p / "fixture.json").is_file())


def moe_args(name: str, out: Path) -> list[str]:
    root = MOE / name
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp("moe") / name
            assert main(moe_args(name, out)) == 0
            cache[name] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_moe_merge_computes_what_megatron_with_lora_computes(name, merged):
    from transformers import AutoModelForCausalLM

    out = merged(name)
    ref = torch.load(MOE / name / "logits.pt", weights_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        logits = model.eval()(ref["input_ids"]).logits
    print(f"\n{name}: max |logits - Megatron+LoRA| = {(logits - ref['logits_lora']).abs().max():.2e}")
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1  # the LoRA (experts included) changed the model


@pytest.mark.parametrize("name", ["qwen3moe_ep2", "qwen2moe_tp2ep2"])
def test_every_expert_is_written_once_per_projection(name, merged):
    info = json.loads((MOE / name / "fixture.json").read_text())
    index = {}
    for shard in merged(name).glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(shard, "pt") as f:
            index.update({k: shard.name for k in f.keys()})
    experts = info.get("num_experts", 4)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        found = {k.split(".experts.")[1].split(".")[0] for k in index if f".{proj}." in k and ".experts." in k
                 and ".layers.1." in k}
        assert found == {str(e) for e in range(experts)}, (proj, found)
