"""Which iteration directory of a checkpoint to read: the one the tracker file names, never a glob."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from lora_merge.errors import MergeError

TRACKER = "latest_checkpointed_iteration.txt"


def resolve_iteration_dir(path: Path, holds_checkpoint: Callable[[Path], bool]) -> tuple[Path, str]:
    """The directory holding the checkpoint files, and its iteration.

    `path` is a checkpoint root with a tracker file, or an `iter_*` / `release` directory itself.
    """
    if not path.is_dir():
        raise MergeError(f"{path}: no such checkpoint directory")
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            it_dir, iteration = path / "release", "release"
        elif text.isdigit():
            it_dir, iteration = path / f"iter_{int(text):07d}", str(int(text))
        else:
            raise MergeError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
        if not it_dir.is_dir():
            raise MergeError(f"{tracker} names iteration {text} but {it_dir} does not exist")
        return it_dir, iteration
    if holds_checkpoint(path):
        m = re.match(r"^iter_(\d+)$", path.name)
        return path, (str(int(m.group(1))) if m else path.name)
    raise MergeError(f"{path}: not a Megatron checkpoint: expected {TRACKER}, or an iter_*/release directory "
                     "holding mp_rank_* dirs or a torch_dist .metadata")


def find_iteration_dir(path: Path) -> Path:
    """The iteration dir `path` leads to, before its format is known (a broken tracker file is an error)."""
    return resolve_iteration_dir(path, lambda p: p.is_dir())[0]
