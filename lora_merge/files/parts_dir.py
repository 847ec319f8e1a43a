"""The shared staging of a run split into parts (`--part I/N`, then `lora-merge finish`): two directories next
to the output, which any host that mounts it may write.

- `OUT.parts/` holds the output's files as the parts complete them; `finish` adds the index, config, card and
  report and renames the directory into `OUT`'s place: one rename within the output's parent, so a reader sees
  no output or a complete one.
- `OUT.manifests/` holds one manifest per part (`part-00003-of-00008.json`): its files with their sizes and
  sha256, rewritten as each file completes (what `--resume` continues from), and the plan's fingerprint.

An output at a URL (files/remote.py) is staged in a local directory whose files are uploaded to `OUT/` as each is
placed (and then removed locally) and whose manifests are mirrored to `OUT.manifests/`; its `finish` uploads
what it writes, index and card last.

Nothing relies on `flock` (it does not hold on every NFS, Lustre or CephFS mount) or on renames between
directories: each file is written under a name of its own run (`.NAME.HOST-PID-RANDOM.tmp`) and renamed into
place in the same directory once complete and flushed. Two runs of one part write the same bytes under
different temporary names; whichever rename comes last leaves a complete file, as before it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from lora_merge.errors import MergeError, OutputConflict
from lora_merge.files import remote
from lora_merge.files.ownership import check_replaceable
from lora_merge.files.staged_dir import _fsync_dir, _fsync_tree, _host, rename_exchange, rename_noreplace
from lora_merge.files.small_files import read_bytes

MANIFEST_FORMAT = 1
MANIFEST_KEY = "lora-merge part manifest"  # first key of every manifest: how a directory is known as ours
MANIFEST = re.compile(r"part-(\d{5})-of-(\d{5})\.json")
TEMPORARY = re.compile(r"\..+\.[^.]+\.tmp")


# The parts directories this process has written into (a path, or the URL of an output there): what an
# interrupted run leaves for --resume (cli.py).
STAGED: list[str] = []


def manifest_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}.json"


class PartsDir:
    """The two staging directories of `out` (see the module's doc)."""

    def __init__(self, out: Path):
        self.out = out
        self.files = out.parent / f"{out.name}.parts"
        self.manifests = out.parent / f"{out.name}.manifests"
        self.token = f"{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.mirror = remote.output_mirror(out)  # an output at a URL: where the files and manifests go

    def create(self) -> None:
        """Both directories, made if missing; existing ones must be ours (only manifests, only files)."""
        for path in (self.files, self.manifests):
            if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
                raise OutputConflict(f"{path}: exists and is not a directory; the parts of {self.out} are staged there")
        if self.manifests.is_dir():
            self.check_manifests_dir()
        has_manifests = self.manifests.is_dir() and any(MANIFEST.fullmatch(p.name) for p in self.manifests.iterdir())
        if self.files.is_dir() and any(self.files.iterdir()) and not has_manifests:
            raise OutputConflict(f"{self.files}: exists with files but no part manifest in {self.manifests.name} "
                                 "beside it; not lora-merge's parts: move it away")
        self.manifests.mkdir(exist_ok=True)
        self.files.mkdir(exist_ok=True)
        STAGED.append(self.mirror.url if self.mirror is not None else str(self.files))

    def check_manifests_dir(self) -> None:
        """The manifests directory holds manifests and temporary files only (it is removed once published)."""
        foreign = [p.name for p in self.manifests.iterdir() if not MANIFEST.fullmatch(p.name)
                   and not TEMPORARY.fullmatch(p.name)]
        if foreign:
            raise OutputConflict(f"{self.manifests / foreign[0]}: not a part manifest of lora-merge; the directory is "
                                 "removed once the output is published: move it away")

    def shown(self, name: str) -> str:
        """Where the output's file `name` is, in words: its path, or its URL."""
        return f"{self.mirror.url}/{name}" if self.mirror is not None else str(self.files / name)

    def has(self, name: str) -> bool:
        return self.mirror.exists(name) if self.mirror is not None else (self.files / name).exists()

    def temporary(self, name: str) -> str:
        """Where this run writes the file `name` (a path relative to the files directory: a Megatron rank file
        is `release/mp_rank_00/model_optim_rng.pt`) until it is complete: beside it, under a name of its own."""
        path = Path(name)
        return str(path.parent / f".{path.name}.{self.token}.tmp")

    def place(self, name: str) -> None:
        """The file written under this run's temporary name becomes `name` (flushed first)."""
        path = self.files / self.temporary(name)
        if self.mirror is not None:  # (local until uploaded: nothing to flush for another host)
            os.replace(path, self.files / name)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(path, self.files / name)
        _fsync_dir((self.files / name).parent)

    def write_manifest(self, index: int, count: int, manifest: dict) -> None:
        name = manifest_name(index, count)
        temporary = self.manifests / f".{name}.{self.token}.tmp"
        with open(temporary, "x") as f:
            # (`writer`: which run wrote it last, so that a run at a URL can tell another run wrote the output too)
            f.write(json.dumps({MANIFEST_KEY: MANIFEST_FORMAT, **manifest, "writer": self.token}, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.manifests / name)
        _fsync_dir(self.manifests)
        if self.mirror is not None:
            self.mirror.put_manifest(name, (self.manifests / name).read_bytes())

    def read_manifests(self, skip: tuple[int, int] | None = None) -> dict[tuple[int, int], dict]:
        """Every part's manifest, by (index, count), but `skip`'s; a damaged one is an error naming it."""
        found = {}
        if not self.manifests.is_dir():
            return found
        for path in sorted(self.manifests.iterdir()):
            match = MANIFEST.fullmatch(path.name)
            if match is None or (int(match[1]), int(match[2])) == skip:
                continue
            found[int(match[1]), int(match[2])] = self.read_manifest(path)
        return found

    def read_manifest(self, path: Path) -> dict:
        match = MANIFEST.fullmatch(path.name)
        rerun = f"remove it and rerun part {int(match[1])}/{int(match[2])}" if match else "remove it"
        try:
            data = json.loads(read_bytes(path, "a part manifest"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise MergeError(f"{path}: not a readable part manifest ({exc}); {rerun}") from None
        if not isinstance(data, dict) or data.get(MANIFEST_KEY) != MANIFEST_FORMAT:
            raise MergeError(f"{path}: not a part manifest of this lora-merge (format "
                             f"{data.get(MANIFEST_KEY) if isinstance(data, dict) else None!r}); {rerun}")
        files = data.get("files")
        if not (isinstance(data.get("plan"), str) and isinstance(data.get("complete"), bool)
                and isinstance(data.get("assigned"), list) and all(isinstance(n, str) for n in data["assigned"])
                and isinstance(files, dict) and all(
                    isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                    for e in files.values())):
            raise MergeError(f"{path}: a part manifest without its plan, files or state; {rerun}")
        return data

    def own_manifest(self, index: int, count: int) -> dict | None:
        """This part's manifest, or None where there is none or it is damaged (rewritten by this run)."""
        path = self.manifests / manifest_name(index, count)
        try:
            return self.read_manifest(path) if path.exists() else None
        except MergeError:
            return None

    def clear_except(self, keep: set[str], ours: set[str]) -> None:
        """Remove from the files directory what runs of lora-merge left there and the output will not hold (the
        relative paths in `keep`): temporary files of killed runs, and the files in `ours` that an interrupted
        finish wrote; directories left empty go too. Anything else is not ours: an error, nothing removed."""
        if self.mirror is not None:
            foreign = self.mirror.foreign(keep, ours)
            if foreign:
                raise OutputConflict(f"{self.mirror.url}/{foreign[0]}: under the output, but not written by lora-merge; "
                                     "move it away")
        paths = sorted(self.files.rglob("*"), key=lambda p: len(p.parts), reverse=True)
        def removable(path: Path) -> bool:
            return TEMPORARY.fullmatch(path.name) is not None or str(path.relative_to(self.files)) in ours
        foreign = [p for p in paths if not p.is_dir() or p.is_symlink()
                   if str(p.relative_to(self.files)) not in keep and not removable(p)]
        if foreign:
            raise OutputConflict(f"{foreign[0]}: in the parts' directory, but not written by lora-merge; move it away")
        for path in paths:
            name = str(path.relative_to(self.files))
            if name in keep:
                continue
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            else:
                path.unlink()

    def publish(self, force: bool, kind: str, recorded: dict) -> None:
        """The files directory becomes the output (with `force`, swapped with an earlier output of this kind,
        which is then removed); then the manifests go. At a URL: what finish wrote is uploaded, the index and card
        last, and the parts' files (`recorded`: their manifest entries) are checked to be there still."""
        if self.mirror is not None:
            self.mirror.publish(self.files, recorded)
            return
        _fsync_tree(self.files)  # what finish wrote (the shards are flushed as they are placed)
        if force and self.out.is_dir() and not self.out.is_symlink():
            check_replaceable(self.out, kind)
            rename_exchange(self.files, self.out)
            shutil.rmtree(self.files)
        else:
            try:
                rename_noreplace(self.files, self.out)
            except FileExistsError as err:
                raise OutputConflict(f"{self.out}: exists (pass --force to replace an earlier output)") from err
        _fsync_dir(self.out.parent)
        shutil.rmtree(self.manifests, ignore_errors=True)
