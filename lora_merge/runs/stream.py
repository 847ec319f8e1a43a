"""The one streaming step of every run that writes tensors into a sink through the background writer thread:
a merge plan executed on the workers (`stream_into`), or tensors made one after another (`stream_tensors`, the
adapter export); the sink finished, or aborted on any failure or interruption."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from lora_merge.merge_pipeline import execute
from lora_merge.merge_plan import MergePlan
from lora_merge.runs.inputs import Progress
from lora_merge.writers.background import BackgroundWriter
from lora_merge.writers.sink import Sink


def stream_into(sink: Sink, directory: Path, plan: MergePlan, progress=None, total: int = 0,
                workers: int | None = None, lanes=None) -> list[str]:
    """Write the plan's tensors into `sink` started in `directory`; return the files it wrote. `progress`:
    called with (done, total) bytes; `lanes`: the plan's tasks in lanes written at once (runs/lanes.py), for a
    sink that writes them so."""
    return _drive(sink, directory, lambda write, update: execute(plan, write, update, workers=workers, lanes=lanes),
                  progress, total)


def stream_tensors(sink: Sink, directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], progress=None,
                   total: int = 0) -> list[str]:
    """Write (name, tensor) in the order given into `sink` started in `directory`; return its files."""
    def fill(write, update):
        for name, tensor in tensors:
            write(name, tensor)
            if update is not None:
                update(tensor.nbytes)
    return _drive(sink, directory, fill, progress, total)


def _drive(sink: Sink, directory: Path, fill: Callable, progress, total: int) -> list[str]:
    background = None
    try:
        sink.start(directory)
        background = BackgroundWriter(sink.write)
        counter = Progress(progress, total) if progress is not None else None
        try:
            fill(background.write, counter.update if counter is not None else None)
        finally:
            background.close()
        return sink.finish()
    finally:
        if background is not None:
            background.stop()  # interrupted while waiting for it: the writer thread may still be writing
        sink.abort()
