"""Handing the bytes of inputs at a URL back once every read of them planned by a run is done.

An input at a URL is read through a sparse local shadow file whose ranges are fetched on first use
(files/remote.py). Without handing them back, the local disk would hold every byte the run reads: the model.
Before the merge starts, each of its reads of an input range is counted: each task's reads (its tensors and
LoRA factors), and the CRC32 checker's (the members it checks, the copies it compares).
When the last of a range's reads is done, the range's whole pages are punched out of the shadow file, on a
thread of this module's own (a writer thread that finishes a piece never waits for it), and forgotten as
fetched. The local disk then holds about the read-ahead distance, whatever the model's size.

Counted ranges are punched only once nothing counted is left to read them. What planning fetched that no counted
read will read (a copy compared with its original, a LoRA checkpoint's own base, headers, pickles) is handed back
before the merge starts (`release_unread`). A range read again later (a verification afterwards) is fetched again:
every load makes its bytes readable first (`remote.ensure`, which knows what is gone). The read-ahead thread
does not fetch a range again once it is handed back (`ahead=True`).
"""

from __future__ import annotations

import bisect
import queue
import threading

from lora_merge.files import remote


class _Counts:
    """Reads left per byte range of one file: sorted breakpoints; counts[i] for [points[i], points[i + 1]),
    None where no read was ever counted."""

    def __init__(self):
        self.points: list[int] = []
        self.counts: list[int | None] = []

    def _split(self, at: int) -> int:
        i = bisect.bisect_left(self.points, at)
        if i < len(self.points) and self.points[i] == at:
            return i
        self.points.insert(i, at)
        # the new segment [at, next) continues the one it was cut from (None before the first, after the last)
        self.counts.insert(i, self.counts[i - 1] if 0 < i <= len(self.counts) else None)
        return i

    def add(self, start: int, end: int, step: int) -> None:
        i, j = self._split(start), self._split(end)
        for k in range(i, j):
            self.counts[k] = (self.counts[k] or 0) + step

    def released(self, start: int, end: int, page: int) -> tuple[int, int] | None:
        """The whole pages [a, b) to hand back once [start, end) has no read left: those inside it, and the pages
        it shares with its neighbours where no read of theirs is left either (only those pages are looked at, so
        a file's thousands of tensors cost no more each than a few)."""
        i, j = bisect.bisect_left(self.points, start), bisect.bisect_left(self.points, end)
        if any(self.counts[k] for k in range(i, j)):
            return None
        a, b = start // page * page, -(-end // page) * page
        if a < start and not self._free(a, start):
            a += page
        if b > end and not self._free(end, b):
            b -= page
        return (a, b) if a < b else None

    def settle(self, end: int) -> None:
        """Count no read left for every byte of [0, end) that none was counted for (the merge does not read it)."""
        self._split(0)
        self._split(end)
        for k, at in enumerate(self.points):
            if at < end and self.counts[k] is None:
                self.counts[k] = 0

    def uncounted(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) no read was counted for."""
        found, at = [], start
        k = bisect.bisect_right(self.points, start) - 1
        while at < end:
            stop = min(end, self.points[k + 1]) if k + 1 < len(self.points) else end
            if k < 0 or self.counts[k] is None:
                found.append((at, stop))
            at, k = stop, k + 1
        return found

    def _free(self, start: int, end: int) -> bool:
        """Whether every byte of [start, end) was counted and has no read left."""
        k = bisect.bisect_right(self.points, start) - 1
        if k < 0:
            return False
        while k < len(self.points) and self.points[k] < end:
            if self.counts[k] != 0:  # (None: never counted)
                return False
            k += 1
        return True


class Reads:
    """One counted set of reads (a task's, a CRC32 job's); `done()` once they are all made, at most once."""

    def __init__(self, owner: "Handback", spans: list[tuple[str, int, int]]):
        self._owner, self._spans, self._lock = owner, spans, threading.Lock()

    def done(self) -> None:
        with self._lock:
            spans, self._spans = self._spans, None
        if spans:
            self._owner._done(spans)


class Handback:
    """The counted reads of one run's inputs at a URL (see the module's docstring); made only where the run reads a
    shadow file (merge_pipeline.execute)."""

    def __init__(self):
        self._counts: dict[str, _Counts] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def reads(self, refs) -> Reads | None:
        """Count one read of each byte range of `refs` that lies in a shadow file (each range once)."""
        spans = sorted({(str(file.path), start, start + nbytes) for ref in refs for file, start, nbytes in ref.byte_spans()
                        if nbytes > 0 and not file.in_memory and remote.is_shadow(file.path)})
        if not spans:
            return None
        with self._lock:
            for path, start, end in spans:
                self._counts.setdefault(path, _Counts()).add(start, end, 1)
        return Reads(self, spans)

    def release_unread(self) -> None:
        """Hand back what was fetched while the run planned (a copy compared with its original, a LoRA checkpoint's
        own base, headers and pickles) but no counted read of the merge will read, in the files the merge reads: to
        be called once every read is counted, before any starts. (Another run's files at once in this process are
        none of these: each run has a shadow of its own.)"""
        with self._lock:
            for path, counts in self._counts.items():
                for start, end in remote.fetched(path):
                    for gap in counts.uncounted(start, end):
                        remote.hand_back(path, *gap)
                # the rest of the file, read by nothing the merge does, no longer keeps a page it shares with a
                # tensor from being handed back with the tensor (a legacy member's zip header, say)
                size = remote.shadow_size(path)
                counts.settle(-(-size // remote.PAGE) * remote.PAGE)

    def _done(self, spans) -> None:
        with self._lock:
            free = []
            for path, start, end in spans:
                counts = self._counts[path]
                counts.add(start, end, -1)
                gone = counts.released(start, end, remote.PAGE)
                if gone is not None:
                    free.append((path, *gone))
            if not self._closed:
                if free and self._thread is None:
                    self._thread = threading.Thread(target=self._hand_back, name="lora-merge-handback", daemon=True)
                    self._thread.start()
                for item in free:
                    self._queue.put(item)
                return
        for item in free:  # after close (a writer done with its last pieces after the merge): here
            remote.hand_back(*item)

    def _hand_back(self) -> None:
        while (item := self._queue.get()) is not None:
            remote.hand_back(*item)

    def close(self) -> None:
        """Wait for the ranges already released to be handed back; those released later are handed back at once."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()
