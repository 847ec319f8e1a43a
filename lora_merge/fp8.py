"""Block-scaled FP8: the format DeepSeek-V3/R1, Kimi-K2 and Qwen3's -FP8 releases ship their linear weights in.

A quantized weight W [out, in] is stored as `q` (float8_e4m3fn, the same shape) and `weight_scale_inv`
(float32, [ceil(out/bo), ceil(in/bi)], one per bo×bi block, (bo, bi) = weight_block_size, 128×128 in every
release): W = q · s over each block, partial edge blocks included (DeepSeek's weight_dequant). The config says
so: `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128], activation_scheme:
dynamic}`. Every other format is refused, naming what was found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lora_merge.errors import MergeError
from lora_merge.shown import shown

SCALE_SUFFIX = "_scale_inv"  # weight_scale_inv beside each quantized weight
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # by bit pattern


@dataclass(frozen=True)
class Fp8Format:
    """A release's block-FP8 quantization_config, checked."""

    block: tuple[int, int]
    config: dict  # as published, written back into an FP8 output's config.json


def read_fp8_config(q, path) -> Fp8Format:
    """The quantization_config of an FP8 release, or a MergeError naming the format found."""
    if not isinstance(q, dict):
        raise MergeError(f"{path}: quantization_config {shown(q)}; expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        name = method if isinstance(method, str) else "unknown method"
        raise MergeError(f"{path}: has a quantization_config ({name}): a model quantized that way is not read; "
                         "block-scaled FP8 (quant_method fp8, weight_block_size [128, 128]) is, and unquantized "
                         "float weights are")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
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
    if scale_fmt not in (None, "float"):
        raise MergeError(f"{path}: quantization_config scale_fmt={shown(scale_fmt)}; only float32 scales are read")
    return Fp8Format(tuple(block), dict(q))


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


def quantize_rows(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale_inv float32) of rows that start on a block boundary: per block s = amax / 448
    (1 where the block is all zero), q = round_to_e4m3(W / s)."""
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
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
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
# experts); never embeddings, norms, the router or lm_head.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                     "kv_b_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                  "activation_scheme": "dynamic"}


def quantized_by_default(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_LINEARS


class BlockQuantizer:
    """Rows of one weight arriving in order, in float32, quantized a whole block of rows at a time: `add`
    gives the fp8 rows ready to write (a multiple of the block's rows, until the last), `scales` the
    weight_scale_inv once every row has come. Memory: less than one block of rows."""

    def __init__(self, shape: tuple[int, int], block: tuple[int, int]):
        self.shape, self.block = shape, block
        self.rows_done = 0
        self._pending: list[torch.Tensor] = []
        self._pending_rows = 0
        self._scales: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> torch.Tensor | None:
        self._pending.append(rows.float())
        self._pending_rows += rows.shape[0]
        last = self.rows_done + self._pending_rows == self.shape[0]
        ready = self._pending_rows if last else self._pending_rows // self.block[0] * self.block[0]
        if not ready:
            return None
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        q, scale = quantize_rows(pending[:ready], self.block)
        self._scales.append(scale)
        self._pending = [pending[ready:]] if ready < pending.shape[0] else []
        self._pending_rows -= ready
        self.rows_done += ready
        return q

    def scales(self) -> torch.Tensor:
        if self.rows_done != self.shape[0]:
            raise MergeError(f"{self.rows_done} of {self.shape[0]} rows quantized (plan error)")
        return torch.cat(self._scales)
