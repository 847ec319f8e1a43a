"""Damaged data never reaches an output unnoticed.

- CRC32: torch writes one for every archive member, tensor data included. Every member the merge reads
  is checked on a thread of its own that runs a bounded distance ahead of the merge (so it also brings
  the data into the page cache just before the merge needs it); the run fails before anything is
  published if one does not match.
- Finiteness: NaN or Inf in any tensor that is written, touched by LoRA or not, stops the run naming it.
- Replicas: copies of a tensor in several files (the dense part in every expert-parallel file, the base
  in an unfiltered LoRA checkpoint) must be identical; equal stored CRC32s of whole members say so
  without reading the unused copy, anything else is compared byte for byte.
"""

from __future__ import annotations

import threading

import torch

from lora_merge.errors import MergeError
from lora_merge.stage_clock import charge_thread
from lora_merge.files.pages import release_pages

# How far (in input bytes, in plan order) the checker may run ahead of the merge: enough to overlap,
# little enough that what it reads is still in the page cache when the merge gets there.
LEAD_BYTES = 1 << 30


def check_finite(tensor: torch.Tensor, name: str, what: str = "non-finite values (NaN or Inf)") -> None:
    """aminmax propagates NaN and shows ±Inf in one pass, many times faster than isfinite().all()."""
    if tensor.numel() == 0 or not tensor.dtype.is_floating_point:
        return
    low, high = torch.aminmax(tensor)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise MergeError(f"{name}: {what}")


def check_records(refs) -> None:
    """Check the CRC32 of the members behind `refs` now, each once (for the small reads outside a merge)."""
    seen = set()
    for ref in refs:
        for record in ref.records():
            if record.key not in seen:
                seen.add(record.key)
                record.check_crc()


def same_stored_member(first, other) -> bool:
    """Whether two copies are each one whole archive member, of the same size and stored CRC32. Then the
    bytes were written identical (a copy from another run or iteration differs in its CRC with certainty
    but for 1 in 2^32), and the copy that is not used need not be read: the one that is used is
    checked against its own CRC32 as it is read. Equal bytes are not an equal tensor: a copy reshaped or
    reinterpreted as another dtype stores the same bytes, so shape and dtype must agree first."""
    if first.shape != other.shape or first.dtype != other.dtype:
        return False
    records = first.records(), other.records()
    if any(len(r) != 1 or r[0] is None for r in records):
        return False
    (a,), (b,) = records
    return a.size == b.size and a.crc == b.crc and all(_whole_member(ref.unread(), rec) for ref, rec in
                                                       ((first, a), (other, b)))


def _whole_member(tensor: torch.Tensor, record) -> bool:
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.numel() * tensor.element_size() == record.size == tensor.untyped_storage().nbytes())


def check_replica(first, other, differs: str | None = None, chunk_bytes: int = 16 << 20) -> None:
    """Two files' copies of one tensor (each expert-parallel rank's file repeats the dense part; an
    unfiltered LoRA checkpoint repeats its base) must be identical; compared a block of rows at a time,
    pages handed back as it goes. `differs`: the message if they are not."""
    if first.shape != other.shape or first.dtype != other.dtype:
        raise MergeError(f"{other.where}: shape {list(other.shape)} {other.dtype}, but its copy in {first.where} has "
                         f"{list(first.shape)} {first.dtype}")
    a, b = first.load(), other.load()
    rows = a.shape[0] if a.dim() else 1
    step = max(1, chunk_bytes // max(1, a[0].nbytes if a.dim() else a.nbytes))
    for start in range(0, rows, step):
        x, y = (a[start:start + step], b[start:start + step]) if a.dim() else (a, b)
        if not torch.equal(x, y):
            raise MergeError(differs or f"{other.where}: differs from its copy in {first.where}; the files of the "
                             "expert-parallel ranks must hold the same dense weights, and the MTP layers' stage the "
                             "first stage's embedding")
        for view, ref in ((x, first), (y, other)):
            if ref.mapped:
                release_pages(view)


class RecordChecker:
    """Checks the members behind each job's tensor references, in order, on a background thread.

    `jobs` are (due, refs, replicas): `due` is how many input bytes the merge will have reached when it
    needs refs; `replicas` are (first, other) copies of a tensor in several files, compared here.
    The merge reports its position with `advance(due)`, which also raises a failure found so far.
    """

    def __init__(self, jobs: list[tuple[int, list]], reads: list | None = None):
        self._jobs = jobs
        self._reads = reads  # each job's counted reads of inputs at a URL (files/handback.py), done after it
        self._progress = 0
        self._stopped = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="lora-merge-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._check_all()
        finally:
            charge_thread("crc32")

    def _check_all(self) -> None:
        seen = set()
        try:
            for i, (due, refs, replicas) in enumerate(self._jobs):
                with self._cond:
                    while not self._stopped and due > self._progress + LEAD_BYTES:
                        self._cond.wait()
                compared = [pair for pair in replicas if not same_stored_member(pair[0], pair[1])]
                for ref in [*refs, *(pair[1] for pair in compared)]:
                    for record in ref.records():
                        if self._stopped:
                            return
                        if record.key not in seen:
                            seen.add(record.key)
                            record.check_crc(stop=lambda: self._stopped)
                for pair in compared:
                    check_replica(*pair)
                if self._reads is not None and self._reads[i] is not None:
                    self._reads[i].done()
        except BaseException as exc:  # handed to the merging thread
            self._error = exc

    def advance(self, due: int) -> None:
        if self._error is not None:
            raise self._error
        with self._cond:
            self._progress = due
            self._cond.notify()

    def finish(self) -> None:
        """Wait until every member has been checked; raise the first failure."""
        self.advance(float("inf"))
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()
