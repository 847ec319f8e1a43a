"""Atomic, honest output: everything is written into a hidden sibling directory, which becomes the output
only once complete and flushed, together with any side files (the report).

- Publishing never replaces a directory that appeared meanwhile (another run with the same --out):
  `renameat2(RENAME_NOREPLACE)`; with --force the old output is swapped out atomically
  (`RENAME_EXCHANGE`), so there is never a moment without a complete directory.
- --force replaces only what looks like an earlier output (empty, or holding a config.json or
  adapter_config.json), never an arbitrary directory.
- Staging dirs of runs on this host that were killed (their process is gone) are removed; nothing that
  is an input is ever removed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.writers.hf_files import COPIED_SUBDIRS
from lora_merge.writers.model_card import MAX_CARD_BYTES, card_files
from lora_merge.writers.targets import InputPaths

# What this process has published, so that an interruption or error afterwards is reported truthfully.
PUBLISHED: list[Path] = []
OUTPUT_MARKERS = ("config.json", "adapter_config.json")


def check_output_target(out: Path, force: bool, inputs: InputPaths, early: bool = False) -> None:
    """The output must not touch any input, must not exist unless --force, and with --force must be an
    earlier output. `early`: only the user's input paths are known yet (a full check follows)."""
    inputs.check(out, "output directory")
    if os.path.lexists(out) and not force:
        raise MergeError(f"{out}: already exists (pass --force to replace it)")
    if out.is_symlink():
        raise MergeError(f"{out}: is a symlink; give the directory itself")
    if os.path.lexists(out) and not out.is_dir():
        raise MergeError(f"{out}: exists and is not a directory")
    if out.is_dir() and not early:
        _check_replaceable(out)
    if not out.parent.is_dir():
        raise MergeError(f"{out.parent}: parent directory of the output does not exist")
    if len(os.fsencode(_prefix(out.name))) + 24 > 255:
        raise MergeError(f"{out}: the name is too long to stage the output next to it; choose a shorter name")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise MergeError(f"{out.parent}: the output's parent directory is not writable")


# What an output of this tool holds: shards and index, configs and reports (*.json), the reference's
# tokenizer, chat template and remote code. Anything else in a directory means it is someone's own.
OUTPUT_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|adapter_model\.safetensors|[^/]+\.json|[^/]+\.py|"
                         r"merges\.txt|tokenizer\.model|chat_template\.jinja|README\.md)$")


def _check_replaceable(out: Path) -> None:
    try:
        entries = list(os.scandir(out))
    except OSError as exc:
        raise MergeError(f"{out}: cannot list it to replace it ({exc.strerror})") from exc
    names = {e.name for e in entries}
    listed = _card_listed(out)  # the reference's other files (tiktoken.model, LICENSE, ...) an output copied
    foreign = sorted(e.name for e in entries if not _output_entry(e, listed))
    if entries and (foreign or not any(name in names for name in OUTPUT_MARKERS)):
        what = f"it holds {', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''}" if foreign else "no config.json"
        raise MergeError(f"{out}: exists and does not look like an output of lora-merge ({what}); not replacing it "
                         "even with --force: remove it yourself if it is not needed")


def _output_entry(entry: os.DirEntry, listed: set[str]) -> bool:
    """Whether an entry of an existing directory is one a lora-merge output holds."""
    if entry.is_file(follow_symlinks=False):
        return bool(OUTPUT_FILE.match(entry.name)) or entry.name in listed
    if entry.name in COPIED_SUBDIRS and entry.is_dir(follow_symlinks=False):
        try:
            return all(f"{entry.name}/{inner}" in listed for inner in os.listdir(entry.path))
        except OSError:
            return False
    return False


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


def _card_listed(out: Path) -> set[str]:
    """The files the model card of an earlier output lists (it lists every file the run wrote)."""
    card = out / "README.md"
    try:
        if not card.is_file() or card.is_symlink() or card.stat().st_size > MAX_CARD_BYTES:
            return set()
        return set(card_files(card.read_text(encoding="utf-8", errors="replace")) or ())
    except OSError:
        return set()


def check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if needed > free:
        raise MergeError(f"{out.parent}: not enough disk space: the output needs {needed / 1e9:.2f} GB, "
                         f"{free / 1e9:.2f} GB are free")


class StagedOutput:
    """`with StagedOutput(out, force, inputs) as stage:` write into `stage.dir` (and side files with
    `stage.side_file`); on success it is published, on any failure or interruption removed."""

    def __init__(self, out: Path, force: bool, inputs: InputPaths):
        self.out, self.force, self.inputs = out, force, inputs
        self.dir: Path | None = None
        self._side: list[tuple[Path, Path]] = []  # (temporary, final)

    def __enter__(self) -> "StagedOutput":
        check_output_target(self.out, self.force, self.inputs)
        remove_abandoned_staging(self.out, self.inputs)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_prefix(self.out.name)}{os.getpid()}-", dir=self.out.parent))
        os.chmod(self.dir, 0o777 & ~current_umask())  # mkdtemp's 0700 would make the result private by accident
        return self

    def side_file(self, final: Path, text: str) -> None:
        """Write `text` now (so that a failure stops the run before publishing), moved to `final` when the
        output is published. A path directly inside the output goes into the staging dir."""
        if os.path.realpath(final.parent) == os.path.realpath(self.out):
            tmp, final = self.dir / final.name, None
        else:
            tmp = final.parent / f"{_prefix(final.name)}{os.getpid()}-{os.urandom(4).hex()}"
        with open(tmp, "x") as f:
            if final is not None:
                self._side.append((tmp, final))
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            _fsync_tree(self.dir)
            self._publish()
        except BaseException:
            self._discard()
            raise
        for tmp, final in self._side:
            try:
                publish_file(tmp, final, self.force)
            except MergeError as err:
                raise MergeError(f"{err}; the output {self.out} was published") from err
            except OSError as err:
                raise MergeError(f"{final}: the output {self.out} was published, but the report could not be "
                                 f"moved into place ({err.strerror}); it is at {tmp}") from err

    def _publish(self) -> None:
        if self.force and self.out.is_dir() and not self.out.is_symlink():
            _check_replaceable(self.out)
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
            raise MergeError(f"{self.out}: appeared while this run was writing (another run with the same --out?); "
                             "it was left as it is and this run's output discarded") from err
        PUBLISHED.append(self.out)
        _fsync_dir(self.out.parent)

    def _discard(self) -> None:
        if self.dir is not None and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        for tmp, _ in self._side:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def publish_file(tmp: Path, final: Path, force: bool) -> None:
    """Move a finished file into place; without --force never over a file that appeared meanwhile."""
    if force:
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final)  # fails if `final` exists, atomically
    except FileExistsError as err:
        raise MergeError(f"{final}: appeared while this run was writing; it was left as it is (pass --force to "
                         "replace it)") from err
    os.unlink(tmp)


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
    """Delete what runs on this host that were killed (their process is gone) left next to `out`: staging
    dirs and side files. Other hosts' are left alone (on shared storage their runs may be alive), and so
    is anything that is an input or a symlink."""
    parent = out.parent
    for kind in ("partial", "old"):
        for path in parent.glob(f"{_prefix(glob_escape(out.name), kind)}*-*"):
            pid = path.name.removeprefix(_prefix(out.name, kind)).split("-", 1)[0]
            if pid.isascii() and pid.isdigit() and _abandoned(int(pid)) and not path.is_symlink() \
                    and path.is_dir() and inputs.conflict(path) is None:
                shutil.rmtree(path, ignore_errors=True)


def remove_abandoned_side_files(target: Path, inputs: InputPaths) -> None:
    for path in target.parent.glob(f"{_prefix(glob_escape(target.name))}*-*"):
        pid = path.name.removeprefix(_prefix(target.name)).split("-", 1)[0]
        if pid.isascii() and pid.isdigit() and _abandoned(int(pid)) and path.is_file() and not path.is_symlink() \
                and inputs.conflict(path) is None:
            path.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _abandoned(pid: int) -> bool:
    if pid == os.getpid():  # an earlier process with our pid: this one has not staged anything yet
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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
