"""`lora-merge finish`: a run in parts (runs/parts.py) checked and published.

Every part of one plan must be there and complete, every file must still have the size and sha256 its part
recorded (hashed again, without the page cache, unless `--no-rehash`), the reference directory must be as part
0 read it, and the output and a report beside it must be free (or, with `--force`, earlier outputs of
lora-merge). Only then is what a one-process run writes last written (the index, config and reference files,
the card, the report) and the directory renamed into place: the bytes of a one-process run.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from lora_merge.errors import MergeError, OutputConflict
from lora_merge.files.remote import RemoteRun, check_inputs_unchanged, is_url
from lora_merge.files.ownership import MEGATRON_CHECKPOINT, MERGED_MODEL, check_replaceable, report_refusal
from lora_merge.files.parts_dir import PartsDir, manifest_name
from lora_merge.files.staged_dir import PUBLISHED, SideFile, check_free_space
from lora_merge.interrupts import ignore_signals
from lora_merge.merge_pipeline import default_workers
from lora_merge.model.model_shape import DTYPES
from lora_merge.report import finished_report, hash_files
from lora_merge.runs.parts import input_files, plan_differences, still_written
from lora_merge.writers.hf_files import copy_reference_files, reference_files
from lora_merge.writers.megatron_legacy import TRACKER
from lora_merge.writers.model_card import finished_card

INDEX = "model.safetensors.index.json"


@dataclass
class FinishResult:
    out: Path
    parts: int
    files: list[str]
    sha256: dict[str, str]
    bytes: int
    seconds: float


def run_finish(out: Path, force: bool = False, workers: int | None = None, rehash: bool = True,
               storage_options: dict | None = None) -> FinishResult:
    """Check every part of `out` and publish it (see `_run_finish`); a reference directory the parts read at a
    URL is read there again (`storage_options` for its filesystem)."""
    references: list[RemoteRun] = []

    def open_input(url: str) -> Path:
        references.append(RemoteRun(storage_options))
        return references[-1].input(url)
    try:
        return _run_finish(out, force, workers, rehash, open_input)
    except MergeError as exc:
        for run in references:
            exc.args = (run.named(str(exc)),) + exc.args[1:]
        raise
    finally:
        for run in references:
            run.close()


def _run_finish(out: Path, force: bool, workers: int | None, rehash: bool, open_input) -> FinishResult:
    """Check every part of `out` and publish it (see the module's doc). `rehash=False` checks the files' sizes
    only, taking each sha256 as its part recorded it while writing: it skips reading the output again (for a
    671B model, 1.34 TB on the host that finishes), at the price of not noticing bytes changed on the disk
    since. `open_input(url)`: the local directory of a reference directory at a URL (files/remote.py)."""
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
    if not _valid_common(common):
        raise MergeError(f"{staging.manifests / manifest_name(0, count)}: says nothing valid of the whole output "
                         f"(its 'common' section); remove it and rerun part 0/{count}")
    expected = set(common["files"])
    assigned = [name for index in range(count) for name in manifests[index, count]["assigned"]]
    recorded = {name: entry for index in range(count) for name, entry in manifests[index, count]["files"].items()}
    if sorted(assigned) != sorted(expected) or not set(recorded) <= expected:
        raise MergeError(f"{staging.manifests}: the parts' files do not make up the output's {len(expected)}; "
                         "the manifests were changed: remove them and rerun the parts")
    owner = {name: index for index in range(count) for name in manifests[index, count]["assigned"]}
    checked = still_written(staging, recorded, workers or default_workers(), rehash)
    for name in common["files"]:
        if name not in checked:
            path = staging.shown(name)
            what = ("is missing" if not staging.has(name) else "has other bytes than its part recorded" if rehash else
                    "has another size than its part recorded" if staging.mirror is None else
                    "has another size or ETag than its part recorded")
            raise MergeError(f"{path}: {what}; rerun " + (f"part {owner[name]}/{count} with --part "
                                                           f"{owner[name]}/{count} --resume" if count > 1 else
                                                           "the merge with --resume"))
    kind = common.get("kind", MERGED_MODEL)
    reference = common.get("reference") or {}
    shown_reference = reference.get("directory")
    if reference.get("directory") and is_url(reference["directory"]):
        reference = {**reference, "directory": str(open_input(reference["directory"]))}
        common = {**common, "reference": reference}
    if reference.get("files") is not None:  # what finish copies: as part 0 saw it, or the plan is not the parts'
        now = input_files(reference["directory"])
        if now != reference["files"]:
            before, after = ({f[1]: f[2:] for f in files} for files in (reference["files"], now))
            changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
            raise MergeError(f"{shown_reference}: changed since part 0/{count} read it "
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
        check_inputs_unchanged()  # (the reference, where it is at a URL)
        ignore_signals()  # the point of no return, as for a one-process run
        staging.publish(force, kind, checked)
    except BaseException:
        if report is not None:
            report.discard()
        raise
    PUBLISHED.append(staging.mirror.url if staging.mirror is not None else out)
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


def _valid_common(common) -> bool:
    """Part 0's record of the whole output, as a part writes it: the output's file names, and for an HF model
    the card, index, report and reference it needs (what finish writes is taken from here, so it is checked)."""
    if not isinstance(common, dict) or not isinstance(common.get("files"), list) or not common["files"] or \
            not all(_output_name(n) for n in common["files"]):
        return False
    if common.get("kind") == MEGATRON_CHECKPOINT:
        return common.get("tracker") == "release"
    card, reference = common.get("card"), common.get("reference")
    return (common.get("kind") == MERGED_MODEL and isinstance(card, dict) and isinstance(card.get("data"), dict)
            and isinstance(card.get("title"), str) and isinstance(card.get("lines"), list)
            and isinstance(common.get("later"), list) and all(isinstance(n, str) and "/" not in n for n in common["later"])
            and (common.get("index") is None or isinstance(common["index"], dict))
            and (common.get("report") is None) == (common.get("report_path") is None)
            and (common.get("report") is None or isinstance(common["report"], dict) and isinstance(
                common["report_path"], str) and os.path.isabs(common["report_path"]))
            and isinstance(reference, dict) and isinstance(reference.get("directory"), str)
            and isinstance(reference.get("config"), dict) and reference.get("dtype") in DTYPES)


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
                                  DTYPES[reference["dtype"]])
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
