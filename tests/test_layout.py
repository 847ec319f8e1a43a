"""Layout rules on labelled tensors, built here by loops straight from the documented Megatron layouts.

Each test would fail on the classic mistake named in it (naive q|k|v split, gate/up swapped, rank-0-only
vocab, wrong concat dim, wrong pipeline numbering).
"""

import argparse
import re

import pytest
import torch

from lora_merge.errors import MergeError
from lora_merge.model.layer_numbering import numbering_from_args
from lora_merge.model.layout import (GatedColumn, QkvColumn, RowParallel, VocabParallel, check_shards, split_qkv,
                               unshard_replicated)
from lora_merge.model.model_shape import ModelShape


def shape_for(heads, groups, head_dim=2, hidden=3, ffn=4, vocab=10):
    return ModelShape(model_type="qwen2", num_layers=2, hidden=hidden, heads=heads, groups=groups,
                      head_dim=head_dim, ffn=ffn, vocab=vocab, tied=False, qkv_bias=True, qk_norm=False, dtype=None)


def label(kind, head, d, hidden):
    # one distinct row per (projection, head, dim): values never collide between q, k and v
    base = {"q": 1000, "k": 2000, "v": 3000}[kind] + 10 * head + d
    return torch.full((hidden,), float(base))


def megatron_qkv_shards(heads, groups, head_dim, hidden, tp):
    """Rank shards of linear_qkv as Megatron lays them out: per group [its q heads, its k, its v]."""
    per_group = heads // groups
    rows = []
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows += [label("q", h, d, hidden) for d in range(head_dim)]
        rows += [label("k", g, d, hidden) for d in range(head_dim)]
        rows += [label("v", g, d, hidden) for d in range(head_dim)]
    full = torch.stack(rows)
    return list(full.chunk(tp, dim=0))


def hf_projection(kind, count, head_dim, hidden):
    return torch.stack([label(kind, h, d, hidden) for h in range(count) for d in range(head_dim)])


@pytest.mark.parametrize("heads,groups,tp", [(8, 4, 4), (8, 4, 2), (8, 2, 1), (4, 4, 2), (6, 2, 2)])
def test_qkv_split_one_and_several_groups_per_rank(heads, groups, tp):
    shape = shape_for(heads, groups)
    rule = QkvColumn("linear_qkv.weight", ("qkv", "hidden"), q="q", k="k", v="v")
    out = rule.to_hf(megatron_qkv_shards(heads, groups, 2, 3, tp), shape, "test")
    assert torch.equal(out["q"], hf_projection("q", heads, 2, 3))
    assert torch.equal(out["k"], hf_projection("k", groups, 2, 3))
    assert torch.equal(out["v"], hf_projection("v", groups, 2, 3))


def test_qkv_naive_split_would_be_caught():
    shards = megatron_qkv_shards(8, 2, 2, 3, 1)
    naive_q = torch.cat(shards)[: 8 * 2]
    assert not torch.equal(naive_q, hf_projection("q", 8, 2, 3))


def test_qkv_bias_and_lora_b_follow_the_weight_rows():
    shape = shape_for(8, 4)
    shards = megatron_qkv_shards(8, 4, 2, 3, 2)
    rule = QkvColumn("b", ("qkv",), q="q", k="k", v="v")
    bias = rule.to_hf([s[:, 0] for s in shards], shape, "test")  # 1-D like a bias
    lora_b = rule.to_hf([s[:, :2] for s in shards], shape, "test")  # [rows, r] like lora_B
    assert torch.equal(bias["k"], hf_projection("k", 4, 2, 3)[:, 0])
    assert torch.equal(lora_b["v"], hf_projection("v", 4, 2, 3)[:, :2])


def test_qkv_groups_must_split_over_tp():
    with pytest.raises(MergeError, match="query groups"):
        QkvColumn("x", ("qkv", "hidden"), q="q", k="k", v="v").to_hf(
            megatron_qkv_shards(6, 3, 2, 3, 1) * 2, shape_for(6, 3), "x")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_fc1_regroups_per_rank(tp):
    ffn, hidden = 8, 3
    gate = torch.arange(ffn * hidden, dtype=torch.float32).reshape(ffn, hidden)
    up = -gate - 1
    # each rank: [its slice of gate; its slice of up]
    shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    out = GatedColumn("fc1", ("gated_ffn", "hidden"), gate="gate", up="up").to_hf(shards, shape_for(4, 2, ffn=ffn), "t")
    assert torch.equal(out["gate"], gate)
    assert torch.equal(out["up"], up)
    if tp > 1:  # the mistake: split the concatenation in halves
        assert not torch.equal(torch.cat(shards)[:ffn], gate)


def test_vocab_parallel_concatenates_all_ranks_and_trims_padding():
    vocab, padded, tp = 10, 16, 4
    table = torch.arange(padded * 3, dtype=torch.float32).reshape(padded, 3)
    rule = VocabParallel("emb", ("vocab", "hidden"), hf="emb")
    shards = list(table.chunk(tp))
    shape = shape_for(4, 2, vocab=vocab)
    assert rule.global_shape(shape, [s.shape for s in shards]) == (padded, 3)
    out = rule.to_hf(shards, shape, "t")["emb"]
    assert torch.equal(out, table[:vocab])  # a rank-0-only reader would give 4 rows


def test_vocab_smaller_than_config_is_an_error():
    with pytest.raises(MergeError, match="fewer than the HF vocab_size"):
        VocabParallel("emb", ("vocab", "hidden"), hf="emb").global_shape(shape_for(4, 2, vocab=10), [(4, 3), (4, 3)])


def test_row_parallel_concatenates_columns():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    out = RowParallel("proj", ("hidden", "q"), hf="o").to_hf(list(full.chunk(2, dim=1)), shape_for(4, 2), "t")
    assert torch.equal(out["o"], full)


def test_replicated_copies_must_agree():
    a = torch.ones(3)
    assert unshard_replicated([a, a.clone()], "n") is a
    with pytest.raises(MergeError, match="differs between TP rank 0 and TP rank 1"):
        unshard_replicated([a, a + 1e-3], "norm")


def test_shard_shape_checks_name_the_rank():
    check_shards([(4, 6), (4, 6)], "column", (8, 6), "w")
    check_shards([(8, 3), (8, 3)], "row", (8, 6), "w")
    with pytest.raises(MergeError, match="TP rank 1 shard has shape \\[5, 6\\], expected \\[4, 6\\]"):
        check_shards([(4, 6), (5, 6)], "column", (8, 6), "w")


def test_split_qkv_on_real_numbers_matches_head_view():
    heads, groups, d, hidden = 8, 2, 4, 5
    w = torch.randn((heads + 2 * groups) * d, hidden)
    q, k, v = split_qkv(w, heads, groups, d)
    per = heads // groups
    for g in range(groups):
        block = w[g * (per + 2) * d:(g + 1) * (per + 2) * d]
        assert torch.equal(q[g * per * d:(g + 1) * per * d], block[: per * d])
        assert torch.equal(k[g * d:(g + 1) * d], block[per * d:(per + 1) * d])
        assert torch.equal(v[g * d:(g + 1) * d], block[(per + 1) * d:])


def ns(**kw):
    return argparse.Namespace(**kw)


def test_pipeline_numbering_even_split():
    n = numbering_from_args(ns(num_layers=8), pp=4, vpp=1)
    assert [n.hf_index(p, 0, 1, "t") for p in range(4)] == [1, 3, 5, 7]


def test_pipeline_numbering_virtual_chunks():
    # chunks run over all stages first: chunk 1 of stage 0 comes after chunk 0 of every stage
    n = numbering_from_args(ns(num_layers=8), pp=2, vpp=2)
    assert n.hf_index(0, 0, 0, "t") == 0
    assert n.hf_index(1, 0, 0, "t") == 2
    assert n.hf_index(0, 1, 0, "t") == 4
    assert n.hf_index(1, 1, 1, "t") == 7


def test_pipeline_numbering_uneven_and_noop():
    n = numbering_from_args(ns(num_layers=6, num_layer_list="1,3,2"), pp=3, vpp=1)
    assert [n.hf_index(2, 0, i, "t") for i in range(2)] == [4, 5]
    first_last = numbering_from_args(ns(num_layers=7, decoder_first_pipeline_num_layers=1,
                                        decoder_last_pipeline_num_layers=2), pp=3, vpp=1)
    assert first_last.counts == ((1, 4, 2),)
    noop = numbering_from_args(ns(num_layers=6, noop_layers={2}), pp=2, vpp=1)
    assert noop.hf_index(1, 0, 0, "t") == 2  # global 3, one noop layer before it
    with pytest.raises(MergeError, match="noop_layers"):
        noop.hf_index(0, 0, 2, "t")


def test_pipeline_local_index_beyond_stage_is_an_error():
    with pytest.raises(MergeError, match="only 2 layers"):
        numbering_from_args(ns(num_layers=4), pp=2, vpp=1).hf_index(0, 0, 2, "t")


@pytest.mark.parametrize("pieces", [1, 2, 4, 8])
def test_gated_fc1_from_global_pieces(pieces):
    # torch_dist stores fc1 globally as [all gate; all up], in as many pieces as it was saved from
    ffn, hidden = 8, 3
    gate = torch.arange(ffn * hidden, dtype=torch.float32).reshape(ffn, hidden)
    up = -gate - 1
    parts = list(torch.cat([gate, up]).chunk(pieces))
    out = GatedColumn("fc1", ("gated_ffn", "hidden"), gate="gate", up="up").to_hf(
        parts, shape_for(4, 2, ffn=ffn), "t", global_pieces=True)
    assert torch.equal(out["gate"], gate) and torch.equal(out["up"], up)


def test_deepseek_distill_qwen_32b_vocab_at_tp8():
    # The 152064-row vocab split over TP=8 (19008 rows a rank): every rank's rows, in rank order. A
    # reader of rank 0 only gets 19008 rows ("size of tensor a (152064) must match ... b (19008)").
    vocab, tp, hidden = 152064, 8, 2
    table = torch.arange(vocab * hidden, dtype=torch.float32).reshape(vocab, hidden)
    shards = list(table.chunk(tp))
    assert {s.shape[0] for s in shards} == {19008}
    rule = VocabParallel("embedding.word_embeddings.weight", ("vocab", "hidden"), hf="model.embed_tokens.weight")
    shape = shape_for(40, 8, hidden=hidden, vocab=vocab)
    check_shards([tuple(s.shape) for s in shards], "column", rule.global_shape(shape, [s.shape for s in shards]), "emb")
    assert torch.equal(rule.to_hf(shards, shape, "emb")["model.embed_tokens.weight"], table)


def test_another_naming_replaces_the_rules_it_names_only_where_the_checkpoint_uses_it():
    """MindSpeed fuses two projections into one parameter: the fused rule is used in a layer whose
    checkpoint has its name and replaces the separate ones there; elsewhere the separate rules stand."""
    from lora_merge.model.architectures.base import Architecture, iter_rules
    from lora_merge.model.layout import Replicated

    a = Replicated("attn.a.weight", ("hidden", "hidden"), hf="a.weight")
    b = Replicated("attn.b.weight", ("hidden", "hidden"), hf="b.weight")
    fused = Replicated("attn.ab.weight", ("hidden", "hidden"), hf="ab.weight", instead_of=("attn.a.weight", "attn.b.weight"))
    arch = Architecture("toy", (), (a, b, fused), ())
    shape = shape_for(4, 2)
    names = lambda present: [names[0] for _, names, _ in iter_rules(arch, shape, present)]  # noqa: E731
    assert names(None) == names(lambda n: False) == ["decoder.layers.0.attn.a.weight", "decoder.layers.0.attn.b.weight",
                                                    "decoder.layers.1.attn.a.weight", "decoder.layers.1.attn.b.weight"]
    assert names(lambda n: n == "decoder.layers.1.attn.ab.weight") == [
        "decoder.layers.0.attn.a.weight", "decoder.layers.0.attn.b.weight", "decoder.layers.1.attn.ab.weight"]


def test_replicated_rows_split_a_fused_replicated_linear_and_its_lora_b_alike():
    """MindSpeed's fused MLA down-projection [q_a; kv_a] is replicated on every rank; its LoRA has one A
    (shared) and a B whose rows split exactly like the weight's."""
    from lora_merge.model.layout import ReplicatedRows
    from lora_merge.lora import hf_factors
    from lora_merge.readers.checkpoint import LoraModule, Pieces, TensorRef

    shape = shape_for(4, 2, hidden=3)  # q: heads·head_dim = 8 rows, kv: 2·2 = 4 rows in the toy dims
    rule = ReplicatedRows("qkv.weight", ("qkv", "hidden"), parts=(("q_a.weight", "q"), ("kv_a.weight", "kv")))
    weight = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    out = rule.to_hf([weight, weight.clone()], shape, "t")
    assert torch.equal(out["q_a.weight"], weight[:8]) and torch.equal(out["kv_a.weight"], weight[8:12])
    with pytest.raises(MergeError, match="differs between TP rank 0 and TP rank 1"):
        rule.to_hf([weight, weight + 1], shape, "t")
    with pytest.raises(MergeError, match="16 rows, but its parts"):  # rows past the parts are never dropped
        rule.to_hf([torch.zeros(16, 3)], shape, "t")

    a, b = torch.randn(2, 3), torch.randn(12, 2)
    ref = lambda t: TensorRef.of("t", t, mapped=False)  # noqa: E731
    factors = hf_factors(rule, LoraModule(Pieces((ref(a), ref(a))), Pieces((ref(b), ref(b)))), shape, "qkv")
    assert torch.equal(factors["q_a.weight"][0], b[:8]) and torch.equal(factors["kv_a.weight"][0], b[8:12])
    assert all(torch.equal(f[1], a) for f in factors.values())


# megatron-core's own reading of --pipeline-model-parallel-layout is the oracle: per (stage, chunk) the decoder layers
# and where the multi-token-prediction layers are
LAYOUTS = [("Et*3|(tt|)*29,m|L", 16, 61, 1), ("Ettt|tttL", 2, 6, 0), ("E|tt|tt|tL", 2, 5, 0), ("Et|t|t|tL", 2, 4, 0),
           ("Et*2|t*3,m|L", 3, 5, 1), ("E(t|)*4L", 5, 4, 0), ([["embedding", "decoder"], ["decoder", "decoder", "loss"]], 2, 3, 0),
           ([["embedding", "decoder"], ["decoder", "mtp", "loss"]], 2, 2, 1),
           ([[" Embedding", "DECODER "], ["decoder", "Loss"]], 2, 2, 0)]


@pytest.mark.parametrize("layout, pp, layers, mtp", LAYOUTS)
def test_pipeline_layout_is_read_as_megatron_core_reads_it(layout, pp, layers, mtp):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout(layout, pp)
    theirs.validate_layer_layout(num_layers=layers, mtp_num_layers=mtp or None)
    vpp = len(theirs.layout[0])
    n = numbering_from_args(ns(num_layers=layers, pipeline_model_parallel_layout=layout), pp=pp, vpp=vpp)
    assert n.counts == tuple(tuple(theirs.layout[p][v].count(LayerType.decoder) for p in range(pp))
                             for v in range(vpp))
    at = [(p, v) for p in range(pp) for v in range(vpp) if LayerType.mtp in theirs.layout[p][v]]
    assert n.mtp_place() == (at[0] if at else (pp - 1, vpp - 1))
    # global numbering runs through the layout's order
    seen = [n.hf_index(p, v, i, "t") for v in range(vpp) for p in range(pp) for i in range(n.counts[v][p])]
    assert seen == list(range(layers))


@pytest.mark.parametrize("args, pp, vpp, message", [
    (dict(num_layers=4, pipeline_model_parallel_layout="Et|tx|tL"), 3, 1, "'x' is no layer character"),
    (dict(num_layers=4, pipeline_model_parallel_layout="Et|ttL"), 2, 1, "3 decoder layers (t), but args.num_layers=4"),
    (dict(num_layers=4, pipeline_model_parallel_layout="tt|ttL"), 2, 1, "the embedding (E) first and the loss (L) last"),
    (dict(num_layers=4, pipeline_model_parallel_layout="Ett|ttL"), 2, 2, "2 virtual stages, but the checkpoint has PP=2 x 2"),
    (dict(num_layers=4, pipeline_model_parallel_layout="Ett|ttL", decoder_first_pipeline_num_layers=2), 2, 1,
     "pipeline_model_parallel_layout and decoder_first_pipeline_num_layers both given"),
    (dict(num_layers=4, pipeline_model_parallel_layout="Etm|tttL"), 2, 1, "must come after every decoder layer"),
    (dict(num_layers=4, pipeline_model_parallel_layout="Et*999999999|L"), 2, 1, "unrolls to more than"),
    (dict(num_layers=4, pipeline_model_parallel_layout=7), 2, 1, "expected a layout string"),
    (dict(num_layers=1, pipeline_model_parallel_layout=[["E", "t"], ["L"]]), 2, 1, "each a list of layer types"),
])
def test_pipeline_layout_refusals(args, pp, vpp, message):
    with pytest.raises(MergeError, match=re.escape(message)):
        numbering_from_args(ns(**args), pp=pp, vpp=vpp)


@pytest.mark.parametrize("fixture, layout, wrong", [("uneven_pp2_fp32", "Et|tttL", "Ett|ttL"),
                                                    ("vpp2_fp32_filtered", "Et|t|t|tL", "Ett||t|tL")])
def test_a_pipeline_layout_in_the_args_merges_as_the_split_it_describes(fixture, layout, wrong, tmp_path, capsys):
    """A real Megatron checkpoint (uneven PP; PP with VPP) whose args give its split as a
    pipeline_model_parallel_layout instead: the same bytes."""
    from safetensors.torch import load_file

    from helpers import copied_args, copy_fixture, rank_files, rewrite
    from lora_merge.cli import main

    root = copy_fixture(fixture, tmp_path / "src")
    assert main(copied_args(root, tmp_path / "split") + ["--no-progress"]) == 0

    def as_layout(state):
        for key in ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"):
            setattr(state["args"], key, None)
        state["args"].pipeline_model_parallel_layout = layout

    for ckpt in ("base", "lora"):
        for f in rank_files(root / ckpt):
            rewrite(f, as_layout)
    assert main(copied_args(root, tmp_path / "layout") + ["--no-progress"]) == 0
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("split", "layout"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for ckpt in ("base", "lora"):  # a layout that puts the layers elsewhere is not the checkpoint's
        for f in rank_files(root / ckpt):
            rewrite(f, lambda state: setattr(state["args"], "pipeline_model_parallel_layout", wrong))
    capsys.readouterr()
    assert main(copied_args(root, tmp_path / "wrong") + ["--no-progress"]) != 0
    assert "local layer" in capsys.readouterr().err
