"""Layout rules: how one Megatron parameter, split over tensor-parallel ranks, becomes HF tensors.

Each rule is a small declarative object (in the spirit of Megatron-Bridge's parameter mappings): the
Megatron name, the HF name(s), the global shape in named dimensions, and how the ranks split it. An
architecture (see `architectures.py`) is a table of these.

The split functions work on any trailing dimensions, so the same rule that un-shards a column-parallel
weight `[out, in]` also un-shards that layer's bias `[out]` and its LoRA B `[out, r]`: all three have
their rows laid out alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from lora_merge.errors import MergeError
from lora_merge.fp8 import Fp8Weight
from lora_merge.mxfp4 import Mxfp4Weight
from lora_merge.integrity import check_finite

if TYPE_CHECKING:
    from lora_merge.model.model_shape import ModelShape


def named_dims(shape: ModelShape) -> dict[str, int]:
    q, kv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    dims = {"hidden": shape.hidden, "q": q, "kv": kv, "qkv": q + 2 * kv, "ffn": shape.ffn,
            "gated_ffn": 2 * shape.ffn, "head_dim": shape.head_dim, "vocab": shape.vocab, "one": 1,
            "two_hidden": 2 * shape.hidden, "heads": shape.heads}
    dims["gated_q"] = 2 * q  # attention with an output gate: q_proj rows doubled (Qwen3-Next)
    mla = getattr(shape, "mla", None)
    if mla is not None:
        dims.update(mla.dims(shape.heads))
    linear = getattr(shape, "linear_attention", None)
    if linear is not None:
        dims.update(linear.dims())
    moe = getattr(shape, "moe", None)
    if moe is not None:
        dims.update(experts=moe.num_experts, moe_ffn=moe.ffn, gated_moe_ffn=2 * moe.ffn,
                    shared_ffn=moe.shared_ffn, gated_shared_ffn=2 * moe.shared_ffn)
    return dims


# --- the un-sharding operations -----------------------------------------------------------------

def unshard_column(shards: list[torch.Tensor]) -> torch.Tensor:
    """Column-parallel: each rank holds a block of output rows."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)


def unshard_row(shards: list[torch.Tensor]) -> torch.Tensor:
    """Row-parallel: each rank holds a block of input columns."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=1)


def unshard_replicated(shards: list[torch.Tensor], where: str) -> torch.Tensor:
    """Replicated: every rank holds the same values; differing copies mean a broken checkpoint."""
    for rank, other in enumerate(shards[1:], start=1):
        if not torch.equal(shards[0], other):
            for shard in (shards[0], other):  # NaN never equals itself: say what is really wrong
                check_finite(shard, where, "non-finite values (NaN or Inf) in the checkpoint")
            raise MergeError(f"{where}: replicated tensor differs between TP rank 0 and TP rank {rank}")
    return shards[0]


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused QKV is interleaved per query group: [q heads of g, k of g, v of g] for each g.

    Ranks hold whole groups in order, so the rank concatenation is already the global layout.
    """
    return tuple(torch.cat(parts) for parts in split_qkv_groups(qkv, heads, groups, head_dim))


def split_qkv_groups(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Like split_qkv, but as per-group row views (q of each group, k of each, v of each), no copies."""
    per_group = heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, head_dim, *rest)
    q = [grouped[g, :per_group].reshape(per_group * head_dim, *rest) for g in range(groups)]
    k = [grouped[g, per_group] for g in range(groups)]
    v = [grouped[g, per_group + 1] for g in range(groups)]
    return q, k, v


# --- row blocks: an HF tensor as views into the checkpoint, materialized a chunk of rows at a time ---

@dataclass(frozen=True)
class RowBlock:
    """Consecutive rows of an HF tensor, still in the checkpoint's (memory-mapped) tensors: one tensor, or
    the rank shards of a row-parallel tensor, joined along dim 1 only for the rows taken."""

    parts: tuple[torch.Tensor, ...]

    @property
    def rows(self) -> int:
        return self.parts[0].shape[0]

    @property
    def row_numel(self) -> int:
        return sum(p[0].numel() if p.dim() > 1 else 1 for p in self.parts)

    def take(self, start: int, stop: int) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0][start:stop]
        return torch.cat([p[start:stop] for p in self.parts], dim=1)

    def whole(self) -> torch.Tensor:
        return self.take(0, self.rows)


@dataclass(frozen=True)
class QuantizedRowBlock(RowBlock):
    """A block-FP8 weight's rows (`parts`: its fp8 rows, as stored), taken dequantized to float32."""

    weight: Fp8Weight | None = None

    def take(self, start: int, stop: int) -> torch.Tensor:
        return self.weight.rows(start, stop)


@dataclass(frozen=True)
class Mxfp4RowBlock(RowBlock):
    """An MXFP4 stacked experts parameter's rows (one expert each; `parts`: its blocks as stored), taken
    dequantized to float32."""

    weight: Mxfp4Weight | None = None

    @property
    def row_numel(self) -> int:  # an expert's values, dequantized (its blocks hold two a byte)
        return self.weight.shape[1] * self.weight.shape[2]

    def take(self, start: int, stop: int) -> torch.Tensor:
        return self.weight.rows(start, stop)


@dataclass(frozen=True)
class SlabBlock(RowBlock):
    """One routed expert's Megatron tensor (`parts`: its expert-TP shards as stored, joined by `join`) as one row of
    a stacked HF tensor: taken through its rule's `slab` (e.g. transposed, gate and up columns interleaved), which
    copies."""

    slab: object = None  # ExpertSlab.slab
    join: object = None  # ExpertSlab.joined, with the pieces' kind bound

    @property
    def rows(self) -> int:
        return 1

    @property
    def row_numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def stored(self) -> torch.Tensor:
        """The expert's whole Megatron tensor (a view of the checkpoint where it is one shard)."""
        return self.join(self.parts)

    def take(self, start: int, stop: int) -> torch.Tensor:
        assert (start, stop) == (0, 1), (start, stop)
        return self.slab(self.stored()).unsqueeze(0)


def join_blocks(blocks: list[RowBlock]) -> torch.Tensor:
    return unshard_column([b.whole() for b in blocks])


def single(t: torch.Tensor | Fp8Weight) -> list[RowBlock]:
    if isinstance(t, Fp8Weight):
        return [QuantizedRowBlock((t.q,), t)]
    if isinstance(t, Mxfp4Weight):
        return [Mxfp4RowBlock((t.blocks,), t)]
    return [RowBlock((t,))]


SPLIT_DIM = {"column": 0, "row": 1}  # the dimension each kind of parallel layer splits
DUPLICATED_OR_COLUMN = "duplicated or column"  # either, as stored (DuplicatedOrColumn)


# --- rules ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Names are templates: `{expert}` in any name is bound per routed expert (see `bind`)."""

    megatron: str
    dims: tuple[str, ...]  # global Megatron shape, in named dimensions
    requires: str | None = None  # a ModelShape feature this parameter exists only with
    aliases: tuple[str, ...] = ()  # other names of the same parameter (TransformerEngine spec, torch_dist)
    # in which decoder layers: "all", or those of a kind (ModelShape.layer_kinds): "dense" (plain MLP) or "moe"
    # (routed experts); "attention" or "linear" (Gated DeltaNet); "indexer" (their own sparse-attention indexer)
    layers: str = "all"
    keep_dtype: torch.dtype | None = None  # written in this dtype whatever --dtype says (a routing bias)
    instead_of: tuple[str, ...] = ()  # another naming: the rules (by Megatron name) it replaces when present
    parallel = "replicated"  # how TP ranks split it: "replicated", "column" (dim 0) or "row" (dim 1)

    @property
    def split_dim(self) -> int | None:
        return SPLIT_DIM.get(self.parallel)

    @property
    def lora_split(self) -> tuple[str, str]:
        """How TP ranks hold this linear's LoRA factors A [r, in] and B [out, r] (PEFT's layout on Megatron's
        parallel linears): a column layer replicates A and splits B like its weight; a row layer splits A on
        its input columns and replicates B; a replicated layer replicates both."""
        return {"column": ("replicated", "column"), "row": ("row", "replicated"),
                DUPLICATED_OR_COLUMN: ("replicated", DUPLICATED_OR_COLUMN)}.get(self.parallel,
                                                                               ("replicated", "replicated"))

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    def bind(self, **indices) -> "Rule":
        """This rule with its name templates filled in (`{expert}` → a global expert number)."""
        changes = {f.name: getattr(self, f.name).format(**indices) for f in fields(self)
                   if isinstance(getattr(self, f.name), str) and "{" in getattr(self, f.name)}
        changes["aliases"] = tuple(a.format(**indices) for a in self.aliases)
        return replace(self, **changes)

    def hf_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def global_shape(self, shape: ModelShape, shards_shapes: list[tuple[int, ...]] | None = None) -> tuple[int, ...]:
        dims = named_dims(shape)
        return tuple(dims[d] for d in self.dims)

    def hf_shapes(self, shape: ModelShape) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def hf_blocks(self, shards: list[torch.Tensor], shape: ModelShape, where: str,
                  global_pieces: bool = False) -> dict[str, list[RowBlock]]:
        """Each HF tensor this parameter becomes, as row blocks that are views of the shards (no copies).

        `shards` are the TP ranks' shards; with `global_pieces` they are instead consecutive pieces of the
        global (TP=1) tensor, as torch_dist stores it. The two agree for every layout but swiglu fc1.
        """
        raise NotImplementedError

    def to_hf(self, shards: list[torch.Tensor], shape: ModelShape, where: str,
              global_pieces: bool = False) -> dict[str, torch.Tensor]:
        """The HF tensors, materialized."""
        return {name: join_blocks(blocks) for name, blocks in self.hf_blocks(shards, shape, where, global_pieces).items()}


def expected_shard_shape(parallel: str, global_shape: tuple[int, ...], tp: int, where: str) -> tuple[int, ...]:
    split_dim = SPLIT_DIM.get(parallel)
    if split_dim is None:
        return global_shape
    if global_shape[split_dim] % tp:
        raise MergeError(f"{where}: dimension {split_dim} of size {global_shape[split_dim]} does not split over TP={tp}")
    shard = list(global_shape)
    shard[split_dim] //= tp
    return tuple(shard)


def stored_split(parallel: str, shapes: list[tuple[int, ...]], global_rows: int) -> str:
    """How the TP ranks hold a parameter: its rule's split, or for DUPLICATED_OR_COLUMN what the shards say
    (whole on every rank: duplicated; fewer rows: column-parallel)."""
    if parallel != DUPLICATED_OR_COLUMN:
        return parallel
    return "replicated" if all(s[0] == global_rows for s in shapes) else "column"


def check_shards(shapes: list[tuple[int, ...]], parallel: str, global_shape: tuple[int, ...], where: str) -> None:
    parallel = stored_split(parallel, shapes, global_shape[0])
    expected = expected_shard_shape(parallel, global_shape, len(shapes), where)
    for rank, got in enumerate(shapes):
        if tuple(got) != expected:
            raise MergeError(f"{where}: TP rank {rank} shard has shape {list(got)}, expected {list(expected)} "
                             f"({parallel} split of global {list(global_shape)} over TP={len(shapes)})")


@dataclass(frozen=True)
class OneToOne(Rule):
    """A Megatron parameter that becomes exactly one HF tensor of the same global shape."""

    hf: str = ""

    def hf_names(self):
        return (self.hf,)

    def hf_shapes(self, shape):
        return {self.hf: self.global_shape(shape)}


@dataclass(frozen=True)
class Replicated(OneToOne):
    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return {self.hf: single(unshard_replicated(shards, where))}


@dataclass(frozen=True)
class AsStored(Replicated):
    """An HF base's tensor that no table names and no LoRA touches (DeepSeek's multi-token-prediction
    layers), written as it is stored: its own shape and dtype."""

    size: tuple[int, ...] = ()

    def global_shape(self, shape, shards_shapes=None):
        return self.size


@dataclass(frozen=True)
class RowParallel(OneToOne):
    parallel = "row"

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return {self.hf: [RowBlock(tuple(shards))]}


@dataclass(frozen=True)
class ColumnParallel(OneToOne):
    parallel = "column"

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return {self.hf: [RowBlock((s,)) for s in shards]}


@dataclass(frozen=True)
class DuplicatedOrColumn(OneToOne):
    """A linear that Megatron builds duplicated on every TP rank with TransformerEngine (TELinear,
    parallel_mode="duplicated") but column-parallel with its local spec (ColumnParallelLinear, whose output
    is gathered before use): MLA's down-projections. Its shards say which; its LoRA's B the same way
    (A is whole on every rank either way)."""

    parallel = DUPLICATED_OR_COLUMN

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        split = stored_split(self.parallel, [tuple(s.shape) for s in shards], self.global_shape(shape)[0])
        as_stored = Replicated if split == "replicated" else ColumnParallel
        return as_stored.hf_blocks(self, shards, shape, where, global_pieces)


@dataclass(frozen=True)
class VocabParallel(ColumnParallel):
    """Embedding / output layer: vocab rows split over ranks, padded past the tokenizer's vocab."""

    def global_shape(self, shape, shards_shapes=None):
        # The padded row count is whatever the ranks hold; it only has to cover the real vocab.
        rows = sum(s[0] for s in shards_shapes) if shards_shapes else shape.vocab
        if rows < shape.vocab:
            raise MergeError(f"{self.megatron}: {rows} vocab rows in the checkpoint, fewer than the HF vocab_size {shape.vocab}")
        return (rows, shape.hidden)

    def hf_shapes(self, shape):
        return {self.hf: (shape.vocab, shape.hidden)}

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        blocks, left = [], shape.vocab  # drop the padding rows past the real vocab
        for s in shards:
            if left > 0:
                blocks.append(RowBlock((s[:left],)))
                left -= min(left, s.shape[0])
        return {self.hf: blocks}


@dataclass(frozen=True)
class SharedCopy(VocabParallel):
    """An HF tensor that copies a parameter the model shares (a multi-token-prediction layer's `embed_tokens` and
    `shared_head.head`, which Megatron takes from the main model): `megatron` is the shared parameter's full
    name, read and merged as it is for the main tensor; a Megatron checkpoint holds it once, so it is checked
    against the main tensor and not written there."""

    copy_of: str = ""  # the HF name of the main tensor it copies


@dataclass(frozen=True)
class QkvColumn(Rule):
    q: str = ""
    k: str = ""
    v: str = ""
    parallel = "column"

    def hf_names(self):
        return (self.q, self.k, self.v)

    def hf_shapes(self, shape):
        dims = named_dims(shape)
        rest = self.global_shape(shape)[1:]
        return {self.q: (dims["q"], *rest), self.k: (dims["kv"], *rest), self.v: (dims["kv"], *rest)}

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return dict(zip((self.q, self.k, self.v), qkv_blocks(shards, shape, where)))


def qkv_blocks(shards, shape, where) -> tuple[list[RowBlock], list[RowBlock], list[RowBlock]]:
    """The q, k and v rows of linear_qkv's TP shards, each as row blocks in HF order."""
    if shape.groups % len(shards):
        raise MergeError(f"{where}: {shape.groups} query groups do not split over TP={len(shards)}")
    out = ([], [], [])
    for shard in shards:  # each rank holds whole groups; split_qkv on it gives views of its rows
        per_rank = split_qkv_groups(shard, shape.heads // len(shards), shape.groups // len(shards), shape.head_dim)
        for blocks, parts in zip(out, per_rank):
            blocks += [RowBlock((p,)) for p in parts]
    return out


@dataclass(frozen=True)
class FusedQkvColumn(OneToOne):
    """linear_qkv as one HF tensor holding all q rows, then all k rows, then all v rows (Phi-3's qkv_proj):
    the query groups Megatron interleaves are taken apart and laid end to end."""

    parallel = "column"

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        q, k, v = qkv_blocks(shards, shape, where)
        return {self.hf: q + k + v}


@dataclass(frozen=True)
class GatedColumn(Rule):
    gate: str = ""
    up: str = ""
    parallel = "column"

    def hf_names(self):
        return (self.gate, self.up)

    def hf_shapes(self, shape):
        rows, *rest = self.global_shape(shape)
        return {self.gate: (rows // 2, *rest), self.up: (rows // 2, *rest)}

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return dict(zip((self.gate, self.up), gate_up_blocks(self, shards, shape, global_pieces)))


def gate_up_blocks(rule: Rule, shards, shape, global_pieces: bool) -> tuple[list[RowBlock], list[RowBlock]]:
    """The gate rows and the up rows of a swiglu fc1's shards (each rank: [its gate rows; its up rows]; as
    torch_dist pieces: consecutive pieces of [all gate rows; all up rows])."""
    if not global_pieces:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [RowBlock((h[0],)) for h in halves], [RowBlock((h[1],)) for h in halves]
    ffn = rule.global_shape(shape)[0] // 2
    gate, up, offset = [], [], 0
    for piece in shards:
        cut = min(max(ffn - offset, 0), piece.shape[0])
        if cut:
            gate.append(RowBlock((piece[:cut],)))
        if cut < piece.shape[0]:
            up.append(RowBlock((piece[cut:],)))
        offset += piece.shape[0]
    return gate, up


@dataclass(frozen=True)
class FusedGatedColumn(OneToOne):
    """A swiglu fc1 as one HF tensor of [all gate rows; all up rows] (Phi-3's gate_up_proj): the halves every
    TP rank holds of each are put back end to end."""

    parallel = "column"

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        gate, up = gate_up_blocks(self, shards, shape, global_pieces)
        return {self.hf: gate + up}


@dataclass(frozen=True)
class ExpertSlab(Rule):
    """Many Megatron parameters to one HF tensor: every routed expert's parameter (bound per expert, one rule each)
    is one row of an HF tensor that stacks them all (gpt-oss: `mlp.experts.gate_up_proj` [E, hidden, 2·ffn]).
    Expert e's task writes row e; the tasks of one layer's experts come one after another, so the rows arrive in
    order. `form` is how an expert's Megatron tensor becomes its row, and back:
      "transposed": [out, in] <-> [in, out] (transformers keeps gpt-oss's experts in -> out);
      "transposed_interleaved": a gated fc1 [gate; up] of [2F, H] <-> [H, 2F] with gate and up columns
        interleaved (gate 0::2, up 1::2), as gpt-oss stores gate_up_proj;
      "interleaved": its bias [gate; up] <-> [2F] interleaved;
      "as_is": the same tensor (fc2's bias).
    Experts are not tensor-parallel here: megatron-core builds experts with biases (gpt-oss's) at expert TP 1 only."""

    hf: str = ""
    hf_dims: tuple[str, ...] = ()  # the stacked HF tensor, in named dimensions (the first: "experts")
    form: str = "as_is"
    expert: str = "{expert}"  # the expert number, once bound
    split: str = "column"  # how expert TP would split it: "column", "row" or "replicated" (only TP 1 is read)

    @property
    def parallel(self) -> str:
        return self.split

    @property
    def index(self) -> int:
        return int(self.expert)

    def hf_names(self):
        return (self.hf,)

    def hf_shapes(self, shape):
        dims = named_dims(shape)
        return {self.hf: tuple(dims[d] for d in self.hf_dims)}

    def whole(self) -> "StackedExperts":
        """The stacked HF tensor as one parameter (an HF base holds it so: one task for all its experts)."""
        return StackedExperts(self.megatron, self.hf_dims, hf=self.hf, requires=self.requires, layers=self.layers,
                              keep_dtype=self.keep_dtype, slab=self)

    def for_expert(self, e: int) -> "ExpertSlab":
        """This bound rule for another expert of the same layer."""
        return replace(self, megatron=self.megatron.replace(f".experts.{self.index}.", f".experts.{e}.", 1),
                       expert=str(e))

    def slab(self, t: torch.Tensor) -> torch.Tensor:
        """The expert's Megatron tensor as its row of the HF tensor (a copy, but for the "as_is" form)."""
        if self.form == "transposed":
            return transposed(t)
        if self.form == "transposed_interleaved":
            rows, cols = t.shape
            out = torch.empty((cols, rows), dtype=t.dtype)
            pairs = out.view(cols, rows // 2, 2)  # [in, ffn, (gate, up)]
            for half, part in enumerate(t.chunk(2, dim=0)):
                transposed(part, pairs[:, :, half])
            return out
        if self.form == "interleaved":
            return interleave_rows(t)
        return t

    def unslab(self, row: torch.Tensor) -> torch.Tensor:
        """The inverse of `slab`: the expert's row of the HF tensor as its Megatron tensor (a copy, but for "as_is")."""
        if self.form == "transposed":
            return transposed(row)
        if self.form == "transposed_interleaved":
            cols, rows = row.shape
            out = torch.empty((rows, cols), dtype=row.dtype)
            pairs = row.reshape(cols, rows // 2, 2)
            for half, part in enumerate(out.chunk(2, dim=0)):
                transposed(pairs[:, :, half], part)
            return out
        if self.form == "interleaved":
            return torch.cat((row[0::2], row[1::2]))
        return row

    def lora_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert's LoRA B [out, r] and A [r, in] with B's rows in the order of the row's output columns (the
        change to the [in, out] row is then scale·Aᵀ·Bᵀ)."""
        return (interleave_rows(b) if self.form == "transposed_interleaved" else b), a

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        if len(shards) > 1 and not global_pieces:  # (refused here, before any data is read)
            raise MergeError(f"{where}: split over expert TP={len(shards)}; megatron-core builds experts with biases "
                             "at expert TP 1 only ('Bias in Moe is only supported when ETP==1'), as this model's are")
        # the expert's whole Megatron tensor: its one shard, or torch_dist's pieces of it joined
        return {self.hf: [SlabBlock(tuple(shards), slab=self.slab, join=lambda parts: unshard_column(list(parts)))]}


@dataclass(frozen=True)
class StackedExperts(Replicated):
    """The HF tensor of an ExpertSlab as one parameter, as an HF base holds it; `slab`: the rule of one of its
    experts (`slab.for_expert(e)`: of expert e), for what is read per expert (a Megatron LoRA's factors)."""

    slab: ExpertSlab | None = None

    def expert_rules(self, experts: int) -> list[ExpertSlab]:
        return [self.slab.for_expert(e) for e in range(experts)]


TRANSPOSE_ROWS = 256  # source rows transposed at a time: the tile stays in cache (7x torch's whole-matrix copy here)


def transposed(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """tᵀ of a 2-D tensor copied into `out` (new and contiguous if None), a tile of rows at a time."""
    if out is None:
        out = torch.empty((t.shape[1], t.shape[0]), dtype=t.dtype)
    for start in range(0, t.shape[0], TRANSPOSE_ROWS):
        out[:, start:start + TRANSPOSE_ROWS].copy_(t[start:start + TRANSPOSE_ROWS].t())
    return out


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows (a gated fc1's, or its bias) as gate and up rows taking turns: gate 0, up 0, gate 1, …"""
    gate, up = t.chunk(2, dim=0)
    return torch.stack((gate, up), dim=1).reshape(t.shape)


@dataclass(frozen=True)
class Skip(Rule):
    """A tensor that is deliberately not written, with the reason (e.g. the tied copy of the embedding)."""

    reason: str = ""
    same_as: str | None = None  # it must be a copy of this parameter (checked on its first and last rows)

    def hf_names(self):
        return ()

    def hf_shapes(self, shape):
        return {}

    def global_shape(self, shape, shards_shapes=None):
        return tuple(shards_shapes[0]) if shards_shapes else ()

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        return {}



@dataclass(frozen=True)
class ReplicatedRows(Rule):
    """A replicated linear whose rows are several HF tensors stacked (MindSpeed's fused MLA down-projection:
    [q_a_proj; kv_a_proj_with_mqa]): `parts` are (HF name, named row count) in order."""

    parts: tuple[tuple[str, str], ...] = ()

    def hf_names(self):
        return tuple(name for name, _ in self.parts)

    def hf_shapes(self, shape):
        dims, rest = named_dims(shape), self.global_shape(shape)[1:]
        return {name: (dims[rows], *rest) for name, rows in self.parts}

    def hf_blocks(self, shards, shape, where, global_pieces=False):
        whole, dims, out, start = unshard_replicated(shards, where), named_dims(shape), {}, 0
        if sum(dims[rows] for _, rows in self.parts) != whole.shape[0]:  # never leave rows unwritten
            raise MergeError(f"{where}: {whole.shape[0]} rows, but its parts "
                             f"{', '.join(f'{n} ({dims[r]})' for n, r in self.parts)} add up to another number")
        for name, rows in self.parts:
            out[name] = single(whole[start:start + dims[rows]])
            start += dims[rows]
        return out
