"""Command line.

    lora-merge [merge] --base BASE --lora LORA --hf-ref HF --out OUT   merge into an HF model
    lora-merge verify OUT --lora LORA [--base BASE] [--hf-ref HF]      check a merged output
    lora-merge inspect DIR                                            what an input dir is
    lora-merge export-adapter --lora LORA --hf-ref HF --out DIR        unmerged PEFT adapter
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

# Only light modules here: `--help`, `--version` and usage errors answer before torch, transformers and
# safetensors are imported (seconds); the runs import what they need in `_run`.
from lora_merge.version import __version__
from lora_merge.console import NORMAL, QUIET, VERBOSE, Console
from lora_merge.errors import MergeError
from lora_merge import interrupts
from lora_merge.interrupts import Interrupted, raise_if_received, signals_raise
from lora_merge import options
from lora_merge.options import MAX_WORKERS
from lora_merge.options import (DEFAULT_SHARD_BYTES, DTYPE_NAMES, EXPERT_FORMATS,
                                VLLM_DEFAULT_MAX_LORA_RANK, parse_size)
from lora_merge.files.parts_dir import STAGED
from lora_merge.files.prefetch import start_early_reads, stop_early_reads
from lora_merge.files.staged_dir import PUBLISHED

if TYPE_CHECKING:
    from lora_merge.api import MergeResult

SUBCOMMANDS = ("merge", "verify", "inspect", "export-adapter", "finish")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except MergeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard_size(text: str) -> int:
    size = _size(text)
    if size < options.MIN_SHARD_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1MB; a shard that small only multiplies files")
    return size


class _StoreOnce(argparse._StoreAction):
    """An option that takes one value, refused when given twice: argparse would keep the last, and a user who
    typed `--lora A --lora B` meaning both would get a model without A, silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(_GIVEN, set())
        if self.dest in given:
            parser.error(f"{'/'.join(self.option_strings) or self.dest} given twice; give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


_GIVEN = "_single_value_options_given"


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error of the tool; every option that takes one value
    taken once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        # a negative value in scientific notation (--lora-weight 0.5 -1e-3) is a value, not an option (argparse's
        # own pattern knows -1 and -1.5 only)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.__dict__.pop(_GIVEN, None)
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"lora-merge: error: {message} (see `{self.prog} --help`)\n")


# What --base and --lora accept, said once for every subcommand's help.
BASE_HELP = ("base model: a Megatron checkpoint dir (legacy or torch_dist; with latest_checkpointed_iteration.txt, or "
             "an iter_*/release dir), or an HF model dir (config.json + safetensors) whose weights the LoRA is merged "
             "onto")
LORA_HELP = ("LoRA: a Megatron LoRA checkpoint dir as MindSpeed-LLM writes it (filtered: only *lora* keys; or "
             "unfiltered: base weights included), or a PEFT adapter dir (adapter_config.json + "
             "adapter_model.safetensors), merged onto an HF --base (or onto --hf-ref's weights)")


def _output_options(p: argparse.ArgumentParser) -> None:
    """-q and -v, the same in every subcommand (see `console.Console`)."""
    level = p.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", dest="level", action="store_const", const=QUIET, default=NORMAL,
                       help="print only errors (the exit status tells the rest)")
    level.add_argument("-v", "--verbose", dest="level", action="store_const", const=VERBOSE,
                       help="print more: every tensor planned, checked or written, every file")
    p.add_argument("--debug", action="store_true", help="show a traceback on errors")


def _lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-r", type=int, help="LoRA rank; overrides args.lora_r of a Megatron LoRA checkpoint")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (> 0); overrides args.lora_alpha of a Megatron LoRA "
                   "checkpoint")
    p.add_argument("--report", type=location, metavar="FILE", help="write a JSON report: inputs, LoRA settings, "
                   "per-tensor status, sha256 of every output file")
    _output_options(p)


def location(text: str):
    """A local path, or a URL (s3://…, any fsspec URL) kept as typed (a Path would fold its "//")."""
    from lora_merge.files.remote import is_url

    return text if is_url(text) else Path(text)


def _staged_in(out) -> str:
    """Where a part's files are until `finish`: beside a local output; at a URL, already under it."""
    from lora_merge.files.remote import is_url

    return f"uploaded to {out.rstrip('/')}/" if is_url(out) else f"in {out.name}.parts/"


def _storage_options(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"endpoint_url\": \"http://minio:9000\"}'")
    return value


def _storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-options", type=_storage_options, metavar="JSON",
                   help="options for the filesystem of URL inputs and outputs (s3://…, any fsspec URL), as fsspec "
                        "takes them, e.g. '{\"endpoint_url\": \"http://minio:9000\", \"anon\": false}'; S3 also "
                        "reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION and AWS_ENDPOINT_URL")


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 1 to {MAX_WORKERS}")
    return value


def _base_model_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model-id", metavar="ORG/NAME", help="Hub id of the base model, for the model card's "
                   "base_model (default: from an HF cache path of the reference, else none)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge",
        usage="lora-merge [merge] --base BASE --lora LORA --hf-ref HF --out OUT [options]\n"
              "       lora-merge verify|inspect|export-adapter ... (see below)",
        description="Merge a MindSpeed-LLM / Megatron-Core LoRA checkpoint, or a PEFT adapter, into a HuggingFace "
                    "model (sharded safetensors + config + tokenizer), on CPU, without Megatron.",
        epilog="subcommands (each has its own --help):\n"
               "  merge            (the default) merge LoRA into the base and write an HF model\n"
               "  verify           check a merged output against its inputs\n"
               "  inspect          print what a checkpoint, HF model dir or PEFT adapter is\n"
               "  export-adapter   write a Megatron LoRA as an unmerged PEFT adapter (PEFT, vLLM, SGLang)\n"
               "  finish           publish a merge run in parts (--part I/N) once every part has run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", type=location, help=BASE_HELP + "; may be omitted when --lora is an unfiltered Megatron "
                   "LoRA checkpoint or a PEFT adapter")
    p.add_argument("--lora", type=location, action="append", help=LORA_HELP + "; optional: without it the base is converted "
                   "as it is; given several times (PEFT adapters), they are merged together: W + Σ wᵢ·ΔWᵢ")
    p.add_argument("--lora-weight", "--lora-weights", dest="lora_weights", type=float, nargs="+", action="extend",
                   metavar="W", help="one weight per --lora, in their order (default: 1 each)")
    p.add_argument("--hf-ref", type=location, help="HF model dir of the base model (required; with --to megatron it defaults to an HF --base): its config.json "
                   "defines the architecture; config, generation config and tokenizer files are copied (its weights, "
                   "if any, are read only as the baseline of --verify, or as the base of a PEFT adapter given "
                   "without --base)")
    p.add_argument("--out", type=location, required=True, help="output dir for the merged HF model (must not exist "
                   "unless --force); written atomically")
    p.add_argument("--dtype", choices=["auto", *DTYPE_NAMES, "fp8", "float8_e4m3fn", "mxfp4"], default="auto",
                   help="output dtype; auto = the reference config's dtype, else the checkpoint's training dtype "
                        "(default: auto); fp8: the attention and MLP/expert weights in block-FP8 (128x128 scales, "
                        "as DeepSeek's and Qwen's FP8 releases), the rest bfloat16; mxfp4 (gpt-oss): the experts in "
                        "MXFP4 as its release, the rest bfloat16")
    p.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_SHARD_BYTES, metavar="SIZE",
                   help="largest safetensors shard, at least 1MB, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    p.add_argument("--verify", action="store_true", help="read the output back and verify it (see `lora-merge "
                   "verify`) before it is moved into place; doubles the I/O")
    p.add_argument("--no-sha256", dest="sha256", action="store_false", help="do not hash the output files (the "
                   "model card and --report then give no sha256); hashing costs ~1 CPU-second per 1.3 GB, which "
                   "slows a merge only where cores are few")
    p.add_argument("--workers", type=_workers, default=None, metavar="N", help="threads merging pieces side by side "
                   "(default: the cores this process may use, by its CPU affinity and cgroup quota, at most 16); "
                   "the output is the same for any N")
    p.add_argument("--dry-run", action="store_true", help="detect and print the plan; write nothing")
    p.add_argument("--part", metavar="I/N", help="write only part I of N (0 ≤ I < N) of the output files, into "
                   "OUT.parts/ beside --out, e.g. --part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; parts run in "
                   "any order on any host that shares the directory; then `lora-merge finish --out OUT` publishes")
    p.add_argument("--resume", action="store_true", help="keep the files a killed run of this part (or, without "
                   "--part, of this merge) completed, checked by their sha256, and write the rest")
    p.add_argument("--allow-partial-lora", action="store_true", help="merge even though some layers lack LoRA "
                   "weights for a target (by default that stops the merge: the checkpoint looks incomplete)")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier output) and --report if they exist, "
                   "only once the new output is complete; never an input")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _base_model_id_option(p)
    _lora_options(p)
    _storage_option(p)
    _megatron_options(p)
    p.add_argument("--version", action="version", version=f"lora-merge {__version__}")
    return p


MEGATRON_OPTIONS = ("tp", "pp", "vpp", "ep", "etp", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers", "ckpt_format", "expert_layout", "make_vocab_size_divisible_by",
                    "padded_vocab_size", "mla_naming", "transformer_impl")


def _megatron_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--to megatron: the checkpoint's layout (Megatron's own option names)")
    g.add_argument("--to", choices=["hf", "megatron"], default="hf", help="what to write: an HF model (default) or "
                   "a Megatron checkpoint; the source may be an HF model or a Megatron checkpoint, --lora optional "
                   "for both (HF → Megatron conversion, Megatron → HF, Megatron → Megatron reshard)")
    for name, help_text in (("--tp", "tensor-parallel size"), ("--pp", "pipeline-parallel size"),
                            ("--vpp", "virtual pipeline chunks per stage"), ("--ep", "expert-parallel size"),
                            ("--etp", "expert tensor-parallel size, 1 or --tp (default: --tp)")):
        g.add_argument(name, type=int, default=None, metavar="N", help=help_text + " (default: 1)" * (name != "--etp"))
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N", help="layers of the first stage")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N", help="layers of the last stage")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default=None,
                   help="torch (legacy mp_rank_* files, what MindSpeed-LLM's converter writes; default)")
    g.add_argument("--expert-layout", choices=["sequential", "grouped"], default=None,
                   help="routed experts as SequentialMLP (default) or GroupedMLP (--moe-grouped-gemm)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="pad the vocabulary to a multiple of N x TP (default: 128, Megatron's; at most 2^20)")
    g.add_argument("--padded-vocab-size", type=int, default=None, metavar="N", help="the padded vocabulary size "
                   "itself (at least the model's vocab_size, divisible by --tp; padding rows zero; the args then "
                   "record --make-vocab-size-divisible-by N/TP, which Megatron's rule turns back into N)")
    g.add_argument("--mla-naming", choices=["megatron-core", "mindspeed"], default=None,
                   help="DeepSeek MLA: Megatron-Core's linear_q_down_proj/linear_kv_down_proj (default), or "
                        "MindSpeed-LLM's fused linear_qkv (what MindSpeed's MLA loads)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="the module names of the model that loads it: local (default; what MindSpeed-LLM builds) or "
                        "transformer_engine (Megatron-LM's default: norms fused into the next linear as "
                        "layer_norm_weight, an _extra_state for every TransformerEngine module)")


def build_verify_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge verify",
        description="Check a merged output: tensor names, shapes and dtypes against its config; finiteness; "
                    "untouched tensors bit-identical to the baseline; LoRA-touched tensors equal to "
                    "baseline + (alpha/r)·B·A within one rounding. The baseline is an HF --base's weights, else "
                    "the reference model's weights when --hf-ref holds *.safetensors, else the Megatron --base.",
    )
    p.add_argument("out", type=location, help="the merged HF model dir")
    p.add_argument("--lora", type=location, action="append", help=LORA_HELP + " (the one that was merged, or each of "
                   "several; needed for the value checks)")
    p.add_argument("--lora-weight", "--lora-weights", dest="lora_weights", type=float, nargs="+", action="extend",
                   metavar="W", help="the weights the adapters were merged with, one per --lora")
    p.add_argument("--base", type=location, help=BASE_HELP + " (the one that was merged onto)")
    p.add_argument("--hf-ref", type=location, help="reference HF model dir; its weights, if any, are the baseline when "
                   "--base is not an HF model dir")
    p.add_argument("--force", action="store_true", help="replace --report if it exists")
    _lora_options(p)
    _storage_option(p)
    return p


def build_inspect_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge inspect",
        description="Print what an input is. A Megatron checkpoint: format, iteration, TP/PP/VPP, architecture from "
                    "its args, LoRA targets with r/alpha, dtype, tensors per rank file. An HF model dir: model type, "
                    "layers, tensors, dtypes, size per file. A PEFT adapter dir: r, lora_alpha, targets, adapted "
                    "modules, dtypes, size.")
    p.add_argument("checkpoint", type=location, metavar="DIR", help="a Megatron checkpoint dir (with "
                   "latest_checkpointed_iteration.txt, or iter_*), an HF model dir or a PEFT adapter dir")
    _output_options(p)
    _storage_option(p)
    return p


def build_export_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge export-adapter",
        description="Write a Megatron LoRA as an unmerged PEFT adapter (adapter_model.safetensors + "
                    "adapter_config.json, HF module names) that PEFT and vLLM load on top of the HF base model.")
    p.add_argument("--lora", type=location, required=True, help="Megatron LoRA checkpoint dir written by MindSpeed-LLM "
                   "(a PEFT adapter is already what this writes)")
    p.add_argument("--hf-ref", type=location, required=True, help="HF model dir of the base model (its config.json "
                   "defines the architecture)")
    p.add_argument("--out", type=location, required=True, help="adapter output dir (must not exist unless --force)")
    p.add_argument("--base", type=location, help="optional: the base (a Megatron checkpoint, cross-checked against the "
                   "config, or an HF model dir); the adapter does not depend on it")
    p.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                   help="adapter dtype; auto = as stored in the LoRA checkpoint (default)")
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, default="per-expert",
                   help="routed experts' LoRA: per-expert = one LoRA per expert and projection under the HF checkpoint "
                        "names (vLLM; PEFT for qwen3_moe and mixtral); fused = one LoRA per transformers-5 fused "
                        "expert parameter (PEFT target_parameters, every MoE model type); a model whose HF checkpoint "
                        "stores its experts stacked (gpt_oss) has no per-expert names: its experts' LoRA is the "
                        "target_parameters form either way")
    p.add_argument("--allow-partial-lora", action="store_true", help="export even though some layers or experts lack "
                   "LoRA weights for a target: those modules get zero factors, so they stay unchanged (as a merge "
                   "with this option leaves them) and PEFT and vLLM find every module the adapter targets")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier adapter) and --report if they exist")
    p.add_argument("--no-progress", action="store_true", help="accepted for symmetry with merge (no progress bar here)")
    _base_model_id_option(p)
    _lora_options(p)
    _storage_option(p)
    return p


def build_finish_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-merge finish",
        description="Publish a merge run in parts (--part I/N): checks that every part of one plan completed and "
                    "that every file still has the sha256 its part recorded, then writes the index, config, "
                    "reference files, model card and report and renames OUT.parts/ into place. The output is "
                    "byte for byte what one process writes.")
    p.add_argument("--out", type=location, required=True, help="the --out the parts were run with (a path or URL)")
    p.add_argument("--force", action="store_true", help="replace --out (an earlier output) and the report")
    p.add_argument("--workers", type=_workers, default=None, metavar="N", help="cores hashing files side by side "
                   "(default: every core this process may use)")
    p.add_argument("--no-rehash", dest="rehash", action="store_false", help="check the files' sizes only, taking "
                   "each sha256 as its part recorded it while writing (skips reading the whole output again; a "
                   "file changed on the disk since goes unnoticed; at a URL: each object's size and ETag)")
    _storage_option(p)
    _output_options(p)
    return p


PARSERS = {"merge": build_parser, "verify": build_verify_parser, "inspect": build_inspect_parser,
           "export-adapter": build_export_parser, "finish": build_finish_parser}


def lora_targets(plan) -> list[str]:
    """The projections the LoRA adapts, by the name its own kind uses: a Megatron module's last part
    (`linear_qkv`), or the HF name a PEFT factor adapts (`q_proj`)."""
    found = set()
    for task in plan.tasks:
        if task.lora is not None:
            found.add(task.lora_module.rsplit(".", 1)[-1])
        for name in task.delta or ():
            found.add(name.removesuffix(".weight").rsplit(".", 1)[-1])
    return sorted(found)


def expert_layout(inp) -> str:
    """How each input stores routed experts: a Megatron checkpoint's own layout (EP, ETP, expert class), an HF
    base's per-expert tensors; a PEFT adapter names HF tensors like its base."""
    parts = []
    for role, ckpt in (("base", inp.base), ("LoRA", inp.lora)):
        if ckpt is None or (role == "LoRA" and ckpt is inp.base):
            continue
        layout = ckpt.experts  # only Megatron checkpoints have one
        if layout is not None:
            parts.append(f"{role} checkpoint: {layout}")
        elif role == "base":
            parts.append("base: HF per-expert tensors")
    return "; ".join(parts)


def print_plan(console: Console, opts, result: MergeResult) -> None:
    from lora_merge.files.staged_dir import gigabytes, space_needed

    inp, plan = result.inputs, result.plan
    s = inp.shape
    total = sum(t.nbytes for t in plan.tensors)
    shards = -(-total // opts.max_shard_size)
    out_dir = Path(result.out)  # (a URL output is staged under a local directory: that one's disk)
    free = shutil.disk_usage(out_dir.parent if out_dir.parent.is_dir() else Path.cwd()).free
    out = console.result
    out("plan (dry run: nothing is written)")
    out(f"  base:   {result.base}")  # (as the result names it: a URL input by its URL)
    if inp.lora is not None and inp.lora is not inp.base:
        out(f"  lora:   {result.lora}")
    heads = f"{s.heads} heads, {s.mla}" if s.mla else f"{s.heads} heads / {s.groups} kv heads x {s.head_dim}"
    out(f"  model:  {s.model_type}, {s.num_layers} layers, hidden {s.hidden}, {heads}, ffn {s.ffn}, vocab {s.vocab}, "
        f"{'tied' if s.tied else 'untied'} embeddings" + "".join(f", {m}" for m in s.mechanics()))
    if s.moe is not None:
        out(f"  experts: {s.moe} in layers {sorted(s.moe.layers)}; {expert_layout(inp)}")
    if inp.settings is None:
        out("  LoRA:   none (a conversion)")
    else:
        out(f"  LoRA:   r={inp.settings.r} alpha={inp.settings.alpha:g} (scale {inp.settings.scale:g}, from "
        f"{inp.settings.source}) on {', '.join(lora_targets(plan)) or 'nothing'}: {plan.merged_modules} modules")
    out(f"  output: {len(plan.tensors)} tensors, {total / 1e9:.3f} GB as {result.dtype} "
        f"in about {shards} shard(s) -> {opts.out}")
    needed = space_needed(total, result.copied_bytes)[1]
    out(f"  disk:   needs {needed}, {gigabytes(free)} free")
    if result.part is not None:
        shown = ", ".join(result.files[:3]) + (f" … {result.files[-1]}" if len(result.files) > 3 else "")
        out(f"  part:   {result.part}: {len(result.files)} of the output's files, {result.tensors} "
            f"tensors, {result.bytes / 1e9:.3f} GB" + (f" ({shown})" if result.files else " (none: more parts than files)"))
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(plan.skipped.items())) or "nothing"
    out(f"  skipped on purpose: {skipped}")
    if console.verbose:
        console.detail("  tensors:")
        merged = {t.name for task in plan.tasks for t in task.outputs  # (a stacked tensor: any of its experts)
                  if task.lora is not None or t.name[len(task.hf_prefix):] in (task.delta or {})}
        for task in plan.tasks:
            for t in task.outputs if task.opens_outputs else ():
                console.detail(f"    {t.name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')} <- {task.source}"
                               + (" + LoRA" if t.name in merged else ""))


def _print_inputs(out, s, merged: str | bool) -> None:
    """The lines both summaries start with: the inputs, the LoRA merged (`merged`, when there is one; no
    line about settings a conversion has none of), what was skipped."""
    out(f"base:   {s.base}")
    if s.lora is not None and s.lora != s.base:
        out(f"lora:   {s.lora}")
    out(merged if s.lora is not None else "no LoRA: converted as it is")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(s.skipped.items())) or "nothing"
    out(f"skipped on purpose: {skipped}")


def print_summary(console: Console, s: MergeResult) -> None:
    out = console.result
    _print_inputs(out, s, s.lora is not None and f"merged {s.lora_modules} LoRA modules with r={s.r} "
                          f"alpha={s.alpha:g} (scale {s.scale:g}, from {s.settings_source})")
    out(f"wrote {s.tensors} tensors, {s.bytes / 1e9:.3f} GB as {s.dtype} in "
        f"{sum(f.endswith('.safetensors') for f in s.files)} shard(s) to {s.out} in {s.seconds:.1f} s"
        + (f" ({len(s.resumed)} kept from an earlier run)" if s.resumed else "") + (" (verified)" if s.verified else ""))
    for name in s.files:
        console.detail(f"  {name}" + (f"  sha256 {s.sha256[name]}" if name in s.sha256 else ""))


def main(argv: list[str] | None = None) -> int:
    caller = options.CALLER.set("cli")  # the API's checks name arguments as options (--lora-r, not lora_r)
    try:
        return _main(argv)
    finally:
        options.CALLER.reset(caller)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "merge"
    opts = PARSERS[command]().parse_args(argv)
    console = Console(opts.level)
    if getattr(opts, "out", None) is not None and command != "verify" and isinstance(opts.out, Path):
        opts.out = Path(os.path.abspath(opts.out))  # `--out .` or `--out ..` name a directory, not a link
    PUBLISHED.clear()
    STAGED.clear()
    with signals_raise():
        try:
            return _run(command, opts, console)
        except MergeError as exc:
            if opts.debug:
                raise
            report = getattr(exc, "report", None)  # api.VerificationFailed: what the check found
            for problem in report.problems if report is not None else ():
                console.problem(problem)
            console.error(str(exc))
            return 1 if report is not None else 2
        except BrokenPipeError:  # output piped into `head`
            return 0
        except OSError as exc:  # disk full, permissions, a file vanishing mid-run
            if opts.debug:
                raise
            console.error(f"{exc.filename or 'I/O'}: {exc.strerror or exc}; {what_was_written()}")
            return 2
        except Interrupted as exc:
            console.interrupted(f"interrupted by {exc.name}; {what_was_written()}")
            return exc.exit_code
        except KeyboardInterrupt:
            console.interrupted(f"interrupted; {what_was_written()}")
            return 130
        except Exception as exc:  # a bug: still one line, and the truth about the output
            if interrupts.RECEIVED:  # a signal that a library's import turned into another error
                interrupted = Interrupted(interrupts.RECEIVED[0])
                console.interrupted(f"interrupted by {interrupted.name}; {what_was_written()}")
                return interrupted.exit_code
            if opts.debug:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            console.error(f"unexpected {type(exc).__name__}: {first} (a bug in lora-merge; --debug shows the "
                          f"traceback); {what_was_written()}")
            return 2


def _loras(given: list | None):
    """--lora given once: its path; several times: the list."""
    return given[0] if given and len(given) == 1 else given


def _run_to_megatron(api, opts, console: Console) -> int:
    from lora_merge.model.megatron_args import DEFAULT_VOCAB_DIVISOR

    if opts.lora and len(opts.lora) > 1 or opts.lora_weights:
        raise MergeError("--lora given several times, or --lora-weight: merged into an HF output only (--to hf)")
    opts.lora = _loras(opts.lora)

    for name in ("max_shard_size", "verify", "report", "force", "base_model_id"):
        if getattr(opts, name) not in (None, False, DEFAULT_SHARD_BYTES):
            raise MergeError(f"--{name.replace('_', '-')}: an option of an HF output, not of --to megatron")

    def given(value, default):  # a value typed, even 0, reaches the API's checks
        return default if value is None else value

    bar = console.progress_bar(enabled=not (opts.no_progress or opts.dry_run))
    try:
        s = api.to_megatron(
            base=opts.base, lora=opts.lora, hf_ref=opts.hf_ref, out=opts.out, tp=given(opts.tp, 1),
            pp=given(opts.pp, 1), vpp=given(opts.vpp, 1), ep=given(opts.ep, 1), etp=opts.etp,
            decoder_first_pipeline_num_layers=opts.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=opts.decoder_last_pipeline_num_layers,
            ckpt_format=given(opts.ckpt_format, "torch"), expert_layout=given(opts.expert_layout, "sequential"),
            make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by, padded_vocab_size=opts.padded_vocab_size,
            mla_naming=given(opts.mla_naming, "megatron-core"),
            transformer_impl=given(opts.transformer_impl, "local"), dtype=opts.dtype, lora_r=opts.lora_r,
            lora_alpha=opts.lora_alpha, allow_partial_lora=opts.allow_partial_lora, dry_run=opts.dry_run,
            workers=opts.workers, progress=bar, part=opts.part, resume=opts.resume, warn=console.warn,
            storage_options=opts.storage_options)
    finally:
        if bar is not None:
            bar.close()
    out = console.result
    if s.part is not None and s.dry_run:
        out(f"part {s.part} would write {len(s.files)} of the checkpoint's files"
            + (f": {', '.join(s.files[:3])}" + (f" … {s.files[-1]}" if len(s.files) > 3 else "") if s.files else ""))
    elif s.part is not None:
        _print_inputs(out, s, f"merged {s.lora_modules} LoRA modules")
        out(f"part {s.part}: {len(s.files)} of the checkpoint's files"
            + (f" ({len(s.resumed)} kept from an earlier run)" if s.resumed else "")
            + f", {_staged_in(opts.out)} in {s.seconds:.1f} s; once every part has run: lora-merge finish --out "
            f"{opts.out}")
        return 0
    _print_inputs(out, s, f"merged {s.lora_modules} LoRA modules")
    verb = "would write" if s.dry_run else "wrote"
    out(f"{verb} a Megatron {s.ckpt_format} checkpoint, {s.layout}, padded vocab {s.padded_vocab_size}: "
        f"{s.tensors} tensor shards, {s.bytes / 1e9:.3f} GB as {s.dtype}"
        + ("" if s.dry_run else f" to {s.out} in {s.seconds:.1f} s")
        + (f" ({len(s.resumed)} kept from an earlier run)" if s.resumed else ""))
    if not s.dry_run:
        out(f"load it with: --load {s.out} --ckpt-format {s.ckpt_format} --transformer-impl {s.transformer_impl} --finetune "
            "--no-load-optim --no-load-rng"
            + (f" --make-vocab-size-divisible-by {s.make_vocab_size_divisible_by}"
               if s.make_vocab_size_divisible_by != DEFAULT_VOCAB_DIVISOR else "") + (", at any layout (the torch_dist loader reshards)"
                                              if s.ckpt_format == "torch_dist" else ", at this layout"))
    for name in s.files:
        console.detail(f"  {name}")
    return 0


def what_was_written() -> str:
    if PUBLISHED:
        return f"{', '.join(map(str, PUBLISHED))} had already been published complete"
    if STAGED:  # a run in parts: its completed files stay, recorded in its manifest
        return (f"nothing was published; {STAGED[-1]} keeps the files completed so far: run the same command with "
                "--resume to continue")
    return "no output was written"


def _run(command: str, opts, console: Console) -> int:
    if command == "merge" and not (opts.dry_run or opts.part or opts.resume):
        # the disk would idle while torch and transformers are imported (~2 s): their input files are read then
        # (a part or a resumed run reads only some of them)
        start_early_reads([opts.base], list(opts.lora or ()))
    try:
        return _run_command(command, opts, console)
    finally:
        stop_early_reads()  # a run that failed before its merge began


def _run_command(command: str, opts, console: Console) -> int:
    from lora_merge import api  # torch, transformers, safetensors: only once the arguments are understood

    raise_if_received()  # a signal an import swallowed still stops the run

    if command == "export-adapter":
        s = api.export_adapter(lora=opts.lora, hf_ref=opts.hf_ref, out=opts.out, base=opts.base, dtype=opts.dtype,
                               expert_format=opts.expert_format, lora_r=opts.lora_r, lora_alpha=opts.lora_alpha,
                               allow_partial_lora=opts.allow_partial_lora, force=opts.force, report=opts.report,
                               base_model_id=opts.base_model_id, warn=console.warn,
                               storage_options=opts.storage_options)
        console.result(f"lora:   {s.lora}")
        console.result(f"wrote a PEFT adapter to {opts.out}: {s.tensors} tensors ({s.bytes / 1e6:.1f} MB), "
                       f"r={s.r} alpha={s.alpha:g}, target_modules={s.target_modules + s.target_parameters}")
        for name in s.files:
            console.detail(f"  {name}")
        if s.r > VLLM_DEFAULT_MAX_LORA_RANK:
            console.note(f"r={s.r} exceeds vLLM's default --max-lora-rank ({VLLM_DEFAULT_MAX_LORA_RANK}); "
                         f"start vLLM with --max-lora-rank {s.r} or more")
        return 0
    if command == "finish":
        s = api.finish(opts.out, force=opts.force, workers=opts.workers, rehash=opts.rehash,
                       storage_options=opts.storage_options)
        console.result(f"checked {s.parts} part(s): {len(s.sha256)} files, {s.bytes / 1e9:.3f} GB of tensors; "
                       f"published {s.out} in {s.seconds:.1f} s")
        for name in s.files:
            console.detail(f"  {name}" + (f"  sha256 {s.sha256[name]}" if name in s.sha256 else ""))
        return 0
    if command == "inspect":
        for line in api.inspect(opts.checkpoint, verbose=console.verbose,
                                storage_options=opts.storage_options).split("\n"):
            console.result(line)
        return 0
    if command == "verify":
        report = api.verify(opts.out, lora=_loras(opts.lora), base=opts.base, hf_ref=opts.hf_ref,
                            lora_weights=opts.lora_weights, lora_r=opts.lora_r,
                            lora_alpha=opts.lora_alpha, report=opts.report, force=opts.force, warn=console.warn,
                            storage_options=opts.storage_options)
        counts = Counter(report.statuses.values())
        console.result(f"baseline: {report.baseline}")
        for status, n in sorted(counts.items()):
            console.result(f"  {n:5d} {status}")
        for name, status in report.statuses.items():
            console.detail(f"    {name}: {status}")
        if not report.ok:
            for problem in report.problems:
                console.problem(problem)
            console.error(f"{opts.out}: verification failed ({len(report.problems)} problem(s))")
            return 1
        console.result(f"verify: OK, {len(report.statuses)} tensors checked")
        return 0
    given = [f"--{name.replace('_', '-')}" for name in MEGATRON_OPTIONS if getattr(opts, name) is not None]
    if opts.to == "hf" and given:
        raise MergeError(f"{', '.join(given)}: options of a Megatron output; add --to megatron")
    if opts.lora is None and opts.base is None:
        raise MergeError("give --lora (a LoRA to merge) or --base (a checkpoint to convert), or both")
    if opts.dtype == "float8_e4m3fn":
        opts.dtype = "fp8"
    if opts.to == "megatron":
        return _run_to_megatron(api, opts, console)
    if opts.hf_ref is None:
        raise MergeError("--hf-ref: required (the HF model dir whose config.json describes the model)")
    bar = console.progress_bar(enabled=not (opts.no_progress or opts.dry_run))
    try:
        result = api.merge(base=opts.base, lora=_loras(opts.lora), lora_weights=opts.lora_weights, hf_ref=opts.hf_ref,
                           out=opts.out, dtype=opts.dtype,
                           max_shard_size=opts.max_shard_size, lora_r=opts.lora_r, lora_alpha=opts.lora_alpha,
                           allow_partial_lora=opts.allow_partial_lora, force=opts.force, verify=opts.verify,
                           report=opts.report, dry_run=opts.dry_run, sha256=opts.sha256, workers=opts.workers,
                           base_model_id=opts.base_model_id, progress=bar, part=opts.part, resume=opts.resume,
                           warn=console.warn, storage_options=opts.storage_options)
    finally:
        if bar is not None:
            bar.close()
    if result.part is not None and not result.dry_run:
        console.result(f"part {result.part}: {len(result.files)} of the output's files"
                       + (f" ({len(result.resumed)} kept from an earlier run)" if result.resumed else "")
                       + f", {result.bytes / 1e9:.3f} GB, {_staged_in(opts.out)} in {result.seconds:.1f} s; "
                       f"once every part has run: lora-merge finish --out {opts.out}")
        for name in result.files:
            console.detail(f"  {name}" + (f"  sha256 {result.sha256[name]}" if name in result.sha256 else ""))
        return 0
    if result.dry_run:
        print_plan(console, opts, result)
    else:
        print_summary(console, result)
    return 0
