"""What every input answers, whatever its format (a Megatron checkpoint, legacy or torch_dist, Megatron-LM's or
Megatron-Bridge's; an HF model dir; a PEFT adapter dir): the questions the runs, the plan and the checks ask of an
input, so that no code outside readers/ asks which class an input is. A new kind of input (a path on object
storage) is a reader answering these."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Source(Protocol):
    path: Path
    format: str  # how `describe` and the report name the format ("legacy", "torch_dist", "HF", "PEFT")
    sources: list  # every file and directory read below `path` (no output may touch them)
    skipped: dict  # reason -> number of entries deliberately not used
    replicas: list  # (first, other): copies of a tensor that several files hold, compared equal while merging

    @property
    def hf_named(self) -> bool:
        """Its tensors are named and laid out as the HF model's (an HF model, a PEFT adapter), not Megatron's."""

    @property
    def megatron_args(self) -> Namespace | None:
        """The args the Megatron run that wrote it recorded; None for an input no Megatron run wrote."""

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The dtype its weights are in: an HF model's as stored, a Megatron run's training dtype (its args);
        None where it says none."""

    @property
    def experts(self):
        """How it lays out routed experts (readers.experts.ExpertLayout), or None."""

    @property
    def fp8(self):
        """Its block-FP8 quantization (fp8.Fp8Format) where its weights are FP8, else None."""

    def has(self, megatron_name: str) -> bool:
        """Whether it holds a parameter by that Megatron name (which of two Megatron namings it uses)."""

    def describe(self) -> str:
        """One line for summaries, reports and cards."""
