"""Run a merge plan: every output tensor in row pieces, computed on a pool of workers, handed to the writer
in plan order.

A piece is at most CHUNK_BYTES of float32 rows of one HF tensor: untouched rows go straight from the
mapped checkpoint to the writer (after the NaN/Inf check), LoRA-touched rows are merged as W + s·B·A in
float32 and rounded once. Pieces are independent, so `workers` threads compute them side by side, each
running torch single-threaded (torch kernels release the GIL; intra-op threads on 8 MB pieces burned five
times the CPU for no gain on a 16-core host). The calling thread keeps a window of pieces in flight and
hands each to `write` in plan order as soon as it and those before it are done. Pieces get smaller as
workers grow (memory stays flat), and LoRA pieces are cut at whole merge blocks, so every row is merged by
the same addmm_ call shape whatever the worker count: the output bytes are exactly those of a one-worker run.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.integrity import RecordChecker, check_finite
from lora_merge.files import remote
from lora_merge.files.handback import Handback
from lora_merge.files.prefetch import Prefetcher, stop_early_reads
from lora_merge.fp8 import SCALE_SUFFIX, BlockQuantizer, quantize_rows, scale_shape
from lora_merge.model.layout import Mxfp4RowBlock, QuantizedRowBlock, SlabBlock
from lora_merge.lora import StackedExpertsDelta
from lora_merge.mxfp4 import (BLOCK as MXFP4_BLOCK, BLOCKS_SUFFIX as MXFP4_BLOCKS, SCALES_SUFFIX as MXFP4_SCALES, quantize as quantize_mxfp4,
                              quantize_rows as quantize_mxfp4_rows)
from lora_merge.lora import megatron_deltas
from lora_merge.merge_plan import MergePlan, Task
from lora_merge.options import MAX_WORKERS
from lora_merge.readers.checkpoint import release_pages
from lora_merge.stage_clock import charge
from lora_merge.writers.safetensors_stream import PlannedTensor

# Rows are merged and written in chunks of about this many float32 bytes, so memory stays bounded
# however large a tensor is (a 671B model's embedding is 1.9 GB). Several chunks are in flight at once
# (computing, queued for the writer and the hasher): at DeepSeek-V3 shapes 8 MB gave a peak RSS of
# 355-363 MB where 64 MB gave 590-644 MB, at the same speed and CPU time (three alternating runs each).
CHUNK_BYTES = 8 << 20
# Float32 bytes of all the pieces in flight together, at most: with many workers each piece is made smaller
# (down to MIN_CHUNK_BYTES) so that memory does not grow with the worker count. On 32B layer shapes, 16
# workers at 8 MB pieces peaked at ~980 MB; with this budget 4, 8 and 16 workers all peak at ~530 MB.
IN_FLIGHT_BYTES = 64 << 20
MIN_CHUNK_BYTES = 1 << 20
# Pieces in flight per worker: one being computed, one done and waiting for its turn to be written.
WINDOW_PER_WORKER = 2
# Default worker count at most this: the pieces in flight (each up to CHUNK_BYTES of float32 while merged,
# then its output rows) stay within a few hundred MB however many cores the host has.
MAX_DEFAULT_WORKERS = 16


CGROUP = Path("/sys/fs/cgroup")


def available_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may use: its CPU affinity, and the CPU quota of its cgroup where one is set
    (a container limited to 2 CPUs on a 64-core host must not start 16 busy workers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs allowed by the cgroup's quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or
    None where there is no quota or it cannot be read."""
    def first_line(path: Path) -> str | None:
        try:
            with open(path, "rb") as f:
                return f.read(256).decode("ascii", "replace").split("\n")[0].strip()
        except OSError:
            return None

    v2 = first_line(cgroup / "cpu.max")
    parts = v2.split() if v2 else []
    if len(parts) == 2 and parts[0] != "max":
        quota, period = parts
    else:
        quota, period = first_line(cgroup / "cpu" / "cpu.cfs_quota_us"), first_line(cgroup / "cpu" / "cpu.cfs_period_us")
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def default_workers() -> int:
    """The cores this process may use, at most MAX_DEFAULT_WORKERS."""
    return max(1, min(available_cores(), MAX_DEFAULT_WORKERS))


class OrderedPool:
    """Compute calls on `workers` threads, deliver their results in submission order.

    `submit(job, deliver)`: `job()` runs on a worker; `deliver(result)` runs on the calling thread, in
    submission order. `submit_in_order(call)` queues a call that runs on the calling thread once everything
    submitted before it is delivered. A job's exception is raised at delivery."""

    def __init__(self, workers: int):
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lora-merge-merge")
        self._pending: deque[tuple[Future | None, object]] = deque()
        self._window = WINDOW_PER_WORKER * workers

    def submit(self, job, deliver) -> None:
        while len(self._pending) >= self._window:
            self._deliver_one()
        self._pending.append((self._executor.submit(job), deliver))

    def submit_in_order(self, call) -> None:
        self._pending.append((None, call))

    def _deliver_one(self) -> None:
        future, deliver = self._pending.popleft()
        if future is None:
            deliver()
        else:
            deliver(future.result())

    def drain(self) -> None:
        while self._pending:
            self._deliver_one()

    def stop(self) -> None:
        """Cancel what has not started and wait for what has: no worker may touch a checkpoint mapping
        after the run unmaps it."""
        for future, _ in self._pending:
            if future is not None:
                future.cancel()
        self._pending.clear()
        interrupted = None
        while True:  # an interrupt while waiting is kept for later: the workers must be gone first
            try:
                self._executor.shutdown(wait=True, cancel_futures=True)
                break
            except BaseException as exc:  # noqa: BLE001
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


def execute(plan: MergePlan, write, progress=None, workers: int | None = None,
            lanes: list[list[Task]] | None = None) -> None:
    """Run the plan, calling `write(name, rows, then)` for each HF tensor in plan order, in row pieces;
    `then` (or None) is to be called once those rows are written. The CRC32 of every archive member read
    is checked alongside; a mismatch fails the run (before the caller publishes anything).

    `lanes`: the plan's tasks cut into runs of consecutive tasks whose outputs go to files no other run
    writes (runs/lanes.py). Their pieces are then handed out in turn, each run at the same pace through its
    input bytes, so that several output files are written (and hashed) at once; within a run, in plan order."""
    workers = default_workers() if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise MergeError(f"workers={workers!r}: expected a whole number from 1 to {MAX_WORKERS}")
    started = time.thread_time()
    checker = pool = prefetcher = handback = crc_reads = None
    _single_threaded_torch(True)
    try:  # the caller's thread count comes back however this ends, a checker that fails to start included
        runs = [_Lane(tasks) for tasks in (lanes or [plan.tasks]) if tasks]
        jobs = list(_crc_jobs(plan, _started_in_turn(runs)))
        if remote.reading_urls():  # every planned read of an input at a URL counted, to hand its bytes back after
            handback = Handback()
            for run in runs:
                run.reads = {id(task): _TaskReads(handback.reads(_task_refs(task))) for task in run.tasks}
            crc_reads = [handback.reads([*refs, *(ref for pair in replicas for ref in pair[:2])])  # (, message)
                         for _, refs, replicas in jobs]
            handback.release_unread()
        prefetcher = Prefetcher(((due, refs) for due, refs, _ in jobs), read_early=stop_early_reads())
        checker = RecordChecker(jobs, crc_reads)
        pool = OrderedPool(workers)

        quantizers: dict[str, BlockQuantizer] = {}  # FP8 output: a weight's rows quantized as they come, in order

        def deliver(name: str, write, result) -> None:
            piece, then = result
            quantizer = quantizers.get(name)
            if isinstance(piece, tuple):  # quantized on a worker: its fp8 rows, and the scales of its block rows
                piece, scales = piece
                quantizer.append(scales)
                write(name, piece, then)
            elif quantizer is not None and piece.dtype != torch.float8_e4m3fn:
                q = quantizer.add(piece)
                if then is not None:
                    then()
                if q is not None:
                    write(name, q, None)
            else:
                write(name, piece, then)
            if progress is not None:
                progress(piece.numel() if quantizer is not None else piece.nbytes)  # FP8: its bytes as written

        chunk = chunk_bytes(workers)
        streams = [run.jobs(plan, chunk, quantizers, write) for run in runs]  # (each task's writes its run's `write`)
        active = list(range(len(runs)))
        while active:
            lane = min(active, key=lambda i: runs[i].pace)  # the run furthest behind, by its share of input bytes
            item = next(streams[lane], None)
            if item is None:
                active.remove(lane)
                continue
            name, job = item
            if job is _STARTED:
                due = sum(run.reached for run in runs)
                prefetcher.advance(due)  # bytes are read into the page cache ahead of the CRC32 checker,
                checker.advance(due)  # which may run ahead of the pieces being computed
            elif name is None:  # a call in order: an FP8 weight's scales once its rows are written; a task's release
                pool.submit_in_order(job)
            else:
                pool.submit(job, partial(deliver, name, runs[lane].write))
        pool.drain()
        checker.finish()
        if handback is not None:
            handback.close()
    finally:  # each step runs even if a second interrupt arrives during the one before
        try:
            if pool is not None:
                pool.stop()
        finally:
            try:
                if checker is not None:
                    checker.stop()
            finally:
                if prefetcher is not None:
                    prefetcher.stop()
                if handback is not None:
                    handback.close()
                _single_threaded_torch(False)
                charge("dispatch", time.thread_time() - started)  # planning pieces, handing them to the writer


_STARTED = object()  # a lane's marker: its next task begins (the checkers are told how far the merge has come)


def _input_bytes(task: Task) -> int:
    return sum(ref.nbytes for ref in task.pieces)


class _Lane:
    """A run of consecutive tasks, and how far through its input bytes its pieces have been handed out."""

    def __init__(self, tasks: list[Task]):
        self.tasks = tasks
        self.total = max(1, sum(_input_bytes(task) for task in tasks))
        self.reached = 0.0  # input bytes of the tasks begun before the current one, and the current one's share
        self.reads: dict[int, _TaskReads] = {}  # by id(task), where inputs at a URL are read
        self.write = None  # the current task's

    @property
    def pace(self) -> float:
        return self.reached / self.total

    def jobs(self, plan: MergePlan, chunk: int, quantizers: dict, write):
        """(name, job) as _task_jobs yields them, a task's release after its pieces, and (None, _STARTED)
        before each task."""
        begun = 0
        for task in self.tasks:
            size = _input_bytes(task)
            self.reached = begun
            reads = self.reads.get(id(task))
            self.write = write if reads is None else reads.counted(write)
            yield None, _STARTED
            pieces = max(1, _pieces_expected(task, chunk))
            for name, job in _task_jobs(plan, task, chunk, quantizers, self.write):
                yield name, job
                self.reached = min(begun + size, self.reached + size / pieces)
            yield None, partial(_release_task, task, reads)
            begun += size
            self.reached = begun


def _pieces_expected(task: Task, chunk: int) -> int:
    """About how many pieces the task's outputs are cut into (float32 rows of `chunk` bytes a piece)."""
    rows = 1 if task.rows is None else (task.rows[1] - task.rows[0]) / max(1, task.outputs[0].shape[0])
    return sum(max(1, math.ceil(rows * math.prod(t.shape) * 4 / chunk)) for t in task.outputs)


def _started_in_turn(runs: list[_Lane]) -> list[Task]:
    """The tasks in the order the lanes begin them: each next from the lane least far through its input bytes."""
    order, begun, at = [], [0] * len(runs), [0] * len(runs)
    active = [i for i, run in enumerate(runs) if run.tasks]
    while active:
        i = min(active, key=lambda k: begun[k] / runs[k].total)
        task = runs[i].tasks[at[i]]
        order.append(task)
        begun[i] += _input_bytes(task)
        at[i] += 1
        if at[i] == len(runs[i].tasks):
            active.remove(i)
    return order


# torch's intra-op thread count is process-wide: the first of overlapping runs saves the caller's value and
# the last one to end restores it.
_threads_lock = threading.Lock()
_runs = 0
_saved_threads = 1


def _single_threaded_torch(entering: bool) -> None:
    global _runs, _saved_threads
    with _threads_lock:
        if entering:
            if _runs == 0:
                _saved_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            _runs += 1
        else:
            _runs -= 1
            if _runs == 0:
                torch.set_num_threads(_saved_threads)


def _crc_jobs(plan: MergePlan, tasks: list[Task]):
    replicas = {}
    for pair in plan.replicas:
        replicas.setdefault(id(pair[0]), []).append(pair)
    due = 0
    for task in tasks:
        refs = (task.lora.refs if task.lora is not None else ()) + task.pieces.refs
        yield due, refs, [pair for ref in refs for pair in replicas.pop(id(ref), [])]
        due += _input_bytes(task)
    yield due, [], [pair for pairs in replicas.values() for pair in pairs]  # copies of skipped tensors


def chunk_bytes(workers: int) -> int:
    """Float32 bytes of rows per piece for this many workers (see IN_FLIGHT_BYTES)."""
    return min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, IN_FLIGHT_BYTES // (WINDOW_PER_WORKER * workers)))


def _task_jobs(plan: MergePlan, task: Task, chunk: int, quantizers: dict | None = None, write=None):
    """(HF name, job) for every piece of the task's outputs; a job returns (rows, then). For an FP8 output
    (plan.quantized), a weight is computed in float32 and quantized in order (`quantizers`), or, read from an
    FP8 base with the same blocks and no LoRA, copied as stored; then (None, call) writes its scales."""
    shape = plan.shape
    where = f"{task.megatron} ({task.pieces[0].where})"
    blocks = task.rule.hf_blocks([ref.load() for ref in task.pieces], shape, where, task.pieces.is_global)
    if task.lora is not None:
        deltas = megatron_deltas(task.rule, task.lora, shape, task.lora_module, plan.settings.scale)
    else:  # a PEFT adapter's factors, already by HF name, each with its own scale
        deltas = {name: f.delta() for name, f in (task.delta or {}).items()}
    scales = {planned.name + SCALE_SUFFIX for planned in task.outputs if planned.name in plan.quantized}
    scales |= {param + MXFP4_SCALES for param in plan.mxfp4}
    for planned in task.outputs:
        if planned.name in scales:
            continue
        param = planned.name.removesuffix(MXFP4_BLOCKS)
        if param in plan.mxfp4:
            name = param[len(task.hf_prefix):]
            yield from _mxfp4_jobs(blocks[name], deltas.get(name), planned, param, plan.mxfp4[param],
                                   task.pieces.mapped, chunk, quantizers, write, task)
            continue
        name = planned.name[len(task.hf_prefix):]
        block = plan.quantized.get(planned.name)
        if block is None:
            for job in _piece_jobs(blocks[name], deltas.get(name), planned, task.pieces.mapped, chunk):
                yield planned.name, job
            continue
        source = blocks[name][0] if len(blocks[name]) == 1 else None
        stored = (isinstance(source, QuantizedRowBlock) and source.weight.block == block
                  and deltas.get(name) is None)  # q and its scales as the base has them
        compute = replace(planned, dtype=torch.float8_e4m3fn if stored else torch.float32)
        starts, row = [], 0
        for b in blocks[name]:
            starts.append(row)
            row += b.rows
        on_workers = not stored and all(start % block[0] == 0 for start in starts)
        if on_workers:  # every piece starts on a block row: quantized where it is computed
            quantizers[planned.name] = ScaleRows(scale_shape(tuple(planned.shape), block), torch.float32)
            for job in _piece_jobs(blocks[name], deltas.get(name), compute, task.pieces.mapped, chunk, block[0]):
                yield planned.name, partial(_quantized, job, block, plan.pow2_scales, planned.name)
        else:
            if not stored:  # rows from sources not aligned to blocks: quantized in order as they come
                quantizers[planned.name] = BlockQuantizer(tuple(planned.shape), block, plan.pow2_scales, planned.name)
            for job in _piece_jobs(blocks[name], deltas.get(name), compute, task.pieces.mapped, chunk):
                yield planned.name, job
        if stored:
            yield None, partial(write, planned.name + SCALE_SUFFIX, source.weight.scale_inv, None)
        else:
            yield None, partial(_write_scales, write, planned.name, quantizers)


def _mxfp4_jobs(blocks, delta, planned: PlannedTensor, param: str, shape, mapped: bool, chunk: int,
                quantizers: dict, write, task: Task):
    """A stacked experts parameter written as MXFP4: from an MXFP4 base without a change, its blocks and scales
    copied as stored; else computed in float32, whole experts a piece, and quantized where computed, its
    scales written once its blocks are (once its last expert's are, where each expert is a task: task.rows)."""
    source = blocks[0] if len(blocks) == 1 else None
    if isinstance(source, Mxfp4RowBlock) and delta is None:
        stored = source.weight
        step = max(1, chunk // (2 * stored.blocks[0].numel()))  # bytes of codes, not float32 values
        for start in range(0, stored.blocks.shape[0], step):
            yield planned.name, partial(_stored_rows, stored.blocks, start, start + step, mapped)
        yield None, partial(write, param + MXFP4_SCALES, stored.scales, None)
        return
    experts, inputs, outputs = shape
    if task.opens_outputs:
        quantizers[planned.name] = ScaleRows((experts, outputs, inputs // MXFP4_BLOCK))
    if isinstance(source, Mxfp4RowBlock) and isinstance(delta, StackedExpertsDelta) and delta.in_out:
        # MXFP4 in and out: merged and quantized in the blocks' own [out, in] layout, never transposed
        step = max(1, chunk // (4 * source.row_numel))
        for start in range(0, source.rows, step):
            yield planned.name, partial(_mxfp4_remerged, source, delta, start, min(start + step, source.rows), param,
                                        mapped)
        yield None, partial(_write_scales, write, planned.name, quantizers, param + MXFP4_SCALES)
        return
    for job in _piece_jobs(blocks, delta, PlannedTensor(param, shape, torch.float32), mapped, chunk):
        yield planned.name, partial(_mxfp4_quantized, job)
    if task.closes_outputs:
        yield None, partial(_write_scales, write, planned.name, quantizers, param + MXFP4_SCALES)


TRANSPOSE_ROWS = 256  # rows of a slab transposed at a time: 5x faster than torch's transpose of a 3-D tensor here


def _transposed_slabs(slabs: torch.Tensor) -> torch.Tensor:
    """[n, a, b] -> [n, b, a] contiguous, a tile of rows at a time."""
    out = torch.empty((slabs.shape[0], slabs.shape[2], slabs.shape[1]), dtype=slabs.dtype)
    for i in range(slabs.shape[0]):
        for row in range(0, slabs.shape[1], TRANSPOSE_ROWS):
            out[i, :, row:row + TRANSPOSE_ROWS].copy_(slabs[i, row:row + TRANSPOSE_ROWS].t())
    return out


def _mxfp4_remerged(source: Mxfp4RowBlock, delta: StackedExpertsDelta, start: int, stop: int, name: str,
                    mapped: bool):
    started = time.thread_time()
    try:
        return quantize_mxfp4_rows(_merged_stored_slabs(source, delta, start, stop, 0, name, mapped)), None
    finally:
        charge("merge", time.thread_time() - started)


def _merged_stored_slabs(block: Mxfp4RowBlock, delta: StackedExpertsDelta | None, start: int, stop: int, offset: int,
                         name: str, mapped: bool) -> torch.Tensor:
    """Experts start..stop of an MXFP4 parameter dequantized and merged in the blocks' own [out, in] layout
    (float32, checked finite); the pages they came from released."""
    weight = block.weight
    slabs = weight.stored_rows(start, stop)
    if delta is not None:
        delta.add_to_transposed(slabs, offset + start)
    check_finite(slabs, f"{name} (experts {offset + start}..{offset + stop - 1})",
                 "non-finite values (NaN or Inf) in the checkpoint; the release is damaged" if delta is None else
                 "merged weight has non-finite values (check the LoRA factors and alpha/r)")
    if mapped:
        _release_all([weight.blocks[start:stop], weight.scales[start:stop]])
    return slabs


def _slab_piece(block: SlabBlock, delta, planned: PlannedTensor, mapped: bool) -> torch.Tensor:
    name, dtype = planned.name, planned.dtype
    for part in block.parts:
        check_finite(part, name, "non-finite values (NaN or Inf) in the checkpoint; the checkpoint is damaged or "
                     "training diverged")
    row = block.take(0, 1)
    piece = delta.merge_rows(row, 0, 1, dtype, name) if delta is not None else row.to(dtype)
    if delta is None and row.dtype != dtype:
        check_finite(piece, name, f"values overflow {str(dtype).removeprefix('torch.')}; choose --dtype bfloat16 or "
                     "float32")
    if mapped:
        _release_all(block.parts)  # the checkpoint's own views (never a joined copy: that is ordinary memory)
    return piece.contiguous()  # (a transposed row without a change is still a view)


def _stored_rows(t: torch.Tensor, start: int, stop: int, mapped: bool):
    rows = t[start:stop]
    return rows, (partial(_release_all, [rows]) if mapped else None)


def _mxfp4_quantized(job):
    piece, then = job()
    started = time.thread_time()
    try:
        return quantize_mxfp4(piece), then
    finally:
        charge("merge", time.thread_time() - started)


def _quantized(job, block, pow2: bool, name: str):
    started = time.thread_time()
    piece, then = job()
    try:
        return quantize_rows(piece, block, pow2), then
    except MergeError as exc:  # a block beyond what power-of-two scales can hold: which tensor
        raise MergeError(f"{name}: {exc}") from None
    finally:
        charge("merge", time.thread_time() - started)


class ScaleRows:
    """The scales of a quantized tensor (MXFP4's E8M0 bytes, block-FP8's float32), filled in as its pieces are delivered (in order), in one buffer made up
    front. Kept as a list of small pieces until the tensor was complete and then joined, they scattered long-lived
    allocations through the heap that freed merge chunks could not reuse around: the process grew to 1.8 GB at
    gpt-oss-120b's 128 experts (0.9 GB at 20b's 32)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8):
        self.buffer = torch.empty(shape, dtype=dtype)
        self.filled = 0

    def append(self, piece: torch.Tensor) -> None:
        self.buffer[self.filled:self.filled + piece.shape[0]] = piece
        self.filled += piece.shape[0]

    def scales(self) -> torch.Tensor:
        if self.filled != self.buffer.shape[0]:
            raise RuntimeError(f"scales of {self.filled} of {self.buffer.shape[0]} rows delivered (plan error)")
        return self.buffer


def _write_scales(write, name: str, quantizers: dict, scales_name: str | None = None) -> None:
    scales = quantizers.pop(name).scales()
    write(scales_name or name + SCALE_SUFFIX, scales, None)


def _task_refs(task: Task) -> tuple:
    """Every tensor reference the task reads: its pieces, its LoRA factors (a PEFT adapter's, by HF name)."""
    delta = tuple(ref for f in (task.delta or {}).values() for ref in (f.a, f.b, getattr(f, "magnitude", None)) if ref is not None)
    return task.pieces.refs + (task.lora.refs if task.lora is not None else ()) + delta


def _release_task(task: Task, reads: "_TaskReads | None" = None) -> None:
    for ref in _task_refs(task):
        ref.release()  # replicated copies on other ranks, and the LoRA factors' pages
    if reads is not None:
        reads.issued()


class _TaskReads:
    """A task's counted reads of inputs at a URL (files/handback.py), done once all its pieces are handed to the
    writer (`issued`) and the writer is through with each (a write's `then`: it may keep a view of the input
    until then, e.g. unchanged rows hashed on its sha256 thread)."""

    def __init__(self, reads):
        self._reads, self._left, self._lock = reads, 1, threading.Lock()

    def counted(self, write):
        if self._reads is None:
            return write

        def counted_write(name, rows, then=None):
            with self._lock:
                self._left += 1
            write(name, rows, partial(self._written, then))
        return counted_write

    def _written(self, then) -> None:
        try:
            if then is not None:
                then()
        finally:
            self._one_done()

    def issued(self) -> None:
        self._one_done()

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done and self._reads is not None:
            self._reads.done()


def _release_all(views) -> None:
    for view in views:
        release_pages(view)


def _piece_jobs(blocks, delta, planned: PlannedTensor, mapped: bool, chunk: int, align: int = 1):
    """Jobs computing the (rows, then) pieces of one HF tensor in output dtype, merged with its delta if it
    has one; the checkpoint pages a piece came from are released once it is written. `align`: pieces start
    at multiples of this many rows (FP8 blocks)."""
    offset = 0
    for block in blocks:
        step = max(1, chunk // (4 * block.row_numel))
        unit = align
        if delta is not None:  # whole merge blocks, so that the bits do not depend on the piece size
            unit = math.lcm(unit, delta.row_unit(block.row_numel))
        step = max(unit, step // unit * unit)
        for start in range(0, block.rows, step):
            stop = min(start + step, block.rows)
            yield partial(_piece, block, start, stop, offset, delta, planned, mapped)
        offset += block.rows


def _piece(block, start: int, stop: int, offset: int, delta, planned: PlannedTensor, mapped: bool):
    started = time.thread_time()
    try:
        return _compute_piece(block, start, stop, offset, delta, planned, mapped)
    finally:
        charge("merge", time.thread_time() - started)


def _compute_piece(block, start: int, stop: int, offset: int, delta, planned: PlannedTensor, mapped: bool):
    name, dtype = planned.name, planned.dtype
    if isinstance(block, SlabBlock):  # an expert's tensor as its row of a stacked tensor: taken whole, reordered
        return _slab_piece(block, delta, planned, mapped), None
    sources = [part[start:stop] for part in block.parts]
    damaged = (f"non-finite values (NaN or Inf) in the checkpoint, rows {offset + start}..{offset + stop - 1}; "
               "the checkpoint is damaged or training diverged")
    if isinstance(block, Mxfp4RowBlock) and (delta is None or isinstance(delta, StackedExpertsDelta) and delta.in_out):
        # dequantized and merged in the blocks' own [out, in] layout, transposed once, in the output dtype
        # (the same bits as merging the transposed view: tests/test_gpt_oss.py)
        piece = _merged_stored_slabs(block, delta, start, stop, offset, name, mapped).to(dtype)
        if dtype != torch.float32:
            check_finite(piece, name, f"values overflow {str(dtype).removeprefix('torch.')}; choose --dtype bfloat16 "
                         "or float32")
        return _transposed_slabs(piece), None
    if isinstance(block, QuantizedRowBlock) and delta is None and dtype == torch.float8_e4m3fn:
        # an FP8 output keeps an untouched weight as stored: checked dequantized, written as it is
        check_finite(block.take(start, stop), name, damaged)
        return sources[0], (partial(_release_all, sources) if mapped else None)
    if isinstance(block, QuantizedRowBlock):  # block-FP8: checked once dequantized (the fp8 bytes are not floats torch checks)
        sources = [block.take(start, stop)]
        if delta is None:
            check_finite(sources[0], name, damaged)
            piece = sources[0].to(dtype)
            check_finite(piece, name, f"values overflow {str(dtype).removeprefix('torch.')}; choose --dtype bfloat16 "
                         "or float32")
            if mapped:
                _release_all([part[start:stop] for part in block.parts])
            return piece, None
    if delta is None:
        for source in sources:
            check_finite(source, name, damaged)
        if len(sources) == 1 and sources[0].dtype == dtype:
            # unchanged bytes: straight from the mapped checkpoint to the file, released once written
            return sources[0], (partial(_release_all, sources) if mapped else None)
        piece = block.take(start, stop).to(dtype)
        if any(source.dtype != dtype for source in sources):  # narrowing can overflow; joining cannot
            check_finite(piece, name, f"values overflow {str(dtype).removeprefix('torch.')}; choose "
                         "--dtype bfloat16 or float32")
    else:
        # NaN/Inf in W carries into W + ΔW, so the merged rows are checked once; only if they fail is the
        # source checked, to say which of the two is at fault.
        try:
            weight = sources[0] if isinstance(block, QuantizedRowBlock) else block.take(start, stop)
            piece = delta.merge_rows(weight, offset + start, offset + stop, dtype, name)
        except MergeError:
            for source in sources:
                check_finite(source, name, damaged)
            raise
    if mapped:
        _release_all([part[start:stop] for part in block.parts])
    return piece, None
