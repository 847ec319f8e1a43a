"""API callers can catch by category: every category is a MergeError (one line, exit 2 on the command line,
messages unchanged), and each is what the representative case raises."""

import json
import shutil
from pathlib import Path

import pytest

import lora_merge
from helpers import FIXTURES, quiet, rank_files

NAME = "tp2_fp32_filtered"



def merge(tmp_path, root=None, **kw):
    root = root or FIXTURES / NAME
    args = dict(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "out", warn=quiet)
    return lora_merge.merge(**{**args, **kw})


def test_every_category_is_a_merge_error():
    for name in ("UsageError", "UnsupportedInput", "DamagedInput", "OutputConflict"):
        assert issubclass(getattr(lora_merge, name), lora_merge.MergeError)


def test_usage(tmp_path):
    with pytest.raises(lora_merge.UsageError, match="lora_r='4'"):
        merge(tmp_path, lora_r="4")


def test_unsupported(tmp_path):
    ref = tmp_path / "ref"
    shutil.copytree(FIXTURES / NAME / "hf_ref", ref)
    config = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    with pytest.raises(lora_merge.UnsupportedInput, match="partial RoPE is not supported"):
        merge(tmp_path, hf_ref=ref)


def test_damaged(tmp_path):
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    victim = rank_files(root / "lora")[0]
    data = bytearray(victim.read_bytes())
    data[-2000] ^= 0xFF  # a byte of the last tensor's data: its CRC32 no longer matches
    victim.write_bytes(bytes(data))
    with pytest.raises(lora_merge.DamagedInput, match="CRC32|damaged"):
        merge(tmp_path, root=root)


def test_output_conflict(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "theirs.txt").write_text("x")
    with pytest.raises(lora_merge.OutputConflict, match="not replacing it"):
        merge(tmp_path)
    with pytest.raises(lora_merge.OutputConflict):
        merge(tmp_path, out=FIXTURES / NAME / "lora" / "inside")
