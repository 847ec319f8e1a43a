"""Command line.

    lora-merge [merge] --base BASE --lora LORA --hf-ref HF --out OUT   merge into an HF model
    lora-merge verify OUT --lora LORA [--base BASE] [--hf-ref HF]      check a merged output
    lora-merge inspect DIR                                            what a checkpoint is
    lora-merge export-adapter --lora LORA --hf-ref HF --out DIR        unmerged PEFT adapter
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_merge import __version__
from lora_merge.describe import describe
from lora_merge.export_adapter import EXPERT_FORMATS, VLLM_DEFAULT_MAX_LORA_RANK, adapter_config, build_adapter, write_adapter
from lora_merge.architectures import Architecture, architecture_for
from lora_merge.errors import MergeError
from lora_merge.lora import LoraSettings, resolve_settings
from lora_merge.merge import MergePlan, build_plan, check_lora_targets, execute
from lora_merge.model_shape import DTYPES, ModelShape, check_against_args, read_hf_config
from lora_merge.readers import open_checkpoint
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.interrupts import Interrupted, signals_raise
from lora_merge.report import hash_files, report_text, write_report
from lora_merge.verify import VerifyReport, verify_output
from lora_merge.writers.background import BackgroundWriter
from lora_merge.writers.hf_files import COPIED_FILES, copy_reference_files, reference_files
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
from lora_merge.writers.staged_dir import (PUBLISHED, StagedOutput, check_free_space, check_output_target,
                                           remove_abandoned_side_files, remove_abandoned_staging)
from lora_merge.writers.targets import InputPaths, check_report_path

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SUBCOMMANDS = ("merge", "verify", "inspect", "export-adapter")


def parse_size(text: str) -> int:
    m = SIZE.match(text)
    if not m or (m.group(2) or "").upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").upper()])


MIN_SHARD_BYTES = 10**6


def shard_size(text: str) -> int:
    size = parse_size(text)
    if size < MIN_SHARD_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1MB; a shard that small only multiplies files")
    return size


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error of the tool."""

    def error(self, message: str):
        self.exit(2, f"lora-merge: error: {message} (see `{self.prog} --help`)\n")


def _lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-r", type=int, help="LoRA rank; overrides args.lora_r of the LoRA checkpoint")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (> 0); overrides args.lora_alpha of the LoRA checkpoint")
    p.add_argument("--report", type=Path, metavar="FILE", help="write a JSON report: inputs, LoRA settings, "
                   "per-tensor status, sha256 of every output file")
    p.add_argument("--debug", action="store_true", help="show a traceback on errors")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge",
        usage="lora-merge [merge] --base BASE --lora LORA --hf-ref HF --out OUT [options]\n"
              "       lora-merge verify|inspect|export-adapter ... (see below)",
        description="Merge a MindSpeed-LLM / Megatron-Core LoRA checkpoint into a HuggingFace model "
                    "(sharded safetensors + config + tokenizer), on CPU, without Megatron.",
        epilog="subcommands (each has its own --help):\n"
               "  merge            (the default) merge LoRA into the base and write an HF model\n"
               "  verify           check a merged output against its inputs\n"
               "  inspect          print what a Megatron checkpoint is\n"
               "  export-adapter   write the LoRA as an unmerged PEFT adapter (PEFT, vLLM, SGLang)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", type=Path, help="base Megatron checkpoint dir (with latest_checkpointed_iteration.txt, "
                   "or an iter_*/release dir); may be omitted when --lora is an unfiltered LoRA checkpoint")
    p.add_argument("--lora", type=Path, required=True, help="LoRA checkpoint dir written by MindSpeed-LLM "
                   "(filtered: only *lora* keys; or unfiltered: base weights included)")
    p.add_argument("--hf-ref", type=Path, required=True, help="HF model dir of the base model: its config.json "
                   "defines the architecture; config, generation config and tokenizer files are copied (weights are not)")
    p.add_argument("--out", type=Path, required=True, help="output dir for the merged HF model (must not exist "
                   "unless --force); written atomically")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="output dtype; auto = the reference "
                   "config's dtype, else the checkpoint's training dtype (default: auto)")
    p.add_argument("--max-shard-size", type=shard_size, default=parse_size("5GB"), metavar="SIZE",
                   help="largest safetensors shard, at least 1MB, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    p.add_argument("--verify", action="store_true", help="read the output back and verify it (see `lora-merge "
                   "verify`) before it is moved into place; doubles the I/O")
    p.add_argument("--dry-run", action="store_true", help="detect and print the plan; write nothing")
    p.add_argument("--allow-partial-lora", action="store_true", help="merge even though some layers lack LoRA "
                   "weights for a target (by default that stops the merge: the checkpoint looks incomplete)")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier output) and --report if they exist, "
                   "only once the new output is complete; never an input")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _lora_options(p)
    p.add_argument("--version", action="version", version=f"lora-merge {__version__}")
    return p


def build_verify_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge verify",
        description="Check a merged output: tensor names, shapes and dtypes against its config; finiteness; "
                    "untouched tensors bit-identical to the baseline; LoRA-touched tensors equal to "
                    "baseline + (alpha/r)·B·A within one rounding. The baseline is the reference model's weights "
                    "when --hf-ref holds *.safetensors, else the Megatron --base.",
    )
    p.add_argument("out", type=Path, help="the merged HF model dir")
    p.add_argument("--lora", type=Path, help="the LoRA checkpoint that was merged (needed for the value checks)")
    p.add_argument("--base", type=Path, help="base Megatron checkpoint (baseline when --hf-ref has no weights)")
    p.add_argument("--hf-ref", type=Path, help="reference HF model dir; its weights, if any, are the baseline")
    p.add_argument("--force", action="store_true", help="replace --report if it exists")
    _lora_options(p)
    return p


def build_inspect_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge inspect",
        description="Print what a Megatron checkpoint is: format, iteration, TP/PP/VPP, architecture from its "
                    "args, tensors per rank file, LoRA targets with r/alpha, dtype, total size.")
    p.add_argument("checkpoint", type=Path, help="checkpoint dir (with latest_checkpointed_iteration.txt, or iter_*)")
    p.add_argument("--debug", action="store_true", help="show a traceback on errors")
    return p


def build_export_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge export-adapter",
        description="Write the LoRA as an unmerged PEFT adapter (adapter_model.safetensors + adapter_config.json, "
                    "HF module names) that PEFT and vLLM load on top of the HF base model.")
    p.add_argument("--lora", type=Path, required=True, help="LoRA checkpoint dir written by MindSpeed-LLM")
    p.add_argument("--hf-ref", type=Path, required=True, help="HF model dir of the base model (its config.json "
                   "defines the architecture)")
    p.add_argument("--out", type=Path, required=True, help="adapter output dir (must not exist unless --force)")
    p.add_argument("--base", type=Path, help="optional base Megatron checkpoint, only cross-checked against the config")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="adapter dtype; auto = as stored in the LoRA checkpoint (default)")
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, default="per-expert",
                   help="routed experts' LoRA: per-expert = one LoRA per expert and projection under the HF checkpoint "
                        "names (vLLM; PEFT for qwen3_moe and mixtral); fused = one LoRA per transformers-5 fused "
                        "expert parameter (PEFT target_parameters, every MoE model type)")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier adapter) and --report if they exist")
    p.add_argument("--no-progress", action="store_true", help="accepted for symmetry with merge (no progress bar here)")
    _lora_options(p)
    return p


PARSERS = {"merge": build_parser, "verify": build_verify_parser, "inspect": build_inspect_parser,
           "export-adapter": build_export_parser}


@dataclass
class Inputs:
    shape: ModelShape
    hf_config: dict
    arch: Architecture
    base: Checkpoint | None
    lora: Checkpoint | None
    settings: LoraSettings | None


def open_inputs(hf_dir: Path, base_dir: Path | None, lora_dir: Path | None, opts, need_base: bool) -> Inputs:
    shape, hf_config = read_hf_config(hf_dir)
    arch = architecture_for(shape)
    lora = open_checkpoint(lora_dir) if lora_dir else None
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
            print(f"lora-merge: warning: {warning}", file=sys.stderr)
    return Inputs(shape, hf_config, arch, base, lora, settings)


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
            found.add_tree(hf_dir, [hf_dir / name for name in ("config.json", "model.safetensors.index.json",
                                                               *COPIED_FILES)] + sorted(hf_dir.iterdir()))
    return found


class VerificationFailed(MergeError):
    def __init__(self, out: Path, report: VerifyReport, published: bool):
        self.report, self.out = report, out
        what = "" if published else ", nothing published"
        super().__init__(f"{out}: verification failed ({len(report.problems)} problem(s)){what}")


def run_merge(opts) -> dict:
    started = time.monotonic()
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True)
    check_report_path(opts.report, opts.force, roots, opts.out)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=True)
    reference_files(opts.hf_ref)  # a broken reference file stops the run before any shard is written
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    dtype = output_dtype(opts.dtype, inp.shape, inp.base.args)
    plan = build_plan(inp.base, inp.lora, inp.shape, inp.arch, inp.settings, dtype)
    writer_plan = plan.tensors
    if opts.dry_run:
        print_plan(opts, inp, plan)
        return {}

    verify_report = None
    # Space held by runs that were killed is given back before deciding whether there is enough.
    remove_abandoned_staging(opts.out, inputs)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    check_free_space(opts.out, sum(t.nbytes for t in writer_plan) + (64 << 20))
    with StagedOutput(opts.out, opts.force, inputs) as stage:
        staging = stage.dir
        writer = ShardedSafetensorsWriter(staging, writer_plan, opts.max_shard_size, hash_files=bool(opts.report))
        progress = _progress_bar(writer.total_bytes, disabled=opts.no_progress)
        background = BackgroundWriter(writer.write)
        try:
            try:
                execute(plan, background.write, progress.update)
            finally:
                background.close()
            files = writer.finish()
        finally:
            writer.abort()
            progress.close()
        files += copy_reference_files(opts.hf_ref, staging, inp.hf_config, dtype)
        if opts.verify:
            verify_report = verify_output(staging, inp.arch, inp.shape, dtype, inp.lora, inp.settings,
                                          reference=opts.hf_ref if has_weights(opts.hf_ref) else None, base=inp.base)
            if not verify_report.ok:
                raise VerificationFailed(opts.out, verify_report, published=False)
        if opts.report:
            hashes = writer.sha256 | hash_files(staging, [f for f in files if f not in writer.sha256])
            stage.side_file(opts.report, report_text(inp, opts.hf_ref, plan, writer.file_of(), hashes, verify_report))

    return {
        "out": str(opts.out), "base": inp.base.describe(), "lora": inp.lora.describe(),
        "tensors": len(writer_plan), "bytes": writer.total_bytes, "files": files,
        "dtype": str(dtype).removeprefix("torch."), "lora_modules": plan.merged_modules,
        "r": inp.settings.r, "alpha": inp.settings.alpha, "scale": inp.settings.scale,
        "settings_source": inp.settings.source, "skipped": dict(plan.skipped),
        "seconds": time.monotonic() - started, "verified": verify_report is not None,
    }


def print_plan(opts, inp: Inputs, plan: MergePlan) -> None:
    s = inp.shape
    targets = sorted({t.megatron.rsplit(".", 2)[-2] for t in plan.tasks if t.lora is not None})
    total = sum(t.nbytes for t in plan.tensors)
    shards = -(-total // opts.max_shard_size)
    free = shutil.disk_usage(opts.out.parent if opts.out.parent.is_dir() else Path.cwd()).free
    print("plan (dry run: nothing is written)")
    print(f"  base:   {inp.base.describe()}")
    if inp.lora is not inp.base:
        print(f"  lora:   {inp.lora.describe()}")
    print(f"  model:  {s.model_type}, {s.num_layers} layers, hidden {s.hidden}, {s.heads} heads / {s.groups} kv heads "
          f"x {s.head_dim}, ffn {s.ffn}, vocab {s.vocab}, {'tied' if s.tied else 'untied'} embeddings"
          f"{', qkv bias' if s.qkv_bias else ''}")
    if s.moe is not None:
        print(f"  experts: {s.moe} in layers {sorted(s.moe.layers)}; checkpoint: {inp.base.experts}")
    print(f"  LoRA:   r={inp.settings.r} alpha={inp.settings.alpha:g} (scale {inp.settings.scale:g}, from "
          f"{inp.settings.source}) on {', '.join(targets)}: {plan.merged_modules} modules")
    print(f"  output: {len(plan.tensors)} tensors, {total / 1e9:.3f} GB as {str(plan.dtype).removeprefix('torch.')} "
          f"in about {shards} shard(s) -> {opts.out}")
    print(f"  disk:   needs {total / 1e9:.3f} GB, {free / 1e9:.1f} GB free")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(plan.skipped.items())) or "nothing"
    print(f"  skipped on purpose: {skipped}")


def run_export(opts) -> dict:
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True)
    check_report_path(opts.report, opts.force, roots, opts.out)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=False)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    dtype = None if opts.dtype == "auto" else DTYPES[opts.dtype]
    adapter = build_adapter(inp.lora, inp.shape, inp.arch, inp.settings, dtype, opts.expert_format)
    tensors, targets = adapter.tensors, adapter.target_modules + adapter.target_parameters
    for warning in adapter.warnings:
        print(f"lora-merge: warning: {warning}", file=sys.stderr)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    with StagedOutput(opts.out, opts.force, inputs) as stage:
        files = write_adapter(stage.dir, tensors, adapter_config(inp.settings, adapter, inp.hf_config, opts.hf_ref))
        if opts.report:
            stage.side_file(opts.report, report_text(inp, opts.hf_ref, None, {}, hash_files(stage.dir, files), None))
    return {"targets": targets, "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()),
            "settings": inp.settings, "lora": inp.lora.describe()}


def run_verify(opts) -> VerifyReport:
    out = opts.out
    roots = given_paths(out, opts.base, opts.lora, opts.hf_ref)
    check_report_path(opts.report, opts.force, roots)
    if not (out / "config.json").is_file():
        raise MergeError(f"{out}: no config.json; not a merged model directory")
    inp = open_inputs(out, opts.base, opts.lora, opts, need_base=False)
    check_report_path(opts.report, opts.force, input_paths(inp, [out, opts.hf_ref], opts.base, opts.lora))
    dtype = inp.shape.dtype or torch.float32
    reference = opts.hf_ref if has_weights(opts.hf_ref) else None
    report = verify_output(out, inp.arch, inp.shape, dtype, inp.lora, inp.settings, reference=reference,
                           base=inp.base)
    if opts.report:
        files = sorted(p.name for p in out.iterdir() if p.is_file())
        write_report(opts.report, report_text(inp, opts.hf_ref, None, {}, hash_files(out, files), report),
                     opts.force)
    return report


def _progress_bar(total: int, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="merging", disable=True if disabled else None,
                file=sys.stderr, dynamic_ncols=True)


def print_summary(s: dict) -> None:
    print(f"base:   {s['base']}")
    if s["lora"] != s["base"]:
        print(f"lora:   {s['lora']}")
    print(f"merged {s['lora_modules']} LoRA modules with r={s['r']} alpha={s['alpha']:g} "
          f"(scale {s['scale']:g}, from {s['settings_source']})")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(s["skipped"].items())) or "nothing"
    print(f"skipped on purpose: {skipped}")
    print(f"wrote {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB as {s['dtype']} in "
          f"{sum(f.endswith('.safetensors') for f in s['files'])} shard(s) to {s['out']} in {s['seconds']:.1f} s"
          + (" (verified)" if s["verified"] else ""))


def print_verify_problems(report: VerifyReport) -> None:
    for problem in report.problems:
        print(f"  problem: {problem}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "merge"
    opts = PARSERS[command]().parse_args(argv)
    if getattr(opts, "out", None) is not None and command != "verify":
        opts.out = Path(os.path.abspath(opts.out))  # `--out .` or `--out ..` name a directory, not a link
    PUBLISHED.clear()
    with signals_raise():
        try:
            return _run(command, opts)
        except VerificationFailed as exc:
            if opts.debug:
                raise
            print_verify_problems(exc.report)
            print(f"lora-merge: error: {exc}", file=sys.stderr)
            return 1
        except MergeError as exc:
            if opts.debug:
                raise
            print(f"lora-merge: error: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # output piped into `head`
            return 0
        except OSError as exc:  # disk full, permissions, a file vanishing mid-run
            if opts.debug:
                raise
            print(f"lora-merge: error: {exc.filename or 'I/O'}: {exc.strerror or exc}; {_what_was_written()}",
                  file=sys.stderr)
            return 2
        except Interrupted as exc:
            print(f"lora-merge: interrupted by {exc.name}; {_what_was_written()}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print(f"lora-merge: interrupted; {_what_was_written()}", file=sys.stderr)
            return 130
        except Exception as exc:  # a bug: still one line, and the truth about the output
            if opts.debug:
                raise
            print(f"lora-merge: error: unexpected {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                  f" (a bug in lora-merge; --debug shows the traceback); {_what_was_written()}", file=sys.stderr)
            return 2


def _what_was_written() -> str:
    if PUBLISHED:
        return f"{', '.join(map(str, PUBLISHED))} had already been published complete"
    return "no output was written"


def _run(command: str, opts) -> int:
    if command == "export-adapter":
        s = run_export(opts)
        settings = s["settings"]
        print(f"lora:   {s['lora']}")
        print(f"wrote a PEFT adapter to {opts.out}: {s['tensors']} tensors ({s['bytes'] / 1e6:.1f} MB), "
              f"r={settings.r} alpha={settings.alpha:g}, target_modules={s['targets']}")
        if settings.r > VLLM_DEFAULT_MAX_LORA_RANK:
            print(f"note: r={settings.r} exceeds vLLM's default --max-lora-rank ({VLLM_DEFAULT_MAX_LORA_RANK}); "
                  f"start vLLM with --max-lora-rank {settings.r} or more")
        return 0
    if command == "inspect":
        print("\n".join(describe(open_checkpoint(opts.checkpoint))))
        return 0
    if command == "verify":
        report = run_verify(opts)
        counts = Counter(report.statuses.values())
        print(f"baseline: {report.baseline}")
        for status, n in sorted(counts.items()):
            print(f"  {n:5d} {status}")
        if not report.ok:
            print_verify_problems(report)
            print(f"lora-merge: error: {opts.out}: verification failed ({len(report.problems)} problem(s))",
                  file=sys.stderr)
            return 1
        print(f"verify: OK, {len(report.statuses)} tensors checked")
        return 0
    summary = run_merge(opts)
    if summary:
        print_summary(summary)
    return 0
