"""--to megatron without Megatron: round trips are byte-identical, every rank file is what torch.save and
our own readers read, and targets a model cannot be split into are refused before anything is written.
(That real Megatron loads what we write and computes the trained logits: test_megatron_loads_ours.py.)"""

import filecmp
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_merge
from lora_merge.errors import MergeError
from helpers import quiet

TESTS = Path(__file__).parent
DENSE = TESTS / "fixtures/tp2pp2_fp32_filtered"
MOE = TESTS / "fixtures_moe/qwen2moe_tp2ep2"
MLA = TESTS / "fixtures_deepseek/deepseek_v3_ep2"
GLM = TESTS / "fixtures_moe/glm4moe_tp2etp1_ep2"



def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def same_tree(a: Path, b: Path) -> None:
    assert files_of(a) == files_of(b)
    for name in files_of(a):
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def to_hf(source: Path, fixture: Path, out: Path, lora=None):
    return lora_merge.merge(base=source, lora=lora, hf_ref=fixture / "hf_ref", out=out, warn=quiet)


def same_as_megatrons_save(ours_dir: Path, theirs_dir: Path) -> None:
    """Each rank file of `ours_dir` against Megatron's own save in `theirs_dir`: the same files, model chunks and
    keys in the same order, the same tensors bit for bit, but the vocabulary padding rows (random in the
    fixtures, zero in ours; the vocabulary is 250)."""
    assert sorted(os.listdir(ours_dir)) == sorted(os.listdir(theirs_dir))
    for rank in os.listdir(theirs_dir):
        ours = torch.load(ours_dir / rank / "model_optim_rng.pt", weights_only=False, mmap=True)
        theirs = torch.load(theirs_dir / rank / "model_optim_rng.pt", weights_only=False, mmap=True)
        chunks = [k for k in theirs if k.startswith("model")]
        assert [k for k in ours if k.startswith("model")] == chunks
        for chunk in chunks:
            assert list(ours[chunk]) == list(theirs[chunk]), (rank, chunk)
            for name, value in theirs[chunk].items():
                if value is None:
                    assert ours[chunk][name] is None
                elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    tp_rank = int(rank.split("_")[2])
                    keep = max(0, min(value.shape[0], 250 - tp_rank * value.shape[0]))
                    assert torch.equal(ours[chunk][name][:keep], value[:keep]), (rank, name)
                    assert not ours[chunk][name][keep:].any()
                else:
                    assert ours[chunk][name].dtype == value.dtype and torch.equal(ours[chunk][name], value), (rank, name)


def test_megatron_to_megatron_reshards_round_trip_byte_identical(tmp_path):
    """TP2×PP2 + LoRA → TP4 → TP1×PP2×VPP2 → TP4: the two TP4 checkpoints are the same bytes, and every
    layout converts to the HF model the direct merge writes."""
    common = dict(hf_ref=DENSE / "hf_ref", warn=quiet)
    lora_merge.to_megatron(base=DENSE / "base", lora=DENSE / "lora", out=tmp_path / "tp4", tp=4, **common)
    lora_merge.to_megatron(base=tmp_path / "tp4", out=tmp_path / "vpp", pp=2, vpp=2, **common)
    lora_merge.to_megatron(base=tmp_path / "vpp", out=tmp_path / "tp4again", tp=4, **common)
    same_tree(tmp_path / "tp4", tmp_path / "tp4again")
    assert files_of(tmp_path / "vpp") == ["latest_checkpointed_iteration.txt", "release/mp_rank_00_000/model_optim_rng.pt",
                                          "release/mp_rank_00_001/model_optim_rng.pt"]
    rank = torch.load(tmp_path / "vpp/release/mp_rank_00_001/model_optim_rng.pt", weights_only=False, mmap=True)
    assert set(rank) == {"args", "checkpoint_version", "iteration", "model0", "model1"}
    assert (rank["checkpoint_version"], rank["iteration"]) == (3.0, 0)
    assert rank["args"].virtual_pipeline_model_parallel_size == 2 and rank["args"].tensor_model_parallel_size == 1
    to_hf(DENSE / "base", DENSE, tmp_path / "direct", lora=DENSE / "lora")
    for layout in ("tp4", "vpp"):
        to_hf(tmp_path / layout, DENSE, tmp_path / f"hf-{layout}")
        assert filecmp.cmp(tmp_path / "direct/model.safetensors", tmp_path / f"hf-{layout}/model.safetensors",
                           shallow=False), layout


@pytest.mark.parametrize("fixture,layout", [
    (MOE, dict(tp=2, pp=2, ep=2)),  # dense layer 0, gated shared expert, experts split over ETP=TP
    (MOE, dict(tp=2, ep=4, etp=1)),
    (MLA, dict(tp=2, pp=3, ep=2)),  # MLA column-parallel down-projections; dense first layer
    (GLM, dict(tp=2, pp=2, ep=2)),  # partial RoPE, q/k/v biases and norms, experts split over ETP=TP
])
def test_hf_to_megatron_to_hf_is_byte_identical(tmp_path, fixture, layout):
    to_hf(fixture / "base", fixture, tmp_path / "hf", lora=fixture / "lora")
    lora_merge.to_megatron(base=tmp_path / "hf", out=tmp_path / "mg", warn=quiet, **layout)
    to_hf(tmp_path / "mg", fixture, tmp_path / "back")
    hf = [n for n in os.listdir(tmp_path / "hf") if n.endswith((".safetensors", ".json"))]
    assert "model.safetensors" in hf or "model.safetensors.index.json" in hf
    for name in hf:
        assert filecmp.cmp(tmp_path / "hf" / name, tmp_path / "back" / name, shallow=False), name


def test_the_rank_files_are_the_sparse_grid_megatron_saves(tmp_path):
    """TP=2, EP=4, ETP=1: a world of 4 ranks; files of expert-data-parallel rank 0 only."""
    lora_merge.to_megatron(base=MOE / "base", hf_ref=MOE / "hf_ref", out=tmp_path / "mg", tp=2, ep=4, etp=1,
                           warn=quiet)
    assert files_of(tmp_path / "mg/release") == [f"mp_rank_0{t}_00{e}/model_optim_rng.pt"
                                                 for t, e in ((0, 0), (0, 2), (1, 1), (1, 3))]
    rank = torch.load(tmp_path / "mg/release/mp_rank_01_003/model_optim_rng.pt", weights_only=False, mmap=True)["model"]
    experts = sorted(k for k in rank if ".local_experts." in k and k.endswith("weight"))
    assert experts == [f"decoder.layers.{i}.mlp.experts.local_experts.0.linear_fc{n}.weight" for i in (1, 2, 3)
                       for n in (1, 2)]
    assert rank["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (64, 64)  # whole: ETP=1
    assert rank["decoder.layers.1.self_attention.linear_qkv.weight"].shape[0] * 2 == 8 * 8 + 2 * 4 * 8


@pytest.mark.parametrize("layout,expected", [
    (dict(tp=3), "8 attention heads do not split over --tp 3"),
    (dict(pp=3), "num_layers=4 is not divisible by PP=3"),
    (dict(pp=2, vpp=3), "do not divide into 3 virtual-pipeline chunks"),
    (dict(vpp=2), "--vpp 2 needs --pp of 2 or more"),
    (dict(ep=2), "--ep 2 but the model has no routed experts"),
    (dict(padded_vocab_size=200), "--padded-vocab-size 200 is smaller than the model's vocab_size 250"),
    (dict(padded_vocab_size=251, tp=2), "--padded-vocab-size 251 does not split over --tp 2"),
    (dict(pp=2, decoder_first_pipeline_num_layers=5), "do not fit 4 layers over PP=2"),
    (dict(ckpt_format="zarr"), "--ckpt-format 'zarr'"),
])
def test_targets_the_model_cannot_be_split_into_are_refused_before_writing(tmp_path, layout, expected):
    with pytest.raises(MergeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", warn=quiet, **layout)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout,expected", [
    (dict(ep=3), "4 experts do not split over --ep 3"),
    (dict(tp=2, etp=4), "--etp 4 with --tp 2"),
])
def test_expert_layouts_that_do_not_fit_are_refused(tmp_path, layout, expected):
    with pytest.raises(MergeError, match=expected):
        lora_merge.to_megatron(base=MOE / "base", hf_ref=MOE / "hf_ref", out=tmp_path / "mg", warn=quiet, **layout)
    assert os.listdir(tmp_path) == []


def test_an_existing_target_or_one_inside_an_input_is_refused(tmp_path):
    (tmp_path / "mg").mkdir()
    with pytest.raises(MergeError, match="already exists"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", warn=quiet)
    with pytest.raises(MergeError, match="lies inside the input directory"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=DENSE / "base" / "x", warn=quiet)
    assert not (DENSE / "base" / "x").exists()


def test_grouped_experts_are_megatrons_groupedmlp_layout(tmp_path):
    """--expert-layout grouped writes weight1/weight2 exactly as the committed GroupedMLP fixture holds them
    (checked there against Megatron's own GroupedMLP), and reads back to the same HF model."""
    fixture, grouped = TESTS / "fixtures_moe/qwen3moe_ep2", TESTS / "fixtures_moe/qwen3moe_grouped_ep2"
    to_hf(fixture / "base", fixture, tmp_path / "hf")
    lora_merge.to_megatron(base=tmp_path / "hf", out=tmp_path / "mg", ep=2, expert_layout="grouped", warn=quiet)
    same_as_megatrons_save(tmp_path / "mg/release", grouped / "base/iter_0000001")
    to_hf(tmp_path / "mg", fixture, tmp_path / "back")
    assert filecmp.cmp(tmp_path / "hf/model.safetensors", tmp_path / "back/model.safetensors", shallow=False)


@pytest.mark.parametrize("fixture,layout", [
    (DENSE, dict(tp=2, pp=2)), (TESTS / "fixtures/vpp2_fp32_filtered", dict(pp=2, vpp=2)),
    (TESTS / "fixtures/uneven_pp2_fp32", dict(pp=2, decoder_first_pipeline_num_layers=1)),
    (TESTS / "fixtures/tied_pp2_llama_fp32", dict(pp=2)), (MOE, dict(tp=2, ep=2)),
    (TESTS / "fixtures_moe/qwen3moe_tp2etp1_ep2", dict(tp=2, ep=2, etp=1)), (MLA, dict(ep=2)),
    (GLM, dict(tp=2, ep=2, etp=1)),
])
def test_a_base_written_at_its_own_layout_is_what_megatron_saved(tmp_path, fixture, layout):
    """Megatron's own save of each fixture's base, rewritten from it at the same layout: the same rank files,
    the same keys in the same order, the same tensors bit for bit (but the vocabulary padding rows, random in
    the fixtures, zero in ours)."""
    lora_merge.to_megatron(base=fixture / "base", hf_ref=fixture / "hf_ref", out=tmp_path / "mg", warn=quiet, **layout)
    iteration = (fixture / "base/latest_checkpointed_iteration.txt").read_text().strip()
    same_as_megatrons_save(tmp_path / "mg/release", fixture / "base" / f"iter_{int(iteration):07d}")


@pytest.mark.parametrize("fixture", [DENSE, MOE, MLA, GLM])
def test_torch_dist_round_trips_byte_identical(tmp_path, fixture):
    """HF → torch_dist → HF, and torch_dist → legacy TP2 → torch_dist again: the same bytes."""
    to_hf(fixture / "base", fixture, tmp_path / "hf", lora=fixture / "lora")
    lora_merge.to_megatron(base=tmp_path / "hf", out=tmp_path / "dist", ckpt_format="torch_dist", warn=quiet)
    assert {"common.pt", "metadata.json", ".metadata"} <= set(os.listdir(tmp_path / "dist/release"))
    to_hf(tmp_path / "dist", fixture, tmp_path / "back")
    assert filecmp.cmp(tmp_path / "hf/model.safetensors", tmp_path / "back/model.safetensors", shallow=False)
    lora_merge.to_megatron(base=tmp_path / "dist", hf_ref=fixture / "hf_ref", out=tmp_path / "tp2", tp=2, warn=quiet)
    lora_merge.to_megatron(base=tmp_path / "tp2", hf_ref=fixture / "hf_ref", out=tmp_path / "dist2",
                           ckpt_format="torch_dist", warn=quiet)
    same_tree(tmp_path / "dist", tmp_path / "dist2")


def test_every_file_a_rank_loads_is_written_even_where_megatron_016_saves_fewer(tmp_path):
    """TP=4, ETP=1, EP=2: ranks 2 and 3 open mp_rank_02_000 and mp_rank_03_001, which megatron-core 0.16.1's
    save (expert-data-parallel rank 0 only) leaves out; we write them."""
    lora_merge.to_megatron(base=MOE / "base", hf_ref=MOE / "hf_ref", out=tmp_path / "mg", tp=4, ep=2, etp=1,
                           warn=quiet)
    assert files_of(tmp_path / "mg/release") == [f"mp_rank_0{t}_00{t % 2}/model_optim_rng.pt" for t in range(4)]


def test_an_hf_base_with_a_peft_adapter_merges_into_megatron(tmp_path):
    """HF + PEFT → Megatron (TP2) → HF equals HF + PEFT → HF."""
    to_hf(DENSE / "base", DENSE, tmp_path / "hf")
    lora_merge.export_adapter(lora=DENSE / "lora", hf_ref=DENSE / "hf_ref", out=tmp_path / "adapter", warn=quiet)
    lora_merge.merge(base=tmp_path / "hf", lora=tmp_path / "adapter", hf_ref=DENSE / "hf_ref",
                     out=tmp_path / "direct", warn=quiet)
    result = lora_merge.to_megatron(base=tmp_path / "hf", lora=tmp_path / "adapter", out=tmp_path / "mg", tp=2,
                                    warn=quiet)
    assert result.lora_modules == 4 * 7 and result.lora is not None  # PEFT counts q, k, v … apart
    to_hf(tmp_path / "mg", DENSE, tmp_path / "back")
    assert filecmp.cmp(tmp_path / "direct/model.safetensors", tmp_path / "back/model.safetensors", shallow=False)


def test_mindspeed_mla_naming_is_the_fused_linear_qkv_mindspeed_loads(tmp_path):
    """--mla-naming mindspeed: the committed MindSpeed-named base rewritten at its layout is its own bytes'
    tensors, key for key (linear_qkv = [q_down; kv_down], whole on every rank, with its _extra_state)."""
    fixture = TESTS / "fixtures_deepseek/deepseek_v3_mindspeed_fused_qkv_ep2"
    for source in (fixture / "base", MLA / "base"):  # from either naming
        out = tmp_path / source.parent.name
        lora_merge.to_megatron(base=source, hf_ref=fixture / "hf_ref", out=out, ep=2, tp=2, etp=1,
                               mla_naming="mindspeed", warn=quiet)
        rank = torch.load(out / "release/mp_rank_01_001/model_optim_rng.pt", weights_only=False, mmap=True)["model"]
        assert "decoder.layers.0.self_attention.linear_q_down_proj.weight" not in rank
        assert rank["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (48 + 32 + 8, 64)  # not split
        assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in rank
    lora_merge.to_megatron(base=fixture / "base", hf_ref=fixture / "hf_ref", out=tmp_path / "same", ep=2,
                           mla_naming="mindspeed", warn=quiet)
    same_as_megatrons_save(tmp_path / "same/release", fixture / "base/iter_0000001")
    to_hf(MLA / "base", MLA, tmp_path / "hf")  # and it reads back (at TP2) as the model it came from
    to_hf(tmp_path / MLA.name, MLA, tmp_path / "back")
    direct, back = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert direct.keys() == back.keys()  # (the fused naming plans q_a/kv_a in another order: tensors, not bytes)
    assert all(torch.equal(direct[k], back[k]) for k in direct)
    with pytest.raises(MergeError, match="--mla-naming mindspeed"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "x", mla_naming="mindspeed",
                               warn=quiet)


def test_the_command_line(tmp_path, capsys):
    from lora_merge.cli import main

    hf = tmp_path / "hf"
    to_hf(DENSE / "base", DENSE, hf)
    # a dry run says what it would write, and writes nothing
    assert main(["--to", "megatron", "--base", str(hf), "--out", str(tmp_path / "mg"), "--tp", "2", "--pp", "2",
                 "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "would write a Megatron torch checkpoint, TP=2 PP=2, padded vocab 256" in out and not (tmp_path / "mg").exists()
    # --hf-ref defaults to an HF --base; the load flags are printed
    assert main(["--to", "megatron", "--base", str(hf), "--out", str(tmp_path / "mg"), "--tp", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "--ckpt-format torch --transformer-impl local --finetune --no-load-optim --no-load-rng" in out
    assert (tmp_path / "mg/release/mp_rank_01/model_optim_rng.pt").is_file()
    # layout options without --to megatron, HF-only options with it, nothing to convert: one line, exit 2
    for argv, expected in (
            (["--base", str(hf), "--hf-ref", str(hf), "--out", str(tmp_path / "o"), "--tp", "2"],
             "--tp: options of a Megatron output; add --to megatron"),
            (["--to", "megatron", "--base", str(hf), "--out", str(tmp_path / "o"), "--verify"],
             "--verify: an option of an HF output, not of --to megatron"),
            (["--to", "megatron", "--hf-ref", str(hf), "--out", str(tmp_path / "o")], "give --lora"),
            (["--to", "megatron", "--base", str(DENSE / "base"), "--out", str(tmp_path / "o")], "--hf-ref: required"),
    ):
        assert main(argv + ["--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_any_worker_count_writes_the_same_checkpoint(tmp_path):
    for workers in (1, 3):
        lora_merge.to_megatron(base=MOE / "base", lora=MOE / "lora", hf_ref=MOE / "hf_ref", out=tmp_path / str(workers),
                               tp=2, ep=2, workers=workers, warn=quiet)
    same_tree(tmp_path / "1", tmp_path / "3")


PUBLISHED = TESTS / "data/published_configs"


def has_megatron_form(config: Path) -> bool:
    """Families merged on the HF routes only (their architecture module says why) have no Megatron output."""
    from lora_merge.model.architectures import ARCHITECTURES
    from lora_merge.model.multimodal import MULTIMODAL

    published = json.loads(config.read_text())
    kind = MULTIMODAL.get(published["model_type"])  # a multimodal release: its language model's type
    arch = ARCHITECTURES.get(kind.text_model_type if kind else published["model_type"]) or next(  # (Kimi-K2: kimi_k2 read as the class it names)
        a for a in ARCHITECTURES.values() if a.config.causal_lm in published.get("architectures", []))
    return not arch.config.hf_only


@pytest.mark.parametrize("name", sorted(p.stem for p in PUBLISHED.glob("*.json") if has_megatron_form(p)))
def test_every_published_config_is_recorded_in_args_our_readers_accept(tmp_path, name):
    """From an HF source the args are derived from the config (RoPE scaling of every kind, MoE routing, MLA);
    target_args checks them against the config with the check every Megatron input gets, so writing one the
    readers would refuse fails here."""
    from lora_merge.model.hf_config import read_hf_config
    from lora_merge.model.parallel_layout import ParallelLayout
    from lora_merge.writers.megatron_args import target_args, vocab_padding

    config = json.loads((PUBLISHED / f"{name}.json").read_text())
    config.pop("quantization_config", None)  # the FP8 releases (read in another issue)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape, _ = read_hf_config(tmp_path)
    padded, divisor = vocab_padding(shape.vocab, 8, None, None)
    args = target_args(shape, ParallelLayout(tp=8), torch.bfloat16, padded, divisor, False)
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size) == (shape.num_layers, shape.hidden, padded)
    assert args.bf16 and args.tensor_model_parallel_size == 8


def test_a_conversion_without_a_lora_on_the_command_line(tmp_path, capsys):
    """Megatron → HF and HF → Megatron with no --lora: the dry run's plan and the summary say so (no LoRA
    settings to print), exit 0."""
    from lora_merge.cli import main

    for argv in (["--base", str(DENSE / "base"), "--hf-ref", str(DENSE / "hf_ref"), "--out", str(tmp_path / "hf")],
                 ["--to", "megatron", "--base", str(tmp_path / "hf"), "--out", str(tmp_path / "mg"), "--tp", "2"]):
        assert main(argv + ["--no-progress", "--dry-run"]) == 0, capsys.readouterr().err
        assert main(argv + ["--no-progress"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "no LoRA: converted as it is" in out and "r=" not in out, out
