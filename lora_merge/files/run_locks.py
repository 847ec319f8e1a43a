"""Lock files that say a run is alive: a directory a run works in (a local output's staging, a URL run's local
directory) or a file it is writing holds one, locked by the run's process (flock) until it ends. A later run that
can take the lock knows the run that made it is gone, and removes what it left."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

# The lock files this process holds (device, inode) until `release`. On a file system where flock is emulated with
# POSIX locks (NFS), a lock is the process's: another open of the file in this process takes it again, so a live
# run of another thread would look abandoned. This process never takes one it holds for abandoned.
_OURS: set[tuple[int, int]] = set()


def create_locked(new: Path, final: Path) -> int:
    """Create the file `final`, already locked by this process: created and locked under `new` (a name no
    cleanup looks at), then renamed, so that no other run can find it at `final` unlocked while we live.
    Where the file system offers no locks it is left unlocked, and then no other run ever takes it for
    abandoned (it cannot prove that)."""
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        os.rename(new, final)
        info = os.fstat(fd)
        _OURS.add((info.st_dev, info.st_ino))
    except BaseException:
        os.close(fd)
        try:
            os.unlink(new)
        except OSError:
            pass
        raise
    return fd


def release(fd: int) -> None:
    """Let go of a lock `create_locked` made (its file may then be taken for abandoned, even by this process)."""
    try:
        info = os.fstat(fd)
        _OURS.discard((info.st_dev, info.st_ino))
    finally:
        os.close(fd)


def lock_if_abandoned(path: Path) -> int | None:
    """An fd holding the lock of the regular file `path` when its run is gone (nobody holds it), else None:
    held by a live run, one of this process's, not a regular file, or a file system without locks (nothing can be
    proven there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if (info.st_dev, info.st_ino) in _OURS:
            raise OSError(errno.EBUSY, "this process's own")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_if_abandoned(directory: Path, lock: str) -> None:
    """Delete `directory` when the run that made it is gone: its lock file `lock` is there and nobody holds it
    (held for this, so that no other cleanup runs into this one)."""
    fd = lock_if_abandoned(directory / lock)
    if fd is not None:
        try:
            shutil.rmtree(directory, ignore_errors=True)
        finally:
            os.close(fd)
