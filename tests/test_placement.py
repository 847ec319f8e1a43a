"""The rules run backwards: HF rows scattered by `hf_segments` into TP shards read back (through the same
rules, forwards) as the HF tensors they came from, for every rule of every family, at TP 1, 2 and 4."""

from pathlib import Path

import pytest
import torch

from lora_merge.model.architectures import architecture_for, iter_rules
from lora_merge.model.hf_config import read_hf_config
from lora_merge.model.layout import DUPLICATED_OR_COLUMN, Skip, VocabParallel, expected_shard_shape
from lora_merge.model.placement import hf_segments

TESTS = Path(__file__).parent
REFS = {"qwen2": TESTS / "fixtures/tp2_fp32_filtered/hf_ref", "qwen3": TESTS / "fixtures/qwen3_tp2_fp32/hf_ref",
        "qwen2_moe": TESTS / "fixtures_moe/qwen2moe_tp2ep2/hf_ref",
        "deepseek_v3": TESTS / "fixtures_deepseek/deepseek_v3_ep2/hf_ref",
        "deepseek_v2_lite": TESTS / "fixtures_deepseek/deepseek_v2_lite_ep2/hf_ref"}


def target_shards(rule, shape, tp):
    parallel = "column" if rule.parallel == DUPLICATED_OR_COLUMN else rule.parallel
    if isinstance(rule, VocabParallel):
        padded = -(-shape.vocab // (64 * tp)) * 64 * tp
        return [(padded // tp, shape.hidden)] * tp
    return [expected_shard_shape(parallel, rule.global_shape(shape), tp, rule.megatron)] * tp


@pytest.mark.parametrize("family", sorted(REFS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_scattered_rows_read_back_as_the_hf_tensors(family, tp):
    shape, _ = read_hf_config(REFS[family])
    arch = architecture_for(shape)
    g = torch.Generator().manual_seed(tp)
    seen = 0
    for rule, names, _ in iter_rules(arch, shape):
        if isinstance(rule, Skip) or (rule.requires == "q_lora" and rule.instead_of) or rule.instead_of:
            continue
        if ".experts.1." in names[0] or ".experts.2." in names[0] or ".experts.3." in names[0]:
            continue
        if any(d for d in rule.global_shape(shape) if d % tp) and rule.parallel != "replicated" \
                and not isinstance(rule, VocabParallel):
            continue  # a size this TP cannot split: the writer refuses it (tested elsewhere)
        shards_shapes = target_shards(rule, shape, tp)
        hf = {n: torch.randn(*dims, generator=g) for n, dims in rule.hf_shapes(shape).items()}
        shards = [torch.full(s, float("nan")) for s in shards_shapes]
        for name, segments in hf_segments(rule, shape, shards_shapes, names[0]).items():
            for seg in segments:
                rows = hf[name][seg.hf_start: seg.hf_start + seg.rows]
                if seg.col_start is not None:
                    rows = rows[:, seg.col_start: seg.col_stop]
                for rank in (range(tp) if seg.rank is None else [seg.rank]):
                    shards[rank][seg.shard_start: seg.shard_start + seg.rows] = rows
        if isinstance(rule, VocabParallel):  # padding rows: zero, as the writer leaves them
            shards = [torch.nan_to_num(s, nan=0.0) for s in shards]
        assert not any(torch.isnan(s).any() for s in shards), f"{names[0]}: shard rows left unwritten"
        back = rule.to_hf(shards, shape, names[0])
        assert back.keys() == hf.keys()
        for name in hf:
            assert torch.equal(back[name], hf[name]), (names[0], name)
        seen += 1
    assert seen > 8
