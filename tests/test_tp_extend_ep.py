"""MindSpeed's --moe-tp-extend-ep base checkpoints (its DeepSeek-V3 recipes): whole experts spread over TP × EP
ranks, E / (TP·EP) each, rank (tp, ep) holding global experts (ep·TP + tp)·n + i, as MindSpeed's MoE layer and
its converters place them (megatron-core has no such layout, so the checkpoint is made from a real one by that
rule: the Qwen3-MoE fixture at TP=2 EP=2 ETP=1, whose two rank files hold experts 0-1 and 2-3, is exactly the
TP=2 EP=1 tp-extended layout once its directories and args say so). Its merge is the same bytes as the real
checkpoint's; what the rule does not cover is refused."""

import shutil
from pathlib import Path

import pytest
import torch

from helpers import rank_files, rewrite, run_failing

SOURCE = Path(__file__).parent / "fixtures_moe" / "qwen3moe_tp2etp1_ep2"


def _as_tp_extended(root: Path, **args):
    it = root / "base" / "iter_0000001"
    for old, new in (("mp_rank_00_000", "mp_rank_00"), ("mp_rank_01_001", "mp_rank_01")):
        (it / old).rename(it / new)
    values = {**dict(expert_model_parallel_size=1, moe_tp_extend_ep=True, moe_token_dispatcher_type="alltoall_seq"),
              **args}
    for f in rank_files(root / "base"):
        rewrite(f, lambda state: [setattr(state["args"], k, v) for k, v in values.items()])


def _merge_args(root: Path, out: Path) -> list[str]:
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]


def test_a_tp_extended_base_merges_to_the_bytes_of_the_layout_it_was_made_from(tmp_path):
    from safetensors.torch import load_file

    from lora_merge.cli import main

    root = tmp_path / "src"
    shutil.copytree(SOURCE, root)
    assert main(_merge_args(root, tmp_path / "real")) == 0
    _as_tp_extended(root)
    assert main(_merge_args(root, tmp_path / "extended")) == 0
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("real", "extended"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".mlp.experts.3." in k for k in a)


@pytest.mark.parametrize("args, message", [
    (dict(moe_token_dispatcher_type="alltoall"), "which layout this checkpoint has is not certain"),
    (dict(expert_model_parallel_size=4), "4 experts do not split over TP×EP=2×4"),
])
def test_what_the_rule_does_not_cover_is_refused(tmp_path, capsys, args, message):
    root = tmp_path / "src"
    shutil.copytree(SOURCE, root)
    _as_tp_extended(root, **args)
    run_failing(_merge_args(root, tmp_path / "out"), capsys, message)


def test_a_missing_rank_directory_is_named(tmp_path, capsys):
    root = tmp_path / "src"
    shutil.copytree(SOURCE, root)
    _as_tp_extended(root)
    shutil.rmtree(root / "base" / "iter_0000001" / "mp_rank_01")
    run_failing(_merge_args(root, tmp_path / "out"), capsys, "missing mp_rank_01")


def test_tp_and_ep_both_above_one_place_experts_ep_major(tmp_path):
    """TP=2 EP=2: one expert per rank file, rank (tp, ep) holding expert ep·2 + tp (not tp·2 + ep). Each file is
    the real one of its TP rank (attention and norms sharded as at TP=2), its experts replaced by that one expert
    (local expert 0), taken from the real file that holds it (TP rank r's held experts 2r and 2r+1)."""
    import re

    from safetensors.torch import load_file

    from lora_merge.cli import main

    root = tmp_path / "src"
    shutil.copytree(SOURCE, root)
    assert main(_merge_args(root, tmp_path / "real")) == 0
    it = root / "base" / "iter_0000001"
    real = {r: it / f"mp_rank_{r:02d}_{r:03d}" for r in (0, 1)}
    made = {}
    for tp in (0, 1):
        for ep in (0, 1):
            expert = 2 * ep + tp
            owner = expert // 2
            holder = rewrite_copy = it / f"new_{tp}_{ep}"
            shutil.copytree(real[tp], holder)
            theirs = {}
            rewrite(real[owner] / "model_optim_rng.pt", lambda state: theirs.update(state["model"]))
            pattern = re.compile(rf"local_experts\.{expert - 2 * owner}\.")

            def one_expert(state, theirs=theirs, pattern=pattern):
                model = {k: v for k, v in state["model"].items() if "local_experts." not in k}
                model.update({pattern.sub("local_experts.0.", k): v for k, v in theirs.items() if pattern.search(k)})
                state["model"] = model
                state["args"].moe_tp_extend_ep = True
                state["args"].moe_token_dispatcher_type = "alltoall_seq"
            rewrite(rewrite_copy / "model_optim_rng.pt", one_expert)
            made[(tp, ep)] = holder
    for d in real.values():
        shutil.rmtree(d)
    for (tp, ep), d in made.items():
        d.rename(it / f"mp_rank_{tp:02d}_{ep:03d}")
    assert main(_merge_args(root, tmp_path / "extended")) == 0
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("real", "extended"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_written_back_as_megatron_it_is_no_longer_tp_extended(tmp_path):
    """--to megatron writes megatron-core's own expert layout: the output's args must not keep the flag (with
    ETP = TP the grouped shapes of the two layouts are the same size, so a kept flag would be read wrongly)."""
    from safetensors.torch import load_file

    from helpers import load_pt
    from lora_merge.cli import main

    root = tmp_path / "src"
    shutil.copytree(SOURCE, root)
    assert main(["--base", str(root / "base"), "--hf-ref", str(root / "hf_ref"), "--out", str(tmp_path / "real"),
                 "--no-progress"]) == 0
    _as_tp_extended(root)
    assert main(["--to", "megatron", "--base", str(root / "base"), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(tmp_path / "mg"), "--tp", "2", "--ep", "2", "--etp", "2", "--expert-layout", "grouped",
                 "--no-progress"]) == 0
    args = load_pt(sorted((tmp_path / "mg").glob("*/*/model_optim_rng.pt"))[0], mmap=False)["args"]
    assert args.moe_tp_extend_ep is False
    assert main(["--base", str(tmp_path / "mg"), "--hf-ref", str(root / "hf_ref"), "--out", str(tmp_path / "back"),
                 "--no-progress"]) == 0
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("real", "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
