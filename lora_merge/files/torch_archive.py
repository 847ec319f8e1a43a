"""torch.save archives — legacy rank files, `common.pt`, and each chunk record inside a torch_dist
`.distcp` — read with our own zip handling instead of torch's, so that every byte is accounted for:

- Every member must be stored uncompressed, with the sizes the central directory declares, inside the
  file. torch never compresses; a compressed or oversized member is how a 3 MB file would make a reader
  allocate gigabytes, so it is refused before anything is read.
- The pickle is read once (at most MAX_PICKLE_BYTES), its CRC32 checked, and unpickled with torch's
  weights-only unpickler under the caller's allow-list. Storages become views into one private,
  read-only mapping of the file, and must have exactly the size of their member.
- Each storage remembers its member, so the merge can check the member's CRC32 (torch writes one for
  every member, tensor data included) while it reads the data.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_merge.errors import MergeError, DamagedInput
from lora_merge.files import remote
from lora_merge.files.pages import release_pages

# Real pickles are a few MB even for a rank file with optimizer state (tensors are separate members).
MAX_PICKLE_BYTES = 64 << 20
# One member per tensor storage plus a few: a rank file of a 671B model at EP=16 has some thousands.
MAX_MEMBERS = 200_000
CRC_CHUNK_BYTES = 16 << 20

try:  # ISA-L's CRC32: zlib's polynomial and values, ~5x faster (22 vs 4 GB/s on one core here); the check
    # reads every input byte, so with zlib it was the largest CPU cost of a merge after hashing the output
    from isal.isal_zlib import crc32
except ImportError:  # a platform without an isal wheel: the same check, slower
    from zlib import crc32
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50


class MappedFile:
    """One checkpoint file, mapped privately once (or read into memory, for files rewritten in place)."""

    def __init__(self, path: Path, in_memory: bool = False):
        self.path = Path(path)
        try:
            self.size = os.stat(self.path).st_size
        except OSError as exc:
            raise MergeError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        self.in_memory = in_memory
        self._storage = None

    def storage(self) -> torch.UntypedStorage:
        if self._storage is None:
            if self.in_memory:
                remote.ensure(self.path, 0, self.size)
                with open(self.path, "rb") as f:
                    data = bytearray(f.read())
                self._storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if data else \
                    torch.UntypedStorage(0)
            else:
                self._storage = torch.UntypedStorage.from_file(str(self.path), shared=False, nbytes=self.size)
        return self._storage

    def bytes_view(self, start: int, nbytes: int, fetch: bool = True) -> torch.Tensor:
        """A uint8 tensor viewing [start, start + nbytes) of the file (no copy); `fetch`: made readable first,
        where the file is at a URL."""
        if fetch:
            remote.ensure(self.path, start, nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(self.storage(), start, (nbytes,))

    def pread(self, start: int, nbytes: int) -> bytes:
        remote.ensure(self.path, start, nbytes)
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(nbytes)
        if len(data) != nbytes:
            raise DamagedInput(f"{self.path}: ends at byte {self.size}, before the data at {start}+{nbytes} (truncated?)")
        return data


@dataclass(frozen=True, eq=False)
class Record:
    """One member of a torch.save archive: where its bytes lie in the file, and their CRC32."""

    file: MappedFile
    name: str
    start: int
    size: int
    crc: int

    @property
    def key(self) -> tuple[str, int]:
        return str(self.file.path), self.start

    def ensure(self) -> None:
        """Make the member's bytes readable (fetched first where the file is at a URL)."""
        remote.ensure(self.file.path, self.start, self.size)

    def check_crc(self, stop=lambda: False) -> None:
        """Recompute the CRC32 through the mapping, a chunk at a time (pages handed back as it goes)."""
        crc = 0
        for offset in range(0, self.size, CRC_CHUNK_BYTES):
            if stop():
                return
            view = self.file.bytes_view(self.start + offset, min(CRC_CHUNK_BYTES, self.size - offset))
            crc = crc32(view.numpy(), crc)
            if not self.file.in_memory:
                release_pages(view)
        if crc != self.crc:
            raise DamagedInput(f"{self.file.path}: record {self.name} fails its CRC32 check (stored {self.crc:08x}, "
                             f"read {crc:08x}): the file is damaged; copy it again from the original")


class _FileSlice(io.RawIOBase):
    """A read-only file object over [start, start + length) of a file, for zipfile."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        self.f.seek(self.start + self.pos)
        n = min(len(b), max(0, self.length - self.pos))
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class TorchArchive:
    """A torch.save zip archive at [offset, offset + length) of a mapped file."""

    def __init__(self, file: MappedFile, offset: int = 0, length: int | None = None, where: str | None = None,
                 fetch_members: bool = True):
        self.file = file
        # Where the file is at a URL, whether a member's bytes are fetched as its storage is unpickled. A reader
        # that reaches every tensor through a TensorRef carrying its record (which fetches first) says no: a
        # legacy rank file's optimizer state is then never fetched, and its weights are as the merge reaches them.
        self.fetch_members = fetch_members
        self.offset = offset
        self.length = file.size - offset if length is None else length
        self.where = where or str(file.path)
        if offset < 0 or self.length <= 0 or offset + self.length > file.size:
            raise DamagedInput(f"{self.where}: lies past the end of {file.path} ({file.size} bytes; truncated?)")
        self.records = self._read_directory()
        self._by_storage: dict[int, Record] = {}
        pickles = [name for name in self.records if name.endswith("data.pkl")]
        if len(pickles) != 1:
            raise DamagedInput(f"{self.where}: not a torch.save archive (expected one data.pkl, found {len(pickles)})")
        self.pickle = self.records[pickles[0]]
        self.prefix = pickles[0][: -len("data.pkl")]

    def _read_directory(self) -> dict[str, Record]:
        try:
            with remote.open_read(self.file.path, buffered=False) as f:  # (an archive may be a slice of the file)
                end = zipfile._EndRecData(_FileSlice(f, self.offset, self.length))
                if end and end[zipfile._ECD_ENTRIES_TOTAL] > MAX_MEMBERS:
                    raise DamagedInput(f"{self.where}: its zip directory lists {end[zipfile._ECD_ENTRIES_TOTAL]} members; "
                                     f"a torch checkpoint holds one per tensor storage (refusing more than {MAX_MEMBERS})")
                with zipfile.ZipFile(_FileSlice(f, self.offset, self.length)) as archive:
                    infos = archive.infolist()
                return {info.filename: self._record(f, info) for info in infos}
        except MergeError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error,
                UnicodeDecodeError) as exc:
            raise DamagedInput(f"{self.where}: not a readable torch checkpoint ({exc})") from exc

    def _record(self, f, info: zipfile.ZipInfo) -> Record:
        what = f"{self.where}: member {info.filename}"
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise DamagedInput(f"{what} is compressed or encrypted; torch stores members uncompressed, so this "
                             "file was not written by torch.save (refused: its declared size cannot be trusted)")
        if info.compress_size != info.file_size:
            raise DamagedInput(f"{what} declares {info.file_size} bytes but stores {info.compress_size}")
        f.seek(self.offset + info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise DamagedInput(f"{what} lies past the end of the file (truncated?)")
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_SIGNATURE or fields[3] != zipfile.ZIP_STORED:
            raise DamagedInput(f"{what}: its local header is damaged or disagrees with the central directory")
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if start + info.file_size > self.length:
            raise DamagedInput(f"{what} runs past the end of the archive ({start + info.file_size} > {self.length} "
                             "bytes; truncated?)")
        return Record(self.file, info.filename, self.offset + start, info.file_size, info.CRC)

    def read_checked(self, record: Record) -> bytes:
        data = self.file.pread(record.start, record.size)
        if crc32(data) != record.crc:
            raise DamagedInput(f"{self.file.path}: record {record.name} fails its CRC32 check: the file is damaged; "
                             "copy it again from the original")
        return data

    def pickle_bytes(self) -> bytes:
        if self.pickle.size > MAX_PICKLE_BYTES:
            raise MergeError(f"{self.where}: its pickle is {self.pickle.size} bytes; refusing more than "
                             f"{MAX_PICKLE_BYTES} (a checkpoint's pickle holds no tensor data)")
        byteorder = self.records.get(self.prefix + "byteorder")
        if byteorder is not None and byteorder.size <= 16 and self.read_checked(byteorder) != b"little":
            raise MergeError(f"{self.where}: a big-endian checkpoint; only little-endian files are supported")
        return self.read_checked(self.pickle)

    def unpickle(self, pickled: bytes):
        """Unpickle with torch's weights-only unpickler (the caller sets the allowed globals); storages
        are views into the mapping, one per member, cached by key as torch does."""
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(saved_id):
            if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
                raise MergeError(f"{self.where}: unexpected persistent reference {saved_id!r:.80}")
            _, storage_type, key, _, numel = saved_id
            key = key.decode() if isinstance(key, bytes) else str(key)
            if key in storages:
                return storages[key]
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
            if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
                raise DamagedInput(f"{self.where}: storage {key} has an unreadable type or size")
            record = self.records.get(f"{self.prefix}data/{key}")
            if record is None:
                raise DamagedInput(f"{self.where}: storage {key} has no member {self.prefix}data/{key}")
            nbytes = numel * dtype.itemsize
            if nbytes != record.size:
                raise DamagedInput(f"{self.where}: storage {key} declares {nbytes} bytes but its member holds "
                                 f"{record.size}")
            if self.fetch_members:
                remote.ensure(self.file.path, record.start, nbytes)
            storage = self.file.storage()[record.start: record.start + nbytes]
            if nbytes:
                self._by_storage[storage.data_ptr()] = record
            storages[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            return storages[key]

        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        return unpickler.load()

    def record_of(self, tensor: torch.Tensor) -> Record | None:
        """The member a loaded tensor's bytes live in (None for an empty tensor)."""
        return self._by_storage.get(tensor.untyped_storage().data_ptr())
