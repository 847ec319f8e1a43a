"""Several output files written at once, in one process.

sha256 of the output is the one stage that cannot be split within a file (its ~0.58 CPU-s per GB on one
core bound a one-file-at-a-time run on two cores, where every other stage together needs less). So the
plan's tasks are cut into lanes: runs of consecutive tasks whose outputs fill consecutive whole files no
other lane writes, about equal in bytes. The merge hands out the lanes' pieces in turn (merge_pipeline.
execute), and each lane's files are written and hashed by a writer of its own (writers/safetensors_stream.
ShardLanes). Every file is still written front to back from the same pieces: the bytes do not depend on the
number of lanes.

A lane boundary can only fall where no task writes on both sides of it (q, k and v of one fused QKV may
straddle two files); where no such boundary lies near an even split, there are fewer lanes. Used by every HF
output: one process (runs/to_hf.py), and a part of a run, balanced over the files it writes (runs/parts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_merge.merge_pipeline import default_workers
from lora_merge.merge_plan import MergePlan, Task, planned_outputs
from lora_merge.runs.stream import stream_into
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter, ShardLanes
from lora_merge.writers.sink import RenamedSink

MAX_LANES = 4  # four sha256 threads hash ~7 GB/s: more than a disk writes


@dataclass
class Lanes:
    lane_of_file: list[int]  # the lane of each output file
    tasks: list[list[Task]]  # each lane's tasks, in plan order


def split_into_lanes(plan: MergePlan, file_of: dict[str, int], sizes: list[int], count: int) -> Lanes | None:
    """`count` lanes (or fewer) of the plan, for an output whose tensor `name` is in file `file_of[name]` and
    whose files have `sizes`; None where the run is one lane. Quantized outputs (FP8, MXFP4) stay one lane:
    their scales are written by calls beside their weights', not as a task's outputs."""
    count = min(count, MAX_LANES, sum(1 for size in sizes if size))  # (a part's: the files it writes)
    if count < 2 or plan.quantized or plan.mxfp4 or not plan.tasks:
        return None
    spans = []  # the first and last file of each task's outputs
    for task in plan.tasks:
        files = [file_of[t.name] for t in task.outputs]
        if not files:
            return None
        spans.append((min(files), max(files)))
    clean = set(range(1, len(sizes)))  # boundaries before file b that no task straddles
    reached = 0
    for first, last in spans:
        if first < reached:  # not in file order: nothing to split safely
            return None
        clean -= set(range(first + 1, last + 1))
        reached = last
    chosen, total, cumulative = [], sum(sizes), [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    for k in range(1, count):
        target = total * k / count
        options = [b for b in clean if not chosen or b > chosen[-1]]
        if options:
            chosen.append(min(options, key=lambda b: (abs(cumulative[b] - target), b)))
    lane_of_file = [sum(b <= f for b in chosen) for f in range(len(sizes))]
    if not chosen:
        return None
    tasks: list[list[Task]] = [[] for _ in range(len(chosen) + 1)]
    for task, (first, _) in zip(plan.tasks, spans):
        tasks[lane_of_file[first]].append(task)
    return Lanes(lane_of_file, tasks)


def stream_into_shards(writer: ShardedSafetensorsWriter, plan: MergePlan, names, directory: Path, progress,
                       total: int, workers: int | None) -> list[str]:
    """Write the plan into an HF output's shards (a part's files, where the writer has a part), in lanes where the
    plan can be cut, balanced over the files this run writes; under a release's own names (`names`) where it has
    them. Returns the files written."""
    index = {t.name: i for i, shard in enumerate(writer.shards) for t in shard}
    stored = (lambda name: name) if names is None else names.stored
    sizes = [sum(t.nbytes for t in shard) if writer.part is None or i in writer.part.files else 0
             for i, shard in enumerate(writer.shards)]  # (another part's files, or kept ones, count nothing)
    lanes = split_into_lanes(plan, {t.name: index[stored(t.name)] for t in planned_outputs(plan.tasks)}, sizes,
                             workers or default_workers())
    sink = writer if lanes is None else ShardLanes(writer, lanes.lane_of_file)
    sink = sink if names is None else RenamedSink(sink, names.stored)
    return stream_into(sink, directory, plan, progress, total, workers, None if lanes is None else lanes.tasks)
