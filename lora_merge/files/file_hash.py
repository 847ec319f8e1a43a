"""The sha256 of a whole file as it is on the disk, read without the page cache where the file system allows.

`finish` and `--resume` hash every output file again, files that were written with O_DIRECT and so are not
in the page cache. Read through the cache, 5 GB cost 0.9 to 5.8 CPU-seconds in the kernel (filling and then
evicting cache pages, erratic from run to run on the 2-core host); read with O_DIRECT into one aligned
buffer, 0.5, and the disk reads straight into our memory. Where a file system refuses O_DIRECT (tmpfs,
some network and FUSE file systems), at open or at a read, the file is read through the cache.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

from lora_merge.files.output_file import O_DIRECT, REFUSED

CHUNK = 8 << 20  # a multiple of every logical block size; several files are hashed side by side


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    try:
        done = _read_direct(path, view, h) if O_DIRECT else 0
        if done is not None:  # O_DIRECT refused after `done` bytes: the rest through the page cache
            with open(path, "rb", buffering=0) as f:
                f.seek(done)
                while n := f.readinto(view):
                    h.update(view[:n])
    finally:
        view.release()
        buffer.close()
    return h.hexdigest()


def _read_direct(path: Path, view: memoryview, h) -> int | None:
    """Hash the file read with O_DIRECT; None when done, else the bytes hashed before the file system refused."""
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in REFUSED:
            return 0
        raise
    done = 0
    try:
        while True:
            try:
                n = os.readv(fd, [view])
            except OSError as exc:
                if exc.errno in REFUSED or exc.errno == errno.EINVAL:
                    return done
                raise
            h.update(view[:n])
            done += n
            if n < len(view):  # the end of the file (a direct read returns short only there)
                return None
    finally:
        os.close(fd)
