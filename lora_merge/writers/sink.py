"""What every output writer is to a run (a sink): planned before anything is written (`total_bytes` known for
the space check), started in the staging dir, given each tensor's pieces in order as they are computed (on the
background writer thread), then finished (its files returned) or aborted (nothing it half-wrote left behind).
The HF safetensors shards (safetensors_stream) and the Megatron checkpoint formats (megatron_legacy,
megatron_dist) are sinks; `runs/stream.py` drives any of them, and staging and publishing know none of them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch


class Sink(Protocol):
    @property
    def total_bytes(self) -> int: ...

    def start(self, directory: Path) -> None: ...

    def write(self, name: str, piece: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        """The next rows of tensor `name` (or the whole tensor); `then` runs once they are written."""

    def finish(self) -> list[str]:
        """The files written, relative to the directory, once every tensor is complete."""

    def abort(self) -> None:
        """Close what is open after a failure (idempotent, also after finish)."""


class RenamedSink:
    """A sink that writes each tensor under the name `name(ours)` gives it (a multimodal release's own names);
    the one it wraps was planned with those names."""

    def __init__(self, sink: Sink, name: Callable[[str], str]):
        self.sink, self.name = sink, name

    @property
    def total_bytes(self) -> int:
        return self.sink.total_bytes

    def start(self, directory: Path) -> None:
        self.sink.start(directory)

    def write(self, name: str, piece: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        self.sink.write(self.name(name), piece, then)

    def finish(self) -> list[str]:
        return self.sink.finish()

    def abort(self) -> None:
        self.sink.abort()
