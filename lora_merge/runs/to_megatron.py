"""`--to megatron`: the same read → un-shard → merge pipeline, ending in a Megatron checkpoint at any layout
instead of an HF model. The source may be an HF model, a Megatron checkpoint (a reshard) or either with a
LoRA merged on the way; the plan is the one an HF output would get, and the writer places each HF row piece
into the target's rank files as it streams."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.files.ownership import MEGATRON_CHECKPOINT
from lora_merge.model.layout import AsStored, SharedCopy
from lora_merge.integrity import check_replica
from lora_merge.merge_plan import build_plan
from lora_merge.runs.inputs import (check_input_dirs, given_paths, input_paths, open_inputs,
                                    output_dtype)
from lora_merge.runs.options import FP8, MegatronOptions
from lora_merge.runs.finish import run_finish
from lora_merge.runs.parts import assign_files, run_megatron_part, stale_parts_warning
from lora_merge.runs.stream import stream_into
from lora_merge.writers.megatron_args import target_args
from lora_merge.writers.megatron_legacy import MegatronLegacyWriter
from lora_merge.writers.row_scatter import Block
from lora_merge.files.staged_dir import StagedOutput, check_free_space, check_output_target, remove_abandoned_staging

# What the space check's margin covers beyond the counted bytes (the legacy rank files are counted exactly)
CHECKPOINT_EXTRAS = "the tracker file and torch_dist's framing and metadata"


@dataclass
class ConvertResult:
    out: Path
    base: str
    lora: str | None
    layout: str
    ckpt_format: str
    dtype: str
    files: list[str]
    tensors: int
    bytes: int
    padded_vocab_size: int
    make_vocab_size_divisible_by: int  # as the args record it: Megatron loads with this value
    lora_modules: int
    skipped: dict
    seconds: float = 0.0
    dry_run: bool = False
    plan: object = None  # a dry run's plan and planned writer (for tools that inspect them)
    writer: object = None
    part: str | None = None  # "I/N": this run wrote part I of N (its `files`), for `finish` to publish
    resumed: list = field(default_factory=list)  # rank files kept from a killed run (--resume)
    transformer_impl: str = "local"  # the module names written: "local" or "transformer_engine" (model/te_spec.py)


def drop_mtp_copies(plan) -> None:
    """The MTP layers' copies of the embedding and output head: Megatron shares the main ones, so each copy
    must be one (every row compared) and is not written."""
    copies = [task for task in plan.tasks if isinstance(getattr(task.rule, "rule", task.rule), SharedCopy)]
    main = {out.name: task for task in plan.tasks for out in task.outputs}
    for task in copies:
        rule, name = getattr(task.rule, "rule", task.rule), task.outputs[0].name
        theirs = main[rule.copy_of].pieces
        if len(task.pieces) != len(theirs) or task.pieces.shapes != theirs.shapes:
            raise MergeError(f"{task.pieces[0].where}: {name} should be a copy of {rule.copy_of}, but their shapes "
                             "differ")
        for mine, original in zip(task.pieces, theirs):
            check_replica(original, mine, f"{mine.where}: {name} differs from {rule.copy_of}; Megatron's "
                          "multi-token-prediction layers share the main model's, so they must be equal")
        plan.tasks.remove(task)
        plan.skipped["copies of the embedding and output layer in the MTP layers (Megatron shares them)"] += 1


def run_to_megatron(opts: MegatronOptions) -> ConvertResult:
    target = opts.target
    started = time.monotonic()
    target.check_values()
    if opts.dtype == FP8:
        raise MergeError("--dtype fp8 with --to megatron: a Megatron checkpoint is written in bfloat16, float16 or "
                         "float32 (FP8 bases are read dequantized)")
    check_input_dirs(opts)
    if opts.out.exists() or opts.out.is_symlink():
        raise MergeError(f"{opts.out}: already exists; a Megatron checkpoint is written to a new directory")
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, False, roots, early=True, kind=MEGATRON_CHECKPOINT)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=True, lora_optional=True)
    if inp.base is None:
        raise MergeError(f"{opts.lora}: holds only LoRA weights; pass --base with the base model")
    shape = inp.shape
    layout = target.layout
    padded, vocab_divisor = target.check_model(shape)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, False, inputs, kind=MEGATRON_CHECKPOINT)
    # the args a Megatron run recorded are kept (how it was trained); derived ones (Megatron-Bridge's) are not copied
    source_args = next((c.megatron_args for c in (inp.base, inp.lora) if c is not None and c.megatron_args is not None
                        and getattr(c, "args_recorded", True)), None)
    source_impl = getattr(source_args, "transformer_impl", None)
    if source_impl in ("local", "transformer_engine") and source_impl != target.transformer_impl:
        opts.warn(f"the source's args say --transformer-impl {source_impl}; writing {target.transformer_impl}'s names, "
                  f"as asked (--transformer-impl {source_impl} writes what that run's model loads)")
    dtype = output_dtype(opts.dtype, shape, inp.base, inp.lora)
    plan = build_plan(inp.base, inp.lora, shape, inp.arch, inp.settings, dtype)
    for note in plan.notes:
        if "num_nextn_predict_layers" not in note:
            opts.warn(note)
    drop_mtp_copies(plan)
    mtp = [task for task in plan.tasks if isinstance(getattr(task.rule, "rule", task.rule), AsStored)]
    if mtp:  # MTP layers of a family whose Megatron MTP layout is not known: not written, and said so
        plan.tasks = [task for task in plan.tasks if task not in mtp]
        plan.skipped["multi-token-prediction layer tensors of the HF base (Megatron's MTP layers are not written)"] \
            += len(mtp)
        opts.warn(f"the base's {len(mtp)} multi-token-prediction tensors are not written: the Megatron checkpoint has "
                  "no MTP layers (train or serve it without --mtp-num-layers)")
    args = target_args(shape, layout, dtype, padded, vocab_divisor,
                       target.expert_layout == "grouped", source=source_args, ckpt_format=target.ckpt_format,
                       transformer_impl=target.transformer_impl)
    dtypes = {t.name: t.dtype for t in plan.tensors}
    if target.ckpt_format == "torch_dist":
        from lora_merge.writers.megatron_dist import MegatronDistOutput  # torch.distributed.checkpoint: only here

        writer = MegatronDistOutput(inp.arch, shape, dtypes, args, padded)
    else:
        writer = MegatronLegacyWriter(inp.arch, shape, layout, dtypes, args, padded,
                                      grouped_experts=target.expert_layout == "grouped",
                                      fused_mla=target.mla_naming == "mindspeed")
    missing = sorted(set(writer.hf) - set(dtypes))
    extra = sorted(set(dtypes) - set(writer.hf))
    if missing or extra:
        raise MergeError(f"the plan and the target layout disagree (missing {missing[:3]}, extra {extra[:3]}); "
                         "nothing written")
    describe = dict(base=inp.base.describe(), lora=inp.lora.describe() if inp.lora is not None else None,
                    layout=str(layout), ckpt_format=target.ckpt_format,
                    transformer_impl=target.transformer_impl, dtype=str(dtype).removeprefix("torch."),
                    tensors=sum(not isinstance(t, Block) for t in writer.targets), bytes=writer.total_bytes, padded_vocab_size=padded,
                    make_vocab_size_divisible_by=vocab_divisor,
                    lora_modules=plan.merged_modules, skipped=dict(plan.skipped))
    if opts.dry_run:
        check_free_space(opts.out, writer.total_bytes, 0, CHECKPOINT_EXTRAS)
        files = []
        if opts.part is not None:  # which files the part would write
            owner = assign_files(writer.file_sizes(), opts.part.count)
            files = [name for name, p in zip(writer.file_names(), owner) if p == opts.part.index]
        return ConvertResult(out=opts.out, files=files, dry_run=True, plan=plan, writer=writer,
                             part=None if opts.part is None else str(opts.part), **describe)
    if opts.part is not None or opts.resume:
        written = run_megatron_part(opts, inp, plan, writer, args)
        files = written.files
        if opts.part is None:  # --resume of a one-process run: part 0/1, published at once
            # (each file was hashed as it was written, or again when kept: not read a third time)
            files = run_finish(opts.out, workers=opts.workers, rehash=False).files
        return ConvertResult(out=opts.out, files=files, seconds=time.monotonic() - started,
                             part=None if opts.part is None else written.part, resumed=written.resumed, **describe)
    stale = stale_parts_warning(opts.out)
    if stale:
        opts.warn(stale)
    remove_abandoned_staging(opts.out, inputs)
    check_free_space(opts.out, writer.total_bytes, 0, CHECKPOINT_EXTRAS)
    with StagedOutput(opts.out, False, inputs, kind=MEGATRON_CHECKPOINT) as stage:
        files = stream_into(writer, stage.dir, plan, opts.progress, sum(t.nbytes for t in plan.tensors), opts.workers)
    return ConvertResult(out=opts.out, files=files, seconds=time.monotonic() - started, **describe)
