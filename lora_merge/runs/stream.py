"""The one streaming step of every run that writes tensors: the plan executed on the workers into a sink
through the background writer thread; the sink finished, or aborted on any failure or interruption."""

from __future__ import annotations

from pathlib import Path

from lora_merge.merge_pipeline import execute
from lora_merge.merge_plan import MergePlan
from lora_merge.runs.inputs import Progress
from lora_merge.writers.background import BackgroundWriter
from lora_merge.writers.sink import Sink


def stream_into(sink: Sink, directory: Path, plan: MergePlan, progress=None, total: int = 0,
                workers: int | None = None) -> list[str]:
    """Write the plan's tensors into `sink` started in `directory`; return the files it wrote. `progress`:
    called with (done, total) bytes."""
    background = None
    try:
        sink.start(directory)
        background = BackgroundWriter(sink.write)
        counter = Progress(progress, total) if progress is not None else None
        try:
            execute(plan, background.write, counter.update if counter is not None else None,
                             workers=workers)
        finally:
            background.close()
        return sink.finish()
    finally:
        if background is not None:
            background.stop()  # interrupted while waiting for it: the writer thread may still be writing
        sink.abort()
