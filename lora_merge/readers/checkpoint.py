"""What every reader produces: a checkpoint's parameters by global Megatron name, each as the pieces it
was saved in (`Pieces`), described the same way whatever the format.

Names use HF layer numbers (`decoder.layers.{i}.…`, pipeline stages resolved) and global expert numbers
(`….mlp.experts.{e}.…`, see `experts.py`), and drop PEFT's `.base_layer`, so a base checkpoint and an
unfiltered LoRA checkpoint name base weights alike. LoRA weights are grouped by the module they adapt.
Tensors are references: nothing is read until `load()`.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.experts import is_expert_name
from lora_merge.files.pages import release_pages  # noqa: F401  (re-exported for the readers)


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a checkpoint, not yet read: its shape and dtype, and how to get it."""

    where: str  # file and key, for messages
    shape: tuple[int, ...]
    dtype: torch.dtype
    loader: Callable[[], torch.Tensor]
    mapped: bool = False  # load() returns a view of a private read-only mapping of the checkpoint file
    # The archive members (torch_archive.Record) its bytes come from, whose CRC32 must be checked when it
    # is read; a function, because a torch_dist chunk's member is known only once its archive is opened.
    records: Callable[[], tuple] = tuple
    # The byte ranges (MappedFile, start, nbytes) load() reads, for reading them ahead (files/prefetch.py);
    # None: those of `records`.
    spans: Callable[[], tuple] | None = None
    # The tensor load() returns, without making its bytes readable first (a view into an input at a URL whose
    # range is not fetched yet): for its layout, and for handing its pages back; None: load()'s.
    view: Callable[[], torch.Tensor] | None = None

    @classmethod
    def of(cls, where: str, tensor: torch.Tensor, mapped: bool, record=None) -> "TensorRef":
        """A tensor already made, e.g. a view into a torch archive's mapping, whose `record` (the member its bytes
        live in) is fetched first where the file is at a URL."""
        if record is None:
            return cls(where, tuple(tensor.shape), tensor.dtype, lambda: tensor, mapped)

        def load():
            record.ensure()
            return tensor
        return cls(where, tuple(tensor.shape), tensor.dtype, load, mapped, lambda: (record,), view=lambda: tensor)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def load(self) -> torch.Tensor:
        return self.loader()

    def byte_spans(self) -> tuple:
        if self.spans is not None:
            return self.spans()
        return tuple((r.file, r.start, r.size) for r in self.records() if r is not None)

    def unread(self) -> torch.Tensor:
        """The tensor's shape, strides and storage, its bytes not necessarily read (nor fetched)."""
        return self.view() if self.view is not None else self.loader()

    def release(self) -> None:
        if self.mapped:
            release_pages(self.unread())


# The dtypes a weight, norm, bias or LoRA factor may have in any input: W + s·B·A is exact only on floats.
# An integer or 8-bit float tensor is a quantized weight (its scales live elsewhere) or damage; cast, it
# would silently become other numbers (int8 → small integers, `verify` against the same cast agreeing).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def require_float(where: str, dtype, stored=None) -> None:
    """Refuse a tensor whose dtype is not one of FLOAT_DTYPES, in one line naming it (`where`: file and
    key), its dtype (`stored`: as the file names it, when torch has none for it) and what is allowed."""
    if dtype not in FLOAT_DTYPES:
        name = stored if stored is not None else str(dtype).removeprefix("torch.")
        raise MergeError(f"{where}: dtype {name}; weights, norms, biases and LoRA factors must be floating point "
                         "(float32, bfloat16, float16 or float64): an integer or quantized tensor cannot be merged "
                         "exactly")


def joined_ref(refs: list[TensorRef], dim: int | None) -> TensorRef:
    """One reference to the concatenation of pieces (a copy on load; for pieces no rule can use as they are)."""
    if len(refs) == 1:
        return refs[0]
    shape = list(refs[0].shape)
    shape[dim] = sum(r.shape[dim] for r in refs)

    def load():
        out = torch.cat([r.load() for r in refs], dim=dim)
        for r in refs:
            r.release()
        return out
    return TensorRef(where=f"{refs[0].where} (+{len(refs) - 1} pieces)", shape=tuple(shape), dtype=refs[0].dtype,
                     loader=load, records=lambda: tuple(rec for r in refs for rec in r.records()),
                     spans=lambda: tuple(span for r in refs for span in r.byte_spans()))


# What split a parameter into its pieces.
TP = "TP"  # one piece per tensor-parallel rank, in rank order, each in that rank's own layout
EXPERT_TP = "expert TP"  # the same over the expert-tensor-parallel ranks (ETP = 1 or TP)
GLOBAL = "global"  # consecutive slices of the global tensor along `dim`, as torch_dist saves them
# Expert parallelism never splits a parameter: it decides which file holds an expert, and each expert
# is its own parameter under its global number. Replicated parameters are rank pieces that must agree;
# which it is, and how a rank lays out its share of a fused tensor, is the layout rule's business.


@dataclass(frozen=True)
class Pieces:
    """One parameter as stored: its pieces, the group that split it and, for global slices, along which
    dimension. Rank pieces are in each rank's own layout (a TP rank's fused gate/up holds its gate rows
    then its up rows), which is not always a slice of the global tensor; global slices always are."""

    refs: tuple[TensorRef, ...]
    group: str = TP
    dim: int | None = None  # GLOBAL only: the dimension the slices are cut along (None: a single piece)
    # an HF base's (group HF): for each HF tensor in turn, how many of `refs` are its pieces and the dimension they
    # are cut along (a DCP's rows per rank); () where each is one ref
    split: tuple[tuple[int, int | None], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "refs", tuple(self.refs))

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self):
        return iter(self.refs)

    def __getitem__(self, i: int) -> TensorRef:
        return self.refs[i]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [r.shape for r in self.refs]

    @property
    def is_global(self) -> bool:
        return self.group == GLOBAL

    @property
    def mapped(self) -> bool:
        return all(r.mapped for r in self.refs)

    def fitted(self, split_dim: int | None) -> "Pieces":
        """These pieces as a rule that splits along `split_dim` (0 column, 1 row, None replicated) can use
        them: rank pieces always; global slices as they are when cut along that dimension, else joined."""
        if not self.is_global or len(self.refs) == 1 or self.dim == split_dim:
            return self
        return Pieces((joined_ref(list(self.refs), self.dim),), GLOBAL)


@dataclass
class LoraModule:
    a: Pieces
    b: Pieces
    # several rank-r adapters fused into one of rank k·r (Megatron-Bridge's CanonicalLoRA: q, k, v of linear_qkv):
    # the adapter (column block of B, row block of A) each of the linear's rows belongs to, -1 for none
    row_block: torch.Tensor | None = None
    # DoRA (Megatron-Bridge's weight_magnitude [out]): the linear's rows, in the order of `magnitude_tp` TP ranks each
    # holding its own rows (a column-parallel linear's; 1: the global order)
    magnitude: TensorRef | None = None
    magnitude_tp: int = 1
    # its own rank where the run gave some modules another (Megatron-Bridge's normalize_moe_lora: routed experts at
    # dim / topk), and its scale over the run's (alpha over its own rank instead of over the run's r)
    rank: int | None = None
    scale_factor: float = 1.0

    @property
    def blocks(self) -> int:
        return 1 if self.row_block is None else int(self.row_block.max()) + 1

    @property
    def refs(self) -> tuple[TensorRef, ...]:
        return self.a.refs + self.b.refs + ((self.magnitude,) if self.magnitude is not None else ())


@dataclass
class Checkpoint:
    path: Path
    format: str
    iteration: str
    args: argparse.Namespace
    tp: int
    pp: int
    vpp: int
    params: dict[str, Pieces] = field(default_factory=dict)
    lora: dict[str, LoraModule] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> number of entries deliberately not used
    adapter_name: str | None = None
    # False where the args were derived from another configuration (Megatron-Bridge's run_config.yaml), not recorded
    # by the Megatron run: they are checked like recorded ones, but never copied into a Megatron checkpoint we write
    args_recorded: bool = True
    numbering: object = None  # LayerNumbering: how pipeline stages map to layers
    files: list = field(default_factory=list)  # (file, tensors, bytes) for each file read
    sources: list = field(default_factory=list)  # every file and directory read below `path`
    note: str = ""  # anything else a user should know about the layout
    experts: object = None  # experts.ExpertLayout of a Mixture-of-Experts checkpoint, else None
    # (first, other) copies of a tensor that several files hold (each expert-parallel rank's file repeats
    # the dense part); checked equal when the merge reads them.
    replicas: list = field(default_factory=list)

    def rank_group(self, name: str) -> tuple[str, int]:
        """(group, size) of the ranks a per-rank checkpoint splits parameter `name` over."""
        if self.experts is not None and is_expert_name(name):
            return EXPERT_TP, self.experts.etp
        return TP, self.tp

    # the Source interface (readers/source.py)
    hf_named = False
    fp8 = None

    @property
    def megatron_args(self) -> argparse.Namespace | None:
        return self.args

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The training dtype its args record (float32 where they say neither bf16 nor fp16)."""
        if self.args is None:
            return None
        if getattr(self.args, "bf16", False):
            return torch.bfloat16
        if getattr(self.args, "fp16", False):
            return torch.float16
        return torch.float32

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds parameter `name`, as a base weight or as the module its LoRA adapts."""
        return name in self.params or name.removesuffix(".weight") in self.lora

    def describe(self) -> str:
        parts = self.note or (f"TP={self.tp} PP={self.pp}" + (f" VPP={self.vpp}" if self.vpp > 1 else ""))
        return f"{self.format} checkpoint {self.path} (iteration {self.iteration}, {parts})"


# --- LoRA keys, shared by all readers --------------------------------------------------------------

LORA_KEY = re.compile(r"^(.+)\.lora_([AB])\.([^.]+)\.weight$")
# PEFT state that changes what the adapter computes beyond W + (alpha/r)·B·A: refused, never dropped.
UNSUPPORTED_PEFT = {".lora_magnitude_vector.": "DoRA (lora_magnitude_vector)",
                    ".modules_to_save.": "modules_to_save (fully trained copies of modules)",
                    ".original_module.": "modules_to_save (fully trained copies of modules)",
                    ".lora_embedding_A.": "LoRA on embeddings", ".lora_embedding_B.": "LoRA on embeddings"}


class LoraCollector:
    """Gathers lora_A/lora_B shards by module and TP rank, and checks that they pair up."""

    def __init__(self, where: str):
        self.where = where
        self.seen: dict[tuple[str, str], dict[int, tuple[TensorRef, int]]] = {}
        self.adapters: set[str] = set()
        self.replicas: list[tuple[TensorRef, TensorRef]] = []

    def add(self, name: str, rank: int, ref: TensorRef, copy: int = 0) -> bool:
        """Take `name` if it is a LoRA weight (True); refuse PEFT state this tool cannot merge. A second
        shard of the same rank from another file (another `copy`) is kept as a replica to compare."""
        for marker, what in UNSUPPORTED_PEFT.items():
            if marker in name:
                raise MergeError(f"{ref.where}: {what} is not supported; only plain LoRA can be merged")
        m = LORA_KEY.match(name)
        if not m:
            return False
        self.adapters.add(m.group(3))
        slot = self.seen.setdefault((m.group(1), m.group(2)), {})
        if rank in slot:
            first, first_copy = slot[rank]
            if first_copy == copy:
                raise MergeError(f"{ref.where}: LoRA weight stored twice for TP rank {rank} ({first.where})")
            self.replicas.append((first, ref))
            return True
        slot[rank] = (ref, copy)
        return True

    def finish(self, ckpt: "Checkpoint", group_of: Callable[[str], tuple[str, int]]) -> None:
        """`group_of(module)`: the (group, size) its factors are split over (`GLOBAL`, 1 when whole)."""
        if len(self.adapters) > 1:
            raise MergeError(f"{self.where}: several LoRA adapters ({', '.join(sorted(self.adapters))}); expected one")
        ckpt.adapter_name = next(iter(self.adapters), None)
        for module in sorted({module for module, _ in self.seen}):
            a, b = self.seen.get((module, "A")), self.seen.get((module, "B"))
            if not a or not b:
                have, lack = ("lora_A", "lora_B") if a else ("lora_B", "lora_A")
                raise MergeError(f"{self.where}: {module} has {have} but no {lack}")
            group = group_of(module)
            ckpt.lora[module] = LoraModule(
                a=all_ranks(f"{module}.lora_A", {r: x for r, (x, _) in a.items()}, group, self.where),
                b=all_ranks(f"{module}.lora_B", {r: x for r, (x, _) in b.items()}, group, self.where))
        ckpt.replicas += self.replicas


def all_ranks(name: str, by_rank: dict[int, TensorRef], group: tuple[str, int], where) -> Pieces:
    """The pieces of every rank of `group` (kind, size); each must be present."""
    kind, size = group
    missing = [t for t in range(size) if t not in by_rank]
    if missing:
        raise MergeError(f"{where}: {name} is missing on {kind} rank(s) {missing} (present on {sorted(by_rank)})")
    return Pieces(tuple(by_rank[t] for t in range(size)), kind)
