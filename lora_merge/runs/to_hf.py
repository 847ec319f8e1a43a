"""A merge (or a conversion) into an HF model: the inputs opened, the plan made, the pipeline streamed into
sharded safetensors, the reference's files, `--verify`, the card and the report, all staged and then published."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.lora import LoraSettings
from lora_merge.merge_plan import MergePlan, build_plan, plan_fp8_output, plan_mxfp4_output
from lora_merge.report import hash_files, report_text
from lora_merge.runs.inputs import (baseline_dir, card_base_model, check_input_dirs, given_paths, input_paths,
                                    inside_dir, open_inputs, output_dtype)
from lora_merge.runs.options import FP8, MXFP4, MergeOptions
from lora_merge.runs.finish import run_finish
from lora_merge.runs.lanes import stream_into_shards
from lora_merge.runs.parts import hf_files_of_part, run_part, stale_parts_warning
from lora_merge.verification import VerifyReport, check_output_files, verify_output
from lora_merge.writers.hf_files import ReferenceFiles, copy_reference_files, reference_files
from lora_merge.writers.model_card import checked_base_model_id, model_card
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
from lora_merge.files.staged_dir import (StagedOutput, check_free_space, check_output_target,
                                           remove_abandoned_side_files, remove_abandoned_staging)
from lora_merge.files.targets import check_report_path


@dataclass
class MergeResult:
    """What a merge did (a dry run: what it would do, `plan` set and nothing written)."""

    out: Path
    base: str  # the base checkpoint, described
    lora: str | None  # None: a conversion without a LoRA (then r, alpha, scale and settings_source are None)
    dtype: str
    tensors: int  # HF tensors written
    bytes: int
    lora_modules: int  # LoRA-adapted Megatron modules merged
    r: int | None
    alpha: float | None
    scale: float | None
    settings_source: str | None  # where r and alpha came from
    skipped: dict[str, int]  # what was deliberately not written, by reason
    files: list[str] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # file -> digest, hashed while writing (README.md aside; none with sha256=False)
    seconds: float = 0.0
    verified: bool = False
    verify_report: VerifyReport | None = None
    dry_run: bool = False
    plan: MergePlan | None = None
    inputs: object = None  # the opened inputs (for printing a dry-run plan)
    copied_bytes: int = 0  # of the reference's files the output holds
    part: str | None = None  # "I/N": this run wrote part I of N (its `files`), for `finish` to publish
    resumed: list[str] = field(default_factory=list)  # files kept from a killed run (--resume)


class VerificationFailed(MergeError):
    def __init__(self, out: Path, report: VerifyReport, published: bool):
        self.report, self.out = report, out
        what = "" if published else ", nothing published"
        super().__init__(f"{out}: verification failed ({len(report.problems)} problem(s)){what}")


def _described(ckpt) -> str | None:
    return None if ckpt is None else ckpt.describe()


def _settings_fields(settings: LoraSettings | None) -> dict:
    if settings is None:
        return dict(r=None, alpha=None, scale=None, settings_source=None)
    return dict(r=settings.r, alpha=settings.alpha, scale=settings.scale, settings_source=settings.source)


def _reference_files(opts, reference: Path) -> ReferenceFiles:
    """What of the reference the output holds; a file that cannot be copied stops the run here, before any
    shard is written, and so does a report named like one of them."""
    found = reference_files(reference)
    if inside_dir(opts.report, opts.out) and (opts.report.name in found.copied or opts.report.name == "config.json"):
        raise MergeError(f"{opts.report}: the output holds the reference's {opts.report.name} under that name; "
                         "name the report e.g. merge-report.json")
    for note in found.notes():
        opts.warn(note)
    return found


def run_merge(opts: MergeOptions) -> MergeResult:
    started = time.monotonic()
    checked_base_model_id(opts.base_model_id)  # a usage error, before any work
    check_input_dirs(opts)
    roots = given_paths(opts.base, opts.lora, *opts.more_loras, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True)
    check_report_path(opts.report, opts.force, roots, opts.out, early=True)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=True)
    ref_files = _reference_files(opts, opts.hf_ref)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    fp8, mxfp4 = opts.dtype == FP8, opts.dtype == MXFP4
    if fp8 and getattr(inp.base, "mxfp4", False):
        raise MergeError(f"--dtype fp8 with the MXFP4 base {inp.base.path}: block-FP8 is written for weights an FP8 "
                         "release quantizes, not for MXFP4 experts; write mxfp4, bfloat16 or float32")
    if fp8 and inp.shape.multimodal:
        raise MergeError(f"--dtype fp8 with a {inp.shape.multimodal} release: which of its towers' linears a block-FP8 "
                         "release would quantize is not known here; write bfloat16 or float32")
    # what the rest keep: bf16, as the releases (an FP8 reference's config is read when it was checked)
    dtype = torch.bfloat16 if fp8 or mxfp4 else output_dtype(opts.dtype, inp.shape, inp.base, inp.lora)
    plan = build_plan(inp.base, inp.lora, inp.shape, inp.arch, inp.settings, dtype)
    quantization = None
    if fp8:
        quantization = plan_fp8_output(plan, inp.base, inp.hf_config.get("quantization_config"))
    elif mxfp4:
        quantization = plan_mxfp4_output(plan, inp.base, inp.hf_config.get("quantization_config"))
    for note in plan.notes:
        opts.warn(note)
    base_model, base_model_warning = card_base_model(opts, inp, opts.hf_ref)
    hf_config = {**inp.hf_config, **plan.config_changes}
    hf_config.pop("quantization_config", None)  # an FP8 base's: the output is FP8 only where it says so
    dtype_name = str(dtype).removeprefix("torch.")
    if quantization is not None:
        hf_config["quantization_config"] = quantization
    if fp8:
        rows, cols = quantization["weight_block_size"]
        dtype_name = f"block-FP8 (float8_e4m3fn, {rows}x{cols} scales) and bfloat16"
    elif mxfp4:
        dtype_name = "MXFP4 experts (E2M1, a power-of-two scale per 32) and bfloat16"
    writer_plan = plan.tensors
    tensor_bytes = sum(t.nbytes for t in writer_plan)
    if opts.dry_run:
        # A dry run says whether the run would work; one that would stop at the space check would not, so it
        # stops here the same way (the real run first removes killed runs' staging dirs; a dry run writes
        # and removes nothing, so it counts them as taken).
        check_free_space(opts.out, tensor_bytes, ref_files.total_bytes)
        result = MergeResult(out=opts.out, base=inp.base.describe(), lora=_described(inp.lora),
                             dtype=dtype_name, tensors=len(writer_plan),
                             bytes=sum(t.nbytes for t in writer_plan), lora_modules=plan.merged_modules,
                             **_settings_fields(inp.settings), skipped=dict(plan.skipped), dry_run=True, plan=plan,
                             inputs=inp, copied_bytes=ref_files.total_bytes)
        if opts.part is not None:  # which files the part would write
            _, shards, names, sizes, mine = hf_files_of_part(writer_plan, getattr(inp.base, "names", None),
                                                             opts.max_shard_size, opts.part)
            result.part, result.files = str(opts.part), [names[i] for i in sorted(mine)]
            result.tensors, result.bytes = sum(len(shards[i]) for i in mine), sum(sizes[i] for i in mine)
        return result

    if opts.part is not None or opts.resume:
        written = run_part(opts, inp, plan, writer_plan, getattr(inp.base, "names", None), hf_config, dtype,
                           dtype_name, ref_files, base_model)
        files, hashes, tensors, nbytes = written.files, written.sha256, written.tensors, written.bytes
        if base_model_warning and (opts.part is None or opts.part.index == 0):
            opts.warn(base_model_warning)  # before anything is published (a warn that raises stops the run)
        if opts.part is None:  # --resume of a one-process run: part 0/1, published at once
            # (each file was hashed as it was written, or again when kept: not read a third time)
            finished = run_finish(opts.out, opts.force, opts.workers, rehash=False)
            files, hashes, tensors, nbytes = finished.files, finished.sha256, len(writer_plan), tensor_bytes
        return MergeResult(out=opts.out, base=inp.base.describe(), lora=_described(inp.lora), dtype=dtype_name,
                           tensors=tensors, bytes=nbytes, lora_modules=plan.merged_modules,
                           **_settings_fields(inp.settings), skipped=dict(plan.skipped), files=files, sha256=hashes,
                           seconds=time.monotonic() - started, part=None if opts.part is None else written.part,
                           resumed=written.resumed)

    stale = stale_parts_warning(opts.out)
    if stale:
        opts.warn(stale)
    verify_report = None
    # Space held by runs that were killed is given back before deciding whether there is enough.
    remove_abandoned_staging(opts.out, inputs)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    # The copied reference files count byte for byte (a tokenizer can be GBs); a margin covers config and card.
    check_free_space(opts.out, tensor_bytes, ref_files.total_bytes)
    with StagedOutput(opts.out, opts.force, inputs) as stage:
        staging = stage.dir
        names = getattr(inp.base, "names", None)  # a multimodal release: written under its own names
        writer = ShardedSafetensorsWriter(staging, writer_plan if names is None else [
            replace(t, name=names.stored(t.name)) for t in writer_plan], opts.max_shard_size, hash_files=opts.sha256)
        files = stream_into_shards(writer, plan, names, staging, opts.progress, writer.total_bytes, opts.workers)
        files += copy_reference_files(opts.hf_ref, staging, hf_config, dtype)
        if opts.verify:
            reference = baseline_dir(inp, opts.hf_ref)
            verify_report = verify_output(staging, inp.arch, inp.shape, dtype, inp.lora, inp.settings,
                                          reference=reference, base=None if inp.base.hf_named else inp.base)
            verify_report.problems += check_output_files(staging, ref_files, card=False)  # no card yet
            if not verify_report.ok:
                raise VerificationFailed(opts.out, verify_report, published=False)
        if opts.sha256:
            hashes = writer.sha256 | hash_files(staging, [f for f in files if f not in writer.sha256])
        else:
            hashes = dict.fromkeys(files)  # listed, not hashed (--no-sha256)
        later = (opts.report.name,) if inside_dir(opts.report, opts.out) else ()
        with (staging / "README.md").open("x") as f:
            f.write(model_card(opts.out.name, inp.base, inp.lora, hf_config, inp.settings,
                               dtype_name, plan.merged_modules, hashes, base_model, later))
        files.append("README.md")
        if opts.report:
            stage.side_file(opts.report, report_text(inp, opts.hf_ref, plan, writer.file_of(), hashes, verify_report,
                                                     ref_files))
        if base_model_warning:  # once the output is complete (not cluttering a failure), before it is published
            opts.warn(base_model_warning)
    return MergeResult(out=opts.out, base=inp.base.describe(), lora=_described(inp.lora),
                       dtype=dtype_name, tensors=len(writer_plan), bytes=writer.total_bytes,
                       lora_modules=plan.merged_modules, **_settings_fields(inp.settings), skipped=dict(plan.skipped),
                       files=files, sha256={f: h for f, h in hashes.items() if h is not None},
                       seconds=time.monotonic() - started,
                       verified=verify_report is not None, verify_report=verify_report)
