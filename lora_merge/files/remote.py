"""Inputs and outputs at a URL: `s3://…` (S3 and S3-compatible stores: MinIO, Ceph, Huawei OBS, Alibaba OSS) or any
other fsspec URL, read by byte ranges and never downloaded whole.

An input URL becomes a local *shadow* directory that the readers open as they open any checkpoint: every object
under the URL is a file there of its real size. Checkpoint data files (safetensors, torch archives, `.distcp`) are
sparse files whose byte ranges are fetched (ranged GETs of 64 MB, 4 at once) when a reader first touches them, so
only the bytes a run reads are transferred (a checkpoint's optimizer state never is), and punched out again once
every read of them the merge planned is done (`hand_back`, counted by files/handback.py: the local disk holds about
the read-ahead distance); every other file (configs, tokenizers, indexes, metadata) is fetched whole. The readers reach the bytes
through `MappedFile`, the safetensors header reader and the torch archive reader, each of which asks `ensure`
first; a range nobody asked for reads as zeros, which the byte-identity tests would see.

An output URL is written by the same writers into a local directory and each file is uploaded as soon as it is
complete (then removed locally), as the parts of a run (`--part`, `--resume`) write their shared directory: the
manifests go to `OUT.manifests/` beside the output, what `finish` writes (index, config, tracker, card) goes
last, and the manifests are removed then, so a reader never sees a half-written model, and a killed run is
continued with `--resume` (`RemoteOutput`). A run that verifies its output before publishing (`--verify`,
`--no-sha256`, `export-adapter`) stages it whole and publishes it at the end (`RemoteRun.publish`). A failed run
that was not asked to be resumable removes what it uploaded.

Inputs at a URL are listed once, with each object's ETag (or the backend's version or date): the parts of a run
recognise each other by these, and before anything is published the inputs are listed again, so an object
replaced during the run stops it (`check_inputs_unchanged`).

fsspec (and s3fs for s3://) is imported only when a URL is given. Credentials and endpoint come as fsspec's
backends take them: for S3 the standard AWS variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`) with no flag; `storage_options` (`--storage-options JSON`) pass the rest.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lora_merge import interrupts
from lora_merge.errors import MergeError, UsageError
from lora_merge.files.run_locks import create_locked, release, remove_if_abandoned

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
TEMPORARY = re.compile(r"\..+\.[^.]+\.tmp")  # as files/parts_dir.py names a file being written
# Files fetched by ranges; anything else is fetched whole when the shadow is made
DATA_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".distcp")
# One ranged GET, and how many run at once: 4 × 64 MB in flight at most. Fewer, larger requests cost less where
# stores charge per request (OBS, OSS, S3), and cost less on servers that read the whole object per request
# (moto's server mode: 16 MB ranges of a 512 MB object took 4× as long as 64 MB ones, here).
FETCH_BYTES = 64 << 20
FETCH_THREADS = 4
# One part of a multipart upload (S3 wants 5 MB to 5 GB, at most 10,000 parts): 16 MB, or more for a file that
# would need more parts; each upload holds about one part in memory.
UPLOAD_PART_BYTES = 16 << 20
MAX_PARTS = 9000
UPLOADS = 4  # files uploaded at once
# Complete output files held locally until uploaded: those uploading and one waiting (the writer waits beyond)
LOCAL_FILES = UPLOADS + 1
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Published after every other object, in this order: what says the model is complete
LAST = ("model.safetensors.index.json", "adapter_config.json", "latest_checkpointed_iteration.txt", "README.md")


def is_url(value) -> bool:
    return isinstance(value, str) and URL.match(value) is not None


def last_component(url: str) -> str:
    """The URL's last path component (what the card and report name an input or output by)."""
    name = url.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1]
    if not name or name in (".", ".."):
        raise UsageError(f"{url}: names no object prefix (expected a URL such as s3://bucket/model)")
    return name


class _Lazy:
    """A sparse shadow file whose byte ranges are fetched on first use, and punched out once handed back."""

    def __init__(self, fs, remote: str, url: str, size: int, path: Path):
        self.fs, self.remote, self.url, self.size, self.path = fs, remote, url, size, path
        self.have: list[list[int]] = []  # fetched [start, end) page ranges, sorted and disjoint
        self.gone: list[list[int]] = []  # ranges handed back (files/handback.py), not fetched ahead again
        self.punches = True  # until the file system refuses to punch holes
        self.lock = threading.Lock()

    def _missing(self, start: int, end: int, have=None) -> list[tuple[int, int]]:
        gaps, at = [], start
        for a, b in self.have if have is None else have:
            if b <= at:
                continue
            if a >= end:
                break
            if a > at:
                gaps.append((at, min(a, end)))
            at = max(at, b)
        if at < end:
            gaps.append((at, end))
        return gaps

    def ensure(self, start: int, nbytes: int, ahead: bool = False) -> None:
        """Fetch what is missing of [start, start + nbytes); `ahead`: for a read to come, so not what was handed
        back (its reads are done)."""
        if nbytes <= 0:
            return
        a, b = max(0, start) // PAGE * PAGE, min(self.size, -(-(start + nbytes) // PAGE) * PAGE)
        with self.lock:
            gaps = self._missing(a, b)
            if ahead and self.gone:
                gaps = [g for x, y in gaps for g in self._missing(x, y, self.gone)]
            if not gaps:
                return
            pieces = [(x, min(y, x + FETCH_BYTES)) for x0, y in gaps for x in range(x0, y, FETCH_BYTES)]
            list(_pool().map(self._fetch, pieces))
            for gap in gaps:
                self._add(*gap)

    def _fetch(self, piece: tuple[int, int]) -> None:
        a, b = piece
        try:
            data = self.fs.cat_file(self.remote, start=a, end=b)
        except Exception as exc:  # noqa: BLE001 - any backend's error, named in one line
            raise MergeError(f"{self.url}: cannot read bytes {a}-{b} ({type(exc).__name__}: {exc})") from None
        if len(data) != b - a:
            raise MergeError(f"{self.url}: bytes {a}-{b} came back as {len(data)} bytes (changed while being read?)")
        view = memoryview(data)
        fd = os.open(self.path, os.O_WRONLY)  # opened per fetch: a model may have more objects than a process may open
        try:
            while view:
                view = view[os.pwrite(fd, view, a + (b - a - len(view))):]
        finally:
            os.close(fd)

    def _add(self, a: int, b: int) -> None:
        self.have = _joined(self.have, a, b)

    def hand_back(self, start: int, end: int) -> None:
        """Punch the whole pages of [start, end) out of the file (its reads are done) and forget them as fetched."""
        a = -(-start // PAGE) * PAGE
        b = self.size if end >= self.size else end // PAGE * PAGE
        if a >= b:
            return
        with self.lock:
            if not self.punches:
                return
            if not any(x < b and a < y for x, y in self.have):  # nothing of it here (any more): only its reads are done
                self.gone = _joined(self.gone, a, b)
                return
            if not _punch_hole(self.path, a, b - a):
                self.punches = False  # (a file system without holes: the bytes stay until the run ends)
                return
            self.have = [[x, y] for p, q in self.have for x, y in ((p, min(q, a)), (max(p, b), q)) if x < y]
            self.gone = _joined(self.gone, a, b)


def _joined(ranges: list[list[int]], a: int, b: int) -> list[list[int]]:
    """Sorted disjoint ranges with [a, b) added."""
    merged = []
    for x, y in sorted(ranges + [[a, b]]):
        if merged and x <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], y)
        else:
            merged.append([x, y])
    return merged


try:
    _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
except (OSError, AttributeError):  # not Linux
    _fallocate = None
_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _punch_hole(path: Path, start: int, nbytes: int) -> bool:
    if _fallocate is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        return _fallocate(fd, _PUNCH_HOLE_KEEP_SIZE, start, nbytes) == 0
    finally:
        os.close(fd)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="lora-merge-fetch")
        return _POOL


_LAZY: dict[str, _Lazy] = {}  # shadow file path -> its lazily fetched file


def _lazy(path) -> _Lazy | None:
    return _LAZY.get(os.fspath(path)) if _LAZY else None


def reading_urls() -> bool:
    """Whether any input is read from a URL (through shadow files) now."""
    return bool(_LAZY)


def is_shadow(path) -> bool:
    """Whether `path` is the shadow file of an object at a URL (its bytes fetched on first use)."""
    return _lazy(path) is not None


def ensure(path, start: int, nbytes: int, ahead: bool = False) -> None:
    """Make bytes [start, start + nbytes) of `path` readable: fetched first if `path` is a shadow file. `ahead`: for
    reading ahead, which does not fetch a range handed back (`hand_back`) again."""
    lazy = _lazy(path)
    if lazy is not None:
        lazy.ensure(start, nbytes, ahead)


def fetched(path) -> list[tuple[int, int]]:
    """The ranges of a shadow file fetched and not handed back (none for any other file)."""
    lazy = _lazy(path)
    if lazy is None:
        return []
    with lazy.lock:
        return [(a, b) for a, b in lazy.have]


def shadow_size(path) -> int:
    """The size of the object a shadow file stands for (0 for any other file)."""
    lazy = _lazy(path)
    return 0 if lazy is None else lazy.size


def hand_back(path, start: int, end: int) -> None:
    """Free the local disk space of [start, end) of a shadow file, whose reads are done (files/handback.py); a
    later `ensure` fetches it again."""
    lazy = _lazy(path)
    if lazy is not None:
        lazy.hand_back(start, end)


def ensure_whole(path) -> None:
    """Make all of `path` readable (a shadow file read by something other than the checkpoint readers)."""
    lazy = _lazy(path)
    if lazy is not None:
        lazy.ensure(0, lazy.size)


def open_read(path, buffered: bool = True):
    """`open(path, "rb")`, whose reads of a shadow file fetch what they read first. `buffered=False`: each read reads
    what it asks for and no more (a reader of a slice of the file: a buffer's 8 KB would reach past the slice, into
    a neighbour's bytes, fetching them again if they were handed back)."""
    lazy = _lazy(path)
    if lazy is None:
        return Path(path).open("rb", buffering=-1 if buffered else 0)
    # the raw file unbuffered: a buffer would keep bytes read before their range was fetched
    fetching = _Fetching(Path(path).open("rb", buffering=0), lazy)
    return io.BufferedReader(fetching) if buffered else fetching


class _Fetching(io.RawIOBase):
    def __init__(self, f, lazy: _Lazy):
        self.f, self.lazy = f, lazy

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        return self.f.seek(pos, whence)

    def tell(self):
        return self.f.tell()

    def fileno(self):
        return self.f.fileno()

    def readinto(self, b):
        self.lazy.ensure(self.f.tell(), len(b))
        return self.f.readinto(b)

    def close(self):
        self.f.close()
        super().close()


def filesystem(url: str, storage_options: dict | None):
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{url}: URLs need fsspec (pip install 'lora-merge[remote]')") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise UsageError(f"{url}: no filesystem for this URL is installed ({exc}); for s3:// pip install "
                         "'lora-merge[remote]'") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{url}: {exc}") from None


def _objects(fs, remote: str, url: str) -> dict[str, dict]:
    """The objects under `remote`, by their path below it, with fsspec's details (size, ETag, ...). Zero-byte keys
    ending in "/" are "folder" markers that consoles and tools create: not files."""
    try:
        fs.invalidate_cache(remote)  # (s3fs keeps listings: a second look must see the store as it is now)
        found = fs.find(remote, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001
        raise MergeError(f"{url}: cannot list ({type(exc).__name__}: {exc})") from None
    prefix = remote.rstrip("/") + "/"
    return {name[len(prefix):]: info for name, info in found.items()
            if name.startswith(prefix) and info.get("type", "file") != "directory"
            and not (name.endswith("/") and not info.get("size"))}


def _version(info: dict) -> str:
    """What changes when an object is written again: its ETag (S3 and S3-compatible stores), else the backend's
    version or date."""
    for key in ("ETag", "etag", "VersionId", "LastModified", "mtime", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _identity(info: dict) -> tuple[int, str]:
    return int(info.get("size") or 0), _version(info)


class _Listing:
    """An input URL as this run listed it: each object's size and version."""

    def __init__(self, fs, remote: str, url: str, objects: dict[str, tuple[int, str]]):
        self.fs, self.remote, self.url, self.objects = fs, remote, url, objects


_SHADOWS: dict[str, _Listing] = {}  # shadow directory -> the URL's listing


def source_name(path) -> str:
    """What an input directory is called across runs: the URL of a shadow, else its real path."""
    listing = _SHADOWS.get(os.fspath(path)) if _SHADOWS else None
    return listing.url if listing is not None else os.path.realpath(path)


def shown_text(text: str) -> str:
    """`text` with every input URL's local shadow directory named by the URL (what a report says)."""
    for shadow, listing in sorted(_SHADOWS.items(), key=lambda item: -len(item[0])) if _SHADOWS else ():
        text = text.replace(shadow, listing.url)
    return text


def listed_files(path) -> list | None:
    """Every object under a shadow's URL as [URL, path below it, size, version], sorted; None for a local
    directory."""
    listing = _SHADOWS.get(os.fspath(path)) if _SHADOWS else None
    if listing is None:
        return None
    return [[listing.url, rel, size, version] for rel, (size, version) in sorted(listing.objects.items())]


_OPEN = threading.local()  # the RemoteRuns open in this thread: a run's inputs (API calls in other threads have theirs)


def check_inputs_unchanged() -> None:
    """Before anything is published: every input URL of the runs open in this thread still holds the objects they
    listed (size and ETag), so a model is never made of two versions of a file (ranged reads are not pinned to a
    version)."""
    listings = [_SHADOWS[shadow] for run in getattr(_OPEN, "runs", ()) for shadow in run._shadows if shadow in _SHADOWS]
    for listing in listings:
        now = _objects(listing.fs, listing.remote, listing.url)
        for rel, identity in sorted(listing.objects.items()):
            info = now.get(rel)
            if info is None or _identity(info) != identity:
                what = "was removed" if info is None else "was written again (its size or ETag differs)"
                raise MergeError(f"{listing.url}/{rel}: {what} while this run read it; nothing was published: rerun "
                                 "once the input is complete")


ROOT_PREFIX = "lora-merge-remote-"
ROOT_LOCK = ".lora-merge-run.lock"


def _hold_root(root: Path) -> int | None:
    """A lock on this run's local directory, held while the run lives: what tells a later run it is not
    abandoned (files/run_locks.py, as for a local output's staging)."""
    try:
        return create_locked(root / f"{ROOT_LOCK}.new", root / ROOT_LOCK)
    except OSError:
        return None


def _remove_abandoned_roots(parent: Path) -> None:
    """The local directories that killed runs left (fetched input ranges, output files not yet uploaded: up to
    a model's size): those whose lock nobody holds. One without a lock (just being made) is left alone."""
    for path in parent.glob(f"{ROOT_PREFIX}*"):
        if not path.is_symlink() and path.is_dir():
            remove_if_abandoned(path, ROOT_LOCK)


class RemoteRun:
    """The URLs of one run: each input's shadow directory, the output's staging directory, and publishing.
    A context manager: on exit the shadows are closed and the local directory removed."""

    def __init__(self, storage_options: dict | None = None, local_dir: str | None = None):
        self.storage_options = storage_options
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=local_dir))
        self._lock = _hold_root(self.root)
        _remove_abandoned_roots(self.root.parent)
        self._lazies: list[_Lazy] = []
        self._shadows: list[str] = []
        self._inputs: dict[str, Path] = {}  # URL -> its shadow
        _OPEN.runs = [*getattr(_OPEN, "runs", ()), self]
        self._count = 0
        self.output: tuple | None = None  # (fs, remote root, url, local staging dir): staged whole, `publish`
        self.mirror: RemoteOutput | None = None  # or each file uploaded once complete, as parts write theirs
        self.names: dict[str, str] = {}  # local directory -> the URL it stands for (for messages)

    def __enter__(self) -> "RemoteRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        _OPEN.runs = [run for run in getattr(_OPEN, "runs", ()) if run is not self]
        if self._lock is not None:
            release(self._lock)
            self._lock = None
        for lazy in self._lazies:
            _LAZY.pop(os.fspath(lazy.path), None)
        self._lazies = []
        for shadow in self._shadows:
            _SHADOWS.pop(shadow, None)
        self._shadows = []
        self._inputs = {}
        if self.mirror is not None:
            self.mirror.close()
            _MIRRORS.pop(str(self.mirror.local), None)
        shutil.rmtree(self.root, ignore_errors=True)

    def _slot(self) -> Path:
        self._count += 1
        slot = self.root / str(self._count)
        slot.mkdir()
        return slot

    def input(self, url: str) -> Path:
        """The local shadow of the objects under `url` (a directory of them): one per URL, however often it is given
        (`--base` and `--hf-ref` alike, or an adapter twice, which is then refused as a local one is)."""
        made = self._inputs.get(url.rstrip("/"))
        if made is not None:
            return made
        fs, remote = filesystem(url, self.storage_options)
        prefix = remote.rstrip("/") + "/"
        objects = _objects(fs, remote, url)
        if not objects:
            raise MergeError(f"{url}: no objects under it (expected a model or checkpoint directory)")
        shadow = self._slot() / last_component(url)
        shadow.mkdir()
        self.names[str(shadow)] = url.rstrip("/")  # (a failure while the shadow is made names the URL)
        for rel, info in sorted(objects.items()):
            parts = rel.split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise MergeError(f"{url}: object {rel!r} has a name no local file can have")
            path = shadow.joinpath(*parts)
            path.parent.mkdir(parents=True, exist_ok=True)
            size = int(info.get("size") or 0)
            if rel.endswith(DATA_SUFFIXES) and size:
                with open(path, "xb") as f:
                    f.truncate(size)
                lazy = _Lazy(fs, prefix + rel, f"{url.rstrip('/')}/{rel}", size, path)
                self._lazies.append(lazy)
                _LAZY[os.fspath(path)] = lazy
            else:
                try:
                    data = fs.cat_file(prefix + rel)
                except Exception as exc:  # noqa: BLE001
                    raise MergeError(f"{url.rstrip('/')}/{rel}: cannot read ({type(exc).__name__}: {exc})") from None
                if len(data) != size:
                    raise MergeError(f"{url.rstrip('/')}/{rel}: {len(data)} bytes read where the listing said {size} "
                                     "(changed while being read?)")
                path.write_bytes(data)
        _SHADOWS[str(shadow)] = _Listing(fs, remote, url.rstrip("/"), {rel: _identity(info)
                                                                         for rel, info in objects.items()})
        self._shadows.append(str(shadow))
        self._inputs[url.rstrip("/")] = shadow
        return shadow

    def output_dir(self, url: str) -> Path:
        """Where the run writes what `publish` uploads to `url`, which must hold no object yet."""
        fs, remote = filesystem(url, self.storage_options)
        try:
            taken = fs.exists(remote) and (not fs.isdir(remote) or bool(fs.find(remote)))
        except Exception as exc:  # noqa: BLE001
            raise MergeError(f"{url}: cannot be checked ({type(exc).__name__}: {exc})") from None
        if taken:
            raise MergeError(f"{url}: already holds objects; lora-merge never writes over an output (remove them "
                             "first, or give another prefix)")
        local = self._slot() / last_component(url)
        self.output = (fs, remote.rstrip("/"), url.rstrip("/"), local)
        self.names[str(local)] = url.rstrip("/")
        return local

    def output_parts(self, url: str, fresh: bool, finishing: bool = False, dry_run: bool = False) -> Path:
        """The local directory standing for an output `url` that is written as parts are (files/parts_dir.py):
        its parts' manifests fetched from `OUT.manifests/`, each file uploaded once complete. `fresh`: a run that
        must start from nothing (a one-process run: nothing at the URL yet); else a part, a resumed run or
        `finishing`, which continue what the manifests record. A `dry_run` writes nothing there."""
        fs, remote = filesystem(url, self.storage_options)
        url, remote = url.rstrip("/"), remote.rstrip("/")
        local = self._slot() / last_component(url)
        mirror = RemoteOutput(fs, remote, url, local)
        manifests = {rel: info for rel, info in mirror.manifest_objects().items() if not TEMPORARY.fullmatch(rel)}
        objects = _objects(fs, remote, url)
        if fresh and (objects or manifests):
            held = f"{url}.manifests" if manifests and not objects else url
            raise MergeError(f"{held}: already holds objects; lora-merge never writes over an output (remove them "
                             "first, or give another prefix" + (", or pass --resume to continue the run that wrote "
                                                               "them)" if manifests else ")"))
        if not fresh and objects and not manifests:
            raise MergeError(f"{url}: holds objects but no part manifests under {url}.manifests/: "
                             + ("finished already?" if finishing else "not parts of lora-merge: remove them, or give "
                                "another prefix"))
        (local.parent / f"{local.name}.manifests").mkdir()
        (local.parent / f"{local.name}.parts").mkdir()
        if not finishing and not dry_run:
            mirror.check_writable()
        mirror.fetch_manifests(local.parent / f"{local.name}.manifests")
        self.mirror = mirror
        _MIRRORS[str(local)] = mirror
        # (the files a parts directory holds are under the URL itself)
        self.names.update({str(local): url, f"{local}.parts": url, f"{local}.manifests": f"{url}.manifests"})
        return local

    def discard_output(self) -> bool:
        """Remove what this run uploaded (a one-process run that failed), its manifests included; whether there
        was anything."""
        return self.mirror is not None and self.mirror.discard()

    def named(self, text: str) -> str:
        """A message with each local directory of this run named by its URL."""
        for local, url in sorted(self.names.items(), key=lambda item: -len(item[0])):
            text = text.replace(local, url)
        return text

    def publish(self) -> list[str]:
        """Upload the staged output: every data object (several at once), then the files that say it is complete;
        on any failure, remove what was uploaded and raise."""
        fs, remote, url, local = self.output
        check_inputs_unchanged()
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        last = [name for tail in LAST for name in files if name == tail or name.endswith("/" + tail)]
        first = [name for name in files if name not in last]
        done: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()  # a failure or a signal: the uploads under way are abandoned, not finished

        def put(name: str) -> None:
            _upload(fs, local / name, f"{remote}/{name}", stop)
            with lock:
                done.append(name)

        try:
            with interrupts.raising_again():  # (the local output is complete: still, a long upload can be stopped)
                with ThreadPoolExecutor(UPLOADS, thread_name_prefix="lora-merge-upload") as uploads:
                    try:
                        list(uploads.map(put, first))
                    except BaseException:
                        stop.set()
                        raise
                for name in last:
                    put(name)
        except BaseException as exc:
            for name in done:
                try:
                    fs.rm_file(f"{remote}/{name}")
                except Exception:  # noqa: BLE001 - best effort; the error below says what failed
                    pass
            if isinstance(exc, Exception):
                raise MergeError(f"{url}: upload failed ({type(exc).__name__}: {exc}); the objects uploaded were "
                                 "removed") from None
            raise
        return files


_MIRRORS: dict[str, "RemoteOutput"] = {}  # local output path -> the URL its files go to


def output_mirror(out) -> "RemoteOutput | None":
    """The URL a local output directory stands for, if it does (files/parts_dir.py uploads to it)."""
    return _MIRRORS.get(os.fspath(out)) if _MIRRORS else None


class RemoteOutput:
    """An output URL written as a shared parts directory is: each file uploaded to `OUT/NAME` as soon as it is
    complete (`UPLOADS` at once and one more waiting: each lane's writer waits beyond, so the local disk holds a
    few files, not the model),
    then removed locally; the part manifests at `OUT.manifests/`, each rewritten with the file's ETag once it
    is uploaded; what `finish` writes, last; then the manifests are removed."""

    def __init__(self, fs, remote: str, url: str, local: Path):
        self.fs, self.remote, self.url, self.local = fs, remote, url, local
        self.manifests_remote = remote + ".manifests"
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(UPLOADS, thread_name_prefix="lora-merge-upload")
        self._waiting = threading.BoundedSemaphore(LOCAL_FILES)
        self._futures: list = []
        self._lock = threading.Lock()
        self.uploaded: list[str] = []  # by this run, under the output and the manifests
        self.written_manifests: dict[str, bool] = {}  # the manifests this run wrote (they name it as `writer`)
        self.writer: str | None = None
        self.published = False

    def manifest_objects(self) -> dict[str, dict]:
        return _objects(self.fs, self.manifests_remote, self.url + ".manifests")

    def check_writable(self) -> None:
        """A small object written and removed: a missing bucket or a denied write is named before the run, not
        after it has merged everything."""
        # (named as a temporary file: a run or finish that lists the manifests meanwhile, or after a kill, skips it)
        probe = f"{self.manifests_remote}/.write-check.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            _put_bytes(self.fs, probe, b"lora-merge")
            self.fs.rm_file(probe)
        except Exception as exc:  # noqa: BLE001
            raise MergeError(f"{self.url}.manifests: cannot be written ({type(exc).__name__}: {exc}); the output's "
                             "parts are recorded there") from None

    def fetch_manifests(self, local_dir: Path) -> None:
        for rel in sorted(self.manifest_objects()):
            if TEMPORARY.fullmatch(rel):  # another run's write check
                continue
            if "/" in rel:
                raise MergeError(f"{self.url}.manifests/{rel}: not a part manifest of lora-merge; the prefix is "
                                 "removed once the output is published: move it away")
            try:
                (local_dir / rel).write_bytes(self.fs.cat_file(f"{self.manifests_remote}/{rel}"))
            except Exception as exc:  # noqa: BLE001
                raise MergeError(f"{self.url}.manifests/{rel}: cannot read ({type(exc).__name__}: {exc})") from None

    def put_manifest(self, name: str, data: bytes) -> None:
        self.written_manifests[name] = True
        self.writer = json.loads(data).get("writer")  # (the same for every manifest of one run)
        try:
            _put_bytes(self.fs, f"{self.manifests_remote}/{name}", data)  # (one PUT: the old or the new is seen)
        except Exception as exc:  # noqa: BLE001
            raise MergeError(f"{self.url}.manifests/{name}: cannot be written ({type(exc).__name__}: {exc})") from None
        with self._lock:
            self.uploaded.append(f"{self.manifests_remote}/{name}")

    def submit(self, path: Path, name: str, done) -> None:
        """Upload the complete local file `path` to `OUT/name` in the background, then remove it and call
        `done(version)`. Waits while `LOCAL_FILES` files are uploading or waiting; an earlier upload's failure
        is raised here, so a run whose output cannot be written stops at its next file."""
        self._raise_failed()
        self._waiting.acquire()
        try:
            self._raise_failed()
        except BaseException:
            self._waiting.release()
            raise

        def upload() -> None:
            try:
                rpath = f"{self.remote}/{name}"
                _upload(self.fs, path, rpath, self.stop)
                with self._lock:
                    self.uploaded.append(rpath)
                version = self.version_of(name)
                path.unlink()
                done(version)
            except BaseException:
                self.stop.set()
                raise
            finally:
                self._waiting.release()
        self._futures.append(self._pool.submit(upload))

    def _raise_failed(self, wait: bool = False) -> None:
        """The first real failure among the uploads (those that stopped because another failed come after it)."""
        failed = [f.exception() for f in self._futures if (wait or f.done()) and f.exception() is not None]
        if failed:
            self.stop.set()
            self._raise(next((e for e in failed if not isinstance(e, _Stopped)), failed[0]))

    def _raise(self, exc: BaseException) -> None:
        if isinstance(exc, MergeError) or not isinstance(exc, Exception):
            raise exc
        if isinstance(exc, _Stopped):
            raise MergeError(f"{self.url}: upload stopped")
        raise MergeError(f"{self.url}: upload failed ({type(exc).__name__}: {exc})") from None

    def wait(self) -> None:
        """Every file submitted is uploaded (or the first failure raised)."""
        self._raise_failed(wait=True)

    def version_of(self, name: str) -> str:
        rpath = f"{self.remote}/{name}"
        self.fs.invalidate_cache(rpath)
        return _version(self.fs.info(rpath))

    def exists(self, name: str) -> bool:
        rpath = f"{self.remote}/{name}"
        self.fs.invalidate_cache(rpath)
        return self.fs.exists(rpath)

    def still_there(self, name: str, entry: dict, rehash: bool) -> bool:
        """Whether `OUT/name` is the object its part recorded: its size and ETag, and with `rehash` its sha256
        (read back)."""
        rpath = f"{self.remote}/{name}"
        try:
            self.fs.invalidate_cache(rpath)
            info = self.fs.info(rpath)
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001
            raise MergeError(f"{self.url}/{name}: cannot be checked ({type(exc).__name__}: {exc})") from None
        if int(info.get("size") or 0) != entry["bytes"] or _version(info) != entry.get("etag"):
            return False
        if not rehash:
            return True
        import hashlib
        digest = hashlib.sha256()
        with self.fs.open(rpath, "rb", block_size=FETCH_BYTES) as f:
            for chunk in iter(lambda: f.read(FETCH_BYTES), b""):
                digest.update(chunk)
        return digest.hexdigest() == entry["sha256"]

    def foreign(self, keep: set[str], ours: set[str]) -> list[str]:
        """Objects under the output that no part recorded and finish does not write (someone else's). What a
        killed run left under a temporary name (a local file system's upload in progress) is removed."""
        found = []
        for rel in sorted(_objects(self.fs, self.remote, self.url)):
            if TEMPORARY.fullmatch(rel.rsplit("/", 1)[-1]):
                try:
                    self.fs.rm_file(f"{self.remote}/{rel}")
                except Exception:  # noqa: BLE001 - best effort: a leftover temporary file harms nothing
                    pass
            elif rel not in keep and rel not in ours:
                found.append(rel)
        return found

    def still_ours(self) -> bool:
        """Whether every manifest this run wrote still names this run as its writer: not so when another run
        writes the same output at the same time (or finished it, removing the manifests). A write of ours that
        failed leaves our earlier manifest, still ours."""
        for name in self.written_manifests:
            try:
                self.fs.invalidate_cache(f"{self.manifests_remote}/{name}")
                writer = json.loads(self.fs.cat_file(f"{self.manifests_remote}/{name}")).get("writer")
            except FileNotFoundError:
                return False
            except (ValueError, AttributeError):
                return False
            if writer != self.writer:
                return False
        return True

    def published_by_another(self) -> bool:
        """Whether the output holds an object that says it is complete (index, tracker, card) which this run did
        not upload: another run published the same output."""
        mine = set(self.uploaded)
        for tail in LAST:
            rpath = f"{self.remote}/{tail}"
            self.fs.invalidate_cache(rpath)
            if rpath not in mine and self.fs.exists(rpath):
                return True
        return False

    def publish(self, files: Path, recorded: dict) -> None:
        """Upload what `finish` wrote into `files` (the index and card last), then check that every file the parts
        recorded is still the object they uploaded (another run at the same URL could have removed it meanwhile:
        then what this run uploaded is removed again), then remove the manifests."""
        if not self.still_ours():  # (a one-process run: two of them at once must not publish each other's files)
            raise MergeError(f"{self.url}: another run wrote to it while this one did ({self.url}.manifests changed); "
                             "nothing was published: run one at a time")
        names = sorted(p.relative_to(files).as_posix() for p in files.rglob("*") if p.is_file())
        last = [name for tail in LAST for name in names if name == tail or name.endswith("/" + tail)]
        done = []
        try:
            with interrupts.raising_again():  # (a signal stops it: what it uploaded is removed below)
                for name in [n for n in names if n not in last] + last:
                    rpath = f"{self.remote}/{name}"
                    _upload(self.fs, files / name, rpath, self.stop)
                    done.append(rpath)
                    with self._lock:
                        self.uploaded.append(rpath)
                gone = [name for name, entry in sorted(recorded.items()) if not self.still_there(name, entry, False)]
                if gone:
                    raise MergeError(f"{self.url}/{gone[0]}: changed or removed while this run published the output "
                                     "(another run writing it at the same time?); the index and card were removed: "
                                     "run one at a time")
        except BaseException as exc:
            for rpath in done:  # no index or card without the rest: the parts' files stay, finish can run again
                try:
                    self.fs.rm_file(rpath)
                except Exception:  # noqa: BLE001 - best effort; the error below says what failed
                    pass
            if isinstance(exc, Exception) and not isinstance(exc, MergeError):
                raise MergeError(f"{self.url}: upload failed ({type(exc).__name__}: {exc}); the index and card were "
                                 "not written") from None
            raise
        self.published = True
        try:
            self.fs.rm(self.manifests_remote, recursive=True)
        except Exception:  # noqa: BLE001 - the model is complete; what is left is named where it is found again
            pass
        _prune_dirs(self.fs, self.manifests_remote)

    def discard(self) -> bool:
        """Remove what this run uploaded; whether it was. Nothing once published (a failure after it is not the
        output's), nor where another run has written the output since or published it (the same names: its
        files)."""
        self.stop.set()
        self._pool.shutdown(wait=True)
        try:
            if self.published or not self.still_ours():
                self.uploaded = []
                return False
        except Exception:  # noqa: BLE001 - the store cannot say: leave it (the error that stopped the run is reported)
            return False
        removed = bool(self.uploaded)
        for rpath in dict.fromkeys(self.uploaded):
            try:
                if self.published_by_another():  # (checked before each: its files have the names this run's had)
                    removed = False
                    break
            except Exception:  # noqa: BLE001 - as above
                removed = False
                break
            try:
                self.fs.rm_file(rpath)
            except Exception:  # noqa: BLE001 - best effort: the error that stopped the run is the one reported
                pass
        self.uploaded = []
        _prune_dirs(self.fs, self.remote)
        _prune_dirs(self.fs, self.manifests_remote)
        return removed

    def close(self) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)


class _Stopped(Exception):
    pass


def _is_local(fs) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool({"file", "local"} & set(protocols))


def _prune_dirs(fs, top: str) -> None:
    """On a local file system: the empty directories at and below `top` removed (what uploads made and a
    failure emptied; object stores have no directories)."""
    if not _is_local(fs):
        return
    path = fs._strip_protocol(top)
    for root, _, _ in sorted(os.walk(path), key=lambda item: -len(item[0])):
        try:
            os.rmdir(root)
        except OSError:
            pass


def _make_parent(fs, rpath: str) -> None:
    """A local file system needs the directories of what is written; an object store has none, and s3fs's
    makedirs would create a missing bucket (a typo in the URL must be an error, not a new bucket)."""
    if _is_local(fs):
        fs.makedirs(rpath.rsplit("/", 1)[0], exist_ok=True)


def _put_bytes(fs, rpath: str, data: bytes) -> None:
    """One object written whole (a reader sees the old one or the new one: on a local file system, by a rename)."""
    _make_parent(fs, rpath)
    if not _is_local(fs):
        fs.pipe_file(rpath, data)
        return
    parent, name = rpath.rsplit("/", 1)
    written = f"{parent}/.{name}.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        fs.pipe_file(written, data)
        _rename_local(fs, written, rpath)
    except BaseException:
        try:
            fs.rm_file(written)
        except Exception:  # noqa: BLE001 - best effort; the first error is the one to report
            pass
        raise


def _rename_local(fs, src: str, dst: str) -> None:
    """A rename on a local file system (fsspec's mv would move a file into `dst` where that is a directory)."""
    os.replace(fs._strip_protocol(src), fs._strip_protocol(dst))


def _upload(fs, local: Path, rpath: str, stop: threading.Event | None = None) -> None:
    """Stream one file up: parts of UPLOAD_PART_BYTES as they are read (a multipart upload where the store has
    them), so memory stays one part whatever the file's size. Never a partial object: a failed copy is
    discarded (the multipart upload aborted), not committed by closing, and what a backend without discard
    wrote is removed. `stop` set: abandoned at the next 8 MB."""
    _make_parent(fs, rpath)
    # a local file system shows a file as it is written: written under a temporary name and renamed (an object
    # store shows an object once its upload completes)
    parent, name = rpath.rsplit("/", 1)
    written = f"{parent}/.{name}.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.tmp" \
        if _is_local(fs) else rpath
    with open(local, "rb") as src:
        part = max(UPLOAD_PART_BYTES, -(-os.fstat(src.fileno()).st_size // MAX_PARTS // (1 << 20)) << 20)
        dst = fs.open(written, "wb", block_size=part)
        try:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                if stop is not None and stop.is_set():
                    raise _Stopped()
                dst.write(chunk)
            dst.close()  # the last part, and the upload completed
            if written != rpath:
                _rename_local(fs, written, rpath)
        except BaseException:
            try:
                discard = getattr(dst, "discard", None)
                if discard is not None:
                    discard()
                dst.closed = True  # (else closing it, even when collected, would upload the rest as an object)
            except Exception:  # noqa: BLE001 - a backend without discard (file://, memory://): removed below
                pass
            try:
                if fs.exists(written):
                    fs.rm_file(written)
            except Exception:  # noqa: BLE001 - best effort; the first error is the one to report
                pass
            raise
