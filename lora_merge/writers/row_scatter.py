"""HF row pieces scattered into Megatron tensors on disk, in constant memory.

A Megatron writer plans its files first and registers each tensor shard here as a `Target` that appends to
its file; `route` then asks the layout rule, run backwards (`placement`), which rows of which HF tensor go where,
and `stream_order` in which order each file's tensors will receive their bytes (the writer lays the file out in
that order, so it is written front to back). As row pieces stream in, each is cut into the segments it covers
and appended to every file holding that shard. Shards whose rows arrive out of order (QKV), and GroupedMLP
experts (stored transposed, `Block`), are gathered and appended whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from lora_merge.errors import MergeError
from lora_merge.model.layout import DUPLICATED_OR_COLUMN, VocabParallel, expected_shard_shape
from lora_merge.model.placement import Segment, hf_segments

ZEROS = memoryview(bytes(8 << 20))


@dataclass(eq=False)
class Target:
    """One Megatron tensor (a TP shard of a parameter) in a file: C order, `row_bytes` per row. Its bytes are
    handed to `append` (set once its file is open) in order, then `padding` zero bytes; `gather`: its rows do
    not arrive in order, so they are collected and appended whole."""

    row_bytes: int
    due: int  # bytes still to be written
    append: Callable | None = None
    gather: bool = False
    padding: int = 0
    buffer: torch.Tensor | None = None
    blocks_done: int = 0  # of a GroupedMLP tensor: its expert blocks appended so far


@dataclass(eq=False)
class Block:
    """One expert's shard inside a GroupedMLP tensor (`weight1` [H, E·2F], `weight2` [E·F, H], expert-major,
    each expert's block its shard transposed, in→out): its rows are gathered, then written transposed."""

    grouped: Target  # the whole weight1/weight2 of that file
    index: int  # its place there (the local expert number): blocks must complete in this order
    due: int
    row_bytes: int  # of the expert's shard as the rule sees it (before transposing)
    buffer: torch.Tensor | None = None


@dataclass
class _Destination:
    segment: Segment
    targets: dict  # TP rank -> [Target | Block] (the same shard in every file holding it)


@dataclass
class _HfTensor:
    destinations: list[_Destination] = field(default_factory=list)
    next_row: int = 0


def target_shard_shapes(rule, shape, tp: int, padded_vocab: int, where: str) -> list[tuple[int, ...]]:
    """Each TP rank's shard shape of a parameter at the target: the vocabulary padded, MLA's
    down-projections column-parallel (Megatron-Core's local spec builds them so)."""
    if isinstance(rule, VocabParallel):
        return [(padded_vocab // tp, shape.hidden)] * tp
    parallel = "column" if rule.parallel == DUPLICATED_OR_COLUMN else rule.parallel
    return [expected_shard_shape(parallel, rule.global_shape(shape), tp, where)] * tp


def tensor_dtype(rule, hf_prefix: str, dtypes: dict, name: str) -> torch.dtype:
    """The dtype a parameter is written in: its HF tensors' (the plan's), which must agree."""
    found = {dtypes[hf_prefix + n] for n in rule.hf_names()}
    if len(found) != 1:
        raise MergeError(f"{name}: its HF tensors come in different dtypes ({sorted(map(str, found))})")
    return found.pop()


class RowScatter:
    """`write(hf_name, rows, then)` in each HF tensor's row order (tensors in any order)."""

    def __init__(self, shape):
        self.shape = shape
        self.hf: dict[str, _HfTensor] = {}
        self.targets: list[Target | Block] = []
        self.ignored: set[int] = set()  # ids of the targets in files another part writes (`--part`)

    def route(self, rule, hf_prefix: str, name: str, shard_shapes: list[tuple[int, ...]], by_rank: dict) -> None:
        """Send the rule's HF rows to `by_rank[rank]` (the targets holding that TP rank's shard)."""
        for target in (t for targets in by_rank.values() for t in targets):
            self.targets.append(target)
        tp = len(shard_shapes)
        for hf_name, segments in hf_segments(rule, self.shape, shard_shapes, name).items():
            entry = self.hf.setdefault(hf_prefix + hf_name, _HfTensor())
            for seg in segments:
                ranks = range(tp) if seg.rank is None else [seg.rank]
                entry.destinations.append(_Destination(seg, {r: by_rank.get(r, []) for r in ranks}))
        if isinstance(rule, VocabParallel):  # padding rows past the vocabulary stay zero: never due
            rows = shard_shapes[0][0]
            for rank, targets in by_rank.items():
                real = max(0, min(self.shape.vocab - rank * rows, rows))
                for t in targets:
                    t.due = real * t.row_bytes

    def stream_order(self, plan_order: list[str], file_of) -> tuple[dict, dict]:
        """For files written front to back: each file's targets (`file_of(target)` names the file) in the order
        their bytes will arrive, and those no byte reaches (all padding: appended as zeros at the end).

        HF tensors come in plan order, each in row order; a tensor's rows go to its shards' rows in order, but
        for a few layouts (QKV: q rows of every group before any k row) not: those shards are gathered
        (`gather`) and arrive whole once complete, as do GroupedMLP experts' blocks. Where two tensors of one
        file would still interleave, the one interrupted is gathered too, until none does."""
        groupeds = {id(b.grouped) for b in self.targets if isinstance(b, Block)}
        for _ in range(2 * len(self.targets) + 2):
            events: dict = {}  # file -> [(target, bytes)] in arrival order
            next_row, held, changed = {}, {}, False
            for name in plan_order:
                for dest in self.hf[name].destinations:
                    seg = dest.segment
                    for t in (t for targets in dest.targets.values() for t in targets):
                        if isinstance(t, Block):
                            held[id(t)] = held.get(id(t), 0) + seg.rows * t.row_bytes
                            if held[id(t)] == t.due:
                                events.setdefault(file_of(t.grouped), []).append((t.grouped, t.due))
                            continue
                        if next_row.get(id(t), 0) != seg.shard_start and not t.gather:
                            t.gather = changed = True  # its earlier rows were counted as streamed: again
                        next_row[id(t)] = seg.shard_start + seg.filled_rows
                        nbytes = seg.filled_rows * t.row_bytes
                        if t.gather:
                            held[id(t)] = held.get(id(t), 0) + nbytes
                            if held[id(t)] == t.due:
                                events.setdefault(file_of(t), []).append((t, t.due))
                        else:
                            events.setdefault(file_of(t), []).append((t, nbytes))
            if changed:
                continue
            interrupted = None
            for file_events in events.values():
                left, current = {}, None
                for t, nbytes in file_events:
                    if t is not current:
                        if current is not None and left[id(current)]:
                            interrupted = current
                            break
                        current = t
                        left.setdefault(id(t), t.due)
                    left[id(t)] -= nbytes
                if interrupted is not None:
                    break
            if interrupted is None:
                break
            if interrupted.gather or id(interrupted) in groupeds:
                raise MergeError("the target layout interleaves two tensors of one file (layout error)")
            interrupted.gather = True
        else:
            raise MergeError("the target layout's write order did not settle (layout error)")
        order, unreached, seen = {}, {}, set()
        for key, file_events in events.items():
            for t, _ in file_events:
                if id(t) not in seen:
                    seen.add(id(t))
                    order.setdefault(key, []).append(t)
        for t in self.targets:
            if not isinstance(t, Block) and id(t) not in seen:
                seen.add(id(t))
                unreached.setdefault(file_of(t), []).append(t)
        return order, unreached

    def write(self, name: str, rows: torch.Tensor, then=None) -> None:
        entry = self.hf.get(name)
        if entry is None:
            raise MergeError(f"{name}: not a tensor of the target Megatron layout (plan error)")
        start, stop = entry.next_row, entry.next_row + rows.shape[0]
        for dest in entry.destinations:
            seg = dest.segment
            lo, hi = max(start, seg.hf_start), min(stop, seg.hf_start + seg.rows)
            if lo >= hi:
                continue
            piece = rows[lo - start: hi - start]
            if seg.col_start is not None:
                piece = piece[:, seg.col_start: seg.col_stop]
            if seg.convert is not None:  # an expert's row of a stacked tensor: its whole Megatron tensor
                piece = seg.convert(piece[0])
            row = seg.shard_start + lo - seg.hf_start
            data = None
            for targets in dest.targets.values():
                for t in targets:
                    if id(t) in self.ignored:
                        continue
                    if isinstance(t, Block):
                        self._gather(t, piece, row)
                        continue
                    if data is None:
                        data = piece.contiguous().view(torch.uint8).numpy()
                    if t.gather:
                        if t.buffer is None:
                            t.buffer = torch.empty(t.due, dtype=torch.uint8)
                        t.buffer[row * t.row_bytes: row * t.row_bytes + data.nbytes] = torch.from_numpy(data).view(-1)
                    else:
                        t.append(data)
                    self._written(t, data.nbytes, name)
        entry.next_row = stop
        if then is not None:
            then()

    def _written(self, t: Target, nbytes: int, name: str) -> None:
        t.due -= nbytes
        if t.due == 0:
            self._complete(t)
        elif t.due < 0:
            raise MergeError(f"{name}: rows written twice (plan error)")

    @staticmethod
    def _complete(t: Target) -> None:
        if t.buffer is not None:
            t.append(t.buffer.numpy())
            t.buffer = None
        for start in range(0, t.padding, ZEROS.nbytes):  # e.g. the vocabulary padding rows
            t.append(ZEROS[:min(ZEROS.nbytes, t.padding - start)])

    def _gather(self, block: Block, piece: torch.Tensor, row: int) -> None:
        if block.buffer is None:
            rows = block.due // (piece.shape[1] * piece.element_size())
            block.buffer = torch.empty((rows, piece.shape[1]), dtype=piece.dtype)
        block.buffer[row: row + piece.shape[0]] = piece
        block.due -= piece.numel() * piece.element_size()
        if block.due == 0:
            data = block.buffer.t().contiguous().view(torch.uint8).numpy()
            block.buffer = None
            if block.index != block.grouped.blocks_done:
                raise MergeError(f"GroupedMLP expert {block.index} complete before expert {block.grouped.blocks_done} "
                                 "(plan error)")
            block.grouped.blocks_done += 1
            block.grouped.append(data)
            self._written(block.grouped, data.nbytes, "a GroupedMLP expert")

    def check_complete(self, where) -> None:
        unwritten = [t for t in self.targets if t.due and id(t) not in self.ignored]
        if unwritten:
            raise MergeError(f"{where}: {len(unwritten)} tensor(s) not completely written (plan error); nothing "
                             "published")
