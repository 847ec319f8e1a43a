"""Small input files read whole (configs, tokenizer files, checkpoint metadata): one bounded reader.

A file read whole must be a regular file (a symlink counts as what it leads to) no larger than the cap
for its kind: a symlink to /dev/zero, a FIFO or a 3 GB sparse file named config.json is not a config, and
reading it would grow memory until the machine gives out, deaf to signals while it does. The type is
checked on the open file (opened without blocking, so a FIFO cannot make the open wait for a writer), and
at most cap + 1 bytes are ever read, so a file swapped or grown meanwhile cannot slip past.

Files that are copied but not parsed (the reference's other files) are streamed by writers/hf_files.py and
counted byte for byte in the free-space check; safetensors headers have their own reader.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from lora_merge.errors import MergeError

MB = 1 << 20
# The most a file of each kind may hold. Each is far above any real one (a config.json is a few KB; the
# largest published tokenizer.json files are ~35 MB; a torch_dist .metadata of a 671B model at high
# parallelism is some hundreds of MB) and far below what would hurt.
CAPS = {
    "config.json": 16 * MB,
    "adapter_config.json": 16 * MB,
    "tokenizer.json": 64 * MB,
    "tokenizer_config.json": 64 * MB,  # may list every added token and several chat templates
    "added_tokens.json": 64 * MB,
    "generation_config.json": 16 * MB,
    "special_tokens_map.json": 16 * MB,
    "chat_template.json": 16 * MB,
    "README.md": 64 * MB,  # a model card (writers/model_card.MAX_CARD_BYTES)
    "latest_checkpointed_iteration.txt": 4096,
    ".metadata": 1024 * MB,  # torch.distributed.checkpoint metadata (a pickle)
    "a part manifest": 256 * MB,  # part 0's carries the report: tens of MB for a 671B model
}
DEFAULT_CAP = 16 * MB


def cap_of(kind: str) -> int:
    return CAPS.get(kind, DEFAULT_CAP)


def _describe_size(limit: int) -> str:
    return f"{limit >> 20} MB" if limit >= MB else f"{limit} bytes"


def _not_regular(path: Path, mode: int, want: str) -> MergeError:
    if stat.S_ISDIR(mode):
        return MergeError(f"{path}: is a directory{want}")
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "of an unknown kind")
    return MergeError(f"{path}: {kind}, not a regular file{want}")


def read_bytes(path: Path, kind: str | None = None, missing: str | None = None, expected: str = "") -> bytes:
    """The whole content of the regular file `path`, at most the cap of `kind` (its name by default), or
    one line naming the file, what it is instead and what was expected (`expected`, e.g. "a JSON file")."""
    path = Path(path)
    kind = kind or path.name
    limit = cap_of(kind)
    want = f"; expected {expected}" if expected else ""
    if path.is_symlink() and not path.exists():
        raise MergeError(f"{path}: broken symlink (to {os.readlink(path)}, which does not exist){want}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MergeError(missing or f"{path}: missing{want}") from None
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror or exc}){want}") from None
    if not stat.S_ISREG(mode):  # a socket cannot even be opened; a device or FIFO is never read
        raise _not_regular(path, mode, want)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror or exc}){want}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped between the stat and the open
            raise _not_regular(path, mode, want)
        if os.fstat(fd).st_size > limit:  # no byte of a sparse 3 GB file is read
            raise MergeError(f"{path}: {os.fstat(fd).st_size} bytes, more than the {_describe_size(limit)} a "
                             f"{kind} may hold{want}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror or exc}){want}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while being read
        raise MergeError(f"{path}: more than the {_describe_size(limit)} a {kind} may hold{want}")
    return data


def read_text(path: Path, kind: str | None = None, missing: str | None = None, expected: str = "") -> str:
    """`read_bytes` decoded as UTF-8; invalid UTF-8 is one line naming the byte and its offset."""
    data = read_bytes(path, kind, missing, expected)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        want = f"; expected {expected or 'UTF-8 text'}"
        raise MergeError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
                         f"{want}") from None


def read_json(path: Path, missing: str | None = None, kind: str | None = None):
    """A JSON file's content under its kind's cap, or one line saying why it cannot be read."""
    text = read_text(path, kind, missing, expected="a UTF-8 JSON file")
    try:
        return json.loads(text)
    except RecursionError:
        raise MergeError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and integers too long to convert
        raise MergeError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None


def json_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {list: "array", str: "string", int: "number", float: "number", dict: "object"}.get(type(value), "null")
