"""Input bytes brought into the page cache before they are used, by plain reads on threads of their own.

The merge reads its inputs through file mappings. From a cold disk each page then comes in by a page fault,
which on this project's 2-core VM cost 0.63 CPU-s per GB at 1.3 GB/s, against 0.15 CPU-s per GB at 2.7 GB/s
for 16 MB `preadv` calls into a buffer; once the bytes are cached, faults cost ~0.14 CPU-s per GB more.
`posix_fadvise` and `madvise` WILLNEED brought nothing in ahead there. So:

- `Prefetcher` reads, in plan order and a bounded distance ahead of the merge, the byte ranges the merge will
  map next (a shadow file of a URL input gets them fetched instead);
- `start_early_reads` reads the input files while the process starts: importing torch and transformers
  takes ~2 s on one core, with the disk idle. Whole files, round robin, up to a budget, stopped when the
  merge begins; the `Prefetcher` skips what they read.

Both only read: a file that cannot be opened or read is skipped, and the reader proper says what is wrong
with it when the merge gets there. Nothing here changes a byte of the output.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from lora_merge.stage_clock import charge_thread

CHUNK_BYTES = 16 << 20
OPEN_FILES = 8  # files a reader keeps open at once
# How far ahead of the merge, in input bytes of the plan; the CRC32 checker runs 1 GB ahead
# (integrity.LEAD_BYTES), and it should find its bytes cached.
LEAD_BYTES = 3 << 29
EARLY_LIMIT = 8 << 30  # at most this much read early, and at most a quarter of the memory available
RANK_FILES = ("model_optim_rng.pt",)  # a legacy rank's model (readers/legacy.py), not distrib_optim.pt


class _Reader:
    """A thread reading byte ranges into a scratch buffer (reads release the GIL), each file opened once."""

    def __init__(self, name: str):
        self._stopped = False
        self._cond = threading.Condition()
        self._fds: OrderedDict[str, int] = OrderedDict()  # the files open now, least recently read first
        self._unreadable: set[str] = set()
        self._buffer = None
        self._thread = threading.Thread(target=self._run, name=f"lora-merge-{name}", daemon=True)
        self._stage = name

    def _run(self) -> None:
        try:
            self._buffer = memoryview(bytearray(CHUNK_BYTES))
            self._read_all()
        except Exception:  # noqa: BLE001 - reading ahead is an optimisation: the merge's own reads report
            pass
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            charge_thread(self._stage)

    def _read_all(self) -> None:
        raise NotImplementedError

    def _fd(self, path: str) -> int | None:
        """`path` open for reading, or None if it cannot be read (not a regular file, missing, denied). At most
        OPEN_FILES are open at once: a checkpoint may have more files than the process may open."""
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if path in self._unreadable:
            return None
        fd = None
        try:  # O_NONBLOCK: a FIFO put where a checkpoint file belongs must not hang this thread
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                fd = None
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
        if fd is None:
            self._unreadable.add(path)
            return None
        self._fds[path] = fd
        while len(self._fds) > OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _read(self, path: str, start: int, end: int) -> int:
        """Read [start, end) of `path`; returns where reading stopped (end, the file's end, or a stop)."""
        fd = self._fd(path)
        if fd is None:
            return start
        at = start
        while at < end and not self._stopped:
            try:
                got = os.preadv(fd, [self._buffer[:min(CHUNK_BYTES, end - at)]], at)
            except OSError:
                return at
            if got <= 0:
                return at
            at += got
        return at

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()


class Prefetcher(_Reader):
    """Reads the byte ranges of each job's tensors ahead of the merge, in plan order.

    `jobs` yields (due, refs) like the CRC32 checker's: `due` is how many input bytes the merge will have
    reached when it needs `refs`. The merge reports its position with `advance(due)`. `read_early`: how
    far each file was read from its start already (by the early reads), not read again."""

    def __init__(self, jobs, read_early: dict[str, int] | None = None, lead: int = LEAD_BYTES):
        super().__init__("prefetch")
        self._jobs, self._lead, self._progress = jobs, lead, 0
        self._read_early = dict(read_early or {})
        self._thread.start()

    def _read_all(self) -> None:
        from lora_merge.files import remote

        seen = set()
        for due, refs in self._jobs:
            with self._cond:
                while not self._stopped and due > self._progress + self._lead:
                    self._cond.wait()
                if due < self._progress:  # begun by the merge, which reads for itself (and may be done with it)
                    continue
            for ref in refs:
                for file, start, nbytes in ref.byte_spans():
                    if self._stopped:
                        return
                    path = str(file.path)
                    if (path, start) in seen or file.in_memory:
                        continue
                    seen.add((path, start))
                    if remote.is_shadow(path):  # a URL input: its bytes fetched ahead instead
                        self._fetch(remote, path, start, nbytes)
                        continue
                    begin = max(start, self._read_early.get(path, 0))
                    if begin < start + nbytes:
                        self._read(path, begin, start + nbytes)

    def _fetch(self, remote, path: str, start: int, nbytes: int) -> None:
        """A shadow file's range fetched a few ranged GETs at a time, so that a stop waits for those only."""
        step = remote.FETCH_BYTES * remote.FETCH_THREADS
        for at in range(start, start + nbytes, step):
            if self._stopped:
                return
            try:
                remote.ensure(path, at, min(step, start + nbytes - at), ahead=True)
            except Exception:  # noqa: BLE001 - the merge's own fetch of them reports
                return

    def advance(self, due: int) -> None:
        with self._cond:
            self._progress = due
            self._cond.notify_all()


class EarlyReads(_Reader):
    """Whole input files read round robin, a chunk of each in turn, until `budget` bytes or `stop()`."""

    def __init__(self, files: list[str], budget: int):
        super().__init__("early-reads")
        self._files, self._budget = files, budget
        self.read_upto: dict[str, int] = {}  # how far each file was read from its start

    def start(self) -> "EarlyReads":
        self._thread.start()
        return self

    def _read_all(self) -> None:
        sizes = {}
        for path in self._files:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes[path] = st.st_size
        left = self._budget
        while sizes and left > 0 and not self._stopped:
            for path, size in list(sizes.items()):
                at = self.read_upto.get(path, 0)
                end = min(size, at + CHUNK_BYTES, at + left)
                reached = self._read(path, at, end)
                self.read_upto[path] = reached
                left -= reached - at
                if reached < end or reached >= size:  # done, or unreadable past here
                    del sizes[path]
                if left <= 0 or self._stopped:
                    break

    def stop(self) -> dict[str, int]:
        """Stop reading; how far each file was read from its start."""
        super().stop()
        return dict(self.read_upto)


_EARLY: list[EarlyReads] = []


def start_early_reads(inputs: list, loras: list) -> None:
    """Read the files of local input dirs while the process starts (LoRA dirs first: the merge needs them
    from its first piece on). URL inputs are left to their shadows' fetching. Whatever goes wrong in finding
    them (a damaged index, say) is left for the readers to report: nothing is read early then."""
    try:
        files = [f for path in loras for f in input_files(path)] + [f for path in inputs for f in input_files(path)]
        budget = min(EARLY_LIMIT, _available_memory() // 4)
    except Exception:  # noqa: BLE001 - reading early is an optimisation
        return
    if files and budget > 0:
        _EARLY.append(EarlyReads(list(dict.fromkeys(files)), budget).start())


def stop_early_reads() -> dict[str, int]:
    """Stop the early reads, if any run; how far each file was read from its start."""
    read = {}
    while _EARLY:
        read.update(_EARLY.pop().stop())
    return read


def input_files(path) -> list[str]:
    """The weight files a merge reads from an input dir, as its reader picks them, found without torch: an
    adapter's weights, an HF model's indexed (or all) safetensors files, a DCP's or torch_dist iteration's
    `.distcp` files, a legacy iteration's rank files (not their optimizer files)."""
    from lora_merge.files.remote import is_url
    from lora_merge.readers.iteration import find_iteration_dir

    if path is None or is_url(path) or not os.path.isdir(path):
        return []
    path = Path(path)
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (path / "adapter_config.json").is_file() and (path / name).is_file():
            return [str(path / name)]
    found = _safetensors_files(path) or _named(path, lambda name: name.endswith(".distcp"))
    if found:
        return found
    try:
        it_dir = find_iteration_dir(path)
    except Exception:  # noqa: BLE001 - not a checkpoint the readers know: they say so
        return []
    found = _named(it_dir, lambda name: name.endswith(".distcp"))
    for rank in _named(it_dir, lambda name: name.startswith("mp_rank_"), dirs=True):
        found += _named(Path(rank), lambda name: name in RANK_FILES)
    return found


def _safetensors_files(directory: Path) -> list[str]:
    """As readers/safetensors_dir.py picks them: those its index lists, else every .safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index, "rb") as f:
                listed = json.loads(f.read(64 << 20)).get("weight_map", {}).values()
            return [str(directory / name) for name in sorted(set(listed))
                    if isinstance(name, str) and "/" not in name and (directory / name).is_file()]
        except (OSError, ValueError, AttributeError):
            return []
    return _named(directory, lambda name: name.endswith(".safetensors"))


def _named(directory: Path, wanted, dirs: bool = False) -> list[str]:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        return [e.path for e in entries if wanted(e.name) and (e.is_dir() if dirs else e.is_file())]
    except OSError:
        return []


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, or less where this process's memory cgroup (a container's limit) leaves
    less (bytes); 0 where it cannot be read (then nothing is read early)."""
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    room = _cgroup_room()
    return available if room is None else min(available, room)


CGROUP = Path("/sys/fs/cgroup")


def _cgroup_room(root: Path = CGROUP, membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least memory any memory cgroup holding this process may still take: its limit less its usage, less
    the inactive file pages the kernel reclaims first (usage counts page cache); None without a limit. Looked
    for at the process's own cgroup and each one above it, and at the mount point, which is the process's own
    where a container has its cgroup namespace (Docker, Kubernetes), cgroup v2 and v1 alike."""
    places = []
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base, v2 = root, True
        elif "memory" in controllers.split(","):
            base, v2 = root / "memory", False
        else:
            continue
        inside = Path(path.lstrip("/"))
        places += [(base / inside, v2)] + [(base / above, v2) for above in inside.parents]
    places += [(root, True), (root / "memory", False)]
    rooms = [room for room in (_room_in(d, v2) for d, v2 in dict.fromkeys(places)) if room is not None]
    return min(rooms) if rooms else None


def _room_in(directory: Path, v2: bool) -> int | None:
    names = ("memory.max", "memory.current", "inactive_file") if v2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        limit = (directory / names[0]).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        usage = int((directory / names[1]).read_text().strip())
        inactive = 0
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == names[2]:
                inactive = int(value)
        return max(0, int(limit) - max(0, usage - inactive))
    except (OSError, ValueError):
        return None
