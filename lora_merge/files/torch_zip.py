"""torch.save archives written in place: the archive is planned from shapes alone, its frame (every header,
the pickle, the central directory) written first, and the tensor bytes then written into their reserved
spans in any order, by anyone holding the file descriptor. That is what lets a Megatron rank file of tens of
GB be filled row piece by row piece, with a few MB in memory.

The bytes are torch.save's own (torch ≥ 2.1's zip layout, as read by `torch.load`, our `torch_archive` and
any zip reader): members stored uncompressed, each tensor's data 64-byte aligned by an "FB" padding extra
field, sizes and CRC32 in a data descriptor after the data and in the central directory, zip64 records where
a size or offset needs them, and a zip64 end record always. A CRC32 can only be known once a member's bytes
are all written, so `finish` reads each tensor member back (from the page cache, just written) and fills it
in. For a small object the archive equals torch.save's byte for byte, but for the random serialization id
(ours is derived from the archive's contents, so the output is reproducible).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass

import torch

try:  # the same fast CRC32 the readers use
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

ALIGNMENT = 64  # torch's .storage_alignment
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields (a module value, so tests can lower it)
_IN_ZIP64 = 0xFFFFFFFF  # what a 32-bit field says when its value is in the zip64 extra field
READ_BACK_BYTES = 16 << 20
PICKLE_PROTOCOL = 2  # torch.save's DEFAULT_PROTOCOL

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_DESCRIPTOR = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_FLAGS_EMPTY = 0x0800  # an empty member has no data descriptor (as miniz writes it)


@dataclass(frozen=True, eq=False)
class TensorSlot:
    """Stands in for a tensor in an object to be saved: its shape and dtype, the bytes to come later.
    Identity matters (two slots are two tensors), hence eq=False."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _SlotPickler(pickle.Pickler):
    """Pickles as torch.save does: a tensor is _rebuild_tensor_v2(storage, 0, size, stride, False,
    OrderedDict()) and its storage a persistent id ('storage', <type>, key, 'cpu', numel), keys numbered
    in the order storages are met."""

    def __init__(self, file, slots: list):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.slots = slots

    def reducer_override(self, obj):
        if isinstance(obj, TensorSlot):
            stride, step = [], 1
            for d in reversed(obj.shape):
                stride.append(step)
                step *= d
            return (torch._utils._rebuild_tensor_v2,
                    (_StorageRef(obj), 0, tuple(obj.shape), tuple(reversed(stride)), False, OrderedDict()))
        return NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            key = str(len(self.slots))
            self.slots.append(obj.slot)
            return ("storage", _storage_type(obj.slot.dtype), key, "cpu", obj.slot.numel)
        return None


@dataclass(frozen=True, eq=False)
class _StorageRef:
    slot: TensorSlot


@dataclass
class _Member:
    name: str
    header: int  # offset of the local header from the archive start
    data: int  # offset of the data
    size: int
    content: bytes | None = None  # small members: known up front
    crc: int | None = None

    @property
    def zip64(self) -> bool:
        return self.size >= ZIP64_LIMIT or self.header >= ZIP64_LIMIT

    @property
    def flags(self) -> int:
        return _FLAGS if self.size else _FLAGS_EMPTY

    @property
    def descriptor_size(self) -> int:
        return 0 if not self.size else _DESCRIPTOR64.size if self.zip64 else _DESCRIPTOR.size

    @property
    def end(self) -> int:
        return self.data + self.size + self.descriptor_size


class TorchArchive:
    """A torch.save archive of `obj` (TensorSlots inside become tensors), planned before any data exists.

    `write_frame(fd, base)` writes everything but the tensor bytes at file offset `base`; the caller then
    writes each slot's bytes (C order, its dtype) at `base + data_offset(slot)`; `finish(fd, base)` fills
    in the CRC32s. `size` is the archive's length."""

    def __init__(self, obj, name: str = "archive", order: list[TensorSlot] | None = None):
        """`order`: the tensor members' order in the file (default: the pickle's, as torch.save has it), e.g.
        the order their bytes will arrive in, so that the archive can be streamed front to back."""
        self.name = name
        slots: list[TensorSlot] = []
        buffer = io.BytesIO()
        _SlotPickler(buffer, slots).dump(obj)
        pickled = buffer.getvalue()
        self.slots = slots
        digest = hashlib.sha256(pickled).digest()
        serial = str(int.from_bytes(digest[:17], "little")).rjust(40, "0")[-40:].encode()
        members = [(f"{name}/data.pkl", pickled), (f"{name}/.format_version", b"1"),
                   (f"{name}/.storage_alignment", str(ALIGNMENT).encode()), (f"{name}/byteorder", b"little")]
        keys = {id(slot): i for i, slot in enumerate(slots)}
        if order is not None and sorted(map(id, order)) != sorted(keys):
            raise ValueError("order must list every tensor of the archive once")
        members += [(f"{name}/data/{keys[id(slot)]}", slot) for slot in (order if order is not None else slots)]
        members += [(f"{name}/version", b"3\n"), (f"{name}/.data/serialization_id", serial)]
        self.members: list[_Member] = []
        self._slot_member: dict[int, _Member] = {}
        cursor = 0
        for member_name, content in members:
            size = content.nbytes if isinstance(content, TensorSlot) else len(content)
            # the "FB" padding field (4 bytes + padding) brings the data to the next multiple of ALIGNMENT
            data = cursor + _LOCAL.size + len(member_name.encode()) + len(self._zip64_local(cursor, size)) + 4
            data += (-data) % ALIGNMENT
            member = _Member(member_name, cursor, data, size, None if isinstance(content, TensorSlot) else content)
            if member.content is not None:
                member.crc = crc32(member.content)
            else:
                self._slot_member[id(content)] = member
            self.members.append(member)
            cursor = member.end
        self.directory_offset = cursor
        self.directory = b"".join(self._central(m) for m in self.members)
        self.size = cursor + len(self._tail())

    # --- the zip records ----------------------------------------------------------------------------

    @staticmethod
    def _zip64_local(header: int, size: int) -> bytes:
        if size < ZIP64_LIMIT and header < ZIP64_LIMIT:
            return b""
        fields = [size, size] + ([header] if header >= ZIP64_LIMIT else [])
        return struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)

    def _local(self, m: _Member) -> bytes:
        name = m.name.encode()
        zip64 = self._zip64_local(m.header, m.size)
        pad = m.data - (m.header + _LOCAL.size + len(name) + len(zip64)) - 4
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = _IN_ZIP64 if m.size >= ZIP64_LIMIT else 0
        return _LOCAL.pack(0x04034B50, 0, m.flags, 0, 0, 0, 0, sizes, sizes, len(name), len(extra)) + name + extra

    def _descriptor(self, m: _Member) -> bytes:
        if not m.size:
            return b""
        if m.zip64:
            return _DESCRIPTOR64.pack(0x08074B50, m.crc, m.size, m.size)
        return _DESCRIPTOR.pack(0x08074B50, m.crc, m.size, m.size)

    def _central(self, m: _Member) -> bytes:
        name = m.name.encode()
        big_size, big_offset = m.size >= ZIP64_LIMIT, m.header >= ZIP64_LIMIT
        fields = ([m.size, m.size] if big_size else []) + ([m.header] if big_offset else [])
        extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
        size = _IN_ZIP64 if big_size else m.size
        return _CENTRAL.pack(0x02014B50, 0, 0, m.flags, 0, 0, 0, m.crc or 0, size, size, len(name), len(extra), 0, 0,
                             0, 0, _IN_ZIP64 if big_offset else m.header) + name + extra

    def _tail(self) -> bytes:
        count, cd_size, cd_offset = len(self.members), len(self.directory), self.directory_offset
        end64 = _END64.pack(0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset)
        locator = _LOCATOR.pack(0x07064B50, 0, cd_offset + cd_size, 1)
        small = lambda v: v if v < ZIP64_LIMIT else _IN_ZIP64  # noqa: E731
        end = _END.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), small(cd_size), small(cd_offset), 0)
        return self.directory + end64 + locator + end

    # --- writing ------------------------------------------------------------------------------------

    def data_offset(self, slot: TensorSlot) -> int:
        return self._slot_member[id(slot)].data

    def write_frame(self, fd: int, base: int) -> None:
        """Headers and the small members; the tensor spans are left for the caller (and the descriptors and
        directory, which need their CRC32s, for `finish`)."""
        for m in self.members:
            pwrite_all(fd, self._local(m), base + m.header)
            if m.content is not None:
                pwrite_all(fd, m.content + self._descriptor(m), base + m.data)

    def finish_member(self, fd: int, base: int, slot: TensorSlot) -> None:
        """The slot's bytes are all written: read them back (from the page cache, just written) for its CRC32."""
        m = self._slot_member[id(slot)]
        m.crc = _crc_of(fd, base + m.data, m.size) if m.size else 0
        pwrite_all(fd, self._descriptor(m), base + m.data + m.size)

    def finish(self, fd: int, base: int) -> None:
        """The CRC32s of the tensor members not finished yet, then the directory."""
        for m in self.members:
            if m.crc is None:
                m.crc = _crc_of(fd, base + m.data, m.size) if m.size else 0
                pwrite_all(fd, self._descriptor(m), base + m.data + m.size)
        self.directory = b"".join(self._central(m) for m in self.members)
        pwrite_all(fd, self._tail(), base + self.directory_offset)


def _crc_of(fd: int, start: int, size: int) -> int:
    crc, done = 0, 0
    while done < size:
        chunk = os.pread(fd, min(READ_BACK_BYTES, size - done), start + done)
        if not chunk:
            raise OSError(f"short read at byte {start + done}")
        crc = crc32(chunk, crc)
        done += len(chunk)
    return crc


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class ArchiveStream:
    """A planned TorchArchive written front to back through a sequential file (`write(bytes)`, `close()`):
    each tensor's bytes are appended in member order, its CRC32 computed as they pass, so the file can go
    out with O_DIRECT at disk speed and nothing is read back."""

    def __init__(self, archive: TorchArchive, out, close_file: bool = True):
        self.archive, self.out, self.close_file = archive, out, close_file
        self._index = 0  # the member being written
        self._crc = 0
        self._left = 0  # bytes still due of the current tensor member
        self._advance()

    def _advance(self) -> None:
        """Write the members that need no data from the caller, up to the next tensor member's header."""
        members = self.archive.members
        while self._index < len(members):
            m = members[self._index]
            self.out.write(self.archive._local(m))
            if m.content is None and m.size:
                self._crc, self._left = 0, m.size
                return
            if m.content is None:  # an empty tensor
                m.crc = 0
            self.out.write((m.content or b"") + self.archive._descriptor(m))
            self._index += 1

    def append(self, slot: TensorSlot, data) -> None:
        m = self.archive.members[self._index] if self._index < len(self.archive.members) else None
        if m is None or self.archive._slot_member.get(id(slot)) is not m:
            raise ValueError(f"{self.archive.name}: bytes for a tensor out of its turn")
        view = memoryview(data).cast("B")
        if view.nbytes > self._left:
            raise ValueError(f"{self.archive.name}: more bytes than the tensor holds")
        self._crc = crc32(view, self._crc)
        self.out.write(view)
        self._left -= view.nbytes
        if not self._left:
            m.crc = self._crc
            self.out.write(self.archive._descriptor(m))
            self._index += 1
            self._advance()

    @property
    def finished(self) -> bool:
        return self._index >= len(self.archive.members)

    def close(self) -> None:
        """The directory and end records (then the file is closed, unless it goes on after this archive)."""
        if not self.finished:
            raise ValueError(f"{self.archive.name}: closed with tensors not written")
        self.archive.directory = b"".join(self.archive._central(m) for m in self.archive.members)
        self.out.write(self.archive._tail())
        if self.close_file:
            self.out.close()
