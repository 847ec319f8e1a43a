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

from lora_merge.errors import OutputConflict
from lora_merge.readers.detect import what_is
from lora_merge.writers.hf_files import COPIED_SUBDIRS
from lora_merge.writers.model_card import MAX_CARD_BYTES, card_files

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
MEGATRON_CHECKPOINT = "Megatron checkpoint"  # never replaced: --to megatron writes a new directory
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


# The file each kind of output cannot be without.
KIND_MARKER = {MERGED_MODEL: "config.json", PEFT_ADAPTER: "adapter_config.json"}
# What an output of this tool holds: shards and index, configs and reports (*.json), the reference's
# tokenizer, chat template and remote code. Anything else in a directory means it is someone's own.
OUTPUT_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|adapter_model\.safetensors|[^/]+\.json|[^/]+\.py|"
                         r"merges\.txt|tokenizer\.model|chat_template\.jinja|README\.md)$")


def check_replaceable(out: Path, kind: str) -> None:
    """--force replaces an empty directory, or an earlier output of lora-merge of this kind: its README.md is
    our model card of that kind, it holds the kind's config, and nothing a lora-merge output does not hold."""
    try:
        entries = list(os.scandir(out))
    except OSError as exc:
        raise OutputConflict(f"{out}: cannot list it to replace it ({exc.strerror})") from exc
    if not entries:
        return
    refuse = (f"{out}: exists and is not an earlier {kind} written by lora-merge ({{}}); not replacing it even "
              "with --force: remove it yourself if it is not needed, or choose another --out")
    found = card_kind(out)
    if found is None:
        raise OutputConflict(refuse.format("no README.md model card of lora-merge"))
    if found != kind:
        raise OutputConflict(refuse.format(f"it is a {found} written by lora-merge"))
    names = {e.name for e in entries}
    listed = _card_listed(out)  # the reference's other files (tiktoken.model, LICENSE, ...) an output copied
    foreign = sorted(e.name for e in entries if not _output_entry(e, listed))
    if foreign:
        raise OutputConflict(refuse.format(f"it also holds {', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''}"))
    if KIND_MARKER[kind] not in names:
        raise OutputConflict(refuse.format(f"no {KIND_MARKER[kind]}"))


def _output_entry(entry: os.DirEntry, listed: set[str]) -> bool:
    """Whether an entry of an existing directory is one a lora-merge output holds."""
    if entry.is_file(follow_symlinks=False):
        return bool(OUTPUT_FILE.match(entry.name)) or entry.name in listed
    if entry.name in COPIED_SUBDIRS and entry.is_dir(follow_symlinks=False):
        try:
            return all(f"{entry.name}/{inner}" in listed for inner in os.listdir(entry.path))
        except OSError:
            return False
    return False


def _card_listed(out: Path) -> set[str]:
    """The files the model card of an earlier output lists (it lists every file the run wrote)."""
    card = out / "README.md"
    try:
        if not card.is_file() or card.is_symlink() or card.stat().st_size > MAX_CARD_BYTES:
            return set()
        return set(card_files(card.read_text(encoding="utf-8", errors="replace")) or ())
    except OSError:
        return set()
