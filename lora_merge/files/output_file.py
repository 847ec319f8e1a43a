"""One large output file, written at disk speed with as little CPU as the OS allows.

Written through the page cache, every byte is copied into it and the kernel then allocates, dirties,
writes back and drops those pages: at DeepSeek-V3 shapes that was ~16 s of kernel time for 28 GB, as much
as `cp` needs to read and write it all, on a machine where the merge is CPU-bound. With O_DIRECT the disk
takes the bytes from our buffer: writing 8 GB took 0.4-0.5 s of kernel time instead of 4.1-4.7 s, at the
same speed.

O_DIRECT needs block-aligned memory, file offsets and lengths, so bytes are gathered in page-aligned
buffers and written a whole buffer at a time; the last block is written padded and the file cut to its
true length. A direct write returns only once the disk has the data, so the writes run on a thread of their
own while the next buffers fill: the disk is never left waiting for a copy, and a slow read elsewhere does
not stall it at once. Where the file system refuses O_DIRECT (tmpfs on older kernels, some network or FUSE
file systems), at open or at a write, the rest of the file goes through the page cache, its dirty pages
bounded.
"""

from __future__ import annotations

import ctypes
import hashlib
import errno
import mmap
import os
import queue
import sys
from pathlib import Path

from lora_merge.writers.background import OrderedWorker

O_DIRECT = getattr(os, "O_DIRECT", 0)
# how file systems say they do not do direct I/O (at open, or at a write)
REFUSED = {errno.EINVAL, getattr(errno, "EOPNOTSUPP", errno.EINVAL), getattr(errno, "ENOTSUP", errno.EINVAL)}
ALIGN = 4096  # covers every logical block size in use (512 and 4096)
BUFFER_BYTES = 8 << 20
BUFFERS = 4  # one filling, the others queued for or being written by the I/O thread


def _named(exc: OSError, path: Path) -> OSError:
    """The error with the file it happened in: os.write and os.fsync name none, and "No space left on
    device" alone does not say where."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))


class OutputFile:
    """A new file at `path` (replacing any), written sequentially by `write`; durable once `close` returns."""

    def __init__(self, path: Path, buffer_bytes: int | None = None):
        self.path = path
        buffer_bytes = buffer_bytes or BUFFER_BYTES
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = None
        self._buffers = []
        self._closed = False
        if O_DIRECT:
            try:
                self._fd = os.open(path, flags | O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno not in REFUSED:
                    raise
        self.direct = self._fd is not None
        if self._fd is None:
            self._fd = os.open(path, flags, 0o666)
        try:
            size = -(-buffer_bytes // ALIGN) * ALIGN
            for _ in range(BUFFERS):
                buffer = mmap.mmap(-1, size)
                self._buffers.append((buffer, memoryview(buffer)))
        except BaseException:
            self._release()
            raise
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for pair in self._buffers[1:]:
            self._free.put(pair)
        self._current = self._buffers[0]
        self._fill = 0  # bytes gathered in the current buffer
        self._queued = 0  # bytes handed to the I/O thread
        self._writeback = BoundedWriteback(self._fd)
        self._io = OrderedWorker("lora-merge-io", depth=BUFFERS)

    @property
    def size(self) -> int:
        return self._queued + self._fill

    def write(self, data) -> None:
        self._check_open()
        data = memoryview(data).cast("B")
        pos = 0
        while pos < len(data):
            view = self._current[1]
            n = min(len(data) - pos, len(view) - self._fill)
            view[self._fill:self._fill + n] = data[pos:pos + n]
            self._fill += n
            pos += n
            if self._fill == len(view):
                self._io.submit(self._write_buffer, self._current, self._fill, self._fill)
                self._queued += self._fill
                self._current, self._fill = self._next_free(), 0

    def _next_free(self):
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                self._io.check()  # a failed write returns no buffer: raise its error instead of waiting
                self._check_open()  # aborted from another thread (an interrupted run): no buffer comes back

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: written to after it was closed or aborted")

    def close(self) -> None:
        """Write what is gathered, then fsync and close."""
        self._check_open()
        try:
            self._io.close()  # every full buffer written (or a write's failure raised)
            self._finish()
        except OSError as exc:
            raise _named(exc, self.path) from exc
        self._release()

    def _finish(self) -> None:
        size, gathered = self.size, self._fill
        if gathered:
            if self.direct:
                padded = -(-gathered // ALIGN) * ALIGN
                self._current[1][gathered:padded] = bytes(padded - gathered)
                self._write_buffer(self._current, padded, gathered)
                os.ftruncate(self._fd, size)  # the padding off (also where this write fell back mid-block)
            else:
                self._write_buffer(self._current, gathered, gathered)
            self._fill = 0
        os.fsync(self._fd)

    def abort(self) -> None:
        """Close without writing what is gathered (the file is about to be removed)."""
        self._io.stop()
        self._release()

    def _release(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for buffer, view in self._buffers:
            try:
                view.release()
                buffer.close()
            except BufferError:  # a failed write's traceback still holds a view: unmapped when it goes
                pass
        self._buffers = []

    def _write_buffer(self, pair, nbytes: int, gathered: int) -> None:
        """Write the first `nbytes` of a buffer (`gathered` of them data, the rest padding), then free it."""
        done = 0
        while done < nbytes:
            try:
                with pair[1][done:nbytes] as rest:
                    wrote = os.write(self._fd, rest)
            except OSError as exc:
                # Some file systems accept O_DIRECT at open and refuse it at the first write; a device with
                # blocks larger than ALIGN refuses the padded last block. The same bytes through the page
                # cache are the same file, so the rest of it goes that way.
                if exc.errno not in REFUSED or not self.direct:
                    raise _named(exc, self.path) from exc
                self._buffered_from_now()
                nbytes = max(gathered, done)  # no more padding; close() cuts what was written of it
                continue
            if wrote <= 0:
                raise OSError(errno.EIO, f"{self.path}: the file system accepted no bytes of a write")
            done += wrote
        if not self.direct:
            self._writeback.advance(nbytes)
        self._free.put(pair)

    def _buffered_from_now(self) -> None:
        import fcntl  # only where there is O_DIRECT: not on Windows

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False


class BoundedWriteback:
    """Keep a file's dirty pages to about two windows while it is written through the page cache.

    Left to itself the kernel lets gigabytes of written data pile up in the page cache, then throttles the
    writer and flushes it all in the final fsync. Here each full window is handed to the disk at once
    (sync_file_range WRITE), the window before it is waited for and dropped from the cache, so the disk
    writes while we compute. Linux only; elsewhere (or where the call fails) it does nothing and the
    closing fsync does all the work.
    """

    WINDOW = 256 << 20
    _WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4

    def __init__(self, fd: int, start: int = 0):
        self._fd = fd
        self._written = self._kicked = self._flushed = start
        self._sync_file_range = _sync_file_range()

    def advance(self, nbytes: int) -> None:
        self._written += nbytes
        if self._sync_file_range is not None and self._written - self._kicked >= self.WINDOW:
            try:
                self._write_back()
            except OSError:
                self._sync_file_range = None  # e.g. a file system without it: fsync at close still syncs

    def _write_back(self) -> None:
        fd = self._fd
        self._sync_file_range(fd, self._kicked, self._written - self._kicked, self._WRITE)
        if self._kicked > self._flushed:
            self._sync_file_range(fd, self._flushed, self._kicked - self._flushed,
                                  self._WAIT_BEFORE | self._WRITE | self._WAIT_AFTER)
            os.posix_fadvise(fd, self._flushed, self._kicked - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._kicked
        self._kicked = self._written


def _sync_file_range():
    """libc's sync_file_range as a callable raising OSError, or None where there is none."""
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if call(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")
    return sync_file_range


class HashedFile:
    """An output file that hashes (sha256) what passes through it, for a part's manifest (a run in parts,
    runs/parts.py), without reading it back."""

    def __init__(self, out: OutputFile):
        self.out, self.sha256, self.path = out, hashlib.sha256(), out.path

    def write(self, data) -> None:
        self.sha256.update(data)
        self.out.write(data)

    def close(self) -> None:
        self.out.close()

    def abort(self) -> None:
        self.out.abort()
