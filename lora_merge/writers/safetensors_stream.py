"""A streaming, sharded safetensors writer.

safetensors puts every tensor's offset in the header, so a file is normally built in memory first.
Here all names, shapes and dtypes are known before any data is read (the merge plan), so each shard's
header is computed up front and tensors are appended one by one as they are produced: memory holds one
tensor at a time, whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

import torch

from lora_merge.writers.background import OrderedWorker
from lora_merge.files.output_file import OutputFile

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * self.dtype.itemsize


def split_into_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive groups of at most max_shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_file_names(count: int, single: str = "model.safetensors") -> list[str]:
    if count == 1:
        return [single]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


class FilePart(Protocol):
    """The files one part of a run writes (`--part`): `files`, shard indices; `arriving`, the names of the
    tensors the part's tasks deliver (those of its files, and the others their parameters also become);
    `temporary(name)`, where a file is written; `written(name, sha256)`, called once it is complete."""

    files: frozenset[int]
    arriving: frozenset[str]

    def temporary(self, name: str) -> str: ...

    def written(self, name: str, sha256: str) -> None: ...


class ShardedSafetensorsWriter:
    """Write the planned tensors, in plan order, into HF-style sharded safetensors files."""

    def __init__(self, directory: Path, tensors: list[PlannedTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None, hash_files: bool = False,
                 single_file: str = "model.safetensors", part: "FilePart | None" = None):
        """`single_file`: the name of the file when all fits in one (PEFT's adapter_model.safetensors).
        `part`: write only some of the files (a `--part` of the run; see FilePart)."""
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.shards = split_into_shards(tensors, max_shard_bytes)
        self.file_names = shard_file_names(len(self.shards), single_file)
        self.metadata = metadata or {"format": "pt"}
        self.single_file = single_file
        self.part = part
        self._order = [(i, t) for i, shard in enumerate(self.shards) for t in shard
                       if part is None or t.name in part.arriving]
        self._next = 0  # index in _order of the tensor being written
        self._done_bytes = 0  # bytes of it written so far
        self._file = None
        self._file_index = -1
        self.sha256: dict[str, str] = {}  # file name -> digest, hashed as written (no second read)
        self._hash = None
        # sha256 runs at ~1.8 GB/s a core: on the writing thread it made writing the slowest stage of a
        # merge, so it is a stage of its own, a short queue behind the writes (started with the first file:
        # a writer whose files ShardLanes writes never starts one)
        self.hash_files = hash_files
        self._hasher = None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for _, t in self._order)

    def start(self, directory: Path) -> None:
        """The shards are created in `directory` as their first bytes arrive."""
        self.directory = Path(directory)

    def write(self, name: str, piece: torch.Tensor, then=None) -> None:
        """Append `piece`: a whole planned tensor, or its next rows (a tensor may come in several pieces).
        `then()`, if given, is called once the piece is written and hashed (its memory may then be reused)."""
        if self._done_bytes == 0 or self._done_bytes == self._order[self._next][1].nbytes:
            if self._done_bytes:
                self._next += 1
                self._done_bytes = 0
            self._skip_empty()
            if self._next >= len(self._order):
                raise RuntimeError(f"writer: {name} is beyond the plan")
        shard_index, planned = self._order[self._next]
        rows_fit = tuple(piece.shape[1:]) == planned.shape[1:] and piece.dim() == len(planned.shape)
        if name != planned.name or piece.dtype != planned.dtype or not rows_fit or \
                self._done_bytes + piece.nbytes > planned.nbytes:
            raise RuntimeError(f"writer: got {name} {list(piece.shape)} {piece.dtype}, the plan expects "
                               f"{'rows of ' if self._done_bytes else ''}{planned.name} {list(planned.shape)} {planned.dtype}")
        if self.part is not None and shard_index not in self.part.files:
            # computed with a tensor of this part's files (one parameter, several HF tensors): not this part's
            self._done_bytes += piece.nbytes
            if then is not None:
                then()
            return
        if shard_index != self._file_index:
            self._open(shard_index)
        data = memoryview(piece.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        self._file.write(data)
        self._done_bytes += piece.nbytes
        if self._hasher is not None:
            self._hasher.submit(self._hash.update, data)  # `data` keeps the piece alive until hashed
            if then is not None:
                self._hasher.submit(then)
        elif then is not None:
            then()

    def _skip_empty(self) -> None:
        """Tensors of no bytes get no write (the merge yields no rows for them): they are complete as planned."""
        while self._next < len(self._order) and self._order[self._next][1].nbytes == 0 and not self._done_bytes:
            shard_index = self._order[self._next][0]
            if shard_index != self._file_index and (self.part is None or shard_index in self.part.files):
                # a shard may hold nothing else: its file must still be written
                self._open(shard_index)
            self._next += 1

    def _open(self, shard_index: int) -> None:
        self._close_file()
        self._file_index = shard_index
        name = self.file_names[shard_index]
        self._file = OutputFile(self.directory / (name if self.part is None else self.part.temporary(name)))
        header = header_bytes(self.shards[shard_index], self.metadata)
        self._file.write(header)
        if self.hash_files and self._hasher is None:
            self._hasher = OrderedWorker("lora-merge-sha256", depth=2)
        self._hash = hashlib.sha256(header) if self._hasher is not None else None

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if self._hasher is not None:
                self._hasher.submit(self._record_digest, self.file_names[self._file_index], self._hash)

    def _record_digest(self, file_name: str, digest) -> None:
        self.sha256[file_name] = digest.hexdigest()
        if self.part is not None:
            self.part.written(file_name, self.sha256[file_name])

    def file_of(self) -> dict[str, str]:
        return {t.name: self.file_names[i] for i, t in self._order}

    def finish(self) -> list[str]:
        """Close the last shard and write the index; returns the files written."""
        # the last tensor written is complete (an empty one is never written: _skip_empty opens its shard, which
        # may be the only thing a lane's writer has to write)
        if self._order and self._next < len(self._order) and 0 < self._done_bytes == self._order[self._next][1].nbytes:
            self._next += 1
            self._done_bytes = 0
        self._skip_empty()
        complete = self._next
        if complete != len(self._order):
            raise RuntimeError(f"writer: only {complete} of {len(self._order)} planned tensors were written")
        self._close_file()
        if self._hasher is not None:
            self._hasher.close()  # every digest recorded
        if self.part is not None:  # the index is written once every part's files are (`lora-merge finish`)
            return [self.file_names[i] for i in sorted(self.part.files)]
        return self._with_index()

    def _with_index(self) -> list[str]:
        """Write the index (for several shards); every file of the output."""
        files = list(self.file_names)
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": self.file_of()}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            files.append("model.safetensors.index.json")
        return files

    def abort(self) -> None:
        if self._file is not None:
            self._file.abort()
            if self.part is not None:  # not in a directory of its own that goes with the run
                self._file.path.unlink(missing_ok=True)
            self._file = None
        if self._hasher is not None:
            self._hasher.stop()


class _LaneFiles:
    """What one lane of a `ShardLanes` writes (the writer's `FilePart`): its files, under their own names, or, in
    a part of a run (`part`), those of them that are the part's, as the part names and records them."""

    def __init__(self, files: frozenset[int], arriving: frozenset[str], part: "FilePart | None"):
        self.part = part
        self.files = files if part is None else files & part.files
        self.arriving = arriving if part is None else arriving & part.arriving

    def temporary(self, name: str) -> str:
        return name if self.part is None else self.part.temporary(name)

    def written(self, name: str, sha256: str) -> None:
        if self.part is not None:  # (a one-process run's digests are in the lane's writer, gathered at finish)
            self.part.written(name, sha256)


class ShardLanes:
    """A writer's shards written as groups of consecutive files at once (a sink, runs/lanes.py): each group
    by a writer of its own, with its own file, I/O thread and sha256 thread, so that hashing, the slowest
    single-threaded stage, runs on several cores. Pieces go to the group whose files hold their tensor, each
    group's in plan order; each file is written front to back as a one-group writer writes it, and the index
    once every group is complete."""

    def __init__(self, writer: ShardedSafetensorsWriter, lane_of_file: list[int]):
        """`writer`: the whole output's (or a part's: its `part` then says which files are written)."""
        self.writer = writer
        tensors = [t for shard in writer.shards for t in shard]
        self.lane_of = {t.name: lane_of_file[i] for i, shard in enumerate(writer.shards) for t in shard}
        self.lanes = []
        for lane in range(max(lane_of_file) + 1):
            files = frozenset(i for i, owner in enumerate(lane_of_file) if owner == lane)
            names = frozenset(t.name for i in files for t in writer.shards[i])
            self.lanes.append(ShardedSafetensorsWriter(
                writer.directory, tensors, writer.max_shard_bytes, writer.metadata, writer.hash_files,
                writer.single_file, part=_LaneFiles(files, names, writer.part)))

    @property
    def total_bytes(self) -> int:
        return self.writer.total_bytes

    def start(self, directory: Path) -> None:
        self.writer.start(directory)
        for lane in self.lanes:
            lane.start(directory)

    def write(self, name: str, piece: torch.Tensor, then=None) -> None:
        self.lanes[self.lane_of[name]].write(name, piece, then)

    def finish(self) -> list[str]:
        for lane in self.lanes:
            lane.finish()
            self.writer.sha256.update(lane.sha256)
        if self.writer.part is not None:  # the index is written by `lora-merge finish`
            return [self.writer.file_names[i] for i in sorted(self.writer.part.files)]
        return self.writer._with_index()

    def abort(self) -> None:
        failed = None
        for lane in self.lanes:  # every lane's file closed, whichever fails
            try:
                lane.abort()
            except BaseException as exc:  # noqa: BLE001 - raised once the others are closed too
                failed = failed or exc
        if failed is not None:
            raise failed
