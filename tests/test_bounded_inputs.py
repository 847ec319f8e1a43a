"""Bounded reads and bounded messages, and vocabularies that would lose trained rows.

Every small file read whole is a regular file under the cap for its kind (a /dev/zero link, a FIFO or a
3 GB sparse file is refused in one line without reading it); every input value shown in a message costs a
bounded amount of text (a 2^40-leaf reference bomb in the args included); the HF vocab_size must keep every
row Megatron's padding rule says was trained, and every id the tokenizer files name."""

import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
from test_config_checks import SMALL_QWEN2, fails_in_cli, megatron_args, read, write_config
from helpers import assert_nothing_written, copied_args, copy_fixture, rank_files, rewrite

from lora_merge.errors import MergeError
from lora_merge.model.hf_config import read_hf_config
from lora_merge.model.megatron_args import check_against_args
from lora_merge.shown import shown
from lora_merge.files.small_files import CAPS, read_json

REPO = Path(__file__).resolve().parent.parent
TIME_LIMIT_S = 30  # a run that reads /dev/zero or walks 2^40 leaves would never end inside it


def reference_bomb(depth: int = 40) -> list:
    """A list of 2^depth leaves in a few hundred bytes of pickle: each level references the one below twice."""
    value: list = []
    for _ in range(depth):
        value = [value, value]
    return value


def run_cli(args: list[str]) -> tuple[int, list[str], float]:
    """The command in a fresh process under TIME_LIMIT_S: (exit code, stderr lines but warnings, seconds)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lora_merge", *args, "--no-progress"], capture_output=True, text=True,
                          timeout=TIME_LIMIT_S, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    lines = [line for line in done.stderr.splitlines() if line.strip() and " warning: " not in line]
    return done.returncode, lines, time.monotonic() - started


def link_to_dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.symlink("/dev/zero", path)


def sparse_3gb(path: Path) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(3 << 30)  # no disk blocks: a hole


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


# --- reads: regular files under a cap per kind ------------------------------------------------------------


@pytest.mark.parametrize("name,damage,words", [
    ("config.json", link_to_dev_zero, ["config.json: a device, not a regular file"]),
    ("config.json", sparse_3gb, ["config.json: 3221225472 bytes, more than the 16 MB a config.json may hold"]),
    ("tokenizer.json", link_to_dev_zero, ["tokenizer.json: a device, not a regular file"]),
    ("tokenizer.json", sparse_3gb, ["tokenizer.json: 3221225472 bytes, more than the 64 MB"]),
    ("tokenizer_config.json", sparse_3gb, ["tokenizer_config.json: 3221225472 bytes, more than the 64 MB"]),
    ("added_tokens.json", fifo, ["added_tokens.json: a FIFO, not a regular file"]),
])
def test_a_reference_file_that_is_not_a_small_regular_file_is_refused_fast(tmp_path, name, damage, words):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    damage(root / "hf_ref" / name)
    out = tmp_path / "out"
    code, lines, seconds = run_cli(copied_args(root, out))
    assert code == 2 and len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
    assert seconds < TIME_LIMIT_S
    assert_nothing_written(out)


@pytest.mark.parametrize("damage,words", [
    (link_to_dev_zero, [".metadata: a device, not a regular file"]),
    (fifo, [".metadata: a FIFO, not a regular file"]),
])
def test_torch_dist_metadata_that_is_not_a_regular_file_is_refused_fast(tmp_path, damage, words):
    root = copy_fixture("dist_tp2pp2_fp32", tmp_path)
    (it_dir,) = (root / "base").glob("iter_*")
    damage(it_dir / ".metadata")
    out = tmp_path / "out"
    code, lines, _ = run_cli(copied_args(root, out))
    assert code == 2 and len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]


def test_the_cap_is_checked_before_reading(tmp_path, monkeypatch):
    """A file over its kind's cap is refused from its size; one that grows while read is cut at cap + 1."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "pad": "x" * 100}))
    monkeypatch.setitem(CAPS, "config.json", 50)
    with pytest.raises(MergeError, match=r"config.json: \d+ bytes, more than the 50 bytes a config.json may hold"):
        read_json(path)
    monkeypatch.setitem(CAPS, "config.json", 1 << 20)
    assert read_json(path)["model_type"] == "qwen2"


# --- messages: the text of an input value is bounded --------------------------------------------------------


def test_shown_bounds_every_value_whatever_it_costs_to_repr():
    from lora_merge.files.safe_load import stand_in_class

    started = time.monotonic()
    assert shown(reference_bomb()).startswith("[[[[") and len(shown(reference_bomb())) <= 83
    selfish: dict = {}
    selfish["me"] = selfish
    assert len(shown(selfish)) <= 83
    assert shown("x" * 10**7).endswith("...") and len(shown("x" * 10**7)) <= 90
    assert shown(10**5000) == "<an int of 16610 bits>"
    enum_like = stand_in_class("megatron.core.enums.ModelType")(reference_bomb())
    assert repr(enum_like).startswith("ModelType([[[") and len(repr(enum_like)) <= 210
    assert len(shown(Namespace(x=reference_bomb()))) <= 83
    assert time.monotonic() - started < 1.0
    # Plain values read as repr writes them: messages keep their words.
    assert (shown(5), shown("rope"), shown((1024, 0)), shown(None), shown({"a": [1]})) == \
           ("5", "'rope'", "(1024, 0)", "None", "{'a': [1]}")


@pytest.mark.parametrize("arg,words", [
    ("num_layers", ["args.num_layers=[[[[", "expected a positive integer"]),
    ("normalization", ["args.normalization=[[[[", "only 'RMSNorm' maps onto"]),
    ("rope_scaling_type", ["args.rope_scaling_type=[[[["]),
    ("noop_layers", ["args: noop_layers [[[["]),
    ("lora_r", ["args.lora_r=[[[[", "expected a positive integer"]),
    ("window_size", ["args.window_size=[[[[", "sliding-window"]),
])
def test_a_reference_bomb_in_the_args_ends_fast_in_one_line(tmp_path, arg, words):
    """A 44 KB rank file whose args value has 2^40 leaves: one bounded line, well inside the time limit."""
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "base") + rank_files(root / "lora"):
        rewrite(f, lambda state: setattr(state["args"], arg, reference_bomb()))
    out = tmp_path / "out"
    code, lines, seconds = run_cli(copied_args(root, out))
    assert code == 2 and len(lines) == 1 and len(lines[0]) < 600, lines
    for word in words:
        assert word in lines[0], lines[0]
    assert seconds < TIME_LIMIT_S
    assert_nothing_written(out)


# --- the vocabulary: no trained row is cut ------------------------------------------------------------------


@pytest.mark.parametrize("vocab,args", [
    (250, {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 64, "tensor_model_parallel_size": 2}),
    (250, {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 128}),  # TP 1
    (129, {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 128}),  # the smallest it can be
    (250, {"padded_vocab_size": 256}),  # no divisor recorded: Megatron's default 128
    (250, {"padded_vocab_size": 250, "make_vocab_size_divisible_by": 1}),  # MindSpeed's own --padded-vocab-size
])
def test_a_vocabulary_megatron_padded_to_the_args_is_accepted(tmp_path, vocab, args):
    shape = read(tmp_path, vocab_size=vocab, bos_token_id=1, eos_token_id=3)
    check_against_args(shape, megatron_args(shape, **args), "ckpt")


@pytest.mark.parametrize("vocab,args,words", [
    (100, {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 64, "tensor_model_parallel_size": 2},
     ["args.padded_vocab_size=256 but the HF config's vocab_size=100 pads to 128 under Megatron's rule",
      "args.make_vocab_size_divisible_by=64 x tensor_model_parallel_size=2 = 128", "rows 100..255 would be cut",
      "expected an HF vocab_size of 129..256"]),
    (128, {"padded_vocab_size": 256}, ["Megatron's default make_vocab_size_divisible_by=128 (the args record none)",
                                       "rows 128..255 would be cut"]),
    (250, {"padded_vocab_size": 256, "make_vocab_size_divisible_by": 1},
     ["pads to 250", "rows 250..255 would be cut"]),
    (250, {"padded_vocab_size": 300, "make_vocab_size_divisible_by": 128},
     ["args.padded_vocab_size=300 is not a multiple of make_vocab_size_divisible_by x tensor_model_parallel_size = "
      "128 x 1", "set by hand", "rows 250..299", "expected vocab_size=300"]),
])
def test_a_vocabulary_that_would_cut_trained_rows_is_refused(tmp_path, vocab, args, words):
    shape = read(tmp_path, vocab_size=vocab, bos_token_id=1, eos_token_id=3)
    with pytest.raises(MergeError) as exc:
        check_against_args(shape, megatron_args(shape, **args), "ckpt/base")
    message = str(exc.value)
    assert message.startswith("ckpt/base: ") and "\n" not in message
    for word in words:
        assert word in message, message


def test_a_cut_vocabulary_without_tokenizer_files_is_refused_in_cli(tmp_path, capsys):
    """The issue's case: vocab_size=100 against padded_vocab_size=256 (TP 2, divisible by 64), no tokenizer."""
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "hf_ref" / name).unlink()
    path = root / "hf_ref" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "vocab_size": 100}))
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, "args.padded_vocab_size=256", "vocab_size=100 pads to 128",
                 "rows 100..255 would be cut")
    assert_nothing_written(out)


@pytest.mark.parametrize("name,content,words", [
    ("tokenizer_config.json", {"added_tokens_decoder": {"3": {"content": "</s>"}, "260": {"content": "<x>"}}},
     ["tokenizer_config.json names id 260", "expected vocab_size >= 261"]),
    ("added_tokens.json", {"<x>": 299, "<y>": 7}, ["added_tokens.json names id 299", "expected vocab_size >= 300"]),
])
def test_ids_named_only_by_other_tokenizer_files_count(tmp_path, name, content, words):
    hf = write_config(tmp_path, SMALL_QWEN2)
    (hf / name).write_text(json.dumps(content))
    with pytest.raises(MergeError) as exc:
        read_hf_config(hf)
    for word in ["vocab_size=250 is smaller than the tokenizer's", *words]:
        assert word in str(exc.value), str(exc.value)


@pytest.mark.parametrize("name,content,words", [
    ("tokenizer_config.json", {"added_tokens_decoder": {"x1": {}}}, ["added_tokens_decoder has the key 'x1'"]),
    ("tokenizer_config.json", {"added_tokens_decoder": []}, ["added_tokens_decoder is a JSON array"]),
    ("added_tokens.json", {"<x>": -1}, ["malformed added_tokens.json: token id -1"]),
    ("added_tokens.json", [1, 2], ["the top level is a JSON array"]),
])
def test_malformed_tokenizer_id_files_are_refused(tmp_path, name, content, words):
    hf = write_config(tmp_path, SMALL_QWEN2)
    (hf / name).write_text(json.dumps(content))
    with pytest.raises(MergeError) as exc:
        read_hf_config(hf)
    assert str(exc.value).startswith(str(hf / name))
    for word in words:
        assert word in str(exc.value), str(exc.value)


def test_tokenizer_files_within_the_vocabulary_are_accepted(tmp_path):
    hf = write_config(tmp_path, SMALL_QWEN2)
    (hf / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"249": {"content": "<x>"}}}))
    (hf / "added_tokens.json").write_text(json.dumps({"<x>": 249}))
    assert read_hf_config(hf)[0].tokenizer_vocab == 250
