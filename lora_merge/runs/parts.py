"""A merge split into parts that any scheduler can run (`--part I/N`), then put together (`lora-merge finish`).

The plan is made from headers before any tensor is read, and the same inputs and options always give the
same plan, so N runs that never talk to each other agree on it: part I writes the output files that fall in
its share of the bytes (consecutive files, about 1/N of the bytes each; a file is the part's in whose share
its middle byte lies), computing only the parameters those files hold. Each part records in its manifest
the plan's fingerprint and, as each file completes, its size and sha256 (files/parts_dir.py). `finish` checks
that every part of one plan is there and every file still has its recorded sha256, then writes what a
one-process run writes last (index, config and reference files, card, report) and publishes the directory:
the bytes are those of a one-process run, for any N.

`--resume` (with or without `--part`) keeps the files whose recorded sha256 still matches and writes the
rest; without `--part` it is part 0/1, finished at once. `finish` itself is runs/finish.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lora_merge.errors import MergeError, UsageError
from lora_merge.files import remote
from lora_merge.files.file_hash import sha256_of
from lora_merge.files.ownership import MEGATRON_CHECKPOINT, MERGED_MODEL
from lora_merge.files.parts_dir import PartsDir, manifest_name
from lora_merge.files.staged_dir import check_free_space
from lora_merge.merge_pipeline import default_workers
from lora_merge.merge_plan import planned_outputs
from lora_merge.options import argument_name
from lora_merge.report import report_data
from lora_merge.runs.lanes import stream_into_shards
from lora_merge.runs.stream import stream_into
from lora_merge.shown import shown
from lora_merge.version import __version__
from lora_merge.writers.model_card import model_card_head
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter, shard_file_names, split_into_shards

MAX_PARTS = 99999  # the manifests' names have five digits


@dataclass(frozen=True)
class Part:
    index: int  # from 0, as Slurm array task ids (--array=0-N) and Kubernetes completion indexes count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_part(value) -> Part | None:
    """`"I/N"` (or (I, N)): part I of N, 0 ≤ I < N."""
    if value is None:
        return None
    expected = f"expected I/N with 0 ≤ I < N ≤ {MAX_PARTS}, e.g. 0/8 (parts count from 0)"
    if isinstance(value, str):
        index, _, count = value.partition("/")
        if not (index.strip().isdigit() and count.strip().isdigit()):
            raise UsageError(f"{argument_name('part')} {value!r}: {expected}")
        index, count = int(index), int(count)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        index, count = value
    else:
        raise UsageError(f"{argument_name('part')} {shown(value)}: {expected}")
    if not 0 <= index < count <= MAX_PARTS:
        raise UsageError(f"{argument_name('part')} {index}/{count}: {expected}")
    return Part(index, count)


def assign_files(sizes: list[int], count: int) -> list[int]:
    """The part of each file: consecutive files, about 1/`count` of the bytes each (a file is the part's in
    whose share its middle byte lies), so that a part reads a contiguous stretch of the model."""
    total = max(1, sum(sizes))
    parts, start = [], 0
    for size in sizes:
        parts.append(min(count - 1, (2 * start + size) * count // (2 * total)))
        start += size
    return parts


class PartFiles:
    """The files one part writes (the writer's `FilePart`): each written under a temporary name, renamed into
    place once complete, and then recorded in the part's manifest (what `--resume` continues from)."""

    def __init__(self, staging: PartsDir, part: Part, files: frozenset[int], arriving: frozenset[str],
                 manifest: dict):
        self.staging, self.part, self.files, self.arriving, self.manifest = staging, part, files, arriving, manifest
        self.lock = threading.Lock()

    def temporary(self, name: str) -> str:
        return self.staging.temporary(name)

    def written(self, name: str, sha256: str) -> None:
        self.staging.place(name)
        entry = {"bytes": (self.staging.files / name).stat().st_size, "sha256": sha256}
        if self.staging.mirror is None:
            self._record(name, entry)
        else:  # recorded once uploaded, with the object's ETag (what --resume and finish check it by)
            self.staging.mirror.submit(self.staging.files / name, name,
                                       lambda version: self._record(name, {**entry, "etag": version}))

    def _record(self, name: str, entry: dict) -> None:
        with self.lock:  # (uploads complete on their own threads)
            self.manifest["files"][name] = entry
            self.staging.write_manifest(self.part.index, self.part.count, self.manifest)


def still_written(staging: PartsDir, recorded: dict, workers: int, rehash: bool = True) -> dict:
    """Of the recorded files, those whose size and sha256 on disk are still what was recorded (`rehash=False`:
    whose size is, the sha256 taken as the part recorded it while writing)."""
    def check(item):
        name, entry = item
        if staging.mirror is not None:  # an output at a URL: the object's size and ETag, and read back to rehash
            return name, entry, staging.mirror.still_there(name, entry, rehash)
        path = staging.files / name
        try:
            ok = path.stat().st_size == entry["bytes"] and (not rehash or sha256_of(path) == entry["sha256"])
        except OSError:
            ok = False
        return name, entry, ok
    # hashlib and the reads let go of the GIL; two files a core keep the disk busy while the other hashes
    with ThreadPoolExecutor(max(1, 2 * workers)) as pool:
        return {name: entry for name, entry, ok in pool.map(check, sorted(recorded.items())) if ok}


@dataclass
class PartWritten:
    part: str  # "I/N"
    files: list[str]  # the output files that are this part's
    sha256: dict[str, str]
    resumed: list[str]  # files kept from a killed run (--resume)
    tensors: int
    bytes: int


class PartRun:
    """What every kind of part run shares: the staging directories opened and checked against the parts
    already there (one plan, one split), the files a killed run of this part completed (`--resume`), and its
    manifest, rewritten as each file completes."""

    def __init__(self, out: Path, part: Part, plan: tuple[str, dict], file_names: list[str], mine: frozenset[int],
                 resume: bool, workers: int | None, common: dict | None, explicit: bool = True):
        self.part, self.file_names = part, file_names
        fingerprint, digests = plan
        self.staging = staging = PartsDir(out)
        staging.create()
        this = f"--part {part}" if explicit else "a one-process run with --resume (part 0/1)"
        own = staging.own_manifest(part.index, part.count)
        others = staging.read_manifests(skip=(part.index, part.count))
        for (index, count), theirs in [*others.items(), *([((part.index, part.count), own)] if own else [])]:
            where = staging.manifests / manifest_name(index, count)
            if count != part.count:
                raise MergeError(f"{where}: part {index}/{count} of a split into {count}, this is {this}; "
                                 f"finish or remove {staging.files} and {staging.manifests} before splitting "
                                 "differently")
            if theirs["plan"] != fingerprint:
                raise MergeError(f"{where}: part {index}/{count} differs from this run ({this}) in "
                                 f"{plan_differences(digests, theirs.get('plan_of', {}))}; rerun with its inputs and "
                                 f"options, or remove {staging.files} and {staging.manifests} to start over")
        assigned = [file_names[i] for i in sorted(mine)]
        kept = {}
        if resume:
            recorded = {k: v for k, v in (own or {}).get("files", {}).items() if k in assigned}
            kept = still_written(staging, recorded, workers or default_workers())
        self.kept = kept
        self.pending = frozenset(i for i in mine if file_names[i] not in kept)
        self.manifest = {"tool": f"lora-merge {__version__}", "part": [part.index, part.count], "plan": fingerprint,
                         "plan_of": digests, "assigned": assigned, "files": dict(kept), "complete": False}
        if part.index == 0:  # what finish writes: from part 0, which every split has
            self.manifest["common"] = common
        staging.write_manifest(part.index, part.count, self.manifest)

    def local_bytes(self, sizes: list[int], workers: int | None) -> int:
        """The local disk this part needs: its files, or for an output at a URL those that can be complete and
        waiting for their upload, or being written, at once."""
        pending = sorted((sizes[i] for i in self.pending), reverse=True)
        if self.staging.mirror is None:
            return sum(pending)
        return sum(pending[:remote.LOCAL_FILES + (workers or default_workers()) + 1])

    def files(self, arriving: frozenset[str]) -> "PartFiles":
        return PartFiles(self.staging, self.part, self.pending, arriving, self.manifest)

    def complete(self) -> None:
        if self.staging.mirror is not None:
            self.staging.mirror.wait()
        remote.check_inputs_unchanged()
        self.manifest["complete"] = True
        self.staging.write_manifest(self.part.index, self.part.count, self.manifest)

    def written(self, tensors: int, nbytes: int) -> PartWritten:
        return PartWritten(part=str(self.part), files=list(self.manifest["assigned"]),
                           sha256={k: v["sha256"] for k, v in self.manifest["files"].items()},
                           resumed=sorted(self.kept), tensors=tensors, bytes=nbytes)


# What each part of a plan's fingerprint is, for the message naming what differs between two parts.
PLAN_PARTS = {"tool": "the version of lora-merge", "settings": "the LoRA settings (r, alpha, rsLoRA)",
              "lora_r": "--lora-r", "lora_alpha": "--lora-alpha", "lora_weights": "--lora-weight",
              "inputs": "the input files (their paths, sizes or modification times)",
              "output": "the output's files (--max-shard-size, the model)", "sizes": "the output's files' sizes",
              "tensors": "the output's tensors (--dtype, the model)", "card": "the model card (--base-model-id)",
              "config": "the output's config.json", "reference": "--hf-ref", "report": "--report",
              "args": "the Megatron checkpoint's layout or args"}


def fingerprint_of(opts, inp, **what) -> tuple[str, dict]:
    """The plan's fingerprint, and a digest of each thing in it: what every part must agree on, with this
    version of lora-merge: the output's files and tensors (`what`), the LoRA settings exactly (repr: 3.0 and
    3.000001 differ, as they do in the merge), the options that choose them, and every input file by its real
    path, size and modification time (a LoRA trained again into the same directory is another input; the same
    directory named by a relative path is not)."""
    parts = {"tool": __version__, "settings": repr(inp.settings), "lora_r": opts.lora_r,
             "lora_alpha": repr(opts.lora_alpha), "lora_weights": repr(opts.lora_weights),
             "inputs": input_files(opts.base, opts.lora, *opts.more_loras, opts.hf_ref), **what}
    digests = {key: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
               for key, value in parts.items()}
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest(), digests


def plan_differences(mine: dict, theirs: dict) -> str:
    """What differs between two plans' digests, in words."""
    keys = sorted(set(mine) | set(theirs))
    differ = [PLAN_PARTS.get(key, key) for key in keys if mine.get(key) != theirs.get(key)]
    return ", ".join(differ) or "what it was made from"


def input_files(*dirs) -> list:
    """Every file below the input directories: [the directory's real path, the file's path in it, its size,
    its modification time] (for an input at a URL: its URL, the object's name, size and ETag)."""
    found = []
    for directory in dirs:
        if directory is None:
            continue
        listed = remote.listed_files(directory)
        if listed is not None:  # an input at a URL: [URL, object below it, size, ETag]
            found += listed
            continue
        top = os.path.realpath(directory)
        for root, subdirs, names in os.walk(top, followlinks=True):
            subdirs.sort()
            for name in sorted(names):
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found.append([top, os.path.relpath(path, top), st.st_size, st.st_mtime_ns])
    return found


def hf_files_of_part(writer_plan, names, max_shard_size: int, part: Part):
    """An HF output's tensors under the names the files hold, its shards, their file names and sizes, and the
    indices of the files that are `part`'s."""
    stored = writer_plan if names is None else [replace(t, name=names.stored(t.name)) for t in writer_plan]
    shards = split_into_shards(stored, max_shard_size)
    sizes = [sum(t.nbytes for t in shard) for shard in shards]
    mine = frozenset(i for i, p in enumerate(assign_files(sizes, part.count)) if p == part.index)
    return stored, shards, shard_file_names(len(shards)), sizes, mine


def run_part(opts, inp, plan, writer_plan, names, hf_config: dict, dtype: torch.dtype, dtype_name: str,
             ref_files, base_model: str | None) -> PartWritten:
    """Part `opts.part` of a merge into an HF model (see the module's doc): its files written and recorded."""
    part = opts.part or Part(0, 1)
    given = f"--part {part}" if opts.part is not None else "--resume"
    if opts.verify:
        raise MergeError(f"--verify with {given}: verify the output once it is published (`lora-merge verify "
                         f"{opts.out} ...`)" + (": each part holds some files only" if opts.part is not None else ""))
    if not opts.sha256:
        raise MergeError(f"--no-sha256 with {given}: finish and --resume check every file by its sha256")
    stored, shards, file_names, sizes, mine = hf_files_of_part(writer_plan, names, opts.max_shard_size, part)
    file_of = {t.name: file_names[i] for i, shard in enumerate(shards) for t in shard}
    inside = opts.report is not None and os.path.realpath(opts.report.parent) == os.path.realpath(opts.out)
    card = model_card_head(opts.out.name, inp.base, inp.lora, hf_config, inp.settings, dtype_name,
                           plan.merged_modules, base_model)
    plan_id = fingerprint_of(
        opts, inp, output=file_names, tensors=[[t.name, list(t.shape), str(t.dtype), file_of[t.name]] for t in stored],
        card=card, config=hf_config, reference=remote.source_name(opts.hf_ref),
        report=os.path.abspath(opts.report) if opts.report else None)
    common = {
        "kind": MERGED_MODEL, "files": file_names, "card": card, "later": [opts.report.name] if inside else [],
        "index": {"metadata": {"total_size": sum(sizes)}, "weight_map": file_of} if len(shards) > 1 else None,
        "report": report_data(inp, opts.hf_ref, plan, file_of, None, ref_files) if opts.report else None,
        "report_path": os.path.abspath(opts.report) if opts.report else None,
        "reference": {"directory": _directory(opts.hf_ref), "config": hf_config,
                      "dtype": str(dtype).removeprefix("torch."), "files": input_files(opts.hf_ref)}
    } if part.index == 0 else None
    run = PartRun(opts.out, part, plan_id, file_names, mine, opts.resume, opts.workers, common,
                  explicit=opts.part is not None)
    pending_names = {file_names[i] for i in run.pending}
    tasks = [task for task in plan.tasks if any(file_of[_stored(names, t.name)] in pending_names
                                                 for t in task.outputs)]
    arriving = frozenset(_stored(names, t.name) for task in tasks for t in task.outputs)
    check_free_space(run.staging.files, run.local_bytes(sizes, opts.workers),
                     ref_files.total_bytes if part.index == 0 else 0)
    writer = ShardedSafetensorsWriter(run.staging.files, stored, opts.max_shard_size, hash_files=True,
                                      part=run.files(arriving))
    stream_into_shards(writer, replace(plan, tasks=tasks), names, run.staging.files, opts.progress,
                       sum(t.nbytes for t in planned_outputs(tasks)), opts.workers)
    run.complete()
    return run.written(sum(len(shards[i]) for i in mine), sum(sizes[i] for i in mine))


def run_megatron_part(opts, inp, plan, writer, args) -> PartWritten:
    """Part `opts.part` of a Megatron checkpoint (`--to megatron`): whole files (legacy rank files; torch_dist's
    .distcp files, then its common.pt, .metadata and metadata.json), split as an HF output's shards are;
    `finish` writes the tracker file."""
    part = opts.part or Part(0, 1)
    file_names = writer.file_names()
    sizes = writer.file_sizes()
    owner = assign_files(sizes, part.count)
    mine = frozenset(i for i, p in enumerate(owner) if p == part.index)
    plan_id = fingerprint_of(opts, inp, output=file_names, sizes=sizes,
                             tensors=[[t.name, list(t.shape), str(t.dtype)] for t in plan.tensors],
                             args=repr(sorted(vars(args).items())))
    common = {"kind": MEGATRON_CHECKPOINT, "files": file_names, "tracker": writer.tracker_text()} \
        if part.index == 0 else None
    run = PartRun(opts.out, part, plan_id, file_names, mine, opts.resume, opts.workers, common,
                  explicit=opts.part is not None)
    tasks = [task for task in plan.tasks if any(writer.files_of(t.name) & run.pending for t in task.outputs)]
    check_free_space(run.staging.files, run.local_bytes(sizes, opts.workers), 0, "the tracker file")
    writer.write_only(run.files(frozenset(t.name for task in tasks for t in task.outputs)))
    stream_into(writer, run.staging.files, replace(plan, tasks=tasks), opts.progress,
                sum(t.nbytes for t in planned_outputs(tasks)), opts.workers)
    run.complete()
    return run.written(len(mine), sum(sizes[i] for i in mine))


def _directory(path) -> str:
    """How finish finds an input directory again: its absolute path, or its URL."""
    url = remote.source_name(path)
    return url if remote.is_url(url) else os.path.abspath(path)


def _stored(names, name: str) -> str:
    return name if names is None else names.stored(name)


def stale_parts_warning(out: Path) -> str | None:
    """For a run in one process: a warning when an earlier run in parts (or with --resume) left its staging
    beside `out`; this run neither uses nor removes it."""
    staging = PartsDir(out)
    if staging.manifests.is_dir() and any(staging.manifests.iterdir()):
        return (f"{staging.files.name}/ and {staging.manifests.name}/ beside {out} hold an earlier run's parts, which "
                "this run neither uses nor removes (--resume would continue them); remove them once this output is "
                "published")
    return None

