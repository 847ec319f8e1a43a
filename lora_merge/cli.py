"""Command line: `lora-merge --base BASE --lora LORA --hf-ref HF --out OUT`."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

from lora_merge import __version__
from lora_merge.architectures import architecture_for
from lora_merge.errors import MergeError
from lora_merge.lora import resolve_settings
from lora_merge.merge import build_plan, check_lora_targets, execute
from lora_merge.model_shape import DTYPES, check_against_args, read_hf_config
from lora_merge.readers import open_checkpoint
from lora_merge.writers.hf_files import copy_reference_files
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
from lora_merge.writers.staged_dir import check_free_space, check_output_target, staged_directory

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    m = SIZE.match(text)
    if not m or (m.group(2) or "").upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lora-merge",
        description="Merge a MindSpeed-LLM / Megatron-Core LoRA checkpoint into a HuggingFace model "
                    "(sharded safetensors + config + tokenizer), on CPU, without Megatron.",
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
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    p.add_argument("--lora-r", type=int, help="LoRA rank; overrides args.lora_r of the LoRA checkpoint")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha; overrides args.lora_alpha of the LoRA checkpoint")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (only once the new output is complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show a traceback on errors")
    p.add_argument("--version", action="version", version=f"lora-merge {__version__}")
    return p


def output_dtype(choice: str, shape, args) -> torch.dtype:
    if choice != "auto":
        return DTYPES[choice]
    if shape.dtype is not None:
        return shape.dtype
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def run_merge(opts) -> dict:
    started = time.monotonic()
    check_output_target(opts.out, opts.force)
    shape, hf_config = read_hf_config(opts.hf_ref)
    arch = architecture_for(shape)

    lora = open_checkpoint(opts.lora)
    base = open_checkpoint(opts.base) if opts.base else lora
    if base is lora and not lora.params:
        raise MergeError(f"{opts.lora}: holds only LoRA weights (a filtered checkpoint); pass --base with the base model")
    for ckpt in {id(base): base, id(lora): lora}.values():
        check_against_args(shape, ckpt.args, str(ckpt.path))
    check_lora_targets(lora)
    settings = resolve_settings(lora.args, opts.lora_r, opts.lora_alpha, str(opts.lora))
    dtype = output_dtype(opts.dtype, shape, base.args)

    plan = build_plan(base, lora, shape, arch, settings, dtype)
    writer_tensors = plan.tensors
    with staged_directory(opts.out, opts.force) as staging:
        writer = ShardedSafetensorsWriter(staging, writer_tensors, opts.max_shard_size)
        check_free_space(opts.out, writer.total_bytes + (64 << 20))
        progress = _progress_bar(writer.total_bytes, disabled=opts.no_progress)
        try:
            execute(plan, writer.write, progress.update)
            files = writer.finish()
        finally:
            writer.abort()
            progress.close()
        files += copy_reference_files(opts.hf_ref, staging, hf_config, dtype)

    return {
        "out": str(opts.out), "base": base.describe(), "lora": lora.describe(),
        "tensors": len(writer_tensors), "bytes": writer.total_bytes, "files": files,
        "dtype": str(dtype).removeprefix("torch."), "lora_modules": plan.merged_modules,
        "r": settings.r, "alpha": settings.alpha, "scale": settings.scale, "settings_source": settings.source,
        "skipped": dict(plan.skipped), "seconds": time.monotonic() - started,
    }


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
          f"{sum(f.endswith('.safetensors') for f in s['files'])} shard(s) to {s['out']} in {s['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        print_summary(run_merge(opts))
        return 0
    except MergeError as exc:
        if opts.debug:
            raise
        print(f"lora-merge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lora-merge: interrupted; no output was written", file=sys.stderr)
        return 130
