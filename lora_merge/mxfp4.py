"""MXFP4 (OCP Microscaling, FP4 E2M1 values with one E8M0 scale per 32), as gpt-oss's release stores its experts.

    quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}
    model.layers.{i}.mlp.experts.gate_up_proj_blocks   uint8 [E, 2·ffn, hidden/32, 16]   two FP4 codes a byte
    model.layers.{i}.mlp.experts.gate_up_proj_scales   uint8 [E, 2·ffn, hidden/32]       2^(s - 127) per 32 values
    (down_proj likewise, [E, hidden, ffn/32, 16])

A byte holds two consecutive values, the low nibble first; a code is sign (bit 3) and magnitude
0, 0.5, 1, 1.5, 2, 3, 4, 6. The blocks run along the input dimension of an [E, out, in] weight, the transpose of
the [E, in, out] parameter transformers builds, so a dequantized expert is transposed once. Scale 255 is E8M0's
NaN and is refused. Read expert by expert as rows stream, like the block-FP8 path.

Written back (`--dtype mxfp4`) as transformers quantizes gpt-oss (`quantize_to_mxfp4`, through triton_kernels'
`downcast_to_mxfp` with its default ROUND_UP scales): per group of 32 input values of an output row, the scale is
the float32 amax / 6 rounded up to a power of two (so no value clips), and each value the nearest E2M1 code of
value / scale, ties away from zero, the sign kept (a negative value too small for 0.5 is -0). The merged float32
values are quantized directly (transformers first rounds to bf16: that would round twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_merge.errors import MergeError

BLOCK = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# E2M1 codes 0..15: magnitude by the low three bits, negative with bit 3
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 255


# the output's quantization_config from an unquantized base: gpt-oss's release's (only the experts are MXFP4)
DEFAULT_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                             "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def is_mxfp4_config(q) -> bool:
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


# a byte's two values (low nibble, high nibble), and a scale byte's power of two (exact in float32: 2^-127 is a
# subnormal); multiplying by it is ldexp, rounded once where the product is subnormal or overflows, as ldexp is
_PAIRS = torch.tensor([(FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]) for b in range(256)], dtype=torch.float32)
_POWERS = torch.tensor([2.0 ** (s - 127) for s in range(256)], dtype=torch.float64).to(torch.float32)
CHUNK_GROUPS = 1 << 16  # groups of 32 values dequantized at a time: 8 MB of values, 8 MB of indices


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, G·32] from uint8 blocks [..., rows, G, 16] and scales [..., rows, G]."""
    flat_blocks, flat_scales = blocks.reshape(-1, blocks.shape[-1]), scales.reshape(-1)
    out = torch.empty((flat_blocks.shape[0], 2 * blocks.shape[-1]), dtype=torch.float32)
    for start in range(0, flat_blocks.shape[0], CHUNK_GROUPS):  # (embedding: torch's fast row gather)
        stop = start + CHUNK_GROUPS
        values = F.embedding(flat_blocks[start:stop].int(), _PAIRS).reshape(-1, 2 * blocks.shape[-1])
        torch.mul(values, F.embedding(flat_scales[start:stop].int(), _POWERS.unsqueeze(1)), out=out[start:stop])
    return out.reshape(*blocks.shape[:-2], -1)


# A float32's sign, exponent and top two mantissa bits (its bits >> 21) decide its E2M1 code: every midpoint
# between two E2M1 magnitudes (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is the lowest value of such a bucket, and a
# magnitude at or above the k-th gets code k (ties away from zero); the sign bit becomes the code's bit 3.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_BUCKETS = (torch.arange(2048, dtype=torch.int32) << 21).view(torch.float32)
_CODES = (torch.bucketize(_BUCKETS.abs(), _MIDPOINTS, right=True) | (torch.signbit(_BUCKETS).long() << 3)).to(torch.uint8)
_EXPONENT, _BELOW_NEXT_POWER = 0x7F800000, 0x007FFFFF


QUANTIZE_VALUES = 1 << 20  # float32 values quantized at a time: a few MB of temporaries per worker


def _codes(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes (x's shape) and E8M0 scale bytes (without `dim`) of finite float32 values in groups of 32 along
    `dim`."""
    amax = torch.maximum(x.amax(dim), x.amin(dim).neg_())
    exponent = amax.div_(6.0).view(torch.int32).add_(_BELOW_NEXT_POWER).bitwise_and_(_EXPONENT)  # rounded up
    scales = exponent.view(torch.float32)
    inverse = torch.where(scales == 0, 0.0, scales.reciprocal()).unsqueeze(dim)  # exact: a power of two
    bucket = torch.mul(x, inverse).view(torch.int32).bitwise_right_shift_(21).bitwise_and_(0x7FF)
    codes = torch.index_select(_CODES, 0, bucket.view(-1)).view(x.shape)
    return codes, exponent.bitwise_right_shift_(23).to(torch.uint8)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 blocks [E, out, G, 16] and scales [E, out, G] of a stacked [E, in, out] float32 parameter (finite),
    the blocks along its input dimension (in = G·32). Computed in the parameter's layout, a few groups at a time;
    only the packed codes are transposed."""
    experts, inputs, outputs = weight.shape
    groups = inputs // BLOCK
    blocks = torch.empty((experts, groups, BLOCK // 2, outputs), dtype=torch.uint8)
    scales = torch.empty((experts, groups, outputs), dtype=torch.uint8)
    step = max(1, QUANTIZE_VALUES // (BLOCK * outputs))
    for e in range(experts):
        for start in range(0, groups, step):
            stop = min(start + step, groups)
            x = weight[e, start * BLOCK:stop * BLOCK].reshape(stop - start, BLOCK, outputs)
            codes, scales[e, start:stop] = _codes(x, 1)
            torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=blocks[e, start:stop])
    return blocks.permute(0, 3, 1, 2).contiguous(), scales.transpose(1, 2).contiguous()


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization of float32 values [..., in] whose groups run along the last dimension (an
    expert's [out, in] slab, as the blocks store it): blocks [..., G, 16] and scales [..., G]."""
    inputs = rows.shape[-1]
    groups = inputs // BLOCK
    flat = rows.reshape(-1, inputs)
    blocks = torch.empty((flat.shape[0], groups, BLOCK // 2), dtype=torch.uint8)
    scales = torch.empty((flat.shape[0], groups), dtype=torch.uint8)
    step = max(1, QUANTIZE_VALUES // inputs)
    for start in range(0, flat.shape[0], step):
        stop = min(start + step, flat.shape[0])
        codes, scales[start:stop] = _codes(flat[start:stop].reshape(stop - start, groups, BLOCK), 2)
        torch.bitwise_or(codes[..., 0::2], codes[..., 1::2] << 4, out=blocks[start:stop])
    return blocks.view(*rows.shape[:-1], groups, BLOCK // 2), scales.view(*rows.shape[:-1], groups)


def within_mxfp4_step(got: torch.Tensor, exact: torch.Tensor, scales: torch.Tensor) -> bool:
    """Dequantized [E, in, out] values within half an E2M1 step of the exact ones: the step is 0.5, 1 or 2 times
    the group's scale below 2, 4 or 6 times it (so at most max(scale/4, |exact|/4)); float32 leaves a little
    more. `scales`: uint8 [E, out, G], the output's; a scale above twice what the exact values call for (their
    amax / 6 rounded up to a power of two: once more for float32 noise at a power of two) is not taken at its
    word, so a zeroed or coarsened group is found."""
    called_for = quantize(exact.float().contiguous())[1].int() + 1
    s = _POWERS[torch.minimum(scales.int(), called_for)].repeat_interleave(BLOCK, -1).transpose(1, 2)
    bound = torch.maximum(s * 0.25, exact.abs() * 0.25) * (1 + 1e-5) + 2.0 ** -149
    return bool(((got.float() - exact).abs() <= bound).all())


@dataclass(frozen=True)
class Mxfp4Weight:
    """A stacked experts parameter [E, in, out] stored as MXFP4 blocks of its transpose; `rows(a, b)` gives
    experts a..b dequantized, float32, in the parameter's layout."""

    blocks: torch.Tensor  # uint8 [E, out, G, 16]
    scales: torch.Tensor  # uint8 [E, out, G]

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, out, groups, _ = self.blocks.shape
        return experts, groups * BLOCK, out

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.stored_rows(start, stop).transpose(1, 2)

    def stored_rows(self, start: int, stop: int) -> torch.Tensor:
        """Experts start..stop dequantized in the blocks' own layout, [n, out, in] contiguous."""
        return dequantize(self.blocks[start:stop], self.scales[start:stop])


def check_pair(blocks, scales, name: str, where: str) -> tuple[int, int, int]:
    """The parameter shape [E, in, out] of an MXFP4 pair, or a MergeError naming what does not fit."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or len(blocks.shape) != 4 or \
            blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise MergeError(f"{where}: MXFP4 {name}{BLOCKS_SUFFIX} {list(blocks.shape)} {blocks.dtype} with "
                         f"{name}{SCALES_SUFFIX} {list(scales.shape)} {scales.dtype}; expected uint8 [E, out, G, 16] "
                         "and uint8 [E, out, G]")
    experts, out, groups, _ = blocks.shape
    return experts, groups * BLOCK, out


def check_scales(scales: torch.Tensor, where: str) -> None:
    if (scales == E8M0_NAN).any():
        raise MergeError(f"{where}: an MXFP4 scale is 255, E8M0's NaN; the release is damaged")
