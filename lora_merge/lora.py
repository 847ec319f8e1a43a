"""The LoRA merge: W' = W + (alpha/r)·B·A, in float32, rounded once to the output dtype.

LoRA factors are brought into HF layout first (B's rows regrouped exactly like W's), so the merge is
independent of how either checkpoint was sharded, and the same factors serve an adapter export.
PEFT's tensor-parallel layout: column layers (qkv, fc1) replicate A and shard B on dim 0; row layers
(proj, fc2) shard A on dim 1 and replicate B; replicated layers (MLA's down-projections) replicate both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.integrity import check_finite
from lora_merge.model.layout import ExpertSlab, Rule, check_shards, unshard_replicated, unshard_row
from lora_merge.model.model_shape import ModelShape
from lora_merge.readers.checkpoint import LoraModule
from lora_merge.value_checks import (MAX_ALPHA, MAX_RANK, finite_number, is_number, lora_scale, positive_int,
                                     shown_value)

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    source: str  # where r and alpha came from, for the summary
    warnings: tuple[str, ...] = ()  # command-line values that replaced different checkpoint values
    rslora: bool = False  # rank-stabilized: the scale is alpha / sqrt(r)
    dora: bool = False  # the modules carry DoRA magnitudes (Megatron-Bridge's DoRA)

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r


def resolve_settings(args, r: int | None, alpha: float | None, where: str) -> LoraSettings:
    """r and alpha from the command line, else from the LoRA checkpoint's args; never a default. rsLoRA where the
    args say so by the field a known trainer writes: ms-swift's Megatron-SWIFT (`use_rslora`, its rank as
    `lora_rank`, its LoraParallelLinear scaling alpha / sqrt(r)); MindSpeed-LLM has no such switch."""
    arg_r, arg_alpha = getattr(args, "lora_r", None), getattr(args, "lora_alpha", None)
    r_key = "lora_r"
    if arg_r is None and getattr(args, "lora_rank", None) is not None:
        arg_r, r_key = args.lora_rank, "lora_rank"
    if getattr(args, "lora_use_rslora", False):
        raise MergeError(f"{where}: args.lora_use_rslora: a switch of no trainer this tool knows (ms-swift's is "
                         "use_rslora); its scaling is not guessed")
    rslora = getattr(args, "use_rslora", False)
    if rslora not in (True, False, None):
        raise MergeError(f"{where}: args.use_rslora={shown_value(rslora)}; expected true or false")
    final_r = r if r is not None else arg_r
    final_alpha = alpha if alpha is not None else arg_alpha
    if final_r is None or final_alpha is None:
        lacking = " and ".join(n for n, v in (("lora_r", final_r), ("lora_alpha", final_alpha)) if v is None)
        raise MergeError(f"{where}: the LoRA checkpoint's args have no {lacking}; pass --lora-r/--lora-alpha "
                         "with the values used in training")
    # Checked as numbers, not converted: args.lora_r="8" is not a rank Megatron used
    final_r = positive_int(final_r, "--lora-r" if r is not None else f"args.{r_key}", where, MAX_RANK)
    alpha_field = "--lora-alpha" if alpha is not None else "args.lora_alpha"
    if is_number(final_alpha) and float(final_alpha) <= 0:
        raise MergeError(f"{where}: {alpha_field}={final_alpha:g}; it must be a finite number above 0 (alpha 0 would "
                         "write the base model unchanged, a negative one would subtract the fine-tune)")
    final_alpha = finite_number(final_alpha, alpha_field, where, 0, MAX_ALPHA, low_open=True)
    lora_scale(final_alpha, final_r, bool(rslora), "alpha/sqrt(r)" if rslora else "alpha/r", where)
    notes = []
    for option, given, stored, name in (("--lora-r", r, arg_r, r_key), ("--lora-alpha", alpha, arg_alpha, "lora_alpha")):
        if given is not None and stored is not None and _differs(given, stored):
            notes.append(f"{option} {shown_value(given)} overrides args.{name}={shown_value(stored)} of the LoRA "
                         "checkpoint")
    source = "command line" if (r is not None and alpha is not None) else (
        "checkpoint args" if (r is None and alpha is None) else "checkpoint args + command line")
    if rslora:
        source += ", rsLoRA (args.use_rslora)"
    if getattr(args, "bridge_normalize_moe_lora", False):  # Megatron-Bridge: the routed experts' scale is their own
        source += (", routed experts at rank r / moe_router_topk, scale alpha over that rank "
                   "(Megatron-Bridge normalize_moe_lora)")
    return LoraSettings(r=final_r, alpha=final_alpha, source=source, warnings=tuple(notes), rslora=bool(rslora),
                        dora=bool(getattr(args, "bridge_dora", False)))


def _differs(given, stored) -> bool:
    try:
        return float(given) != float(stored)
    except (TypeError, ValueError):
        return True


def check_factor_shapes(rule: Rule, lora: LoraModule, shape: ModelShape, r: int, module: str) -> None:
    r = lora.rank or r  # a module trained at a rank of its own
    out_dim, in_dim = rule.global_shape(shape)
    a_shapes, b_shapes = lora.a.shapes, lora.b.shapes
    if len(a_shapes[0]) != 2 or len(b_shapes[0]) != 2:
        raise MergeError(f"{lora.a[0].where}: lora_A/lora_B of {module} must be matrices, "
                         f"found shapes {list(a_shapes[0])} and {list(b_shapes[0])}")
    blocks = lora.blocks
    if a_shapes[0][0] != r * blocks or b_shapes[0][1] != r * blocks:
        if blocks > 1:
            raise MergeError(f"{lora.a[0].where}: {module}'s {blocks} adapters have rank {a_shapes[0][0] // blocks} "
                             f"each, but r={r}")
        raise MergeError(f"{lora.a[0].where}: {module} has LoRA rank {a_shapes[0][0]} (lora_A) / {b_shapes[0][1]} "
                         f"(lora_B), but r={r}")
    r *= blocks
    a_split, b_split = rule.lora_split
    check_shards(a_shapes, a_split, (r, in_dim), f"{module}.lora_A ({lora.a[0].where})")
    check_shards(b_shapes, b_split, (out_dim, r), f"{module}.lora_B ({lora.b[0].where})")


def hf_factors(rule: Rule, lora: LoraModule, shape: ModelShape, module: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(B, A) for each HF tensor the rule produces, with B's rows in that tensor's HF order."""
    a, b_shards = _factor_shards(rule, lora, module)
    factors = {name: (b, a) for name, b in rule.to_hf(b_shards, shape, f"{module}.lora_B").items()}
    return _own_blocks(rule, lora, shape, factors, module) if lora.row_block is not None else factors


def _own_blocks(rule: Rule, lora: LoraModule, shape: ModelShape, factors: dict, module: str) -> dict:
    """A fused module of several adapters (`LoraModule.row_block`): each HF tensor keeps the adapters that own its
    rows (the others' columns of B are zero there by construction), so a projection an adapter of its own trained
    gets that adapter's factors, of rank r; one no adapter trained gets zero factors (PEFT's model of the same
    run has no LoRA there: W is written unchanged either way)."""
    blocks = lora.blocks
    r = lora.a[0].shape[0] // blocks
    owner = torch.nn.functional.one_hot((lora.row_block.long() + 1), blocks + 1)[:, 1:].to(torch.float32)
    owned = rule.to_hf([owner], shape, f"{module} (its adapters' rows)")
    out = {}
    for name, (b, a) in factors.items():
        mine = [i for i in range(blocks) if owned[name][:, i].any()]
        if not mine:
            out[name] = (b.new_zeros(b.shape[0], r), a.new_zeros(r, a.shape[1]))
            continue
        cols = torch.cat([torch.arange(i * r, (i + 1) * r) for i in mine])
        out[name] = (b[:, cols], a[cols])
    return out


def whole_factors(rule: Rule, lora: LoraModule, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] of a linear, un-sharded as they are (Megatron's row order)."""
    a, b_shards = _factor_shards(rule, lora, module)
    return a, torch.cat(b_shards) if len(b_shards) > 1 else b_shards[0]


def _factor_shards(rule: Rule, lora: LoraModule, module: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A un-sharded (row-split or replicated), and B's shards: one, where every rank holds it whole (checked)."""
    a_shards = [ref.load() for ref in lora.a]
    b_shards = [ref.load() for ref in lora.b]
    a_split, b_split = rule.lora_split
    a = unshard_row(a_shards) if a_split == "row" else unshard_replicated(a_shards, f"{module}.lora_A")
    if b_split == "replicated":  # whole on every rank: the rule sees it as one rank's shard
        b_shards = [unshard_replicated(b_shards, f"{module}.lora_B")]
    return a, b_shards


# W + s·B·A is computed this many float32 bytes of rows at a time: the block stays in the CPU cache from
# the widening copy through addmm_ to the narrowing copy, instead of three passes over main memory (a
# 2048×7168 bf16 expert: 44 ms → 13 ms on one core). Rows are independent, so the result is the same.
MERGE_BLOCK_BYTES = 1 << 20


def merge_block_rows(cols: int) -> int:
    """Rows per addmm_ block. Its result bits depend on how many rows one call covers (MKL), so pieces are
    cut at multiples of this (merge_pipeline) and every row is merged in the same block for any piece size."""
    rows = max(1, MERGE_BLOCK_BYTES // (4 * max(cols, 1)))
    # a power of two: pieces that must also start on FP8 block rows (128) then need no larger common multiple
    return 1 << (rows.bit_length() - 1)


class Delta(Protocol):
    """What the pipeline asks of a change to one HF weight (plain LoRA today; DoRA and others are further
    implementations): its rows merged into the weight's, and the row unit pieces must be cut at so that the
    result's bits do not depend on the piece size."""

    def row_unit(self, cols: int) -> int: ...

    def merge_rows(self, weight: torch.Tensor, start: int, stop: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """Rows [start, stop) of the merged weight, in `dtype`; `weight`: those rows of the base weight."""


@dataclass(frozen=True)
class LowRankDelta:
    """ΔW = scale·B·A for one HF weight, B's rows in the weight's HF order (rsLoRA and per-module patterns
    only change `scale`): W + ΔW in float32, rounded once."""

    b: torch.Tensor  # [rows, r]
    a: torch.Tensor  # [r, cols]
    scale: float

    def row_unit(self, cols: int) -> int:
        return merge_block_rows(cols)

    def merge_rows(self, weight: torch.Tensor, start: int, stop: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        return merge_weight(weight, self.b[start:stop], self.a, self.scale, dtype, name)


@dataclass(frozen=True)
class DoraDelta:
    """DoRA (PEFT's DoraLinearVariant): W' = m / ‖W + s·B·A‖ · (W + s·B·A), the norm one per output row (over the
    input dimension: dim 1 of the [out, in] weight), of the float32 merged row, in float32 (PEFT computes it in the
    weight's dtype: the same in float32); the row then scaled by its magnitude over its norm and rounded once."""

    low_rank: LowRankDelta
    magnitude: torch.Tensor  # [rows]: lora_magnitude_vector

    def row_unit(self, cols: int) -> int:
        return self.low_rank.row_unit(cols)

    def merge_rows(self, weight: torch.Tensor, start: int, stop: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        d = self.low_rank
        merged = merge_weight(weight, d.b[start:stop], d.a, d.scale, torch.float32, name)
        merged.mul_((self.magnitude[start:stop].float() / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1))
        check_finite(merged, name, "DoRA: non-finite values (a merged row of zero norm, or the magnitude vector's "
                     "values)")
        return merged.to(dtype)


@dataclass(frozen=True)
class StackedExpertsDelta:
    """PEFT's LoRA on a stacked experts parameter stored as it is (gpt-oss's and Llama-4's gate_up_proj and
    down_proj): A [E·r, in] is (E, r, in), B [out, r·E] is (out, r, E), and expert e changes by scale·B_e·A_e,
    added transposed to an [in, out] slab (transformers' is_transposed experts: gpt-oss) or as it is to an
    [out, in] one (Llama-4: PEFT swaps the features). A row of the tensor is one expert, merged whole, so the
    result's bits do not depend on how the rows are cut."""

    b: torch.Tensor  # [out, r·E]
    a: torch.Tensor  # [E·r, in]
    scale: float
    experts: int
    in_out: bool = True  # the slabs are [in, out] (transformers' is_transposed experts); else [out, in]

    def factors_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's change as low-rank factors of its slab: (A_eᵀ [in, r], B_eᵀ [r, out]) for an [in, out] slab,
        (B_e [out, r], A_e [r, in]) for an [out, in] one."""
        r = self.a.shape[0] // self.experts
        a_e, b_e = self.a.reshape(self.experts, r, -1)[e], self.b.reshape(self.b.shape[0], r, self.experts)[:, :, e]
        return (a_e.t(), b_e.t()) if self.in_out else (b_e, a_e)

    def row_unit(self, cols: int) -> int:
        return 1

    def add_to_transposed(self, slabs: torch.Tensor, start: int) -> None:
        """Add experts start.. 's changes in place to float32 slabs stored as their transposes ([out, in] of an
        [in, out] parameter: MXFP4 blocks run along the input). The same sums as merge_rows in the other
        orientation (bit-identical at the shapes tested; an addmm of the other orientation may sum in another order,
        which could move a value by one float32 ulp before the output's rounding)."""
        assert self.in_out
        for i in range(slabs.shape[0]):
            a_t, b_t = self.factors_of(start + i)
            slabs[i].addmm_(b_t.t().float(), a_t.t().float(), alpha=self.scale)

    def merge_rows(self, weight: torch.Tensor, start: int, stop: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        out = torch.empty(weight.shape, dtype=dtype)
        for i, e in enumerate(range(start, stop)):
            b, a = self.factors_of(e)
            out[i] = merge_weight(weight[i], b, a, self.scale, dtype, f"{name} (expert {e})")
        return out


@dataclass(frozen=True)
class ExpertLoras:
    """The Megatron LoRA modules of every expert of a stacked HF tensor that an HF base holds whole (None: an expert
    the LoRA does not adapt), merged as one change (`stacked_delta`)."""

    rules: tuple[ExpertSlab, ...]
    modules: tuple[LoraModule | None, ...]

    @property
    def refs(self) -> tuple:
        return tuple(ref for m in self.modules if m is not None for ref in m.refs)

    def __len__(self) -> int:
        return sum(m is not None for m in self.modules)

    def stacked_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """PEFT's factors of the stacked tensor (target_parameters): B [out, r·E] as (out, r, E) and A [E·r, in] as
        (E, r, in), B's rows in the row's output order; an expert without LoRA zero."""
        pairs = [rule.lora_factors(*reversed(whole_factors(rule, m, rule.megatron.removesuffix(".weight"))))
                 if m is not None else None for rule, m in zip(self.rules, self.modules)]
        b0, a0 = next(p for p in pairs if p is not None)
        pairs = [p if p is not None else (b0.new_zeros(b0.shape), a0.new_zeros(a0.shape)) for p in pairs]
        a = torch.cat([a for _, a in pairs])
        b = torch.stack([b for b, _ in pairs], dim=2).reshape(b0.shape[0], -1)
        return b, a

    def stacked_delta(self, scale: float) -> StackedExpertsDelta:
        b, a = self.stacked_factors()
        # routed experts share one rank, so one scale (normalize_moe_lora: alpha over theirs, not the run's r)
        factors = {m.scale_factor for m in self.modules if m is not None}
        if len(factors) > 1:
            raise MergeError(f"{self.rules[0].megatron}: the experts of one stacked tensor were trained at different "
                             "ranks; expected one")
        return StackedExpertsDelta(b, a, scale * factors.pop(), experts=len(self.modules), in_out=True)


def megatron_deltas(rule: Rule, lora, shape: ModelShape, module: str, scale: float) -> dict[str, Delta]:
    """The deltas of a Megatron LoRA module, by the HF tensor each changes (a routed expert's of a stacked tensor:
    the change to its row, as PEFT's factors of one expert; every expert's of one an HF base holds whole)."""
    if isinstance(lora, ExpertLoras):
        if any(m is not None and m.magnitude is not None for m in lora.modules):
            raise UnsupportedInput(f"{module}: DoRA on experts stored stacked (gpt-oss's) is not supported")
        return {rule.hf: lora.stacked_delta(scale)}
    if isinstance(rule, ExpertSlab):
        if lora.magnitude is not None:
            raise UnsupportedInput(f"{module}: DoRA on experts stored stacked (gpt-oss's) is not supported")
        a, b = whole_factors(rule, lora, module)
        b, a = rule.lora_factors(b, a)
        return {rule.hf: StackedExpertsDelta(b, a, scale * lora.scale_factor, experts=1, in_out=True)}
    return {name: f if isinstance(f, DoraDelta) else LowRankDelta(*f, scale * lora.scale_factor)
            for name, f in megatron_factors(rule, lora, shape, module, scale).items()}


def megatron_factors(rule: Rule, lora: LoraModule, shape: ModelShape, module: str,
                     scale: float) -> dict[str, "tuple[torch.Tensor, torch.Tensor] | DoraDelta"]:
    """(B, A) for each HF tensor of a Megatron LoRA module (to be scaled by `scale` times the module's
    `scale_factor`), or its DoraDelta where the module is DoRA (its magnitude cut into each HF tensor's rows as the
    linear's rows are; scaled already)."""
    factors = hf_factors(rule, lora, shape, module)
    if lora.magnitude is None:
        return factors
    m = lora.magnitude.load()
    pieces = [p.unsqueeze(1) for p in m.chunk(lora.magnitude_tp)]
    rows = rule.to_hf(pieces, shape, f"{module} (DoRA magnitude)")
    return {name: DoraDelta(LowRankDelta(b, a, scale * lora.scale_factor), rows[name][:, 0])
            for name, (b, a) in factors.items()}


def merge_weight(weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float, dtype: torch.dtype,
                 name: str) -> torch.Tensor:
    rows, cols = weight.shape
    result = torch.empty((rows, cols), dtype=dtype)
    step = merge_block_rows(cols)
    block = torch.empty((min(step, rows), cols), dtype=torch.float32)
    b, a = b.float(), a.float()
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        work = block[:stop - start]
        work.copy_(weight[start:stop])
        work.addmm_(b[start:stop], a, alpha=scale)
        result[start:stop].copy_(work)
    check_finite(result, name, f"merged weight has non-finite values in {str(dtype).removeprefix('torch.')} "
                 "(check the LoRA factors and alpha/r, or the output dtype's range)")
    return result
