"""A Megatron target is valid when Megatron would accept it, and that is checked before anything is written:
pipeline splits against megatron-core's own TransformerConfig, one rule for the command line and the API
(0 is refused, not taken for the default), the padded vocabulary honoured as documented, bounded sizes that
plan nothing per row, and every API argument checked for its type."""

import inspect
import os
import resource
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_merge
from lora_merge.cli import main
from lora_merge.errors import MergeError
from lora_merge.model.parallel_layout import ParallelLayout
from helpers import quiet

TESTS = Path(__file__).parent
DENSE = TESTS / "fixtures/tp2pp2_fp32_filtered"  # 4 layers, 8 heads / 4 groups, vocab 250
MOE = TESTS / "fixtures_moe/qwen2moe_tp2ep2"
NUM_LAYERS = 4



def megatron_refusal(num_layers: int, pp: int, vpp: int, first, last) -> str | None:
    """What megatron-core 0.16.1's TransformerConfig says of a pipeline split (None: accepted)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=8,
                              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                              num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                              pipeline_dtype=torch.float32)
        except (ValueError, AssertionError) as exc:
            return str(exc)
    return None


def our_refusal(num_layers: int, pp: int, vpp: int, first, last) -> str | None:
    layout = ParallelLayout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    try:
        layout.check_values()
        layout.numbering(num_layers)
    except MergeError as exc:
        return str(exc)
    return None


SPLITS = [(n, pp, vpp, first, last) for n in (4, 6, 8) for pp in (2, 3, 4) for vpp in (1, 2)
          for first in (None, 0, 1, 2, 3, 4, 8) for last in (None, 0, 1, 2, 4)]


def test_every_uneven_pipeline_split_is_accepted_exactly_when_megatron_accepts_it():
    """Every first/last stage split of 4, 6 and 8 layers over PP 2-4 (VPP 1, 2), 0 and counts past the model
    included: where Megatron's TransformerConfig refuses (a stage with no layers, 0, a split that does not
    divide), we refuse; where it accepts, we write that layout. Splits without first/last counts: we accept
    a subset of what TransformerConfig accepts (Megatron-LM's training arguments also require num_layers
    divisible by PP, which TransformerConfig leaves to them), and first/last counts past the model's layers
    are refused where TransformerConfig lets them through."""
    disagree = []
    for split in SPLITS:
        theirs, ours = megatron_refusal(*split), our_refusal(*split)
        n, _, _, first, last = split
        uneven = first is not None or last is not None
        # TransformerConfig takes first/last counts past the model (first=8 of 4 layers at PP 2: -4 "middle"
        # layers on one stage); a model has no such layers, and we refuse them
        past_the_model = (first or 0) + (last or 0) > n
        if (theirs is None) != (ours is None) and (ours is None or (uneven and not past_the_model)):
            disagree.append((split, theirs, ours))
    assert not disagree, disagree[:5]
    assert sum(our_refusal(*s) is None for s in SPLITS if s[3] is not None or s[4] is not None) >= 20  # not all refused


@pytest.mark.parametrize("layout", [
    dict(pp=2, decoder_first_pipeline_num_layers=0),
    dict(pp=2, decoder_first_pipeline_num_layers=4),  # the last stage empty
    dict(pp=3, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2),  # the middle stage empty
    dict(pp=4, vpp=2, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=0),
    dict(pp=2, decoder_last_pipeline_num_layers=-1),
])
def test_the_reported_pipeline_splits_are_refused_before_writing(tmp_path, layout):
    first, last = layout.get("decoder_first_pipeline_num_layers"), layout.get("decoder_last_pipeline_num_layers")
    assert megatron_refusal(NUM_LAYERS, layout["pp"], layout.get("vpp", 1), first, last) is not None
    with pytest.raises(MergeError, match="pipeline|stage"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", warn=quiet, **layout)
    assert os.listdir(tmp_path) == []


LAYOUT_OPTIONS = ["--tp", "--pp", "--vpp", "--ep", "--etp", "--decoder-first-pipeline-num-layers",
                  "--decoder-last-pipeline-num-layers", "--make-vocab-size-divisible-by", "--padded-vocab-size"]


@pytest.mark.parametrize("option", LAYOUT_OPTIONS)
@pytest.mark.parametrize("value", ["0", "-2"])
def test_zero_or_negative_on_the_command_line_is_refused_not_taken_for_the_default(tmp_path, capsys, option, value):
    """`--tp 0` was `opts.tp or 1`: silently TP 1. The command line passes what was typed to the checks the
    API uses, so both refuse alike, naming the option."""
    argv = ["--to", "megatron", "--base", str(DENSE / "base"), "--hf-ref", str(DENSE / "hf_ref"), "--out",
            str(tmp_path / "mg"), "--no-progress", option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert option in err and "expected" in err, err
    assert os.listdir(tmp_path) == []
    kwargs = {option.removeprefix("--").replace("-", "_"): int(value)}
    with pytest.raises(MergeError, match=option):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", warn=quiet, **kwargs)


@pytest.mark.parametrize("tp,padded", [(1, 256), (1, 251), (1, 1000), (2, 252), (2, 384)])
def test_a_padded_vocab_size_given_by_hand_is_written_as_documented(tmp_path, tp, padded):
    """--padded-vocab-size: any size of at least vocab_size (250) divisible by TP, not only the rule's own;
    padding rows zero; the args record make_vocab_size_divisible_by = size / TP, from which Megatron's rule
    gives back that size, so our readers (and Megatron's --use-checkpoint-args) accept it: it converts back to
    exactly the model it came from."""
    result = lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", tp=tp,
                                    padded_vocab_size=padded, warn=quiet)
    assert result.padded_vocab_size == padded and result.make_vocab_size_divisible_by == padded // tp
    rank0 = torch.load(tmp_path / "mg/release/mp_rank_00/model_optim_rng.pt", weights_only=False, mmap=True)
    args = rank0["args"]
    assert args.padded_vocab_size == padded
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    assert -(-250 // multiple) * multiple == padded  # Megatron's own rule on the recorded args
    rows = torch.cat([torch.load(tmp_path / f"mg/release/mp_rank_{t:02d}/model_optim_rng.pt", weights_only=False,
                                 mmap=True)["model"]["embedding.word_embeddings.weight"] for t in range(tp)])
    assert rows.shape[0] == padded and not rows[250:].any()
    lora_merge.merge(base=tmp_path / "mg", hf_ref=DENSE / "hf_ref", out=tmp_path / "back", warn=quiet)
    lora_merge.merge(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "direct", warn=quiet)
    back, direct = load_file(tmp_path / "back/model.safetensors"), load_file(tmp_path / "direct/model.safetensors")
    assert back.keys() == direct.keys() and all(torch.equal(back[k], direct[k]) for k in direct)


def test_a_padded_size_and_a_divisor_that_disagree_are_refused(tmp_path):
    with pytest.raises(MergeError, match="Megatron's rule pads vocab_size 250 to 256 at --tp 1; give one of the two"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg",
                               padded_vocab_size=300, make_vocab_size_divisible_by=128, warn=quiet)
    result = lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                                    padded_vocab_size=256, make_vocab_size_divisible_by=128, warn=quiet)
    assert (result.padded_vocab_size, result.make_vocab_size_divisible_by) == (256, 128)


def test_the_load_line_names_the_divisor_megatron_must_be_given(tmp_path, capsys):
    assert main(["--to", "megatron", "--base", str(DENSE / "base"), "--hf-ref", str(DENSE / "hf_ref"), "--out",
                 str(tmp_path / "mg"), "--no-progress", "--padded-vocab-size", "300"]) == 0
    assert "--make-vocab-size-divisible-by 300" in capsys.readouterr().out
    assert main(["--to", "megatron", "--base", str(DENSE / "base"), "--hf-ref", str(DENSE / "hf_ref"), "--out",
                 str(tmp_path / "mg2"), "--no-progress"]) == 0
    assert "--make-vocab-size-divisible-by" not in capsys.readouterr().out  # Megatron's default, 128


@pytest.mark.parametrize("option,value", [("make_vocab_size_divisible_by", 10**9), ("make_vocab_size_divisible_by", 3 * 10**9),
                                          ("make_vocab_size_divisible_by", 10**12), ("padded_vocab_size", 10**12)])
def test_absurd_vocabulary_padding_is_refused_by_a_bound(tmp_path, option, value):
    with pytest.raises(MergeError, match=f"--{option.replace('_', '-')} {value}; expected a whole number .* (to|at most) "
                                         f"{(1 << 20) if option.startswith('make') else (1 << 31) - 1}$"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                               warn=quiet, **{option: value})


def test_the_largest_padding_allowed_plans_without_memory_per_row(tmp_path):
    """2^31 - 1 rows (the bound) are planned in a dry run without building an index tensor per row (a 1e9
    divisor once cost ~4 GB before the space check): the run is refused for disk space, not memory."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MergeError, match="not enough disk space"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                               padded_vocab_size=(1 << 31) - 1, warn=quiet)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1000, grown_mb  # an int32 index per row would be 8 GB
    result = lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                                    make_vocab_size_divisible_by=1 << 20, warn=quiet)
    assert result.padded_vocab_size == 1 << 20


def test_etp_on_a_model_without_experts_is_refused(tmp_path, capsys):
    with pytest.raises(MergeError, match="--etp 2 but the model has no routed experts"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", etp=2, warn=quiet)
    result = lora_merge.to_megatron(base=MOE / "base", hf_ref=MOE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                                    tp=2, etp=1, warn=quiet)
    assert result.layout == "TP=2 PP=1 EP=1 ETP=1"


def test_the_space_check_keeps_a_margin_for_a_megatron_output_too(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    written = lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg", dry_run=True,
                                     warn=quiet).bytes
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, written + 10**6))
    with pytest.raises(MergeError, match="margin for the tracker file"):
        lora_merge.to_megatron(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=tmp_path / "mg2", warn=quiet)
    assert not (tmp_path / "mg2").exists()


# --- every API argument is checked for its type, where it is read ---

PATH, BOOL, INT, OPT_INT, NUMBER, CHOICE, SIZE, CALLABLE, TEXT, WEIGHTS, PART, OPTIONS = (
    "path", "bool", "int", "optional int", "number", "choice", "size", "callable", "text", "weights", "part",
    "options")
KINDS = {
    "hf_ref": PATH, "out": PATH, "lora": PATH, "base": PATH, "report": PATH, "checkpoint": PATH,
    "dtype": CHOICE, "ckpt_format": CHOICE, "expert_layout": CHOICE, "mla_naming": CHOICE, "transformer_impl": CHOICE,
    "expert_format": CHOICE,
    "max_shard_size": SIZE, "lora_r": OPT_INT, "lora_alpha": NUMBER, "workers": OPT_INT,
    "allow_partial_lora": BOOL, "force": BOOL, "verify": BOOL, "dry_run": BOOL, "sha256": BOOL, "verbose": BOOL,
    "base_model_id": TEXT, "progress": CALLABLE, "warn": CALLABLE,
    "tp": INT, "pp": INT, "vpp": INT, "ep": INT, "etp": OPT_INT, "decoder_first_pipeline_num_layers": OPT_INT,
    "decoder_last_pipeline_num_layers": OPT_INT, "make_vocab_size_divisible_by": OPT_INT, "padded_vocab_size": OPT_INT,
    "lora_weights": WEIGHTS, "part": PART, "resume": BOOL, "storage_options": OPTIONS,
}
WRONG = {
    PATH: [5, 1.5, [], object(), b"dir"],
    BOOL: ["yes", 1, [], object()],
    INT: ["2", 2.0, 1.5, True, None, [], object()],
    OPT_INT: ["2", 2.0, 1.5, True, [], object()],
    NUMBER: ["2", True, [], object(), float("nan")],
    CHOICE: [5, None, [], ("torch",), object()],
    SIZE: [True, [], object(), -1],
    CALLABLE: [5, "print"],
    TEXT: [5, [], object()],
    WEIGHTS: ["1", 1.0, [float("nan")], ["1"], [True], [1.0, 2.0], object()],
    PART: [5, 1.5, "1", "2/2", "0/0", (1,), (True, 2), (0, 2.0), [], object()],
    OPTIONS: [5, "{}", [], ("anon",), {1: True}, object()],
}


def valid_calls(out: Path):
    """Each API function with arguments that work on the fixtures (a dry run where there is one)."""
    return {
        lora_merge.merge: dict(base=DENSE / "base", lora=DENSE / "lora", hf_ref=DENSE / "hf_ref", out=out,
                               dry_run=True, warn=quiet),
        lora_merge.to_megatron: dict(base=DENSE / "base", hf_ref=DENSE / "hf_ref", out=out, dry_run=True, warn=quiet),
        lora_merge.export_adapter: dict(lora=DENSE / "lora", hf_ref=DENSE / "hf_ref", out=out, warn=quiet),
        lora_merge.verify: dict(out=DENSE / "hf_ref", warn=quiet),
        lora_merge.inspect: dict(checkpoint=DENSE / "lora"),
    }


def test_every_api_argument_has_a_kind_here():
    """A new keyword must be added to KINDS (and so to the type test below)."""
    for fn in valid_calls(Path("/nonexistent")):
        missing = [name for name in inspect.signature(fn).parameters if name not in KINDS]
        assert not missing, (fn.__name__, missing)


@pytest.mark.parametrize("fn_name", ["merge", "to_megatron", "export_adapter", "verify", "inspect"])
def test_every_api_argument_of_the_wrong_type_is_a_merge_error(tmp_path, fn_name):
    """`to_megatron(padded_vocab_size="128")` raised a raw TypeError, `decoder_first_pipeline_num_layers="1"` was
    written into args as '1': every argument of every function, given a value of the wrong type, raises
    MergeError naming it, and writes nothing."""
    fn = getattr(lora_merge, fn_name)
    fn(**valid_calls(tmp_path / "valid")[fn])  # the arguments work as they are
    kwargs = valid_calls(tmp_path / "out")[fn]
    problems = []
    for name in inspect.signature(fn).parameters:
        for value in WRONG[KINDS[name]]:
            try:
                fn(**{**kwargs, name: value})
            except MergeError as exc:
                if name.split("_")[0] not in str(exc).replace("-", "_") and name != "checkpoint":
                    problems.append(f"{name}={value!r}: the message does not name it: {exc}")
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                problems.append(f"{name}={value!r}: {type(exc).__name__}: {exc}")
            else:
                problems.append(f"{name}={value!r}: accepted")
            assert not (tmp_path / "out").exists(), (name, value)
    assert not problems, "\n".join(problems)
