"""The Python API: what the `lora-merge` command does, as functions.

    import lora_merge
    result = lora_merge.merge(base="mcore/", lora="out/", hf_ref="hf/", out="merged/")
    report = lora_merge.verify("merged/", lora="out/", base="mcore/")

Keyword arguments mirror the command-line options. Bad input raises `MergeError` (one message saying what,
where and what was expected); nothing is printed — warnings go through `warnings.warn` (or `warn=`), and
progress through `progress(done_bytes, total_bytes)` when given. The command line is a thin layer on this.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect as _signature
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Callable

from lora_merge import options as limits
from lora_merge.files import remote
from lora_merge.files.parts_dir import STAGED
from lora_merge.readers.describe import describe_dir
from lora_merge.errors import MergeError, UsageError
from lora_merge.megatron_target import MegatronTarget
from lora_merge.model.model_shape import DTYPES
from lora_merge.options import DEFAULT_SHARD_BYTES, MAX_WORKERS, MIN_SHARD_BYTES, argument_name, parse_size  # noqa: F401
from lora_merge.model.parallel_layout import ParallelLayout
from lora_merge.peft_adapter import EXPERT_FORMATS
from lora_merge.readers.detect import check_input_dir
from lora_merge.runs.export import ExportResult, run_export
from lora_merge.runs.inputs import BASE, HF_REF, LORA, OUT, reference_dir
from lora_merge.runs.finish import FinishResult, run_finish
from lora_merge.runs.parts import parse_part
from lora_merge.runs.options import FP8, MXFP4, ExportOptions, MegatronOptions, MergeOptions, VerifyOptions
from lora_merge.runs.to_hf import MergeResult, VerificationFailed, run_merge  # noqa: F401  (API)
from lora_merge.runs.to_megatron import ConvertResult, run_to_megatron
from lora_merge.runs.verify import run_verify
from lora_merge.value_checks import MAX_ALPHA, MAX_RANK, is_number, shown_value
from lora_merge.verification import VerifyReport
from lora_merge.writers.model_card import checked_base_model_id


def _load_lazy_attributes() -> None:
    """transformers and huggingface_hub load their attributes on first access, which is not thread-safe:
    two threads' first merge at once failed with "module 'transformers' has no attribute 'CONFIG_MAPPING'".
    Loaded here, once, while this module is imported (Python's import lock serialises that)."""
    import transformers
    from huggingface_hub import ModelCard, ModelCardData  # noqa: F401

    transformers.CONFIG_MAPPING  # noqa: B018


_load_lazy_attributes()

def shard_size(value: int | float | str) -> int:
    if isinstance(value, str):
        size = parse_size(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        size = int(value)  # 5e9 is how a byte count is naturally written in Python
    else:
        raise UsageError(f"{argument_name('max_shard_size')} {value!r}: expected a whole number of bytes or a size such as '5GB', "
                         "'500MB', '2GiB'")
    if size < limits.MIN_SHARD_BYTES:
        raise UsageError(f"{argument_name('max_shard_size')} {value!r} is below 1MB; a shard that small only multiplies files")
    return size


def _storage_options(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise UsageError(f"{argument_name('storage_options')}={shown_value(value)}: expected a dict of the URL's "
                         "filesystem options (string keys), as fsspec takes them")
    return value


def _through_urls(*inputs: str, output: str | None = None, resumable: bool = False, finishes: bool = False):
    """Let the decorated function take URLs (s3://…, any fsspec URL; files/remote.py) for `inputs` and `output`:
    inputs are read through local shadow directories. A `resumable` function's output at a URL is written as
    parts are (each file uploaded once complete, `--part`/`--resume`/`finish` at the URL); where the run checks its
    output before publishing it (`verify`, `sha256=False`) or cannot be resumed, the output is staged locally
    whole and published once complete. `finishes`: the function publishes the parts already at `output`."""
    def wrap(fn):
        signature = _signature.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            kw = bound.arguments
            options = _storage_options(kw.get("storage_options"))
            many = lambda v: isinstance(v, (list, tuple))  # noqa: E731
            given = [k for k in inputs if any(remote.is_url(v) for v in (kw.get(k) if many(kw.get(k)) else [kw.get(k)]))]
            to_url = output is not None and remote.is_url(kw.get(output))
            if remote.is_url(kw.get("report")):
                raise UsageError(f"{argument_name('report')}={kw['report']}: the report is written to a local file")
            if not given and not to_url:
                return fn(*bound.args, **bound.kwargs)
            if to_url and kw.get("force"):
                raise UsageError(f"{argument_name('force')} with {argument_name(output)} {kw[output]}: an output at a "
                                 "URL is never written over (remove its objects first)")
            continued = kw.get("part") is not None or bool(kw.get("resume")) or finishes
            streamed = to_url and resumable and not continued and not kw.get("verify") and kw.get("sha256", True) \
                and not kw.get("dry_run")
            with remote.RemoteRun(options) as run:
                try:
                    for k in given:
                        value = kw[k]
                        kw[k] = [run.input(v) if remote.is_url(v) else v for v in value] if many(value) \
                            else run.input(value)
                    url = kw.get(output) if to_url else None
                    if to_url and resumable and (continued or streamed):
                        kw[output] = run.output_parts(url, fresh=streamed, finishing=finishes,
                                                      dry_run=bool(kw.get("dry_run")))
                        if streamed:
                            kw["resume"] = True  # (from nothing: part 0/1, finished at once)
                    elif to_url:
                        kw[output] = run.output_dir(url)
                    if callable(kw.get("warn")):
                        warn = kw["warn"]
                        kw["warn"] = lambda message: warn(run.named(message))
                    try:
                        result = fn(*bound.args, **bound.kwargs)
                    except BaseException as exc:
                        if streamed:  # a one-process run leaves nothing behind (a part or a resumed run: its files)
                            if run.discard_output() and isinstance(exc, MergeError) and "were removed" not in str(exc):
                                exc.args = (f"{exc}; the objects uploaded were removed",) + exc.args[1:]
                            if STAGED and STAGED[-1] == url.rstrip("/"):
                                STAGED.pop()
                        raise
                    if to_url and run.output is not None and not getattr(result, "dry_run", False):
                        run.publish()
                    result = _named(result, run.named)
                    if to_url:
                        result.out = url
                    return result
                except MergeError as exc:  # named by the URLs the caller gave, not the local shadows
                    exc.args = (run.named(str(exc)),) + exc.args[1:]
                    raise
        return call
    return wrap


def _named(value, named: Callable[[str], str]):
    """A result whose texts (an input's description, verify's baseline, ...) name each local shadow or staging
    directory of a run with URLs by its URL; what is not text is left as it is."""
    if isinstance(value, str):
        return named(value)
    if isinstance(value, list):
        return [_named(v, named) for v in value]
    if isinstance(value, dict):
        return {k: _named(v, named) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a result (not its plan or inputs)
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if isinstance(item, (str, list, dict, VerifyReport)):
                setattr(value, field.name, _named(item, named))
    return value


def _path(value, name: str = "path", what: str = "a directory") -> Path | None:
    if value is None:
        return None
    try:
        text = os.fspath(value)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise UsageError(f"{argument_name(name)}={value!r}: expected the path of {what} (a str or os.PathLike)")
    return Path(text)


def _required(value, name: str, what: str) -> Path:
    if value is None:
        raise UsageError(f"{argument_name(name)} is missing: expected the path of {what}")
    return _path(value, name, what)


def _abs(value) -> Path:
    return Path(os.path.abspath(value))  # `out="."` names a directory, not a link


def _lora_r(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= MAX_RANK:
        raise UsageError(f"{argument_name('lora_r')}={shown_value(value)}: expected a positive int (the LoRA rank) of at most {MAX_RANK}")
    return int(value)


def _lora_alpha(value) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or value > MAX_ALPHA):
        raise UsageError(f"{argument_name('lora_alpha')}={shown_value(value)}: expected a finite number above 0 and at most {MAX_ALPHA:g}")
    return value


def _workers(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS):
        raise UsageError(f"{argument_name('workers')}={value!r}: expected a whole number from 1 to {MAX_WORKERS}, or None for every core")
    return value


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{argument_name(name)}={shown_value(value)}: expected True or False")
    return value


def _callable(value, name: str, optional: bool = False):
    if not (callable(value) or (optional and value is None)):
        raise UsageError(f"{argument_name(name)}={value!r}: expected a function" + (" or None" if optional else ""))
    return value


def _warn_default(message: str) -> None:
    warnings.warn(message, stacklevel=3)


MAX_LORAS = 64  # adapters merged at once: far above any real blend, and each one's factors are held while merging


def _loras(lora, weights) -> tuple[tuple[Path, ...], tuple[float, ...] | None]:
    """The adapter dirs (`lora`: one, or a list of PEFT adapter dirs) and their weights, checked."""
    many = isinstance(lora, (list, tuple))
    paths = tuple(_path(p, "lora", LORA) for p in lora) if many else ((_path(lora, "lora", LORA),) if lora is not None
                                                                      else ())
    if many and not 1 <= len(paths) <= MAX_LORAS:
        raise UsageError(f"{argument_name('lora')}: {len(paths)} adapters; expected 1 to {MAX_LORAS}")
    if len(set(p.resolve() for p in paths)) != len(paths):
        raise UsageError(f"{argument_name('lora')}: an adapter given twice; give each once (weight it instead)")
    if weights is None:
        return paths, None
    if not isinstance(weights, (list, tuple)) or not all(is_number(w) and math.isfinite(w) for w in weights):
        raise UsageError(f"{argument_name('lora_weights')}={shown_value(weights)}: expected a list of finite numbers, "
                         "one per adapter")
    if len(weights) != len(paths):
        raise UsageError(f"{argument_name('lora_weights')}: {len(weights)} weight(s) for {len(paths)} adapter(s); "
                         "give one per adapter")
    return paths, tuple(float(w) for w in weights)


def _dtype_choice(value: str, quantized: bool = False) -> str:
    """`quantized`: the merge's output, which may also be block-FP8 or MXFP4."""
    expected = f"expected auto, {', '.join(DTYPES)}" + (f", {FP8}, {MXFP4}" if quantized else "")
    if not isinstance(value, str):
        raise UsageError(f"{argument_name('dtype')} {shown_value(value)}: {expected}")
    if quantized and value in (FP8, "float8_e4m3fn"):
        return FP8
    if quantized and value == MXFP4:
        return MXFP4
    if value != "auto" and value not in DTYPES:
        raise UsageError(f"{argument_name('dtype')} {value!r}: {expected}")
    return value


@_through_urls("base", "lora", "hf_ref", output="out", resumable=True)
def merge(*, hf_ref, out, lora=None, base=None, dtype: str = "auto", max_shard_size: int | str = DEFAULT_SHARD_BYTES,
          lora_weights=None, lora_r: int | None = None, lora_alpha: float | None = None, allow_partial_lora: bool = False,
          force: bool = False, verify: bool = False, report=None, dry_run: bool = False, sha256: bool = True,
          workers: int | None = None, base_model_id: str | None = None,
          progress: Callable[[int, int], None] | None = None, part=None, resume: bool = False,
          warn: Callable[[str], None] = _warn_default, storage_options: dict | None = None) -> MergeResult:
    """Merge a Megatron LoRA checkpoint into an HF model at `out` (see `lora-merge --help`); without `lora`,
    convert the Megatron checkpoint `base` as it is. `lora` may be a list of PEFT adapter dirs, merged together
    as W + Σ wᵢ·ΔWᵢ with `lora_weights` (one each; 1 each by default).

    `part="I/N"` (or (I, N)): write only part I of N of the files, for `finish(out)` to publish once every part
    has run (any order, any host sharing the directory). `resume`: keep the files that a killed run of this
    part (or, without `part`, of this merge) completed, checked by their sha256.

    `base`, `lora`, `hf_ref` and `out` may be URLs (s3://…, or any fsspec URL), read by byte ranges, each output
    file uploaded once complete and the index and card last (files/remote.py); `storage_options` go to the URL's
    filesystem. A dry run's `plan` and `inputs` then refer to local copies removed when it returns (its other
    fields name the URLs)."""
    if lora is None and base is None:
        raise MergeError("merge: give lora (a LoRA to merge) or base (a Megatron checkpoint to convert), or both")
    loras, weights = _loras(lora, lora_weights)
    opts = MergeOptions(base=_path(base, "base", BASE), lora=loras[0] if loras else None, more_loras=loras[1:],
                        lora_weights=weights,
                        hf_ref=_required(hf_ref, "hf_ref", HF_REF), out=_abs(_required(out, "out", OUT)),
                        dtype=_dtype_choice(dtype, quantized=True), max_shard_size=shard_size(max_shard_size),
                        lora_r=_lora_r(lora_r), lora_alpha=_lora_alpha(lora_alpha),
                        allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"),
                        force=_flag(force, "force"), verify=_flag(verify, "verify"),
                        report=_path(report, "report", "a file"), dry_run=_flag(dry_run, "dry_run"),
                        sha256=_flag(sha256, "sha256"),
                        workers=_workers(workers), base_model_id=checked_base_model_id(base_model_id),
                        progress=_callable(progress, "progress", optional=True), warn=_callable(warn, "warn"),
                        part=parse_part(part), resume=_flag(resume, "resume"))
    return run_merge(opts)


@_through_urls(output="out", resumable=True, finishes=True)
def finish(out, *, force: bool = False, workers: int | None = None, rehash: bool = True,
           storage_options: dict | None = None) -> FinishResult:
    """Publish a merge run in parts (`merge(..., part="I/N")`) at `out`: every part of one plan must have
    completed and every file must still have the sha256 its part recorded (`rehash=False`: the size; the
    sha256 as recorded while writing); then the index, config, reference files, card and report are written
    and the directory is renamed into place (see `lora-merge finish --help`)."""
    return run_finish(_abs(_required(out, "out", OUT)), force=_flag(force, "force"), workers=_workers(workers),
                      rehash=_flag(rehash, "rehash"), storage_options=_storage_options(storage_options))


@_through_urls("base", "lora", "hf_ref", output="out", resumable=True)
def to_megatron(*, hf_ref=None, out, base=None, lora=None, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                etp: int | None = None, decoder_first_pipeline_num_layers: int | None = None,
                decoder_last_pipeline_num_layers: int | None = None, ckpt_format: str = "torch",
                expert_layout: str = "sequential", make_vocab_size_divisible_by: int | None = None,
                padded_vocab_size: int | None = None, mla_naming: str = "megatron-core",
                transformer_impl: str = "local", dtype: str = "auto",
                lora_r: int | None = None,
                lora_alpha: float | None = None, allow_partial_lora: bool = False, dry_run: bool = False,
                workers: int | None = None, progress: Callable[[int, int], None] | None = None, part=None,
                resume: bool = False, warn: Callable[[str], None] = _warn_default,
                storage_options: dict | None = None) -> ConvertResult:
    """Write a Megatron checkpoint at `out` in the given layout from an HF model or a Megatron checkpoint,
    with a LoRA merged on the way if `lora` is given (see `lora-merge --to megatron --help`). `hf_ref`
    defaults to `base` when that is an HF model dir. `part` and `resume` as for `merge` (whole files of the
    checkpoint)."""
    base_path = _path(base, "base", BASE)
    hf_ref = reference_dir(base_path, _path(hf_ref, "hf_ref", HF_REF))
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=tp if etp is None else etp,
                            first_stage_layers=decoder_first_pipeline_num_layers,
                            last_stage_layers=decoder_last_pipeline_num_layers)
    target = MegatronTarget(layout=layout, ckpt_format=ckpt_format, expert_layout=expert_layout,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                            padded_vocab_size=padded_vocab_size, mla_naming=mla_naming,
                            transformer_impl=transformer_impl)
    opts = MegatronOptions(base=base_path, lora=_path(lora, "lora", LORA), hf_ref=_required(hf_ref, "hf_ref", HF_REF),
                           out=_abs(_required(out, "out", OUT)), target=target, dtype=_dtype_choice(dtype),
                           lora_r=_lora_r(lora_r), lora_alpha=_lora_alpha(lora_alpha),
                           allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"),
                           dry_run=_flag(dry_run, "dry_run"), workers=_workers(workers), warn=_callable(warn, "warn"),
                           progress=_callable(progress, "progress", optional=True), part=parse_part(part),
                           resume=_flag(resume, "resume"))
    return run_to_megatron(opts)


@_through_urls("base", "lora", "hf_ref", output="out")
def export_adapter(*, lora, hf_ref, out, base=None, dtype: str = "auto", expert_format: str = "per-expert",
                   lora_r: int | None = None, lora_alpha: float | None = None, allow_partial_lora: bool = False,
                   force: bool = False, report=None, base_model_id: str | None = None,
                   warn: Callable[[str], None] = _warn_default, storage_options: dict | None = None) -> ExportResult:
    """Write the LoRA as an unmerged PEFT adapter at `out` (see `lora-merge export-adapter --help`)."""
    if not isinstance(expert_format, str) or expert_format not in EXPERT_FORMATS:
        raise UsageError(f"{argument_name('expert_format')} {shown_value(expert_format)}: expected one of {', '.join(EXPERT_FORMATS)}")
    opts = ExportOptions(base=_path(base, "base", BASE),
                         lora=_required(lora, "lora", "the Megatron LoRA checkpoint dir"),
                         hf_ref=_required(hf_ref, "hf_ref", HF_REF),
                         out=_abs(_required(out, "out", "the adapter dir")),
                         dtype=_dtype_choice(dtype), expert_format=expert_format, lora_r=_lora_r(lora_r),
                         lora_alpha=_lora_alpha(lora_alpha),
                         allow_partial_lora=_flag(allow_partial_lora, "allow_partial_lora"), force=_flag(force, "force"),
                         report=_path(report, "report", "a file"), base_model_id=checked_base_model_id(base_model_id),
                         warn=_callable(warn, "warn"))
    return run_export(opts)


@_through_urls("out", "base", "lora", "hf_ref")
def verify(out, *, lora=None, base=None, hf_ref=None, lora_weights=None, lora_r: int | None = None,
           lora_alpha: float | None = None, report=None, force: bool = False,
           warn: Callable[[str], None] = _warn_default, storage_options: dict | None = None) -> VerifyReport:
    """Check a merged output (see `lora-merge verify --help`); problems are in the report's `problems`
    (`ok` is False), bad input raises MergeError. `lora` and `lora_weights` as for `merge`."""
    loras, weights = _loras(lora, lora_weights)
    opts = VerifyOptions(out=_required(out, "out", "the merged HF model dir"), lora=loras[0] if loras else None,
                         more_loras=loras[1:], lora_weights=weights,
                         base=_path(base, "base", BASE), hf_ref=_path(hf_ref, "hf_ref", HF_REF),
                         lora_r=_lora_r(lora_r), lora_alpha=_lora_alpha(lora_alpha),
                         report=_path(report, "report", "a file"), force=_flag(force, "force"),
                         warn=_callable(warn, "warn"))
    return run_verify(opts)


@_through_urls("checkpoint")
def inspect(checkpoint, verbose: bool = False, storage_options: dict | None = None) -> str:
    """What an input is, as text: a Megatron checkpoint (format, iteration, parallel layout, experts, LoRA,
    files), an HF model dir (model type, layers, tensors, dtypes, files) or a PEFT adapter (r, alpha, targets,
    adapted modules); `verbose` lists every tensor."""
    path = _required(checkpoint, "checkpoint", "a Megatron checkpoint, HF model or PEFT adapter dir")
    check_input_dir(path, "a Megatron checkpoint, HF model or PEFT adapter dir")
    return "\n".join(describe_dir(path, verbose=_flag(verbose, "verbose")))


