"""How a Megatron model is spread over ranks: tensor, pipeline (with virtual chunks and uneven first/last
stages), expert and expert-tensor parallelism — which layer lives on which stage and chunk, which expert on
which expert-parallel rank, and which rank files a legacy checkpoint of this layout has.

Megatron orders ranks tensor-parallel fastest, then data-parallel, then pipeline; the experts' grid is
expert-tensor-parallel fastest, then expert-parallel, then expert-data-parallel (megatron.core's
RankGenerator orders "tp-cp-ep-dp-pp" and "tp-ep-dp-pp"). On load every rank opens the file of its own
(TP rank, PP rank, EP rank); with ETP=1 < TP that grid is sparse (TP=2, EP=2: only mp_rank_00_000 and
mp_rank_01_001). Megatron 0.16.1 saves from expert-data-parallel rank 0 only, which for TP=4 ETP=1 EP=2
leaves files that ranks load unwritten (it cannot reload its own save); we write every file a rank opens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from lora_merge.errors import MergeError
from lora_merge.model.layer_numbering import LayerNumbering, numbering_from_args
from lora_merge.value_checks import MAX_SIZE, is_int, shown_value


@dataclass(frozen=True)
class RankFile:
    """One legacy rank file: its coordinates on both grids."""

    tp: int
    pp: int
    ep: int
    etp: int  # the expert-tensor-parallel shard of the experts it holds

    def dir_name(self, layout: "ParallelLayout") -> str:
        name = f"mp_rank_{self.tp:02d}"
        if layout.pp > 1:
            name += f"_{self.pp:03d}"
        if layout.ep > 1:
            name += f"_{self.ep:03d}"
        return name


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline stage (Megatron's virtual pipeline size; 1: none)
    ep: int = 1
    etp: int = 1
    first_stage_layers: int | None = None  # Megatron's decoder_first_pipeline_num_layers
    last_stage_layers: int | None = None

    def __str__(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP={self.vpp}")
        if self.ep > 1 or self.etp != self.tp:
            parts += [f"EP={self.ep}", f"ETP={self.etp}"]
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"first/last stage layers {self.first_stage_layers}/{self.last_stage_layers}")
        return " ".join(parts)

    def numbering(self, num_layers: int) -> LayerNumbering:
        args = SimpleNamespace(num_layers=num_layers, decoder_first_pipeline_num_layers=self.first_stage_layers,
                               decoder_last_pipeline_num_layers=self.last_stage_layers)
        try:
            return numbering_from_args(args, self.pp, self.vpp)
        except MergeError as exc:  # its messages speak of args; here the layout is the user's choice
            raise MergeError(f"target layout {self}: {str(exc).removeprefix('args: ')}") from None

    def layer_homes(self, num_layers: int) -> list[tuple[int, int, int]]:
        """(stage, chunk, local index) of every global layer, in order."""
        numbering, homes = self.numbering(num_layers), []
        for chunk, row in enumerate(numbering.counts):
            for stage, count in enumerate(row):
                homes += [(stage, chunk, local) for local in range(count)]
        return homes

    def expert_home(self, expert: int, num_experts: int) -> tuple[int, int]:
        """(EP rank, local expert index) of a global expert."""
        local = num_experts // self.ep
        return expert // local, expert % local

    @property
    def world(self) -> int:
        """The smallest world this layout runs on: data parallel just large enough for the expert grid."""
        return self.pp * math.lcm(self.tp, self.etp * self.ep)

    def rank_files(self) -> list[RankFile]:
        """The files the ranks of this layout load, in rank order."""
        per_stage, files, seen = self.world // self.pp, [], set()
        for pp in range(self.pp):
            for local in range(per_stage):
                tp, etp = local % self.tp, local % self.etp
                ep = (local // self.etp) % self.ep
                if (tp, pp, ep) not in seen:
                    seen.add((tp, pp, ep))
                    files.append(RankFile(tp, pp, ep, etp))
        return files

    def check_values(self, where: str = "target layout") -> None:
        """Refuse sizes Megatron would refuse whatever the model: each a whole number of at least 1, and stage
        layer counts, when given, at least 1 (megatron-core's TransformerConfig: "num_layers_in_first_pipeline_stage
        must be larger than 0"; a stage with no layers is not a stage)."""
        for name, value in (("--tp", self.tp), ("--pp", self.pp), ("--vpp", self.vpp), ("--ep", self.ep),
                            ("--etp", self.etp)):
            if not is_int(value) or not 1 <= value <= MAX_SIZE:
                raise MergeError(f"{where}: {name} {shown_value(value)}; expected a whole number of at least 1")
        for name, value in (("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                            ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
            if value is not None and (not is_int(value) or not 1 <= value <= MAX_SIZE):
                raise MergeError(f"{where}: {name} {shown_value(value)}; expected a whole number of at least 1 (a "
                                 "pipeline stage holds at least one layer), or none for an even split")
        if self.vpp > 1 and self.pp == 1:
            raise MergeError(f"{where}: --vpp {self.vpp} needs --pp of 2 or more (virtual chunks interleave stages)")
        if (self.first_stage_layers is not None or self.last_stage_layers is not None) and self.pp == 1:
            raise MergeError(f"{where}: first/last pipeline stage layer counts need --pp of 2 or more")

    def check(self, shape, where: str = "target layout") -> None:
        """Refuse a layout the model cannot be split into (before anything is written). Every tensor's split
        is checked again when the writer plans its shards."""
        self.check_values(where)
        num_layers, heads, groups = shape.num_layers, shape.heads, shape.groups
        num_experts = shape.moe.num_experts if shape.moe is not None else None
        if heads % self.tp:
            raise MergeError(f"{where}: {heads} attention heads do not split over --tp {self.tp}")
        if shape.mla is None and groups % self.tp:
            raise MergeError(f"{where}: {groups} query groups (key/value heads) do not split over --tp {self.tp}")
        dense_layers = shape.moe is None or len(shape.moe.layers) < num_layers
        if dense_layers and shape.ffn % self.tp:
            raise MergeError(f"{where}: the MLP's intermediate size {shape.ffn} does not split over --tp {self.tp}")
        if shape.moe is not None and shape.moe.ffn % self.etp:
            raise MergeError(f"{where}: the experts' intermediate size {shape.moe.ffn} does not split over --etp {self.etp}")
        self.numbering(num_layers)  # refuses layer counts that do not split (with the args' messages)
        if num_experts is None:
            # expert parallel sizes other than the defaults mean nothing without experts: refused, not shown as
            # a layout the checkpoint does not have
            if self.ep > 1:
                raise MergeError(f"{where}: --ep {self.ep} but the model has no routed experts")
            if self.etp != self.tp:
                raise MergeError(f"{where}: --etp {self.etp} but the model has no routed experts (expert tensor "
                                 "parallelism applies to experts only)")
            return
        if num_experts % self.ep:
            raise MergeError(f"{where}: {num_experts} experts do not split over --ep {self.ep}")
        if self.etp not in (1, self.tp):
            raise MergeError(f"{where}: --etp {self.etp} with --tp {self.tp}; expert tensor parallelism must be 1 or "
                             "equal to --tp")
