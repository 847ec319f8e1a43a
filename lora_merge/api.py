"""The Python API: what the `lora-merge` command does, as functions.

    import lora_merge
    result = lora_merge.merge(base="mcore/", lora="out/", hf_ref="hf/", out="merged/")
    report = lora_merge.verify("merged/", lora="out/", base="mcore/")

Keyword arguments mirror the command-line options. Bad input raises `MergeError` (one message saying what,
where and what was expected); nothing is printed — warnings go through `warnings.warn` (or `warn=`), and
progress through `progress(done_bytes, total_bytes)` when given. The command line is a thin layer on this.
"""

from __future__ import annotations

import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from lora_merge.architectures import Architecture, architecture_for
from lora_merge.describe import describe_dir
from lora_merge.errors import MergeError
from lora_merge.peft_adapter import EXPERT_FORMATS, adapter_config, build_adapter, write_adapter
from lora_merge.lora import LoraSettings, resolve_settings
from lora_merge.merge_pipeline import execute
from lora_merge.merge_plan import MergePlan, build_plan, check_lora_targets, plan_fp8_output
from lora_merge.hf_config import check_same_model, read_hf_config
from lora_merge.megatron_args import check_against_args
from lora_merge.model_shape import DTYPES, ModelShape
from lora_merge.options import MAX_WORKERS
from lora_merge.options import DEFAULT_SHARD_BYTES, MIN_SHARD_BYTES, parse_size  # noqa: F401  (part of the API)
from lora_merge.readers import open_checkpoint
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.readers import HF_DIR, PEFT_DIR, input_kind, is_megatron_checkpoint
from lora_merge.readers.hf_model import HfModel, read_hf_model
from lora_merge.readers.peft import read_peft_adapter
from lora_merge.report import hash_files, report_text, write_report
from lora_merge.value_checks import MAX_ALPHA, MAX_RANK, shown_value
from lora_merge.verification import VerifyReport, check_output_files, verify_output
from lora_merge.writers.background import BackgroundWriter
from lora_merge.writers.hf_files import ReferenceFiles, copy_reference_files, reference_files
from lora_merge.writers.model_card import adapter_card, checked_base_model_id, model_card, resolve_base_model
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
from lora_merge.writers.ownership import PEFT_ADAPTER, check_input_dir
from lora_merge.writers.staged_dir import (StagedOutput, check_free_space, check_output_target,
                                           remove_abandoned_side_files, remove_abandoned_staging)
from lora_merge.writers.targets import InputPaths, check_report_path
from lora_merge.parallel_layout import ParallelLayout
from lora_merge.megatron_target import ConvertResult, MegatronTarget, run_to_megatron

def _load_lazy_attributes() -> None:
    """transformers and huggingface_hub load their attributes on first access, which is not thread-safe:
    two threads' first merge at once failed with "module 'transformers' has no attribute 'CONFIG_MAPPING'".
    Loaded here, once, while this module is imported (Python's import lock serialises that)."""
    import transformers
    from huggingface_hub import ModelCard, ModelCardData  # noqa: F401

    transformers.CONFIG_MAPPING  # noqa: B018


_load_lazy_attributes()

# What each path argument names, for the message when it is missing or not a path.
LORA = "the LoRA dir (a Megatron checkpoint or a PEFT adapter)"
HF_REF = "the HF model dir of the base model"
BASE = "the base checkpoint dir"
OUT = "the output dir"


def shard_size(value: int | float | str) -> int:
    if isinstance(value, str):
        size = parse_size(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        size = int(value)  # 5e9 is how a byte count is naturally written in Python
    else:
        raise MergeError(f"max_shard_size {value!r}: expected a whole number of bytes or a size such as '5GB', "
                         "'500MB', '2GiB'")
    if size < MIN_SHARD_BYTES:
        raise MergeError(f"max_shard_size {value!r} is below 1MB; a shard that small only multiplies files")
    return size


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


@dataclass
class ExportResult:
    out: Path
    lora: str
    tensors: int
    bytes: int
    r: int
    alpha: float
    target_modules: list[str]
    target_parameters: list[str]
    files: list[str]


class _Progress:
    def __init__(self, callback, total: int):
        self.callback, self.total, self.done = callback, total, 0

    def update(self, n: int) -> None:
        self.done += n
        self.callback(self.done, self.total)


def _path(value, name: str = "path", what: str = "a directory") -> Path | None:
    if value is None:
        return None
    try:
        text = os.fspath(value)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise MergeError(f"{name}={value!r}: expected the path of {what} (a str or os.PathLike)")
    return Path(text)


def _required(value, name: str, what: str) -> Path:
    if value is None:
        raise MergeError(f"{name} is missing: expected the path of {what}")
    return _path(value, name, what)


def _abs(value) -> Path:
    return Path(os.path.abspath(value))  # `out="."` names a directory, not a link


def _lora_r(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= MAX_RANK:
        raise MergeError(f"lora_r={shown_value(value)}: expected a positive int (the LoRA rank) of at most {MAX_RANK}")
    return int(value)


def _lora_alpha(value) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or value > MAX_ALPHA):
        raise MergeError(f"lora_alpha={shown_value(value)}: expected a finite number above 0 and at most {MAX_ALPHA:g}")
    return value


def _workers(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS):
        raise MergeError(f"workers={value!r}: expected a whole number from 1 to {MAX_WORKERS}, or None for every core")
    return value


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise MergeError(f"{name}={shown_value(value)}: expected True or False")
    return value


def _callable(value, name: str, optional: bool = False):
    if not (callable(value) or (optional and value is None)):
        raise MergeError(f"{name}={value!r}: expected a function" + (" or None" if optional else ""))
    return value


def _warn_default(message: str) -> None:
    warnings.warn(message, stacklevel=3)


FP8 = "fp8"  # --dtype fp8 (or float8_e4m3fn): block-FP8 linear weights, as DeepSeek's and Qwen's releases


def _dtype_choice(value: str, fp8: bool = False) -> str:
    if not isinstance(value, str):
        raise MergeError(f"dtype {shown_value(value)}: expected auto, {', '.join(DTYPES)}" + (", fp8" if fp8 else ""))
    if fp8 and value in (FP8, "float8_e4m3fn"):
        return FP8
    if value != "auto" and value not in DTYPES:
        raise MergeError(f"dtype {value!r}: expected auto, {', '.join(DTYPES)}" + (", fp8" if fp8 else ""))
    return value


def merge(*, hf_ref, out, lora=None, base=None, dtype: str = "auto", max_shard_size: int | str = DEFAULT_SHARD_BYTES,
          lora_r: int | None = None, lora_alpha: float | None = None, allow_partial_lora: bool = False,
          force: bool = False, verify: bool = False, report=None, dry_run: bool = False, sha256: bool = True,
          workers: int | None = None, base_model_id: str | None = None,
          progress: Callable[[int, int], None] | None = None,
          warn: Callable[[str], None] = _warn_default) -> MergeResult:
    """Merge a Megatron LoRA checkpoint into an HF model at `out` (see `lora-merge --help`); without `lora`,
    convert the Megatron checkpoint `base` as it is."""
    if lora is None and base is None:
        raise MergeError("merge: give lora (a LoRA to merge) or base (a Megatron checkpoint to convert), or both")
    opts = SimpleNamespace(base=_path(base, "base", BASE), lora=_path(lora, "lora", LORA),
                           hf_ref=_required(hf_ref, "hf_ref", HF_REF), out=_abs(_required(out, "out", OUT)),
                           dtype=_dtype_choice(dtype, fp8=True), max_shard_size=shard_size(max_shard_size),
                           lora_r=_lora_r(lora_r), lora_alpha=_lora_alpha(lora_alpha),
                           allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"),
                           force=_flag(force, "force"), verify=_flag(verify, "verify"),
                           report=_path(report, "report", "a file"), dry_run=_flag(dry_run, "dry_run"),
                           sha256=_flag(sha256, "sha256"),
                           workers=_workers(workers), base_model_id=checked_base_model_id(base_model_id),
                           progress=_callable(progress, "progress", optional=True), warn=_callable(warn, "warn"))
    return run_merge(opts)


def to_megatron(*, hf_ref=None, out, base=None, lora=None, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                etp: int | None = None, decoder_first_pipeline_num_layers: int | None = None,
                decoder_last_pipeline_num_layers: int | None = None, ckpt_format: str = "torch",
                expert_layout: str = "sequential", make_vocab_size_divisible_by: int | None = None,
                padded_vocab_size: int | None = None, mla_naming: str = "megatron-core", dtype: str = "auto",
                lora_r: int | None = None,
                lora_alpha: float | None = None, allow_partial_lora: bool = False, dry_run: bool = False,
                workers: int | None = None, progress: Callable[[int, int], None] | None = None,
                warn: Callable[[str], None] = _warn_default) -> ConvertResult:
    """Write a Megatron checkpoint at `out` in the given layout from an HF model or a Megatron checkpoint,
    with a LoRA merged on the way if `lora` is given (see `lora-merge --to megatron --help`). `hf_ref`
    defaults to `base` when that is an HF model dir."""
    base_path = _path(base, "base", BASE)
    if hf_ref is None and base_path is not None and input_kind(base_path) == HF_DIR:
        hf_ref = base_path
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=tp if etp is None else etp,
                            first_stage_layers=decoder_first_pipeline_num_layers,
                            last_stage_layers=decoder_last_pipeline_num_layers)
    target = MegatronTarget(layout=layout, ckpt_format=ckpt_format, expert_layout=expert_layout,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                            padded_vocab_size=padded_vocab_size, mla_naming=mla_naming)
    opts = SimpleNamespace(base=base_path, lora=_path(lora, "lora", LORA), hf_ref=_required(hf_ref, "hf_ref", HF_REF),
                           out=_abs(_required(out, "out", OUT)), dtype=_dtype_choice(dtype), lora_r=_lora_r(lora_r),
                           lora_alpha=_lora_alpha(lora_alpha),
                           allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"),
                           dry_run=_flag(dry_run, "dry_run"), workers=_workers(workers), warn=_callable(warn, "warn"),
                           force=False,
                           progress=_callable(progress, "progress", optional=True))
    return run_to_megatron(opts, target)


def export_adapter(*, lora, hf_ref, out, base=None, dtype: str = "auto", expert_format: str = "per-expert",
                   lora_r: int | None = None, lora_alpha: float | None = None, allow_partial_lora: bool = False,
                   force: bool = False, report=None, base_model_id: str | None = None,
                   warn: Callable[[str], None] = _warn_default) -> ExportResult:
    """Write the LoRA as an unmerged PEFT adapter at `out` (see `lora-merge export-adapter --help`)."""
    if not isinstance(expert_format, str) or expert_format not in EXPERT_FORMATS:
        raise MergeError(f"expert_format {shown_value(expert_format)}: expected one of {', '.join(EXPERT_FORMATS)}")
    opts = SimpleNamespace(base=_path(base, "base", BASE),
                           lora=_required(lora, "lora", "the Megatron LoRA checkpoint dir"),
                           hf_ref=_required(hf_ref, "hf_ref", HF_REF),
                           out=_abs(_required(out, "out", "the adapter dir")),
                           dtype=_dtype_choice(dtype), expert_format=expert_format, lora_r=_lora_r(lora_r),
                           lora_alpha=_lora_alpha(lora_alpha),
                           allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"), force=_flag(force, "force"),
                           report=_path(report, "report", "a file"), base_model_id=checked_base_model_id(base_model_id),
                           warn=_callable(warn, "warn"))
    return run_export(opts)


def verify(out, *, lora=None, base=None, hf_ref=None, lora_r: int | None = None, lora_alpha: float | None = None,
           report=None, force: bool = False, warn: Callable[[str], None] = _warn_default) -> VerifyReport:
    """Check a merged output (see `lora-merge verify --help`); problems are in the report's `problems`
    (`ok` is False), bad input raises MergeError."""
    opts = SimpleNamespace(out=_required(out, "out", "the merged HF model dir"), lora=_path(lora, "lora", LORA),
                           base=_path(base, "base", BASE), hf_ref=_path(hf_ref, "hf_ref", HF_REF),
                           lora_r=_lora_r(lora_r), lora_alpha=_lora_alpha(lora_alpha),
                           report=_path(report, "report", "a file"), force=_flag(force, "force"),
                           warn=_callable(warn, "warn"))
    return run_verify(opts)


def inspect(checkpoint, verbose: bool = False) -> str:
    """What an input is, as text: a Megatron checkpoint (format, iteration, parallel layout, experts, LoRA,
    files), an HF model dir (model type, layers, tensors, dtypes, files) or a PEFT adapter (r, alpha, targets,
    adapted modules); `verbose` lists every tensor."""
    path = _required(checkpoint, "checkpoint", "a Megatron checkpoint, HF model or PEFT adapter dir")
    check_input_dir(path, "a Megatron checkpoint, HF model or PEFT adapter dir")
    return "\n".join(describe_dir(path, verbose=_flag(verbose, "verbose")))


# --- the runs, on an options namespace (the CLI's parsed arguments or the functions' keywords) ---

@dataclass
class Inputs:
    shape: ModelShape
    hf_config: dict
    arch: Architecture
    base: Checkpoint | None
    lora: Checkpoint | None
    settings: LoraSettings | None


def open_inputs(hf_dir: Path, base_dir: Path | None, lora_dir: Path | None, opts, need_base: bool) -> Inputs:
    notes: list[str] = []
    shape, hf_config = read_hf_config(hf_dir, notes)
    for note in notes:
        opts.warn(note)
    arch = architecture_for(shape)
    if lora_dir is not None and input_kind(lora_dir) == PEFT_DIR:
        return _open_peft(shape, hf_config, arch, hf_dir, base_dir, lora_dir, opts)
    lora = open_checkpoint(lora_dir) if lora_dir else None
    if base_dir is not None and input_kind(base_dir) == HF_DIR:
        if lora is None and not getattr(opts, "lora_optional", False):
            raise MergeError(f"{base_dir}: an HF model as --base needs a Megatron --lora to merge")
        check_same_model(shape, hf_dir, base_dir)
        if lora is None:  # a conversion of the HF weights as they are
            return Inputs(shape, hf_config, arch, read_hf_model(base_dir), None, None)
        base = read_hf_model(base_dir)
        check_against_args(shape, lora.args, str(lora.path))
        check_lora_targets(lora, arch, shape, getattr(opts, "allow_partial_lora", False))
        settings = resolve_settings(lora.args, opts.lora_r, opts.lora_alpha, str(lora_dir))
        for warning in settings.warnings:
            opts.warn(warning)
        return Inputs(shape, hf_config, arch, base, lora, settings)
    base = open_checkpoint(base_dir) if base_dir else lora
    if base_dir and not base.params:
        raise MergeError(f"{base_dir}: holds no base weights (is it a filtered LoRA checkpoint?)")
    if need_base and base is lora and lora is not None and not lora.params:
        raise MergeError(f"{lora_dir}: holds only LoRA weights (a filtered checkpoint); pass --base with the base model")
    if base is not None and not base.params:
        base = None
    for ckpt in {id(c): c for c in (base, lora) if c is not None}.values():
        check_against_args(shape, ckpt.args, str(ckpt.path))
    settings = None
    if lora is not None:
        check_lora_targets(lora, arch, shape, getattr(opts, "allow_partial_lora", False))
        settings = resolve_settings(lora.args, opts.lora_r, opts.lora_alpha, str(lora_dir))
        for warning in settings.warnings:
            opts.warn(warning)
    return Inputs(shape, hf_config, arch, base, lora, settings)


def _open_peft(shape, hf_config, arch, hf_dir: Path, base_dir: Path | None, lora_dir: Path, opts) -> Inputs:
    """A PEFT adapter goes onto HF weights: --base, or the reference's own when --base is not given."""
    if opts.lora_r is not None or opts.lora_alpha is not None:
        raise MergeError(f"{lora_dir}: --lora-r/--lora-alpha set a Megatron LoRA's settings; a PEFT adapter's r and "
                         "lora_alpha (and rank/alpha patterns) come from its adapter_config.json")
    base_dir = base_dir or hf_dir
    if input_kind(base_dir) != HF_DIR:
        raise MergeError(f"{base_dir}: a PEFT adapter is merged onto an HF model: --base (or --hf-ref) must be an HF "
                         "model dir with safetensors weights")
    check_same_model(shape, hf_dir, base_dir)
    adapter = read_peft_adapter(lora_dir, arch, shape)
    settings = LoraSettings(r=adapter.config["r"], alpha=float(adapter.config["lora_alpha"]),
                            source="adapter_config.json" + (", rsLoRA" if adapter.config.get("use_rslora") else "")
                            + (", per-module patterns" if adapter.config.get("rank_pattern")
                               or adapter.config.get("alpha_pattern") else ""))
    return Inputs(shape, hf_config, arch, read_hf_model(base_dir), adapter, settings)


def output_dtype(choice: str, shape: ModelShape, args) -> torch.dtype:
    if choice != "auto":
        return DTYPES[choice]
    if shape.dtype is not None:
        return shape.dtype
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def has_weights(hf_dir: Path | None) -> bool:
    return hf_dir is not None and any(hf_dir.glob("*.safetensors"))


def given_paths(*paths) -> InputPaths:
    """The input paths as given, for the checks made before anything is opened."""
    found = InputPaths()
    for path in paths:
        found.add(path)
    return found


def input_paths(inp: Inputs, hf_dirs, base_dir: Path | None, lora_dir: Path | None) -> InputPaths:
    """Every file and directory the run reads, for the checks on what it writes (`hf_dirs`: HF-layout dirs
    read: the reference, and for verify the output being checked)."""
    found = given_paths(base_dir, lora_dir)
    for ckpt in (inp.base, inp.lora):
        if ckpt is not None:
            found.add_tree(ckpt.path, ckpt.sources)
    for hf_dir in [hf_dirs] if isinstance(hf_dirs, Path) else hf_dirs:
        if hf_dir is not None and hf_dir.is_dir():
            found.add_tree(hf_dir, [hf_dir / name for name in ("config.json", "model.safetensors.index.json")]
                           + sorted(hf_dir.iterdir()) + sorted(hf_dir.glob("additional_chat_templates/*")))
    return found


def _inside(path: Path | None, directory: Path) -> bool:
    return path is not None and os.path.realpath(path.parent) == os.path.realpath(directory)


def _base_model(opts, inp: Inputs, reference: Path) -> tuple[str | None, str | None]:
    """The Hub id for the card's base_model (and the adapter's base_model_name_or_path), and the warning to
    give when only local paths are known: once the output is complete (it is about the published card, and
    would only clutter a failure) but before it is published, as every warning is, so that a `warn` that
    raises (or `warnings.simplefilter("error")`) stops the run with nothing published."""
    explicit = checked_base_model_id(getattr(opts, "base_model_id", None))
    hf_base = inp.base.path if isinstance(inp.base, HfModel) else None
    return resolve_base_model(explicit, [hf_base, reference], inp.hf_config)


def _reference_files(opts, reference: Path) -> ReferenceFiles:
    """What of the reference the output holds; a file that cannot be copied stops the run here, before any
    shard is written, and so does a report named like one of them."""
    found = reference_files(reference)
    if _inside(opts.report, opts.out) and (opts.report.name in found.copied or opts.report.name == "config.json"):
        raise MergeError(f"{opts.report}: the output holds the reference's {opts.report.name} under that name; "
                         "name the report e.g. merge-report.json")
    for note in found.notes():
        opts.warn(note)
    return found


def baseline_dir(inp: Inputs, hf_ref: Path | None) -> Path | None:
    """The HF weights a merged output is checked against: those the LoRA went onto when the base is HF (an
    HF --base, or --hf-ref's own for a PEFT adapter given without --base), else the reference's, if any."""
    if isinstance(inp.base, HfModel):
        return inp.base.path
    return hf_ref if has_weights(hf_ref) else None


def _check_input_dirs(opts) -> None:
    for path, what in ((opts.base, BASE), (opts.lora, LORA), (opts.hf_ref, HF_REF)):
        check_input_dir(path, what)


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


def run_merge(opts) -> MergeResult:
    started = time.monotonic()
    checked_base_model_id(getattr(opts, "base_model_id", None))  # a usage error, before any work
    _check_input_dirs(opts)
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True)
    check_report_path(opts.report, opts.force, roots, opts.out, early=True)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=True)
    ref_files = _reference_files(opts, opts.hf_ref)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    fp8 = opts.dtype == FP8
    dtype = torch.bfloat16 if fp8 else output_dtype(opts.dtype, inp.shape, getattr(inp.base, "args", None)
                                                    or getattr(inp.lora, "args", None))
    if opts.dtype == "auto" and inp.shape.dtype is None and isinstance(inp.base, HfModel):
        dtype = inp.base.dtype  # the HF weights' own
    plan = build_plan(inp.base, inp.lora, inp.shape, inp.arch, inp.settings, dtype)
    # what the rest keep: bf16, as the releases (an FP8 reference's config is read when it was checked)
    quantization = plan_fp8_output(plan, inp.base, inp.hf_config.get("quantization_config")) if fp8 else None
    for note in plan.notes:
        opts.warn(note)
    base_model, base_model_warning = _base_model(opts, inp, opts.hf_ref)
    hf_config = {**inp.hf_config, **plan.config_changes}
    hf_config.pop("quantization_config", None)  # an FP8 base's: the output is FP8 only where it says so
    dtype_name = str(dtype).removeprefix("torch.")
    if quantization is not None:
        hf_config["quantization_config"] = quantization
        rows, cols = quantization["weight_block_size"]
        dtype_name = f"block-FP8 (float8_e4m3fn, {rows}x{cols} scales) and bfloat16"
    writer_plan = plan.tensors
    tensor_bytes = sum(t.nbytes for t in writer_plan)
    if opts.dry_run:
        # A dry run says whether the run would work; one that would stop at the space check would not, so it
        # stops here the same way (the real run first removes killed runs' staging dirs; a dry run writes
        # and removes nothing, so it counts them as taken).
        check_free_space(opts.out, tensor_bytes, ref_files.total_bytes)
        return MergeResult(out=opts.out, base=inp.base.describe(), lora=_described(inp.lora),
                           dtype=dtype_name, tensors=len(writer_plan),
                           bytes=sum(t.nbytes for t in writer_plan), lora_modules=plan.merged_modules,
                           **_settings_fields(inp.settings), skipped=dict(plan.skipped), dry_run=True, plan=plan,
                           inputs=inp, copied_bytes=ref_files.total_bytes)

    verify_report = None
    # Space held by runs that were killed is given back before deciding whether there is enough.
    remove_abandoned_staging(opts.out, inputs)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    # The copied reference files count byte for byte (a tokenizer can be GBs); a margin covers config and card.
    check_free_space(opts.out, tensor_bytes, ref_files.total_bytes)
    with StagedOutput(opts.out, opts.force, inputs) as stage:
        staging = stage.dir
        writer = ShardedSafetensorsWriter(staging, writer_plan, opts.max_shard_size, hash_files=opts.sha256)
        progress = _Progress(opts.progress, writer.total_bytes) if opts.progress is not None else None
        background = BackgroundWriter(writer.write)
        try:
            try:
                execute(plan, background.write, progress.update if progress is not None else None,
                        workers=getattr(opts, "workers", None))
            finally:
                background.close()
            files = writer.finish()
        finally:
            background.stop()  # interrupted while waiting for it: the writer thread may still be writing
            writer.abort()
        files += copy_reference_files(opts.hf_ref, staging, hf_config, dtype)
        if opts.verify:
            reference = baseline_dir(inp, opts.hf_ref)
            verify_report = verify_output(staging, inp.arch, inp.shape, dtype, inp.lora, inp.settings,
                                          reference=reference, base=None if isinstance(inp.base, HfModel) else inp.base)
            verify_report.problems += check_output_files(staging, ref_files, card=False)  # no card yet
            if not verify_report.ok:
                raise VerificationFailed(opts.out, verify_report, published=False)
        if opts.sha256:
            hashes = writer.sha256 | hash_files(staging, [f for f in files if f not in writer.sha256])
        else:
            hashes = dict.fromkeys(files)  # listed, not hashed (--no-sha256)
        later = (opts.report.name,) if _inside(opts.report, opts.out) else ()
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


def run_export(opts) -> ExportResult:
    check_input_dir(opts.lora, LORA)
    if input_kind(opts.lora) == PEFT_DIR:
        raise MergeError(f"{opts.lora}: a PEFT adapter (adapter_config.json), already what export-adapter writes; "
                         "expected a Megatron LoRA checkpoint dir (PEFT and vLLM load this adapter as it is)")
    checked_base_model_id(getattr(opts, "base_model_id", None))
    _check_input_dirs(opts)
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True, kind=PEFT_ADAPTER)
    check_report_path(opts.report, opts.force, roots, opts.out, early=True)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=False)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs, kind=PEFT_ADAPTER)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    dtype = None if opts.dtype == "auto" else DTYPES[opts.dtype]
    if inp.base is not None and inp.base is not inp.lora and inp.lora.params:
        # an unfiltered LoRA holds the base it was trained on: a --base with other weights is refused, as the
        # merge refuses it (the plan's checks compare the two; nothing of the plan is run)
        build_plan(inp.base, inp.lora, inp.shape, inp.arch, inp.settings, torch.float32)
    adapter = build_adapter(inp.lora, inp.shape, inp.arch, inp.settings, dtype, opts.expert_format,
                            getattr(opts, "allow_partial_lora", False))
    tensors = adapter.tensors
    for warning in adapter.warnings:
        opts.warn(warning)
    base_model, base_model_warning = _base_model(opts, inp, opts.hf_ref)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    with StagedOutput(opts.out, opts.force, inputs, kind=PEFT_ADAPTER) as stage:
        files = write_adapter(stage.dir, tensors, adapter_config(inp.settings, adapter, base_model))
        hashes = hash_files(stage.dir, files)
        later = (opts.report.name,) if _inside(opts.report, opts.out) else ()
        with (stage.dir / "README.md").open("x") as f:
            f.write(adapter_card(opts.out.name, inp.lora, inp.settings, adapter.target_modules + adapter.target_parameters,
                                 hashes, base_model, later))
        files.append("README.md")
        if opts.report:
            stage.side_file(opts.report, report_text(inp, opts.hf_ref, None, {}, hashes, None))
        if base_model_warning:  # once the adapter is complete, before it is published
            opts.warn(base_model_warning)
    return ExportResult(out=opts.out, lora=inp.lora.describe(), tensors=len(tensors),
                        bytes=sum(t.nbytes for t in tensors.values()), r=inp.settings.r, alpha=inp.settings.alpha,
                        target_modules=adapter.target_modules, target_parameters=adapter.target_parameters,
                        files=files)


def run_verify(opts) -> VerifyReport:
    out = opts.out
    check_input_dir(out, "the merged HF model dir")
    _check_input_dirs(opts)
    roots = given_paths(out, opts.base, opts.lora, opts.hf_ref)
    check_report_path(opts.report, opts.force, roots, early=True)
    if not (out / "config.json").is_file():
        if is_megatron_checkpoint(out):
            raise MergeError(f"{out}: a Megatron checkpoint; verify checks HF outputs only (verifying a Megatron "
                             "output is not supported: convert it to HF with `lora-merge --base OUT --hf-ref HF_DIR "
                             "--out HF_OUT` and verify that)")
        raise MergeError(f"{out}: no config.json; not a merged model directory")
    base_dir = opts.base
    if base_dir is None and opts.lora is not None and input_kind(opts.lora) == PEFT_DIR and has_weights(opts.hf_ref):
        base_dir = opts.hf_ref  # as the merge took it: a PEFT adapter without --base went onto --hf-ref's weights
    inp = open_inputs(out, base_dir, opts.lora, opts, need_base=False)
    inputs = input_paths(inp, [out, opts.hf_ref], opts.base, opts.lora)
    check_report_path(opts.report, opts.force, inputs)
    dtype = inp.shape.dtype or torch.float32
    hf_base = isinstance(inp.base, HfModel)
    # A PEFT adapter with neither --base nor weights in --hf-ref is opened onto the output itself: no baseline.
    reference = None if hf_base and inp.base.path == out else baseline_dir(inp, opts.hf_ref)
    report = verify_output(out, inp.arch, inp.shape, dtype, inp.lora, inp.settings, reference=reference,
                           base=None if hf_base else inp.base)
    for note in report.notes:  # what is right but will be misread by some loader (a merge warns of it in its plan)
        opts.warn(note)
    # The reference's files as the merge copied them (the merge copies from --hf-ref only, never from --base).
    report.problems += check_output_files(out, reference_files(opts.hf_ref) if opts.hf_ref else None, card=True,
                                          known=report.problems)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
        files = sorted(p.name for p in out.iterdir() if p.is_file())
        write_report(opts.report, report_text(inp, opts.hf_ref, None, {}, hash_files(out, files), report),
                     opts.force)
    return report
