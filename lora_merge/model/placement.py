"""The layout rules run backwards: where each row of an HF tensor goes in a Megatron parameter's TP shards.

Nothing here restates a layout. Each rule already says, in `hf_blocks`, which rows of which rank's shard
make each HF tensor; run it on *index shards* (each rank's shard a view of its own row numbers, no data) and
the views it returns name, for every HF row, the rank and shard row it came from — and so where it goes.
Reading and writing are then inverse by construction, for every rule (QKV groups, gated halves, vocab
padding, stacked MLA projections) and any TP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from lora_merge.errors import MergeError
from lora_merge.model.layout import ExpertSlab, Rule, stored_split


@dataclass(frozen=True)
class Segment:
    """HF rows [hf_start, hf_start + rows) → rows [shard_start, …) of TP rank `rank`'s shard (None: every
    rank holds the whole tensor), taking HF columns [col_start, col_stop) (None: whole rows)."""

    hf_start: int
    rows: int
    rank: int | None
    shard_start: int
    col_start: int | None = None
    col_stop: int | None = None
    # an expert's row of a stacked HF tensor (layout.ExpertSlab): the row, made its Megatron tensor by `convert`,
    # fills the whole shard (`shard_rows` rows of it)
    convert: Callable | None = None
    shard_rows: int | None = None

    @property
    def filled_rows(self) -> int:
        """How many rows of the shard it fills."""
        return self.rows if self.shard_rows is None else self.shard_rows


def index_shards(shard_shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Per rank, a tensor of the shard's shape whose row r starts at element r of a storage of its own: a
    view's storage_offset is then its first shard row, and the storage its rank (the trailing dimensions
    have stride 0). The values are all zero, equal on every rank as a replicated rule checks; one byte a row,
    from calloc, whose large blocks are the kernel's untouched zero pages: a vocabulary padded to 2^31 rows
    costs no memory."""
    shards = []
    for shape in shard_shapes:
        rows = torch.from_numpy(np.zeros(shape[0], dtype=np.uint8))
        shards.append(rows.view(shape[0], *([1] * (len(shape) - 1))).expand(*shape))
    return shards


def hf_segments(rule: Rule, shape, shard_shapes: list[tuple[int, ...]], where: str) -> dict[str, list[Segment]]:
    """For each HF tensor the rule makes: the segments its rows are written to, in HF row order."""
    if isinstance(rule, ExpertSlab):  # the expert's row, reordered, is its whole tensor
        if len(shard_shapes) != 1:  # (the target's check refuses such a layout first: own_mechanics.check_target)
            raise MergeError(f"{where}: expert TP={len(shard_shapes)}; {rule.hf} is written at expert TP 1 only")
        return {rule.hf: [Segment(rule.index, 1, 0, 0, convert=rule.unslab, shard_rows=shard_shapes[0][0])]}
    shards = index_shards(shard_shapes)
    owner = {s.untyped_storage().data_ptr(): rank for rank, s in enumerate(shards)}
    global_rows = rule.global_shape(shape, shard_shapes)[0] if shard_shapes[0] else 0
    replicated = stored_split(rule.parallel, shard_shapes, global_rows) == "replicated"
    out = {}
    for name, blocks in rule.hf_blocks(shards, shape, where).items():
        segments, hf_row = [], 0
        for block in blocks:
            col = 0
            for part in block.parts:
                if part.dim() and part.shape[0] > 1 and part.stride(0) != 1:
                    raise MergeError(f"{where}: {name}'s rows are not consecutive shard rows (layout rule error)")
                rank = owner[part.untyped_storage().data_ptr()]
                width = part.shape[1] if part.dim() > 1 and len(block.parts) > 1 else None
                segments.append(Segment(hf_row, block.rows, None if replicated else rank, part.storage_offset(),
                                        col if width is not None else None,
                                        col + width if width is not None else None))
                col += width or 0
            hf_row += block.rows
        out[name] = segments
    return out
