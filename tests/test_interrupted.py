"""A run killed while writing leaves no output directory, and the next run succeeds."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from synthetic_checkpoint import write_checkpoint  # noqa: E402

from lora_merge.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    import torch

    write_checkpoint(root, preset="small", layers=4, tp=2, dtype=torch.float32)
    return root


def test_sigkill_mid_write_leaves_no_output_and_rerun_succeeds(synthetic, tmp_path):
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "lora_merge", "--base", str(synthetic / "base"), "--lora", str(synthetic / "lora"),
           "--hf-ref", str(synthetic / "hf_ref"), "--out", str(out), "--max-shard-size", "20MB", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    killed_mid_write = False
    while time.monotonic() < deadline and proc.poll() is None:
        partial = list(tmp_path.glob(".merged.partial-*/model-*.safetensors"))
        if len(partial) >= 2:  # the first shard is complete and the second under way
            os.kill(proc.pid, signal.SIGKILL)
            killed_mid_write = True
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_mid_write, "the merge finished before it could be interrupted"
    assert not out.exists()
    assert list(tmp_path.glob(".merged.partial-*"))  # the abandoned staging dir, hidden and named as partial

    assert main(cmd[3:]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert not list(tmp_path.glob(".merged.partial-*"))  # the rerun cleaned up after the killed run
