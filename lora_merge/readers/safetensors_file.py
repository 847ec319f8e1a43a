"""The one safetensors reader: every safetensors file lora-merge reads (an HF base's shards, a PEFT
adapter's adapter_model.safetensors, the reference and the output `verify` reads) goes through here.

The header is checked as safetensors itself checks it before any tensor is used: an 8-byte length no
larger than safetensors' 100 MB limit and within the file, a UTF-8 JSON object, `__metadata__` an object of
strings, every entry {dtype, shape, data_offsets} with a known dtype, non-negative integer dims and offsets,
a span exactly the size its dtype and shape imply, and the spans, sorted, tiling the data section from
its first byte to the file's last with no gap and no overlap (so no tensor can borrow another's bytes, or
bytes past the end). safetensors does not require data to be aligned, so misaligned data is read through
a copy rather than refused.

Only the header is read when a file is opened; tensor data is mapped (a base's weights) or read a row
range at a time (`verify`), so opening a 100 GB model costs its headers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_merge.errors import DamagedInput, MergeError
from lora_merge.readers.checkpoint import TensorRef, require_float
from lora_merge.files import remote
from lora_merge.files.torch_archive import MappedFile

# safetensors refuses headers above 100 MB; checking first means a hostile length is never allocated.
MAX_HEADER_BYTES = 100_000_000
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64}
# The dtypes torch can hold, to read a tensor of them (the float ones are all a merge may use, see
# `require_float`; the others are still read to report, e.g. a reference's baseline, as safetensors would).
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Damaged(Exception):
    """Why a safetensors file cannot be used (the message, without the path)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a checked header: its shape, safetensors dtype name, and bytes [begin, end) of the
    data section."""

    shape: tuple[int, ...]
    dtype: str
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict[str, Entry]
    data_start: int  # file offset of the data section: 8 + the header's length

    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (e.shape, e.dtype) for name, e in self.entries.items()}


def read_header(path: Path) -> Header:
    """A file's header once it and the file's size are checked to agree (raises `Damaged`).

    Reads 8 bytes and the header, never the data: a truncated, padded or garbage file is found from
    its size alone, and a header length beyond the file or above safetensors' limit is never allocated.
    """
    require_file(path)
    try:
        with remote.open_read(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise Damaged(f"truncated: {size} bytes, less than the 8-byte header length")
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise Damaged(f"header length {length} is above safetensors' limit of {MAX_HEADER_BYTES} "
                              "bytes: not a safetensors file, or damaged")
            if 8 + length > size:
                raise Damaged(f"truncated: the header alone should be {length} bytes, the file has {size - 8} "
                              "after the header length")
            raw = f.read(length)
    except OSError as exc:
        raise Damaged(f"cannot be read ({exc.strerror or exc})") from exc
    entries, data_end = _parse_header(parse_json(raw, "header: "))
    held = size - 8 - length
    if data_end > held:
        raise Damaged(f"truncated: its header needs {data_end} bytes of tensor data, the file holds {held}")
    if data_end < held:
        raise Damaged(f"{held - data_end} bytes after the last tensor's data, which safetensors refuses")
    return Header(Path(path), entries, 8 + length)


def _parse_header(header) -> tuple[dict[str, Entry], int]:
    """Entries and where the data ends, checked as safetensors would: sizes match, no gaps, no overlap."""
    if not isinstance(header, dict):
        raise Damaged("header: not a JSON object: not a safetensors file, or damaged")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise Damaged("header: __metadata__ is not an object of strings, which safetensors refuses")
            continue
        entries[name] = _entry(name, entry)
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise Damaged(f"header: {shown_name(name)} starts at data byte {entry.begin}, expected {position} "
                          "(gap or overlap)")
        position = entry.end
    return entries, position


def _entry(name: str, entry) -> Entry:
    bad = Damaged(f"header: {shown_name(name)} is not {{dtype, shape, data_offsets}} as safetensors writes it")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    # Bounded like safetensors' own u64s, so a hostile shape cannot make the size product huge.
    if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**64 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and 0 <= o < 2**64 for o in offsets) or offsets[0] > offsets[1]):
        raise bad
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise Damaged(f"header: {shown_name(name)} has unknown dtype {shown(dtype)}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]  # in integers: a float would overflow on a hostile shape
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        size = f"{shown(bits // 8)} bytes" if bits % 8 == 0 else f"{shown(bits)} bits"
        raise Damaged(f"header: {shown_name(name)} is {dtype} {shown(shape)}, {size}, but its data_offsets span "
                      f"{offsets[1] - offsets[0]}")
    return Entry(tuple(shape), dtype, offsets[0], offsets[1])


def tensor_refs(path: Path, what: str, fp8: bool = False, mxfp4: bool = False) -> dict[str, TensorRef]:
    """Every tensor of a file a merge uses (an HF base shard, a PEFT adapter), each a view of the mapped
    file; damage, and any dtype that is not a float a merge can use, is a MergeError naming the file.
    `what` says what the file is, for messages ("the HF base's weights"); `fp8`: float8_e4m3fn tensors are
    let through (a block-FP8 release's weights, which the caller pairs with their scales); `mxfp4`: uint8
    `*_blocks` / `*_scales` tensors too (an MXFP4 release's, paired by the caller)."""
    try:
        header = read_header(path)
    except Damaged as exc:
        raise DamagedInput(f"{path}: {exc}; {what} must be intact") from None
    mapped = MappedFile(path)
    refs = {}
    for name, entry in header.entries.items():
        where = f"{path}[{shown_name(name)}]"
        dtype = TORCH_DTYPES.get(entry.dtype)
        packed = mxfp4 and dtype == torch.uint8 and name.endswith(("_blocks", "_scales"))
        if not (fp8 and dtype == torch.float8_e4m3fn) and not packed:  # quantized weights: paired later
            require_float(where, dtype, entry.dtype)
        offset = header.data_start + entry.begin
        # A misaligned tensor is loaded as a copy, which is not the mapping: `mapped` is what lets release()
        # hand its pages back (madvise), and on a copy's heap memory that would zero live data.
        refs[name] = TensorRef(where=where, shape=entry.shape, dtype=dtype, mapped=offset % dtype.itemsize == 0,
                               loader=_view(mapped, offset, entry.end - entry.begin, dtype, entry.shape),
                               view=_view(mapped, offset, entry.end - entry.begin, dtype, entry.shape, fetch=False),
                               spans=lambda span=(mapped, offset, entry.end - entry.begin): (span,))
    return refs


def _view(mapped: MappedFile, offset: int, nbytes: int, dtype: torch.dtype, shape, fetch: bool = True):
    def load() -> torch.Tensor:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        data = mapped.bytes_view(offset, nbytes, fetch)
        if offset % dtype.itemsize:  # safetensors does not promise aligned data: a copy then
            data = data.clone()
        return data.view(dtype).reshape(shape)
    return load


def read_rows(header: Header, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of one tensor (its elements, for a 1-D one; the whole of a 0-D one), read with
    one pread: no mapping is kept, so pages read for one chunk do not stay resident."""
    entry = header.entries[name]
    dtype = TORCH_DTYPES.get(entry.dtype)
    if dtype is None:
        raise MergeError(f"{header.path}: {shown_name(name)} is {entry.dtype}, which cannot be read as a tensor here")
    if not entry.shape:
        start, stop, row_bytes = 0, 1, entry.end - entry.begin
    else:
        row_bytes = (entry.end - entry.begin) // entry.shape[0] if entry.shape[0] else 0
    rows = entry.shape[1:] if entry.shape else ()
    count = max(0, min(stop, entry.shape[0] if entry.shape else 1) - start)
    offset, nbytes = header.data_start + entry.begin + start * row_bytes, count * row_bytes
    try:
        remote.ensure(header.path, offset, nbytes)
        with header.path.open("rb") as f:
            data = os.pread(f.fileno(), nbytes, offset) if nbytes else b""
    except OSError as exc:
        raise MergeError(f"{header.path}: {shown_name(name)} unreadable ({exc.strerror or exc})") from exc
    if len(data) != nbytes:  # changed since its header was checked
        raise MergeError(f"{header.path}: {shown_name(name)} unreadable (the file ends before its data: changed "
                         "since its header was read?)")
    tensor = torch.frombuffer(bytearray(data), dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
    return tensor.reshape((count, *rows) if entry.shape else ())


def require_file(path: Path) -> None:
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise Damaged(f"broken symlink (to {os.readlink(path)})")
    if not path.exists():
        raise Damaged("missing")
    if not path.is_file():
        raise Damaged("a directory, expected a file" if path.is_dir() else "not a regular file")


def parse_json(raw: bytes, subject: str):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise Damaged(f"{subject}not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[…" nested a million deep
        raise Damaged(f"{subject}not JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def shown(value) -> str:
    """A value read from a file, fit for a one-line message: quoted, control characters escaped, cut."""
    from lora_merge.value_checks import shown_value
    return shown_value(value)


def shown_name(name: str) -> str:
    """A tensor name from a file as is, unless it would break the one-line message."""
    return name if isinstance(name, str) and name.isprintable() and len(name) <= 200 else shown(name)
