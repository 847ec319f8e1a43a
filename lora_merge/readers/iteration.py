"""Which iteration directory of a checkpoint to read: the one the tracker file names, never a glob."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from lora_merge.errors import MergeError

TRACKER = "latest_checkpointed_iteration.txt"
EXPECTED = "expected an iteration number or 'release'"
# Megatron writes a number and a newline; anything this long is not a tracker, and a huge file must not
# be read whole just to say so.
TRACKER_MAX_BYTES = 4096
# str.isdigit and int() accept '²', '٣' and other non-ASCII digits; Megatron only ever writes ASCII ones.
ITERATION_NUMBER = re.compile(r"[0-9]{1,20}", re.ASCII)


def resolve_iteration_dir(path: Path, holds_checkpoint: Callable[[Path], bool]) -> tuple[Path, str]:
    """The directory holding the checkpoint files, and its iteration.

    `path` is a checkpoint root with a tracker file, or an `iter_*` / `release` directory itself.
    """
    if not path.is_dir():
        raise MergeError(f"{path}: no such checkpoint directory")
    tracker = path / TRACKER
    # lexists, not is_file: a tracker that is a directory or a broken symlink is a broken checkpoint, not
    # a sign that `path` is an iteration dir itself.
    if os.path.lexists(tracker):
        return _tracked_iteration(path, tracker)
    if holds_checkpoint(path):
        return path, _iteration_of_dir_name(path)
    raise MergeError(f"{path}: not a Megatron checkpoint: expected {TRACKER}, or an iter_*/release directory "
                     "holding mp_rank_* dirs or a torch_dist .metadata")


def _tracked_iteration(path: Path, tracker: Path) -> tuple[Path, str]:
    text = read_tracker(tracker)
    if text == "release":
        it_dir, iteration = path / "release", "release"
    elif ITERATION_NUMBER.fullmatch(text):
        it_dir, iteration = path / f"iter_{int(text):07d}", str(int(text))
    else:
        raise MergeError(f"{tracker}: {EXPECTED}, found {_shown(text)}")
    if not it_dir.is_dir():
        raise MergeError(f"{tracker} names iteration {iteration} but {it_dir} does not exist")
    return it_dir, iteration


def read_tracker(tracker: Path) -> str:
    """The tracker's text, stripped; every way it can be unreadable is an error naming it."""
    if tracker.is_symlink() and not tracker.exists():
        raise MergeError(f"{tracker}: broken symlink (to {os.readlink(tracker)}); {EXPECTED}")
    if not tracker.is_file():  # a directory, or a FIFO that would block the read
        kind = "a directory" if tracker.is_dir() else "not a regular file"
        raise MergeError(f"{tracker}: {kind}; {EXPECTED} in a text file")
    try:
        with tracker.open("rb") as f:
            raw = f.read(TRACKER_MAX_BYTES + 1)
    except OSError as exc:
        raise MergeError(f"{tracker}: cannot be read ({exc.strerror or exc}); {EXPECTED}") from exc
    if len(raw) > TRACKER_MAX_BYTES:
        raise MergeError(f"{tracker}: over {TRACKER_MAX_BYTES} bytes, not a tracker file; {EXPECTED}")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise MergeError(f"{tracker}: not text (not UTF-8: {_shown(raw)}); {EXPECTED}") from None
    if not text:
        raise MergeError(f"{tracker}: empty; {EXPECTED}")
    return text


def _iteration_of_dir_name(path: Path) -> str:
    name = path.name
    number = name.removeprefix("iter_")
    if number != name and ITERATION_NUMBER.fullmatch(number):
        return str(int(number))
    if number != name and any(not c.isascii() and c.isnumeric() for c in number):
        raise MergeError(f"{path}: the iteration in the name is not written in ASCII digits; "
                         "expected iter_ and a number like iter_0000010")
    return name  # `release`, or a directory the user renamed


def _shown(value: str | bytes) -> str:
    """A value for a one-line message: repr (so control characters show), cut when long."""
    text = repr(value)
    unit = "bytes" if isinstance(value, bytes) else "characters"
    return text if len(text) <= 60 else f"{text[:57]}... ({len(value)} {unit})"


def find_iteration_dir(path: Path) -> Path:
    """The iteration dir `path` leads to, before its format is known (a broken tracker file is an error)."""
    return resolve_iteration_dir(path, lambda p: p.is_dir())[0]
