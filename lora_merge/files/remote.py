"""Inputs and outputs at a URL: `s3://…` (S3 and S3-compatible stores: MinIO, Ceph, Huawei OBS, Alibaba OSS) or any
other fsspec URL, read by byte ranges and never downloaded whole.

An input URL becomes a local *shadow* directory that the readers open as they open any checkpoint: every object
under the URL is a file there of its real size. Checkpoint data files (safetensors, torch archives, `.distcp`) are
sparse files whose byte ranges are fetched (ranged GETs of 64 MB, 4 at once) when a reader first touches them, so
only the bytes a run reads are transferred (a checkpoint's optimizer state never is), and they stay in the sparse
file until the run ends (the shadow is removed then; punching them out once used would race with another view of
the same bytes, e.g. a CRC check beside the merge, so it is not done: the local disk needs room for the data a run
reads); every other file (configs, tokenizers, indexes, metadata) is fetched whole. The readers reach the bytes
through `MappedFile`, the safetensors header reader and the torch archive reader, each of which asks `ensure`
first; a range nobody asked for reads as zeros, which the byte-identity tests would see.

An output URL is written to a local staging directory by the same writers and published when complete: the data
objects first (multipart uploads, several at once), then the index, the tracker and the card, so a reader never
sees a half-written model; a failed upload removes what it uploaded.

fsspec (and s3fs for s3://) is imported only when a URL is given. Credentials and endpoint come as fsspec's
backends take them: for S3 the standard AWS variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`) with no flag; `storage_options` (`--storage-options JSON`) pass the rest.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lora_merge import interrupts
from lora_merge.errors import MergeError, UsageError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
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
    """A sparse shadow file whose byte ranges are fetched on first use."""

    def __init__(self, fs, remote: str, url: str, size: int, path: Path):
        self.fs, self.remote, self.url, self.size, self.path = fs, remote, url, size, path
        self.have: list[list[int]] = []  # fetched [start, end) page ranges, sorted and disjoint
        self.lock = threading.Lock()
        self.fd = os.open(path, os.O_RDWR)

    def _missing(self, start: int, end: int) -> list[tuple[int, int]]:
        gaps, at = [], start
        for a, b in self.have:
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

    def ensure(self, start: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        a, b = max(0, start) // PAGE * PAGE, min(self.size, -(-(start + nbytes) // PAGE) * PAGE)
        with self.lock:
            gaps = self._missing(a, b)
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
        while view:
            view = view[os.pwrite(self.fd, view, a + (b - a - len(view))):]

    def _add(self, a: int, b: int) -> None:
        merged = []
        for x, y in sorted(self.have + [[a, b]]):
            if merged and x <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], y)
            else:
                merged.append([x, y])
        self.have = merged

    def close(self) -> None:
        os.close(self.fd)


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


def ensure(path, start: int, nbytes: int) -> None:
    """Make bytes [start, start + nbytes) of `path` readable: fetched first if `path` is a shadow file."""
    lazy = _lazy(path)
    if lazy is not None:
        lazy.ensure(start, nbytes)


def ensure_whole(path) -> None:
    """Make all of `path` readable (a shadow file read by something other than the checkpoint readers)."""
    lazy = _lazy(path)
    if lazy is not None:
        lazy.ensure(0, lazy.size)


def open_read(path):
    """`open(path, "rb")`, whose reads of a shadow file fetch what they read first."""
    lazy = _lazy(path)
    if lazy is None:
        return Path(path).open("rb")
    # unbuffered: a buffer would keep bytes read before their range was fetched
    return io.BufferedReader(_Fetching(Path(path).open("rb", buffering=0), lazy))


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


class RemoteRun:
    """The URLs of one run: each input's shadow directory, the output's staging directory, and publishing.
    A context manager: on exit the shadows are closed and the local directory removed."""

    def __init__(self, storage_options: dict | None = None, local_dir: str | None = None):
        self.storage_options = storage_options
        self.root = Path(tempfile.mkdtemp(prefix="lora-merge-remote-", dir=local_dir))
        self._lazies: list[_Lazy] = []
        self._count = 0
        self.output: tuple | None = None  # (fs, remote root, url, local staging dir)
        self.names: dict[str, str] = {}  # local directory -> the URL it stands for (for messages)

    def __enter__(self) -> "RemoteRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for lazy in self._lazies:
            _LAZY.pop(os.fspath(lazy.path), None)
            lazy.close()
        self._lazies = []
        shutil.rmtree(self.root, ignore_errors=True)

    def _slot(self) -> Path:
        self._count += 1
        slot = self.root / str(self._count)
        slot.mkdir()
        return slot

    def input(self, url: str) -> Path:
        """The local shadow of the objects under `url` (a directory of them)."""
        fs, remote = filesystem(url, self.storage_options)
        try:
            found = fs.find(remote, detail=True)
        except Exception as exc:  # noqa: BLE001
            raise MergeError(f"{url}: cannot list ({type(exc).__name__}: {exc})") from None
        prefix = remote.rstrip("/") + "/"
        # (zero-byte keys ending in "/" are "folder" markers that consoles and tools create: not files)
        objects = {name[len(prefix):]: info for name, info in found.items()
                   if name.startswith(prefix) and info.get("type", "file") != "directory"
                   and not (name.endswith("/") and not info.get("size"))}
        if not objects:
            raise MergeError(f"{url}: no objects under it (expected a model or checkpoint directory)")
        shadow = self._slot() / last_component(url)
        shadow.mkdir()
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
                path.write_bytes(data)
        self.names[str(shadow)] = url.rstrip("/")
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

    def named(self, text: str) -> str:
        """A message with each local directory of this run named by its URL."""
        for local, url in sorted(self.names.items(), key=lambda item: -len(item[0])):
            text = text.replace(local, url)
        return text

    def publish(self) -> list[str]:
        """Upload the staged output: every data object (several at once), then the files that say it is complete;
        on any failure, remove what was uploaded and raise."""
        fs, remote, url, local = self.output
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


class _Stopped(Exception):
    pass


def _upload(fs, local: Path, rpath: str, stop: threading.Event | None = None) -> None:
    """Stream one file up: parts of UPLOAD_PART_BYTES as they are read (a multipart upload where the store has
    them), so memory stays one part whatever the file's size. Never a partial object: a failed copy is
    discarded (the multipart upload aborted), not committed by closing, and what a backend without discard
    wrote is removed. `stop` set: abandoned at the next 8 MB."""
    parent = rpath.rsplit("/", 1)[0]
    try:
        fs.makedirs(parent, exist_ok=True)  # (a file system needs its directories; object stores have none)
    except Exception:  # noqa: BLE001 - a store that refuses it writes the object anyway, or says why below
        pass
    with open(local, "rb") as src:
        part = max(UPLOAD_PART_BYTES, -(-os.fstat(src.fileno()).st_size // MAX_PARTS // (1 << 20)) << 20)
        dst = fs.open(rpath, "wb", block_size=part)
        try:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                if stop is not None and stop.is_set():
                    raise _Stopped()
                dst.write(chunk)
            dst.close()  # the last part, and the upload completed
        except BaseException:
            try:
                discard = getattr(dst, "discard", None)
                if discard is not None:
                    discard()
                dst.closed = True  # (else closing it, even when collected, would upload the rest as an object)
            except Exception:  # noqa: BLE001 - a backend without discard (file://, memory://): removed below
                pass
            try:
                if fs.exists(rpath):
                    fs.rm_file(rpath)
            except Exception:  # noqa: BLE001 - best effort; the first error is the one to report
                pass
            raise
