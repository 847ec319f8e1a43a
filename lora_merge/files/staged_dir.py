"""Atomic, honest output: everything is written into a hidden sibling directory, which becomes the output
only once complete and flushed, together with any side files (the report).

- Publishing never replaces a directory that appeared meanwhile (another run with the same --out):
  `renameat2(RENAME_NOREPLACE)`; with --force the old output is swapped out atomically
  (`RENAME_EXCHANGE`), so there is never a moment without a complete directory.
- --force replaces only an earlier output of lora-merge of the same kind (its model card says so; see
  ownership.py), or an empty directory, never anything else; never a mount point (a rename cannot replace one).
- Every staging directory and side file is held locked (flock) by its run for as long as the run lives. Another
  run removes one only when it can take that lock itself: its owner is gone, whatever its pid says (a pid
  proves nothing across PID namespaces sharing a hostname, nor between threads of one process). Nothing that
  is an input is ever removed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import tempfile
from pathlib import Path

from lora_merge.errors import MergeError, OutputConflict
from lora_merge.files import remote
from lora_merge.files.run_locks import create_locked, lock_if_abandoned, release, remove_if_abandoned
from lora_merge.interrupts import ignore_signals
from lora_merge.readers.detect import what_is
from lora_merge.files.ownership import MERGED_MODEL, check_replaceable, report_refusal
from lora_merge.files.targets import InputPaths

# What this process has published, so that an interruption or error afterwards is reported truthfully.
PUBLISHED: list[Path] = []

# Inside a staging directory, held locked by its run (removed just before publishing).
STAGING_LOCK = ".lora-merge-staging.lock"
# Errors that only writing causes: one of these without a file name happened while writing the output.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def check_output_target(out: Path, force: bool, inputs: InputPaths, early: bool = False,
                        kind: str = MERGED_MODEL) -> None:
    """The output must not touch any input, must not exist unless --force, and with --force must be an
    earlier output of this `kind`. `early`: only the user's input paths are known yet (a full check follows)."""
    inputs.check(out, "output directory")
    if os.path.ismount(out):  # checked first: --force could never help, and publishing would fail at the end
        raise OutputConflict(f"{out}: is a mount point; the output is published by renaming a directory into its "
                         f"place, which a mount point cannot be: name a directory inside it, e.g. {out / 'merged'}")
    if out.is_symlink():
        raise OutputConflict(f"{out}: is a symlink; give the directory itself")
    if os.path.lexists(out) and not out.is_dir():
        raise OutputConflict(f"{out}: exists and is {what_is(out)}, not a directory; not replacing it even with --force")
    if out.is_dir() and (not early or not force):
        check_replaceable(out, kind)  # before suggesting --force: only where it would help
    if os.path.lexists(out) and not force:
        raise OutputConflict(f"{out}: already exists (pass --force to replace it)")
    if not out.parent.is_dir():
        raise OutputConflict(f"{out.parent}: parent directory of the output does not exist")
    if len(os.fsencode(_prefix(out.name))) + 24 > 255:
        raise OutputConflict(f"{out}: the name is too long to stage the output next to it; choose a shorter name")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputConflict(f"{out.parent}: the output's parent directory is not writable")


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask reads it only by setting
    another, which for a moment would apply to files other threads create)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def output_file_mode() -> int:
    """The mode of every file of an output: what open(2) with 0o666 gives under the umask (the shards are
    created that way), so that files written by libraries that choose 0600 (safetensors' save_file) are
    no more private than the rest."""
    return 0o666 & ~current_umask()


def gigabytes(nbytes: int) -> str:
    """A size for a message, with the digits that matter (1.2 MB, not 0.00 GB)."""
    if nbytes < 10 ** 6:
        return f"{nbytes / 1e3:.1f} kB"
    if nbytes < 10 ** 9:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e9:.2f} GB"


SPACE_MARGIN = 64 * 10 ** 6  # config, model card, report: small files not counted one by one


def space_needed(tensor_bytes: int, copied_bytes: int, small_files: str = "config, card and report") -> tuple[int, str]:
    """The bytes a run needs on the output's file system, and what they are, for a message."""
    total = tensor_bytes + copied_bytes + SPACE_MARGIN
    parts = f"{gigabytes(tensor_bytes)} of tensors"
    if copied_bytes:
        parts += f" + {gigabytes(copied_bytes)} of reference files"
    return total, f"{gigabytes(total)} ({parts} + {gigabytes(SPACE_MARGIN)} margin for {small_files})"


def check_free_space(out: Path, tensor_bytes: int, copied_bytes: int = 0,
                     small_files: str = "config, card and report") -> None:
    needed, what = space_needed(tensor_bytes, copied_bytes, small_files)
    free = shutil.disk_usage(out.parent).free
    if needed > free:
        raise MergeError(f"{out.parent}: not enough disk space for {out.name}: the output needs {what}, "
                         f"{gigabytes(free)} are free")


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class SideFile:
    """A file written next to `final` under a hidden name, moved into place by `publish`; locked by this run
    until then, so that the cleanup of another run leaves it alone."""

    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.parent / f"{_prefix(final.name)}{os.getpid()}-{os.urandom(4).hex()}"
        new = final.parent / f"{_prefix(final.name, 'new')}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self._fd: int | None = create_locked(new, self.tmp)
        except OSError as exc:
            raise _named(exc, final) from exc

    def write(self, text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except OSError as exc:  # os.write names no file: name the one the user asked for
            raise _named(exc, self.final) from exc

    def publish(self, force: bool) -> None:
        """Move the file into place: without --force never over anything that appeared meanwhile, with it only
        over an earlier report of lora-merge. On failure the file is removed (or named when it cannot be)."""
        try:
            if force:
                refusal = report_refusal(self.final)  # again: something else may have appeared since the start
                if refusal:
                    raise OutputConflict(f"{refusal} (it appeared while this run was writing); this run's report was "
                                     "discarded")
                os.replace(self.tmp, self.final)
            else:
                try:
                    os.link(self.tmp, self.final)  # fails if `final` exists, atomically
                except FileExistsError as err:
                    raise OutputConflict(f"{self.final}: appeared while this run was writing; it was left as it is and "
                                     "this run's report discarded (pass --force to replace an earlier report of "
                                     "lora-merge)") from err
                os.unlink(self.tmp)
        except MergeError:
            self.discard()
            raise
        except OSError as err:
            left = self.discard()
            where = f"it is left at {self.tmp}" if left else "this run's report was discarded"
            raise OutputConflict(f"{self.final}: the report could not be moved into place ({err.strerror}); "
                             f"{where}") from err
        self._release()

    def discard(self) -> bool:
        """Remove the file; True when it could not be removed (and is still there)."""
        try:
            os.unlink(self.tmp)
            left = False
        except FileNotFoundError:
            left = False
        except OSError:
            left = True
        self._release()
        return left

    def _release(self) -> None:
        if self._fd is not None:
            release(self._fd)
            self._fd = None


def _named(exc: OSError, path: Path) -> OSError:
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))


class StagedOutput:
    """`with StagedOutput(out, force, inputs) as stage:` write into `stage.dir` (and side files with
    `stage.side_file`); on success it is published, on any failure or interruption removed. Once publishing
    begins the handled signals are ignored until the process exits (interrupts.py): a published output is
    never reported as a failure."""

    def __init__(self, out: Path, force: bool, inputs: InputPaths, kind: str = MERGED_MODEL):
        self.out, self.force, self.inputs, self.kind = out, force, inputs, kind
        self.dir: Path | None = None
        self._lock: int | None = None
        self._side: list[SideFile] = []

    def __enter__(self) -> "StagedOutput":
        check_output_target(self.out, self.force, self.inputs, kind=self.kind)
        remove_abandoned_staging(self.out, self.inputs)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_prefix(self.out.name)}{os.getpid()}-", dir=self.out.parent))
        try:
            os.chmod(self.dir, 0o777 & ~current_umask())  # mkdtemp's 0700 would make the result private by accident
            self._lock = create_locked(self.dir / f"{STAGING_LOCK}.new", self.dir / STAGING_LOCK)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return self

    def side_file(self, final: Path, text: str) -> None:
        """Write `text` now (so that a failure stops the run before publishing), moved to `final` when the
        output is published. A path directly inside the output goes into the staging dir."""
        if os.path.realpath(final.parent) == os.path.realpath(self.out):
            try:
                with open(self.dir / final.name, "x") as f:
                    f.write(text)
            except OSError as exc:
                raise _named(exc, final) from exc
            return
        side = SideFile(final)
        self._side.append(side)
        side.write(text)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            if isinstance(exc, OSError):
                raise self._write_error(exc) from exc
            return
        try:
            os.unlink(self.dir / STAGING_LOCK)  # not part of the output; the lock stays held through the fd
            _fsync_tree(self.dir)
            remote.check_inputs_unchanged()  # (inputs at a URL: still the objects read)
            ignore_signals()  # the point of no return (raises Interrupted for a signal that came before it)
            self._publish()
        except BaseException:
            self._discard()
            raise
        self._release_lock()
        for side in self._side:
            try:
                side.publish(self.force)
            except MergeError as err:
                raise MergeError(f"{err}; the output {self.out} was published") from err

    def _write_error(self, exc: OSError) -> BaseException:
        """An error while writing, as one line naming the output file (not its staging path), or the output
        dir when the system named no file; other errors (reading an input) as they are."""
        where = exc.filename
        inside = where is not None and self.dir is not None and Path(os.fsdecode(where)).parent.is_relative_to(self.dir)
        if inside:
            where = self.out / Path(os.fsdecode(exc.filename)).relative_to(self.dir)
        elif where is None and exc.errno in WRITE_ERRNOS:
            where = f"{self.out} (while writing it)"
        else:
            return exc
        return MergeError(f"{where}: {exc.strerror or exc}; no output was written")

    def _publish(self) -> None:
        if self.force and self.out.is_dir() and not self.out.is_symlink():
            check_replaceable(self.out, self.kind)
            try:
                rename_exchange(self.dir, self.out)
            except FileNotFoundError:  # removed meanwhile: publish as new
                pass
            else:
                PUBLISHED.append(self.out)
                shutil.rmtree(self.dir)  # now the old output
                _fsync_dir(self.out.parent)
                return
        try:
            rename_noreplace(self.dir, self.out)
        except FileExistsError as err:
            raise OutputConflict(f"{self.out}: appeared while this run was writing (another run with the same --out?); "
                             "it was left as it is and this run's output discarded") from err
        PUBLISHED.append(self.out)
        _fsync_dir(self.out.parent)

    def _discard(self) -> None:
        if self.dir is not None and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        self._release_lock()
        for side in self._side:
            side.discard()

    def _release_lock(self) -> None:
        if self._lock is not None:
            release(self._lock)
            self._lock = None


# --- renameat2 ------------------------------------------------------------------------------------

_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (OSError, AttributeError):  # not Linux, or glibc < 2.28
    _renameat2 = None


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2 with flags; False when the system or filesystem does not offer it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename, failing with FileExistsError if dst exists."""
    if _rename2(src, dst, _RENAME_NOREPLACE):
        return
    # Without renameat2, rename(2) still refuses to replace a non-empty directory (ENOTEMPTY), and an
    # output is never empty; only an empty directory created meanwhile could be replaced.
    if os.path.lexists(dst) and not (dst.is_dir() and not any(dst.iterdir())):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    try:
        os.rename(src, dst)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from err
        raise


def rename_exchange(new: Path, old: Path) -> None:
    """Swap two directories atomically (after it, `new` holds the old contents)."""
    if _rename2(new, old, _RENAME_EXCHANGE):
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{_prefix(old.name, 'old')}{os.getpid()}-", dir=old.parent))
    os.rename(old, aside / old.name)
    try:
        rename_noreplace(new, old)
    except BaseException:
        os.rename(aside / old.name, old)
        aside.rmdir()
        raise
    os.rename(aside / old.name, new)  # new's name is free again: the caller removes it as with the exchange
    aside.rmdir()


# --- abandoned staging dirs -----------------------------------------------------------------------

def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _prefix(name: str, kind: str = "partial") -> str:
    return f".{name}.{kind}-{_host()}-"


def remove_abandoned_staging(out: Path, inputs: InputPaths) -> None:
    """Delete the staging dirs that runs on this host left next to `out` when they were killed: those whose
    lock nobody holds. A live run's (another thread, another process, another PID namespace) is held; one with
    no lock file (a run of an earlier version, or one that has only just created it) is left alone, and so are
    other hosts' (their locks may not reach us), symlinks and anything that is an input."""
    for path in out.parent.glob(f"{_prefix(glob_escape(out.name))}*"):
        if path.is_symlink() or not path.is_dir() or inputs.conflict(path) is not None:
            continue
        remove_if_abandoned(path, STAGING_LOCK)


def remove_abandoned_side_files(target: Path, inputs: InputPaths) -> None:
    """Delete the hidden side files (reports being written) of killed runs next to `target`, as above."""
    for path in target.parent.glob(f"{_prefix(glob_escape(target.name))}*"):
        if path.is_symlink() or inputs.conflict(path) is not None:
            continue
        fd = lock_if_abandoned(path)
        if fd is not None:
            try:
                if _same_file(fd, path):
                    path.unlink(missing_ok=True)
            finally:
                os.close(fd)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _fsync_tree(path: Path) -> None:
    """Flush every file written into the staging dir (the shards are already flushed by their writer)."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():  # additional_chat_templates/
            _fsync_tree(child)
        elif child.is_file() and child.suffix != ".safetensors":
            with open(child, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
