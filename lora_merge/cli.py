"""Command line.

    lora-merge [merge] --base BASE --lora LORA --hf-ref HF --out OUT   merge into an HF model
    lora-merge verify OUT --lora LORA [--base BASE] [--hf-ref HF]      check a merged output
    lora-merge inspect DIR                                            what a checkpoint is
    lora-merge export-adapter --lora LORA --hf-ref HF --out DIR        unmerged PEFT adapter
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

from lora_merge import __version__
from lora_merge.api import (DEFAULT_SHARD_BYTES, MIN_SHARD_BYTES, MergeResult, VerificationFailed, parse_size,
                            run_export, run_merge, run_verify)
from lora_merge.errors import MergeError
from lora_merge.peft_adapter import EXPERT_FORMATS, VLLM_DEFAULT_MAX_LORA_RANK
from lora_merge.interrupts import Interrupted, signals_raise
from lora_merge.model_shape import DTYPES
from lora_merge.readers import open_checkpoint
from lora_merge.describe import describe
from lora_merge.verification import VerifyReport
from lora_merge.writers.staged_dir import PUBLISHED

SUBCOMMANDS = ("merge", "verify", "inspect", "export-adapter")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except MergeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard_size(text: str) -> int:
    size = _size(text)
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


def _base_model_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model-id", metavar="ORG/NAME", help="Hub id of the base model, for the model card's "
                   "base_model (default: from an HF cache path of the reference, else none)")


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
    p.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_SHARD_BYTES, metavar="SIZE",
                   help="largest safetensors shard, at least 1MB, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    p.add_argument("--verify", action="store_true", help="read the output back and verify it (see `lora-merge "
                   "verify`) before it is moved into place; doubles the I/O")
    p.add_argument("--no-sha256", dest="sha256", action="store_false", help="do not hash the output files (the "
                   "model card and --report then give no sha256); hashing costs ~1 CPU-second per 1.3 GB, which "
                   "slows a merge only where cores are few")
    p.add_argument("--dry-run", action="store_true", help="detect and print the plan; write nothing")
    p.add_argument("--allow-partial-lora", action="store_true", help="merge even though some layers lack LoRA "
                   "weights for a target (by default that stops the merge: the checkpoint looks incomplete)")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier output) and --report if they exist, "
                   "only once the new output is complete; never an input")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _base_model_id_option(p)
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
    p.add_argument("--allow-partial-lora", action="store_true", help="export even though some layers or experts lack "
                   "LoRA weights for a target: those modules get zero factors, so they stay unchanged (as a merge "
                   "with this option leaves them) and PEFT and vLLM find every module the adapter targets")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier adapter) and --report if they exist")
    p.add_argument("--no-progress", action="store_true", help="accepted for symmetry with merge (no progress bar here)")
    _base_model_id_option(p)
    _lora_options(p)
    return p


PARSERS = {"merge": build_parser, "verify": build_verify_parser, "inspect": build_inspect_parser,
           "export-adapter": build_export_parser}


def print_plan(opts, result: MergeResult) -> None:
    inp, plan = result.inputs, result.plan
    s = inp.shape
    targets = sorted({t.megatron.rsplit(".", 2)[-2] for t in plan.tasks if t.lora is not None})
    total = sum(t.nbytes for t in plan.tensors)
    shards = -(-total // opts.max_shard_size)
    free = shutil.disk_usage(opts.out.parent if opts.out.parent.is_dir() else Path.cwd()).free
    print("plan (dry run: nothing is written)")
    print(f"  base:   {inp.base.describe()}")
    if inp.lora is not inp.base:
        print(f"  lora:   {inp.lora.describe()}")
    heads = f"{s.heads} heads, {s.mla}" if s.mla else f"{s.heads} heads / {s.groups} kv heads x {s.head_dim}"
    print(f"  model:  {s.model_type}, {s.num_layers} layers, hidden {s.hidden}, {heads}, ffn {s.ffn}, vocab {s.vocab}, "
          f"{'tied' if s.tied else 'untied'} embeddings"
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


class ProgressBar:
    """The API's progress(done, total) callback as a tqdm bar on stderr."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="merging", file=sys.stderr, disable=None,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def warn(message: str) -> None:
    print(f"lora-merge: warning: {message}", file=sys.stderr)


def print_summary(s: MergeResult) -> None:
    print(f"base:   {s.base}")
    if s.lora != s.base:
        print(f"lora:   {s.lora}")
    print(f"merged {s.lora_modules} LoRA modules with r={s.r} alpha={s.alpha:g} "
          f"(scale {s.scale:g}, from {s.settings_source})")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(s.skipped.items())) or "nothing"
    print(f"skipped on purpose: {skipped}")
    print(f"wrote {s.tensors} tensors, {s.bytes / 1e9:.3f} GB as {s.dtype} in "
          f"{sum(f.endswith('.safetensors') for f in s.files)} shard(s) to {s.out} in {s.seconds:.1f} s"
          + (" (verified)" if s.verified else ""))


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
    opts.warn, opts.progress = warn, None
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
        print(f"lora:   {s.lora}")
        print(f"wrote a PEFT adapter to {opts.out}: {s.tensors} tensors ({s.bytes / 1e6:.1f} MB), "
              f"r={s.r} alpha={s.alpha:g}, target_modules={s.target_modules + s.target_parameters}")
        if s.r > VLLM_DEFAULT_MAX_LORA_RANK:
            print(f"note: r={s.r} exceeds vLLM's default --max-lora-rank ({VLLM_DEFAULT_MAX_LORA_RANK}); "
                  f"start vLLM with --max-lora-rank {s.r} or more")
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
    bar = None if opts.no_progress or opts.dry_run else ProgressBar()
    opts.progress = bar
    try:
        result = run_merge(opts)
    finally:
        if bar is not None:
            bar.close()
    if result.dry_run:
        print_plan(opts, result)
    else:
        print_summary(result)
    return 0
