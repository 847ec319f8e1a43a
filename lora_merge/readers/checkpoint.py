"""What every reader produces: a checkpoint's parameters by global Megatron name, still TP-sharded.

Names use HF layer numbers (`decoder.layers.{i}.…`, pipeline stages resolved) and drop PEFT's
`.base_layer`, so a base checkpoint and an unfiltered LoRA checkpoint name base weights alike. LoRA
weights are grouped by the module they adapt. Tensors are references: nothing is read until `load()`.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import mmap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a checkpoint, not yet read: its shape and dtype, and how to get it."""

    where: str  # file and key, for messages
    shape: tuple[int, ...]
    dtype: torch.dtype
    loader: Callable[[], torch.Tensor]
    mapped: bool = False  # load() returns a view of a private read-only mapping of the checkpoint file

    @classmethod
    def of(cls, where: str, tensor: torch.Tensor, mapped: bool) -> "TensorRef":
        return cls(where, tuple(tensor.shape), tensor.dtype, lambda: tensor, mapped)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def load(self) -> torch.Tensor:
        return self.loader()

    def release(self) -> None:
        if self.mapped:
            release_pages(self.loader())


PAGE = mmap.PAGESIZE
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
except (OSError, AttributeError):  # not on Linux: nothing to release
    def _madvise(*_):
        return 0


def release_pages(tensor: torch.Tensor) -> None:
    """Give the pages of a view into a memory-mapped checkpoint back to the OS (they stay in the page cache).

    Pages of a file mapping count in the process's RSS once read; without this, RSS would grow to the size
    of the checkpoint. Dropping clean private file pages is safe: a later read faults them in again. Only
    for tensors whose memory is such a mapping (`TensorRef.mapped`): on ordinary memory it would zero it.
    """
    if tensor.numel():
        start = tensor.data_ptr() & ~(PAGE - 1)
        end = tensor.data_ptr() + tensor.nbytes
        _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


Shards = list  # list[TensorRef], one per tensor-parallel rank


@dataclass
class LoraModule:
    a: Shards
    b: Shards


@dataclass
class Checkpoint:
    path: Path
    format: str
    iteration: str
    args: argparse.Namespace
    tp: int
    pp: int
    vpp: int
    params: dict[str, Shards] = field(default_factory=dict)
    lora: dict[str, LoraModule] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> number of entries deliberately not used
    adapter_name: str | None = None
    numbering: object = None  # LayerNumbering: how pipeline stages map to layers
    files: list = field(default_factory=list)  # (file, tensors, bytes) for each file read
    note: str = ""  # anything else a user should know about the layout

    def describe(self) -> str:
        parts = f"TP={self.tp} PP={self.pp}" + (f" VPP={self.vpp}" if self.vpp > 1 else "")
        return f"{self.format} checkpoint {self.path} (iteration {self.iteration}, {parts})"
