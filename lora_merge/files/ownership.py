"""What this tool wrote, recognised by its content: --force replaces only an earlier report of lora-merge (a
regular file whose JSON starts with our marker) or an earlier output of the same kind (a directory whose
README.md is our model card of that kind). Everything else at such a path is someone's own, and the refusal
says what it is.

Every read here is bounded (a few KiB at the ends of a file), so a path that is a huge file, a FIFO or a
device is recognised as not ours without reading it."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from lora_merge.readers.detect import what_is

# The first key of every report (written first by json.dumps: dicts keep their order). Reports written before
# the marker existed start with "tool": "lora-merge VERSION" followed by "inputs": recognised too.
REPORT_MARKER = "lora_merge_report"
REPORT_FORMAT = 1
_REPORT_HEAD = re.compile(r'\A\{\s*"' + REPORT_MARKER + r'":\s*\d+,\s*"tool":\s*"lora-merge [^"\\]*"')
_OLD_REPORT_HEAD = re.compile(r'\A\{\s*"tool":\s*"lora-merge [^"\\]*",\s*"inputs":\s*\{')
_HEAD_BYTES = 4096
# A model card's metadata header is a few hundred bytes; the file list after it can be megabytes.
_CARD_HEAD_BYTES = 64 << 10

MERGED_MODEL = "merged model"
PEFT_ADAPTER = "PEFT adapter"
# The card tags that say which kind of output a lora-merge card belongs to (writers/model_card.py).
_KIND_TAG = {MERGED_MODEL: "merged-lora", PEFT_ADAPTER: "lora"}


def _read_ends(path: Path, nbytes: int) -> tuple[bytes, bytes] | None:
    """The first and last `nbytes` of a regular file (not through a symlink), or None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        head = os.pread(fd, nbytes, 0)
        tail = os.pread(fd, nbytes, max(0, info.st_size - nbytes))
        return head, tail
    except OSError:
        return None
    finally:
        os.close(fd)


def is_our_report(path: Path) -> bool:
    """Whether `path` is a regular file holding a report of lora-merge (this version's or an earlier one's)."""
    ends = _read_ends(path, _HEAD_BYTES)
    if ends is None:
        return False
    head, tail = (part.decode("utf-8", errors="replace") for part in ends)
    return bool(_REPORT_HEAD.match(head) or _OLD_REPORT_HEAD.match(head)) and tail.rstrip().endswith("}")


def report_refusal(path: Path) -> str | None:
    """Why --force must not replace what is at `path` with a report, or None when it may (nothing there, or an
    earlier report of ours)."""
    if not os.path.lexists(path) or is_our_report(path):
        return None
    what = what_is(path)
    if what == "a regular file":
        what = "a file that is not a report of lora-merge"
    return (f"{path}: already exists and is {what}; --force replaces only an earlier report of lora-merge: "
            "name another --report file")


def card_kind(directory: Path) -> str | None:
    """The kind of lora-merge output whose model card `directory/README.md` is (MERGED_MODEL or PEFT_ADAPTER),
    or None when there is no such card."""
    ends = _read_ends(directory / "README.md", _CARD_HEAD_BYTES)
    if ends is None:
        return None
    text = ends[0].decode("utf-8", errors="replace")
    match = re.match(r"\A---\r?\n(.*?)\r?\n---\r?\n", text, re.S)
    if not match:
        return None
    import yaml

    try:
        header = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    tags = header.get("tags") if isinstance(header, dict) else None
    if not isinstance(tags, list) or "lora-merge" not in tags:
        return None
    if _KIND_TAG[MERGED_MODEL] in tags:
        return MERGED_MODEL
    if _KIND_TAG[PEFT_ADAPTER] in tags and header.get("library_name") == "peft":
        return PEFT_ADAPTER
    return None
