"""Block-scaled FP8: the format DeepSeek-V3/R1, Kimi-K2 and Qwen3's -FP8 releases ship their linear weights in.

A quantized weight W [out, in] is stored as `q` (float8_e4m3fn, the same shape) and `weight_scale_inv`
(float32, [ceil(out/bo), ceil(in/bi)], one per bo×bi block, (bo, bi) = weight_block_size, 128×128 in every
release): W = q · s over each block, partial edge blocks included (DeepSeek's weight_dequant). The config says
so: `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128], activation_scheme:
dynamic}`; DeepSeek-V3.1/V3.2 add `scale_fmt: ue8m0`: the scales, still stored as float32, are all powers of
two (what E8M0 kernels take), each block's the smallest power of two that holds its amax / 448. Every other
format is refused, naming what was found.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.shown import shown

SCALE_SUFFIX = "_scale_inv"  # weight_scale_inv beside each quantized weight
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # by bit pattern
# The scales a quantizer writes: s = amax / 448 of a block, never below the smallest normal float32 (a block
# whose values are all below 448·2^-126 ≈ 5.3e-36 gets 2^-126: amax / 448 would be a subnormal that
# multiplies with lost bits, or 0, which turns W / s into NaN codes), 1 for an all-zero block.
SCALE_MIN = 2.0 ** -126
# The largest scale an FP8 input (base or reference) may have: its block's largest value 448·s is then within
# float16's range (65504), orders of magnitude above the linear weights of any trained model. A larger one is
# damage (it would silently multiply a block), not a release.
FLOAT16_MAX = 65504.0
SCALE_MAX = float(torch.tensor(FLOAT16_MAX / E4M3_MAX, dtype=torch.float32))  # 146.214…, as a float32
POW2_SCALE_MAX = 2.0 ** 119  # the largest power-of-two scale whose 448·s stays a finite float32
# With power-of-two scales (ue8m0) a block within float16's range can get the next power of two above SCALE_MAX
POW2_INPUT_SCALE_MAX = 256.0
SCALE_RANGE = "from 2^-126 (the smallest normal float32) to 65504/448 = 146.2 (a block's values within float16's range)"


@dataclass(frozen=True)
class Fp8Format:
    """A release's block-FP8 quantization_config, checked."""

    block: tuple[int, int]
    config: dict  # as published, written back into an FP8 output's config.json
    pow2: bool = False  # scale_fmt ue8m0: every scale a power of two


def read_fp8_config(q, path) -> Fp8Format:
    """The quantization_config of an FP8 release, or a MergeError naming the format found."""
    if not isinstance(q, dict):
        raise MergeError(f"{path}: quantization_config {shown(q)}; expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        name = method if isinstance(method, str) else "unknown method"
        raise UnsupportedInput(f"{path}: has a quantization_config ({name}): a model quantized that way is not read; "
                         "block-scaled FP8 (quant_method fp8, weight_block_size [128, 128]) is, and unquantized "
                         "float weights are")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # (MiniMax-M2 names the torch dtype)
        raise MergeError(f"{path}: quantization_config fmt={shown(fmt)}; only e4m3 FP8 weights are read")
    block = q.get("weight_block_size")
    if block is None:
        raise MergeError(f"{path}: quantization_config has no weight_block_size: per-tensor or per-channel FP8 "
                         "scales are not read; block-scaled FP8 ([128, 128]) is")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                               and 1 <= b <= 1 << 16 for b in block)):
        raise MergeError(f"{path}: quantization_config weight_block_size={shown(block)}; expected [rows, columns]")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise MergeError(f"{path}: quantization_config activation_scheme={shown(q.get('activation_scheme'))}; only "
                         "dynamic activation scaling (no stored activation scales) is read")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise MergeError(f"{path}: quantization_config scale_fmt={shown(scale_fmt)}; float32 scales are read, and "
                         "'ue8m0' (float32 scales that are powers of two)")
    for key in ("modules_to_not_convert", "ignored_layers"):
        patterns = q.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise MergeError(f"{path}: quantization_config {key}={shown(patterns)}; expected a list of module names or "
                             "regular expressions (or null)")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise MergeError(f"{path}: quantization_config {key} has {shown(pattern)}, which is not a regular "
                                 f"expression ({exc}); transformers matches each entry as one") from None
    return Fp8Format(tuple(block), dict(q), pow2=scale_fmt == "ue8m0")


def check_scales(scales: torch.Tensor, where: str, bounded: bool = True, pow2: bool = False) -> None:
    """Block scales as a quantizer writes them: finite and at least 2^-126 (a zero scale zeroes its block, a
    negative one negates it); `bounded` (an input's): at most SCALE_MAX too; `pow2` (scale_fmt ue8m0): powers
    of two. A MergeError naming `where` (the file and the tensor), the first bad block and the range otherwise."""
    s = scales.float()
    bad = ~torch.isfinite(s) | (s < SCALE_MIN)
    if bounded:
        bad |= s > (POW2_INPUT_SCALE_MAX if pow2 else SCALE_MAX)
    if pow2 and not bad.any():
        odd = torch.frexp(s).mantissa != 0.5
        if odd.any():
            index = [int(i) for i in odd.nonzero()[0]]
            raise MergeError(f"{where}: block {index} has scale {float(s[tuple(index)]):.6g}, not a power of two "
                             f"({int(odd.sum())} such block(s)); scale_fmt ue8m0 says every scale is one")
    if not bad.any():
        return
    index = [int(i) for i in bad.nonzero()[0]]
    value = float(s[tuple(index)])
    what = ("not finite" if not math.isfinite(value) else "its block would read as zeros" if value == 0 else
            "its block would read negated" if value < 0 else "subnormal" if value < SCALE_MIN else
            f"its block would reach {value * E4M3_MAX:.3g}")
    limits = (SCALE_RANGE.replace("65504/448 = 146.2", "256 (the power of two above 65504/448)") if pow2 else SCALE_RANGE)
    raise MergeError(f"{where}: block {index} has scale {value:.4g} ({what}; {int(bad.sum())} bad block(s)); "
                     f"expected finite scales {limits if bounded else 'of at least 2^-126'}")


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_rows(q: torch.Tensor, scale_inv: torch.Tensor, start: int, block: tuple[int, int]) -> torch.Tensor:
    """Rows [start, start + len(q)) of W = q · s, in float32 (q: those rows; scale_inv: the whole tensor).
    One conversion pass and one in-place scaling pass, the scales broadcast over each block's columns."""
    rows, cols = q.shape
    if not rows or not cols:
        return q.to(torch.float32)
    # every e4m3 value from a 256-entry table: numpy's take is ~8x torch's float8 -> float32 conversion
    out = torch.from_numpy(np.take(E4M3_VALUES, q.contiguous().view(torch.uint8).numpy()))
    s = scale_inv[torch.div(torch.arange(start, start + rows), block[0], rounding_mode="floor")].float()
    full = cols // block[1] * block[1]
    if full:
        out[:, :full].unflatten(1, (full // block[1], block[1])).mul_(s[:, :full // block[1], None])
    if full < cols:  # the partial last column block
        out[:, full:].mul_(s[:, -1:])
    return out


def quantize_rows(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale_inv float32) of rows that start on a block boundary: per block s = amax / 448,
    at least SCALE_MIN (1 where the block is all zero), q = round_to_e4m3(W / s); `pow2` (scale_fmt ue8m0): s
    rounded up to a power of two, so W / s still fits. Sound for every finite float32 (with `pow2`, up to
    448·2^119; a larger block is refused): no NaN code, no zero or subnormal scale, within half an e4m3 step of
    the block."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    w = w.float()
    if rows != br * block[0] or cols != bc * block[1]:  # partial edge blocks: zero-padded to whole ones
        padded = torch.zeros((br * block[0], bc * block[1]), dtype=torch.float32)
        padded[:rows, :cols] = w
    else:
        padded = w
    blocks = padded.view(br, block[0], bc, block[1])
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_(min=SCALE_MIN), torch.ones_like(amax))
    if pow2:  # m·2^e with m in [0.5, 1): 2^(e-1) when m is 0.5 (already a power of two), else 2^e
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
        if (scale > POW2_SCALE_MAX).any():  # q up to 256 (rounded) times 2^120 is 2^128: no float32
            raise MergeError(f"a block of {float(amax.max()):.4g} (beyond 448·2^119 ≈ 2.98e38) cannot be stored with "
                             "power-of-two scales (scale_fmt ue8m0): it would dequantize past float32's largest value")
    scaled = blocks / scale[:, None, :, None]
    q = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(br * block[0], bc * block[1])
    if padded is not w:
        q = q[:rows, :cols].contiguous()
    return q, scale


@dataclass
class Fp8Weight:
    """A quantized weight as a merge reads it: its fp8 rows and scales, still mapped; rows come out in float32."""

    q: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self):
        return self.q.shape

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return dequantize_rows(self.q[start:stop], self.scale_inv, start, self.block)


# The linear weights DeepSeek's and Qwen's FP8 releases quantize (attention and MLP, experts and shared
# experts; Mixtral's experts are w1/w3/w2); never embeddings, norms, the router or lm_head.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                     "kv_b_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# The modules of these models that transformers builds as nn.Linear (so makes FP8 unless modules_to_not_convert
# excludes them): the quantized linears, lm_head, and Qwen2-MoE's shared_expert_gate.
LOADER_LINEARS = QUANTIZED_LINEARS + ("lm_head", "shared_expert_gate")
DEFAULT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                  "activation_scheme": "dynamic"}


def quantized_by_default(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_LINEARS


def is_loader_linear(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and name.split(".")[-2] in LOADER_LINEARS


EXPERT = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")


def loader_module(name: str) -> str:
    """The module a loader builds for a weight, whose name modules_to_not_convert is matched against: the
    weight's own module, except for routed experts, which transformers 5 and vLLM hold as one module per layer
    (`….mlp.experts`), FP8 all together or not at all."""
    module = name.removesuffix(".weight")
    expert = EXPERT.match(module)
    return expert.group(1) if expert else module


def skip_patterns(config: dict) -> list[str] | None:
    """A quantization_config's modules_to_not_convert as transformers takes it (ignored_layers where it is
    absent); None where neither is given (transformers then skips its defaults: lm_head, tied weights)."""
    patterns = config.get("modules_to_not_convert")
    return config.get("ignored_layers") if patterns is None else patterns


def not_converted(module: str, patterns) -> bool:
    """Whether transformers 5 leaves `module` unconverted under modules_to_not_convert `patterns`: an entry
    excludes the modules whose name ends with it, and those it matches from the start as a regular expression
    whose match ends at a module boundary (before a dot or the end of the name, or just after a dot): so
    `model.layers.1` excludes `model.layers.1.mlp` but not `model.layers.11`, and `mlp.gate` is not
    `mlp.gate_proj`. Tested against transformers' own function on every module name of the fixtures."""
    return any(module.endswith(pattern) or _at_boundary(pattern).match(module) for pattern in patterns or ())


@functools.lru_cache(maxsize=4096)
def _at_boundary(pattern: str) -> re.Pattern:
    """`pattern`, then a module boundary: just after a dot, or before a dot or the end."""
    return re.compile(f"(?:{pattern})(?:(?<=\\.)|(?=\\.|$))")


def quantized_by_default_unless_excluded(weights, patterns) -> set[str]:
    """Of the (name, shape) `weights`, those an FP8 output of an unquantized base quantizes: the linears the
    releases quantize, less those whose loader module modules_to_not_convert `patterns` excludes."""
    decided: dict[str, bool] = {}
    chosen = set()
    for name, shape in weights:
        module = loader_module(name)
        if module not in decided:
            decided[module] = not not_converted(module, patterns)
        if decided[module] and quantized_by_default(name, shape):
            chosen.add(name)
    return chosen


def not_converted_modules(weights, chosen: set[str], where) -> list[str]:
    """The modules_to_not_convert that describes an FP8 output: the full name of every module with a 2-D weight
    (of `weights`, (name, shape) pairs) not in `chosen`, and lm_head (transformers skips it by default only
    without a list). Full names match themselves alone in every loader's reading (transformers' prefix, suffix
    and regex, vLLM's exact names); a module with FP8 and unquantized weights (a layer's experts partly FP8
    in a base) cannot be described and is refused."""
    kept: dict[str, str] = {}
    fp8: dict[str, str] = {}
    for name, _ in weights:
        (fp8 if name in chosen else kept).setdefault(loader_module(name), name)
    for module, name in kept.items():
        if module in fp8:
            raise MergeError(f"{where}: {fp8[module]} is block-FP8 but {name} is not: transformers and vLLM load "
                             f"{module} as one module, all FP8 or none, so no FP8 output can say which is which; "
                             "choose --dtype bfloat16")
    excluded = list(kept) + ["lm_head"] * ("lm_head" not in kept)
    for module in fp8:
        if not_converted(module, excluded):  # cannot happen with these models' names; checked, not assumed
            raise MergeError(f"{where}: {module} is block-FP8, but the name of a module left unquantized matches it "
                             "as transformers reads modules_to_not_convert; no list of names describes this output")
    return excluded


def transformers_cpu_reading(shape, block: tuple[int, int]) -> str | None:
    """What transformers 5's CPU loader (FineGrainedFP8Config(dequantize=True)) does with a weight of this
    shape in these blocks: it takes the block size from the scale grid (rows ÷ scale rows) rather than from
    the config, so a dimension with more than one block and a partial last one is read with smaller blocks —
    "refuses" where the grid does not divide the dimension, "misreads" (wrong values, no error) where it does;
    None where every block is read as written."""
    wrong = refused = False
    for size, b in zip(shape, block):
        grid = math.ceil(size / b)
        if grid > 1 and size % b:
            wrong = True
            refused |= size % grid != 0
    return "refuses" if refused else "misreads" if wrong else None


def partial_block_note(weights, block: tuple[int, int]) -> str | None:
    """One line about the block-FP8 `weights` ((name, shape) pairs) that transformers' CPU loader refuses or
    reads wrongly, or None if there are none. The merge warns it before writing; verify reports it as a note."""
    found = {}
    for name, shape in weights:
        reading = transformers_cpu_reading(tuple(shape), block)
        if reading is not None:
            found[name] = (tuple(shape), reading)
    if not found:
        return None
    names = sorted(found)
    shown_names = ", ".join(f"{n} {list(found[n][0])}" for n in names[:3]) + (", …" if len(names) > 3 else "")
    refused = sum(reading == "refuses" for _, reading in found.values())
    wrong = len(found) - refused
    what = " and ".join(part for part in (f"refuses {refused} of them" if refused else "",
                                          f"reads {wrong} of them wrongly without an error" if wrong else "") if part)
    return (f"{len(found)} block-FP8 weight{'s' if len(found) != 1 else ''} ({shown_names}) have a partial "
            f"{block[0]}x{block[1]} block after the first in a dimension: transformers' CPU loader "
            f"(FineGrainedFP8Config(dequantize=True)) takes the block size from the scale grid, not from the config, "
            f"and {what}; vLLM and SGLang, which use the config's block size, read them as written "
            "(docs/formats.md, block-FP8)")


class BlockQuantizer:
    """Rows of one weight arriving in order, in float32, quantized a whole block of rows at a time: `add`
    gives the fp8 rows ready to write (a multiple of the block's rows, until the last), `scales` the
    weight_scale_inv once every row has come. Memory: less than one block of rows."""

    def __init__(self, shape: tuple[int, int], block: tuple[int, int], pow2: bool = False, name: str = ""):
        self.shape, self.block, self.pow2, self.name = shape, block, pow2, name
        self.rows_done = 0
        self._pending: list[torch.Tensor] = []
        self._pending_rows = 0
        self._scales: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> torch.Tensor | None:
        # a copy even of float32 rows: they may view an input whose pages are handed back once the piece is
        # delivered (files/handback.py), while they wait here for the rest of their block
        self._pending.append(rows.to(torch.float32, copy=True))
        self._pending_rows += rows.shape[0]
        last = self.rows_done + self._pending_rows == self.shape[0]
        ready = self._pending_rows if last else self._pending_rows // self.block[0] * self.block[0]
        if not ready:
            return None
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        try:
            q, scale = quantize_rows(pending[:ready], self.block, self.pow2)
        except MergeError as exc:
            raise MergeError(f"{self.name}: {exc}") from None
        self._scales.append(scale)
        self._pending = [pending[ready:]] if ready < pending.shape[0] else []
        self._pending_rows -= ready
        self.rows_done += ready
        return q

    def scales(self) -> torch.Tensor:
        if self.rows_done != self.shape[0]:
            raise MergeError(f"{self.rows_done} of {self.shape[0]} rows quantized (plan error)")
        return torch.cat(self._scales)
