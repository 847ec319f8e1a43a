"""Atomic output: everything is written into a hidden sibling directory that is renamed into place only
once complete and flushed, so an interrupted run never leaves a directory that looks finished."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

from lora_merge.errors import MergeError


def check_output_target(out: Path, force: bool, inputs=()) -> None:
    """The output must not overlap any input (with --force that would delete the inputs), and must not
    exist unless --force."""
    target = out.resolve()
    for inp in inputs:
        if inp is None:
            continue
        source = Path(inp).resolve()
        if target == source or target in source.parents or source in target.parents:
            raise MergeError(f"{out}: the output directory overlaps the input {inp}; choose a separate directory")
    if out.exists() and not force:
        raise MergeError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise MergeError(f"{out}: exists and is not a directory")
    if not out.parent.is_dir():
        raise MergeError(f"{out.parent}: parent directory of the output does not exist")


def check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if needed > free:
        raise MergeError(f"{out.parent}: not enough disk space: the output needs {needed / 1e9:.2f} GB, "
                         f"{free / 1e9:.2f} GB are free")


@contextmanager
def staged_directory(out: Path, force: bool, inputs=()):
    """Yield a temporary directory next to `out`; on success it becomes `out`, on failure it is removed."""
    check_output_target(out, force, inputs)
    remove_abandoned_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{_host()}-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would make the result private by accident
    try:
        yield staging
        _fsync_tree(staging)
        if out.exists():
            # Swap the old output aside first so there is never a moment without a complete directory.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(staging, out)
            shutil.rmtree(old)
        else:
            os.rename(staging, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def remove_abandoned_staging(out: Path) -> None:
    """Delete staging dirs of earlier runs on this host for the same output that were killed (their
    process is gone). Other hosts' dirs are left alone: on shared storage their runs may be alive."""
    for path in out.parent.glob(f".{out.name}.partial-{_host()}-*-*"):
        pid = path.name.removeprefix(f".{out.name}.partial-{_host()}-").split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(path: Path) -> None:
    """Flush every file written into the staging dir (the shards are already flushed by their writer)."""
    for child in path.iterdir():
        if child.is_file() and child.suffix != ".safetensors":
            with open(child, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
