"""What the command line offers, kept free of heavy imports: `--help`, `--version` and a mistyped option
answer before torch, transformers or safetensors are loaded (seconds of start-up). The modules that use
these values import them from here; tests check the few the heavy modules also spell out."""

from __future__ import annotations

import contextvars
import re

from lora_merge.errors import MergeError

# Output dtypes by name, as `model_shape.DTYPES` maps them to torch dtypes.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Routed experts' adapter naming (`peft_adapter.EXPERT_FORMATS`).
EXPERT_FORMATS = ("per-expert", "fused")
# vLLM's default --max-lora-rank (`peft_adapter.VLLM_DEFAULT_MAX_LORA_RANK`).
VLLM_DEFAULT_MAX_LORA_RANK = 16

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MIN_SHARD_BYTES = 10**6
DEFAULT_SHARD_BYTES = 5 * 10**9


def parse_size(text: str) -> int:
    m = SIZE.match(text)
    if not m or (m.group(2) or "").upper() not in UNITS:
        raise MergeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").upper()])


# --workers: more would only add threads and pieces in flight (2 per worker, each at least 1 MB).
MAX_WORKERS = 256


# Who is calling: the API names an argument by its keyword (lora_r), the command line by its option
# (--lora-r); the checks are the same code (the command line calls the API).
CALLER = contextvars.ContextVar("lora_merge_caller", default="api")


def argument_name(keyword: str) -> str:
    return "--" + keyword.replace("_", "-") if CALLER.get() == "cli" else keyword
