"""A Megatron legacy ("torch" format) checkpoint at any layout, written from HF tensors as they stream.

    release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   {args, checkpoint_version: 3.0, iteration: 0,
    latest_checkpointed_iteration.txt ("release")         model | model0, model1, … (virtual pipeline chunks)}

Every rank file is planned from shapes before any data exists (writers/torch_zip), so each HF row piece goes
straight to its places: `placement` says which TP shard rows it becomes, the layout which file and model
chunk holds that shard (layers by stage and chunk, experts by EP rank, numbered locally as Megatron numbers
them). Names are Megatron-Core's local spec (what MindSpeed-LLM builds on Ascend, and what a
`--transformer-impl local` run builds): no TransformerEngine `_extra_state`, norms as their own modules.
Vocabulary padding rows are zero. No optimizer or RNG state: load with `--finetune` (or `--no-load-optim
--no-load-rng`).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.architectures import Architecture, iter_rules
from lora_merge.architectures.base import HF_LAYER, MEGATRON_LAYER
from lora_merge.errors import MergeError
from lora_merge.layout import DUPLICATED_OR_COLUMN, Skip, VocabParallel, expected_shard_shape
from lora_merge.model_shape import ModelShape
from lora_merge.parallel_layout import ParallelLayout, RankFile
from lora_merge.placement import Segment, hf_segments
from lora_merge.readers.experts import is_expert_name
from lora_merge.writers.torch_zip import TensorSlot, TorchArchive, pwrite_all

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
FILE_NAME = "model_optim_rng.pt"


@dataclass
class _File:
    rank: RankFile
    path: Path
    chunks: list  # per model chunk: OrderedDict local name -> TensorSlot
    archive: TorchArchive | None = None
    fd: int | None = None


@dataclass
class _Target:
    """One TP shard of a Megatron parameter in one file: where its bytes go and how many are still due."""

    file: _File
    slot: TensorSlot
    row_bytes: int
    due: int
    offset: int = 0  # absolute file offset of the shard's data, once planned


@dataclass
class _Block:
    """One expert's shard inside a GroupedMLP tensor (`weight1` [H, E·2F], `weight2` [E·F, H], expert-major,
    each expert's block its shard transposed, in→out): its rows are gathered here, then written transposed."""

    grouped: _Target  # the whole weight1/weight2 of that file
    start: int  # byte offset of this expert's block in it
    buffer: torch.Tensor | None
    due: int

    @property
    def file(self) -> _File:
        return self.grouped.file


@dataclass
class _Destination:
    segment: Segment
    targets: dict  # TP rank -> [_Target] (the same shard in every file holding it)


@dataclass
class _HfTensor:
    destinations: list[_Destination] = field(default_factory=list)
    next_row: int = 0


class MegatronLegacyWriter:
    """`write(hf_name, rows, then)` in each HF tensor's row order (tensors in any order), then `finish()`."""

    def __init__(self, arch: Architecture, shape: ModelShape, layout: ParallelLayout, dtypes: dict, args,
                 padded_vocab: int, grouped_experts: bool = False):
        self.layout, self.shape, self.args, self.grouped_experts = layout, shape, args, grouped_experts
        self._grouped: dict = {}  # (file, chunk, name) -> the _Target of a GroupedMLP weight1/weight2
        self.out: Path | None = None
        files = {f: _File(f, Path(RELEASE, f.dir_name(layout), FILE_NAME), [OrderedDict() for _ in range(layout.vpp)])
                 for f in layout.rank_files()}
        self.files = list(files.values())
        self.hf: dict[str, _HfTensor] = {}
        self.targets: list[_Target] = []
        self.linears: set[str] = set()  # local module names of Megatron's parallel linears (they carry _extra_state)
        homes = layout.layer_homes(shape.num_layers)
        last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
        for rule, names, hf_prefix in iter_rules(arch, shape):
            if isinstance(rule, Skip):
                continue
            name = names[0]
            if hf_prefix:  # a decoder layer's parameter: its stage, chunk and local number
                layer = int(hf_prefix.split(".")[2])  # HF_LAYER: model.layers.{i}.
                stage, chunk, local = homes[layer]
                local_name = MEGATRON_LAYER.format(i=local) + name[len(MEGATRON_LAYER.format(i=layer)):]
            elif name.startswith("embedding."):
                stage, chunk, local_name = 0, 0, name
            else:
                stage, chunk, local_name = last_stage, last_chunk, name
            expert, block = is_expert_name(name), None
            if expert:
                e = int(name.split(".mlp.experts.")[1].split(".")[0])
                ep_rank, k = layout.expert_home(e, shape.moe.num_experts)
                if grouped_experts:  # mlp.experts.{e}.linear_fc1.weight -> mlp.experts.weight1, block k
                    fc = local_name.split(".mlp.experts.")[1].split(".")[1]
                    block = k
                    local_name = local_name.split(".mlp.experts.")[0] + ".mlp.experts.weight" + fc[-1]
                else:
                    local_name = local_name.replace(f".mlp.experts.{e}.", f".mlp.experts.local_experts.{k}.")
            tp = layout.etp if expert else layout.tp
            self._place(rule, hf_prefix, name, local_name, tp, dtypes, padded_vocab,
                        [f for f in self.files if f.rank.pp == stage and (not expert or f.rank.ep == ep_rank)], chunk,
                        block)
            if isinstance(rule, VocabParallel) and name.startswith("embedding.") and shape.tied and (
                    layout.pp > 1 or layout.vpp > 1):
                # the last stage keeps its own copy of a tied embedding as output_layer (Megatron synchronises
                # them at start-up); it must be there for a strict load
                self._place(rule, hf_prefix, name, "output_layer.weight", tp, dtypes, padded_vocab,
                            [f for f in self.files if f.rank.pp == last_stage], last_chunk)
        for f in self.files:
            f.chunks = [_with_extra_state(chunk, self.linears) for chunk in f.chunks]
            models = {"model": f.chunks[0]} if layout.vpp == 1 else {f"model{v}": c for v, c in enumerate(f.chunks)}
            f.archive = TorchArchive({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, **models},
                                     name=FILE_NAME.removesuffix(".pt"))

    def _place(self, rule, hf_prefix, name, local_name, tp, dtypes, padded_vocab, files, chunk, block=None) -> None:
        if not files:
            raise MergeError(f"{name}: no rank file of the target layout holds it (layout error)")
        parallel = "column" if rule.parallel == DUPLICATED_OR_COLUMN else rule.parallel
        if isinstance(rule, VocabParallel):
            shard_shapes = [(padded_vocab // tp, self.shape.hidden)] * tp
        else:
            shard_shapes = [expected_shard_shape(parallel, rule.global_shape(self.shape), tp,
                                                 f"{name} at the target layout {self.layout}")] * tp
        dtype = {dtypes[hf_prefix + n] for n in rule.hf_names()}
        if len(dtype) != 1:
            raise MergeError(f"{name}: its HF tensors come in different dtypes ({sorted(map(str, dtype))})")
        dtype = dtype.pop()
        if rule.parallel != "replicated" and not local_name.startswith("embedding.") and block is None:
            self.linears.add(local_name.rsplit(".", 1)[0])
        shard_targets: dict[int, list[_Target]] = {}
        for f in files:
            rank = f.rank.etp if tp != self.layout.tp else f.rank.tp
            shape = shard_shapes[rank]
            if block is not None:
                target = self._expert_block(f, chunk, local_name, shape, dtype, block)
                shard_targets.setdefault(rank, []).append(target)
                self.targets.append(target)
                continue
            slot = TensorSlot(tuple(shape), dtype)
            if local_name in f.chunks[chunk]:
                raise MergeError(f"{local_name}: planned twice in {f.path.parent.name} (layout error)")
            f.chunks[chunk][local_name] = slot
            row_bytes = slot.nbytes // shape[0] if shape[0] else 0
            target = _Target(f, slot, row_bytes, slot.nbytes)
            shard_targets.setdefault(rank, []).append(target)
            self.targets.append(target)
        for hf_name, segments in hf_segments(rule, self.shape, shard_shapes, name).items():
            entry = self.hf.setdefault(hf_prefix + hf_name, _HfTensor())
            for seg in segments:
                ranks = range(tp) if seg.rank is None else [seg.rank]
                entry.destinations.append(_Destination(seg, {r: shard_targets.get(r, []) for r in ranks}))
        if isinstance(rule, VocabParallel):  # padding rows past the vocabulary stay zero: not due
            for rank, targets in shard_targets.items():
                real = max(0, min(self.shape.vocab - rank * shard_shapes[0][0], shard_shapes[0][0]))
                for t in targets:
                    t.due = real * t.row_bytes

    def _expert_block(self, f: _File, chunk: int, name: str, shard: tuple, dtype, k: int) -> _Block:
        """Expert k's block of a file's GroupedMLP weight1/weight2 (planned with the first expert met)."""
        local = self.shape.moe.num_experts // self.layout.ep
        rows, cols = shard  # the Megatron shard [out, in]; the block holds it transposed
        key = (id(f), chunk, name)
        grouped = self._grouped.get(key)
        if grouped is None:
            whole = (cols, local * rows) if name.endswith("weight1") else (local * cols, rows)
            slot = TensorSlot(whole, dtype)
            f.chunks[chunk][name] = slot
            grouped = self._grouped[key] = _Target(f, slot, 0, slot.nbytes)
            self.targets.append(grouped)
        nbytes = rows * cols * dtype.itemsize
        return _Block(grouped, k * nbytes, None, nbytes)

    # --- writing ------------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(f.archive.size for f in self.files)

    def start(self, out: Path) -> None:
        """Create every rank file in `out` at its final size with its frame; data spans are zero until written."""
        self.out = Path(out)
        (self.out / RELEASE).mkdir()
        for f in self.files:
            (self.out / f.path).parent.mkdir()
            f.fd = os.open(self.out / f.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            os.ftruncate(f.fd, f.archive.size)
            f.archive.write_frame(f.fd, 0)
        for t in self.targets:
            if isinstance(t, _Block):
                continue
            t.offset = t.file.archive.data_offset(t.slot)
            if t.due == 0:
                t.file.archive.finish_member(t.file.fd, 0, t.slot)

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
            data = piece.contiguous().view(torch.uint8).numpy()
            for targets in dest.targets.values():
                for t in targets:
                    if isinstance(t, _Block):
                        self._gather(t, piece, seg.shard_start + lo - seg.hf_start)
                        continue
                    pwrite_all(t.file.fd, data, t.offset + (seg.shard_start + lo - seg.hf_start) * t.row_bytes)
                    t.due -= data.nbytes
                    if t.due == 0:
                        t.file.archive.finish_member(t.file.fd, 0, t.slot)
                    elif t.due < 0:
                        raise MergeError(f"{name}: rows written twice into {self.out / t.file.path} (plan error)")
        entry.next_row = stop
        if then is not None:
            then()

    def _gather(self, block: _Block, piece: torch.Tensor, row: int) -> None:
        if block.buffer is None:
            rows = block.due // (piece.shape[1] * piece.element_size())
            block.buffer = torch.empty((rows, piece.shape[1]), dtype=piece.dtype)
        block.buffer[row: row + piece.shape[0]] = piece
        block.due -= piece.numel() * piece.element_size()
        if block.due == 0:
            data = block.buffer.t().contiguous().view(torch.uint8).numpy()
            grouped = block.grouped
            pwrite_all(grouped.file.fd, data, grouped.offset + block.start)
            grouped.due -= data.nbytes
            block.buffer = None
            if grouped.due == 0:
                grouped.file.archive.finish_member(grouped.file.fd, 0, grouped.slot)

    def finish(self) -> list[str]:
        unwritten = [t for t in self.targets if t.due]
        if unwritten:
            raise MergeError(f"{self.out / unwritten[0].file.path}: {len(unwritten)} tensor shard(s) not completely written "
                             "(plan error); nothing published")
        for f in self.files:
            f.archive.finish(f.fd, 0)
            os.fsync(f.fd)
            os.close(f.fd)
            f.fd = None
        with open(self.out / TRACKER, "x") as tracker:
            tracker.write(RELEASE)
        return [TRACKER] + [str(f.path) for f in self.files]

    def abort(self) -> None:
        for f in self.files:
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None


# The order in which Megatron-Core's modules register their parameters (and so state_dict's order), within
# a decoder layer: attention's output projection comes before its input projections.
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.linear_q_proj.", "self_attention.linear_q_down_proj.",
                "self_attention.linear_q_up_proj.", "self_attention.linear_kv_down_proj.",
                "self_attention.linear_kv_up_proj.", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                "self_attention.kv_layernorm.", "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.",
                "mlp.router.", "mlp.experts.", "mlp.shared_experts.gate_weight", "mlp.shared_experts.")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.)?")


def _megatron_order(name: str):
    if not name.startswith("decoder.layers."):
        return (0 if name.startswith("embedding.") else 2 if name.startswith("output_layer.") else 1.5,) + (0,) * 3
    _, _, layer, rest = name.split(".", 3)
    place = next(i for i, prefix in enumerate(_LAYER_ORDER + ("",)) if rest.startswith(prefix))
    expert = _EXPERT.match(rest)
    return (1, int(layer), place, int(expert.group(1)) if expert and expert.group(1) else 0)


def _with_extra_state(chunk: OrderedDict, linears: set[str]) -> OrderedDict:
    """The chunk in Megatron's state_dict order, with the `_extra_state` of None that Megatron-Core's parallel
    linears (local spec) save after their parameters (TransformerEngine keeps FP8 metadata there); a strict
    load expects the key."""
    out, names = OrderedDict(), sorted(chunk, key=_megatron_order)  # stable: a module's own order is kept
    for i, name in enumerate(names):
        out[name] = chunk[name]
        module = name.rsplit(".", 1)[0]
        following = names[i + 1].rsplit(".", 1)[0] if i + 1 < len(names) else None
        if module in linears and following != module:
            out[module + "._extra_state"] = None
    return out
