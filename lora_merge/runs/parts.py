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
rest; without `--part` it is part 0/1, finished at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lora_merge.errors import MergeError, OutputConflict, UsageError
from lora_merge.files.ownership import MEGATRON_CHECKPOINT, MERGED_MODEL, check_replaceable, report_refusal
from lora_merge.files.file_hash import sha256_of
from lora_merge.files.parts_dir import PartsDir, manifest_name
from lora_merge.files.staged_dir import PUBLISHED, SideFile, check_free_space
from lora_merge.interrupts import ignore_signals
from lora_merge.merge_pipeline import default_workers
from lora_merge.options import argument_name
from lora_merge.report import finished_report, hash_files, report_data
from lora_merge.runs.stream import stream_into
from lora_merge.shown import shown
from lora_merge.version import __version__
from lora_merge.writers.hf_files import copy_reference_files, reference_files
from lora_merge.writers.megatron_legacy import TRACKER
from lora_merge.writers.model_card import finished_card, model_card_head
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter, shard_file_names, split_into_shards
from lora_merge.writers.sink import RenamedSink

MAX_PARTS = 99999  # the manifests' names have five digits
INDEX = "model.safetensors.index.json"


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

    def temporary(self, name: str) -> str:
        return self.staging.temporary(name)

    def written(self, name: str, sha256: str) -> None:
        self.staging.place(name)
        self.manifest["files"][name] = {"bytes": (self.staging.files / name).stat().st_size, "sha256": sha256}
        self.staging.write_manifest(self.part.index, self.part.count, self.manifest)


def _still_written(staging: PartsDir, recorded: dict, workers: int, rehash: bool = True) -> dict:
    """Of the recorded files, those whose size and sha256 on disk are still what was recorded (`rehash=False`:
    whose size is, the sha256 taken as the part recorded it while writing)."""
    def check(item):
        name, entry = item
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
            kept = _still_written(staging, recorded, workers or default_workers())
        self.kept = kept
        self.pending = frozenset(i for i in mine if file_names[i] not in kept)
        self.manifest = {"tool": f"lora-merge {__version__}", "part": [part.index, part.count], "plan": fingerprint,
                         "plan_of": digests, "assigned": assigned, "files": dict(kept), "complete": False}
        if part.index == 0:  # what finish writes: from part 0, which every split has
            self.manifest["common"] = common
        staging.write_manifest(part.index, part.count, self.manifest)

    def files(self, arriving: frozenset[str]) -> "PartFiles":
        return PartFiles(self.staging, self.part, self.pending, arriving, self.manifest)

    def complete(self) -> None:
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
             "inputs": _input_files(opts.base, opts.lora, *opts.more_loras, opts.hf_ref), **what}
    digests = {key: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
               for key, value in parts.items()}
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest(), digests


def plan_differences(mine: dict, theirs: dict) -> str:
    """What differs between two plans' digests, in words."""
    keys = sorted(set(mine) | set(theirs))
    differ = [PLAN_PARTS.get(key, key) for key in keys if mine.get(key) != theirs.get(key)]
    return ", ".join(differ) or "what it was made from"


def _input_files(*dirs) -> list:
    """Every file below the input directories: [the directory's real path, the file's path in it, its size,
    its modification time]."""
    found = []
    for directory in dirs:
        if directory is None:
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
        card=card, config=hf_config, reference=os.path.realpath(opts.hf_ref),
        report=os.path.abspath(opts.report) if opts.report else None)
    common = {
        "kind": MERGED_MODEL, "files": file_names, "card": card, "later": [opts.report.name] if inside else [],
        "index": {"metadata": {"total_size": sum(sizes)}, "weight_map": file_of} if len(shards) > 1 else None,
        "report": report_data(inp, opts.hf_ref, plan, file_of, None, ref_files) if opts.report else None,
        "report_path": os.path.abspath(opts.report) if opts.report else None,
        "reference": {"directory": os.path.abspath(opts.hf_ref), "config": hf_config,
                      "dtype": str(dtype).removeprefix("torch."), "files": _input_files(opts.hf_ref)}
    } if part.index == 0 else None
    run = PartRun(opts.out, part, plan_id, file_names, mine, opts.resume, opts.workers, common,
                  explicit=opts.part is not None)
    pending_names = {file_names[i] for i in run.pending}
    tasks = [task for task in plan.tasks if any(file_of[_stored(names, t.name)] in pending_names
                                                 for t in task.outputs)]
    arriving = frozenset(_stored(names, t.name) for task in tasks for t in task.outputs)
    check_free_space(run.staging.files, sum(sizes[i] for i in run.pending),
                     ref_files.total_bytes if part.index == 0 else 0)
    writer = ShardedSafetensorsWriter(run.staging.files, stored, opts.max_shard_size, hash_files=True,
                                      part=run.files(arriving))
    sink = writer if names is None else RenamedSink(writer, names.stored)
    stream_into(sink, run.staging.files, replace(plan, tasks=tasks), opts.progress,
                sum(t.nbytes for task in tasks for t in task.outputs), opts.workers)
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
    check_free_space(run.staging.files, sum(sizes[i] for i in run.pending), 0, "the tracker file")
    writer.write_only(run.files(frozenset(t.name for task in tasks for t in task.outputs)))
    stream_into(writer, run.staging.files, replace(plan, tasks=tasks), opts.progress,
                sum(t.nbytes for task in tasks for t in task.outputs), opts.workers)
    run.complete()
    return run.written(len(mine), sum(sizes[i] for i in mine))


def _stored(names, name: str) -> str:
    return name if names is None else names.stored(name)


@dataclass
class FinishResult:
    out: Path
    parts: int
    files: list[str]
    sha256: dict[str, str]
    bytes: int
    seconds: float


def run_finish(out: Path, force: bool = False, workers: int | None = None, rehash: bool = True) -> FinishResult:
    """Check every part of `out` and publish it (see the module's doc). `rehash=False` checks the files' sizes
    only, taking each sha256 as its part recorded it while writing: it skips reading the output again (for a
    671B model, 1.34 TB on the host that finishes), at the price of not noticing bytes changed on the disk
    since."""
    started = time.monotonic()
    staging = PartsDir(out)
    manifests = staging.read_manifests()
    if not manifests:
        if out.is_dir() and not staging.files.exists():
            raise MergeError(f"{out}: no parts to finish: the output is there and {staging.files.name} is not "
                             "(finished already?)")
        raise MergeError(f"{out}: no parts to finish (no part manifests in {staging.manifests}); run the parts "
                         "first (--part I/N)")
    if not staging.files.is_dir() or staging.files.is_symlink():
        raise OutputConflict(f"{staging.files}: " + ("is a symlink" if staging.files.is_symlink() else "is missing")
                             + f"; the parts' files are written there (finished already, if {out} is complete: then "
                               f"remove {staging.manifests})")
    counts = sorted({count for _, count in manifests})
    if len(counts) > 1:
        raise MergeError(f"{staging.manifests}: parts of splits into {' and '.join(map(str, counts))}; remove the "
                         "parts of the split not meant")
    count = counts[0]
    plans = {m["plan"] for m in manifests.values()}
    if len(plans) > 1:
        first = manifests[min(manifests)]
        odd, theirs = next(((i, m) for (i, _), m in sorted(manifests.items()) if m["plan"] != first["plan"]))
        raise MergeError(f"{staging.manifests}: part {odd}/{count} differs from part {min(manifests)[0]}/{count} in "
                         f"{plan_differences(first.get('plan_of', {}), theirs.get('plan_of', {}))}; rerun it with the "
                         "same inputs and options")
    staging.check_manifests_dir()  # nothing there but manifests: it is removed once published
    for index in range(count):
        manifest = manifests.get((index, count))
        if manifest is None:
            raise MergeError(f"{out}: part {index}/{count} is missing (no manifest); run it with --part {index}/{count}")
        if not manifest["complete"]:
            raise MergeError(f"{out}: part {index}/{count} did not complete ({len(manifest['files'])} of "
                             f"{len(manifest['assigned'])} files written); rerun it with "
                             + (f"--part {index}/{count} --resume" if count > 1 else "--resume"))
    common = manifests[0, count].get("common")
    if not isinstance(common, dict) or not all(_output_name(n) for n in common.get("files", [None])):
        raise MergeError(f"{staging.manifests / manifest_name(0, count)}: says nothing valid of the whole output "
                         f"(its 'common' section); remove it and rerun part 0/{count}")
    expected = set(common["files"])
    assigned = [name for index in range(count) for name in manifests[index, count]["assigned"]]
    recorded = {name: entry for index in range(count) for name, entry in manifests[index, count]["files"].items()}
    if sorted(assigned) != sorted(expected) or not set(recorded) <= expected:
        raise MergeError(f"{staging.manifests}: the parts' files do not make up the output's {len(expected)}; "
                         "the manifests were changed: remove them and rerun the parts")
    owner = {name: index for index in range(count) for name in manifests[index, count]["assigned"]}
    checked = _still_written(staging, recorded, workers or default_workers(), rehash)
    for name in common["files"]:
        if name not in checked:
            path = staging.files / name
            what = ("is missing" if not path.exists() else "has other bytes than its part recorded" if rehash else
                    "has another size than its part recorded")
            raise MergeError(f"{path}: {what}; rerun " + (f"part {owner[name]}/{count} with --part "
                                                           f"{owner[name]}/{count} --resume" if count > 1 else
                                                           "the merge with --resume"))
    kind = common.get("kind", MERGED_MODEL)
    reference = common.get("reference") or {}
    if reference.get("files") is not None:  # what finish copies: as part 0 saw it, or the plan is not the parts'
        now = _input_files(reference["directory"])
        if now != reference["files"]:
            before, after = ({f[1]: f[2:] for f in files} for files in (reference["files"], now))
            changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
            raise MergeError(f"{reference['directory']}: changed since part 0/{count} read it "
                             f"({', '.join(changed[:3]) or 'its place'}); the output would hold other reference files "
                             "than the parts were made with: restore it, or rerun the parts")
    if out.is_symlink():
        raise OutputConflict(f"{out}: is a symlink; give the directory itself")
    if os.path.lexists(out):
        if kind == MEGATRON_CHECKPOINT:
            raise OutputConflict(f"{out}: already exists; a Megatron checkpoint is written to a new directory")
        check_replaceable(out, kind)  # before suggesting --force: only where it would help
        if not force:
            raise OutputConflict(f"{out}: already exists (pass --force to replace it)")
    if common.get("report_path") and not common.get("later"):  # beside the output: checked before publishing
        report = Path(common["report_path"])
        refusal = report_refusal(report)
        if refusal or (os.path.lexists(report) and not force):
            raise OutputConflict(refusal or f"{report}: already exists: an earlier report of lora-merge (pass --force "
                                 "to replace it)")
    # what killed runs and an interrupted finish left; anything else there is not ours, and stops the run
    staging.clear_except(expected, _finish_writes(common))
    hashes = {name: checked[name]["sha256"] for name in common["files"]}
    if kind == MEGATRON_CHECKPOINT:
        files = [TRACKER, *common["files"]]
        (staging.files / TRACKER).write_text(common["tracker"])
        report = None
    else:
        files, report = _finish_hf_model(staging, common, hashes)
    try:
        ignore_signals()  # the point of no return, as for a one-process run
        staging.publish(force, kind)
    except BaseException:
        if report is not None:
            report.discard()
        raise
    PUBLISHED.append(out)
    if report is not None:
        report.publish(force)
    return FinishResult(out=out, parts=count, files=files, sha256=hashes,
                        bytes=sum(recorded[name]["bytes"] for name in common["files"]),
                        seconds=time.monotonic() - started)


OUTPUT_NAMES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|release/mp_rank_\d{2}(_\d{3}){0,2}/model_optim_rng\.pt"
                          r"|release/(__0_\d+\.distcp|common\.pt|\.metadata|metadata\.json)")


def _output_name(name) -> bool:
    """A file name a part may write: a shard or a rank file, nothing with a way out of the directory."""
    return isinstance(name, str) and OUTPUT_NAMES.fullmatch(name) is not None


def _finish_writes(common: dict) -> set[str]:
    """What finish itself writes into the files directory (an interrupted finish may have left them)."""
    if common.get("kind") == MEGATRON_CHECKPOINT:
        return {TRACKER}
    names = {INDEX, "README.md", "config.json", *common.get("later", [])}
    reference = common.get("reference") or {}
    if reference.get("directory"):
        names |= set(reference_files(Path(reference["directory"])).copied)
    return names


def _finish_hf_model(staging: PartsDir, common: dict, hashes: dict) -> tuple[list[str], SideFile | None]:
    """What a one-process merge writes after its shards: the index, config and reference files, the card, and
    the report (inside the output, or beside it as a side file published with it). `hashes` gains theirs."""
    reference = common["reference"]
    check_free_space(staging.files, 0, reference_files(Path(reference["directory"])).total_bytes)
    files = list(common["files"])
    if common["index"] is not None:
        (staging.files / INDEX).write_text(json.dumps(common["index"], indent=2) + "\n")
        files.append(INDEX)
    copied = copy_reference_files(Path(reference["directory"]), staging.files, reference["config"],
                                  getattr(torch, reference["dtype"]))
    files += copied
    hashes |= hash_files(staging.files, [INDEX] * (common["index"] is not None) + copied)
    later = tuple(common["later"])
    with (staging.files / "README.md").open("x") as f:
        f.write(finished_card(common["card"], hashes, later))
    files.append("README.md")
    if common["report"] is None:
        return files, None
    text = finished_report(common["report"], hashes)
    path = Path(common["report_path"])
    if later:
        (staging.files / path.name).write_text(text)
        return files, None
    report = SideFile(path)
    report.write(text)
    return files, report


def stale_parts_warning(out: Path) -> str | None:
    """For a run in one process: a warning when an earlier run in parts (or with --resume) left its staging
    beside `out`; this run neither uses nor removes it."""
    staging = PartsDir(out)
    if staging.manifests.is_dir() and any(staging.manifests.iterdir()):
        return (f"{staging.files.name}/ and {staging.manifests.name}/ beside {out} hold an earlier run's parts, which "
                "this run neither uses nor removes (--resume would continue them); remove them once this output is "
                "published")
    return None

