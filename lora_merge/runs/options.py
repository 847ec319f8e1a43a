"""What each run is asked to do, typed: built once from the API's keywords, after they are checked (the command
line calls the API, so its values are checked by the same code), and never changed by the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lora_merge.megatron_target import MegatronTarget
from lora_merge.options import DEFAULT_SHARD_BYTES

FP8 = "fp8"  # --dtype fp8 (or float8_e4m3fn): block-FP8 linear weights, as DeepSeek's and Qwen's releases
MXFP4 = "mxfp4"  # --dtype mxfp4: gpt-oss's stacked experts in MXFP4, as its release


@dataclass(kw_only=True)
class InputOptions:
    """The inputs of every run and how their LoRA settings may be overridden; `warn` takes each warning (the
    API's default hands it to `warnings.warn`)."""

    hf_ref: Path | None
    base: Path | None = None
    lora: Path | None = None
    more_loras: tuple[Path, ...] = ()  # PEFT adapters merged together with `lora` (several adapters)
    lora_weights: tuple[float, ...] | None = None  # one per adapter (`lora`, then `more_loras`); None: 1 each
    lora_r: int | None = None
    lora_alpha: float | None = None
    allow_partial_lora: bool = False
    warn: Callable[[str], None]


@dataclass(kw_only=True)
class MergeOptions(InputOptions):
    out: Path
    dtype: str = "auto"  # auto, a DTYPES name, FP8 or MXFP4
    max_shard_size: int = DEFAULT_SHARD_BYTES
    force: bool = False
    verify: bool = False
    report: Path | None = None
    dry_run: bool = False
    sha256: bool = True
    workers: int | None = None
    base_model_id: str | None = None
    progress: Callable[[int, int], None] | None = None
    part: object = None  # runs.parts.Part: this run writes one part of the files, `finish` the rest
    resume: bool = False  # keep the files a killed run of this part completed (their sha256 still matching)


@dataclass(kw_only=True)
class MegatronOptions(InputOptions):
    out: Path
    target: MegatronTarget = field(default_factory=MegatronTarget)
    dtype: str = "auto"
    dry_run: bool = False
    workers: int | None = None
    progress: Callable[[int, int], None] | None = None
    part: object = None  # as MergeOptions': whole files of the checkpoint
    resume: bool = False


@dataclass(kw_only=True)
class ExportOptions(InputOptions):
    out: Path
    dtype: str = "auto"
    expert_format: str = "per-expert"
    force: bool = False
    report: Path | None = None
    base_model_id: str | None = None


@dataclass(kw_only=True)
class VerifyOptions(InputOptions):
    out: Path
    report: Path | None = None
    force: bool = False
