"""A Megatron legacy ("torch" format) checkpoint at any layout, written from HF tensors as they stream.

    release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   {args, checkpoint_version: 3.0, iteration: 0,
    latest_checkpointed_iteration.txt ("release")         model | model0, model1, … (virtual pipeline chunks)}

Every rank file is planned from shapes before any data exists (files/torch_zip), so each HF row piece goes
straight to its places: `placement` says which TP shard rows it becomes, the layout which file and model
chunk holds that shard (layers by stage and chunk, experts by EP rank, numbered locally as Megatron numbers
them). Names are Megatron-Core's local spec (what MindSpeed-LLM builds on Ascend, and what a
`--transformer-impl local` run builds: norms as their own modules, an `_extra_state` of None for each parallel
linear), or with `args.transformer_impl` "transformer_engine" the TE spec's (model/te_spec.py: norms fused into
the next linear, an `_extra_state` for every TE module, TEGroupedMLP's `linear_fc1.weight{k}` for grouped experts).
Vocabulary padding rows are zero. No optimizer or RNG state: load with `--finetune` (or `--no-load-optim
--no-load-rng`).
"""

from __future__ import annotations

import re
from functools import partial
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path


from lora_merge.model.architectures import Architecture, iter_rules
from lora_merge.model.architectures.base import MEGATRON_LAYER
from lora_merge.errors import MergeError
from lora_merge.model.layout import ExpertSlab, SharedCopy, Skip, VocabParallel
from lora_merge.model.mtp import megatron_name as mtp_megatron_name
from lora_merge.model import te_spec
from lora_merge.model.model_shape import ModelShape
from lora_merge.model.parallel_layout import ParallelLayout, RankFile
from lora_merge.readers.experts import is_expert_name
from lora_merge.writers.row_scatter import Block, RowScatter, Target, target_shard_shapes, tensor_dtype
from lora_merge.files.output_file import ALIGN, HashedFile, OutputFile
from lora_merge.files.torch_zip import ArchiveStream, TensorSlot, TorchArchive

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
FILE_NAME = "model_optim_rng.pt"
STREAM_BUFFER_BYTES = 32 << 20  # write buffers of all rank files together (each file has 4 of its share)


@dataclass
class _File:
    rank: RankFile
    path: Path
    chunks: list  # per model chunk: OrderedDict local name -> TensorSlot
    archive: TorchArchive | None = None
    stream: ArchiveStream | None = None


class MegatronLegacyWriter(RowScatter):
    """`start(dir)`, then `write(hf_name, rows, then)` in each HF tensor's row order (tensors in any order),
    then `finish()` (or `abort()`)."""

    def __init__(self, arch: Architecture, shape: ModelShape, layout: ParallelLayout, dtypes: dict, args,
                 padded_vocab: int, grouped_experts: bool = False, fused_mla: bool = False):
        super().__init__(shape)
        self.layout, self.args, self.grouped_experts = layout, args, grouped_experts
        self._grouped: dict = {}  # (file, chunk, name) -> the Target of a GroupedMLP weight1/weight2
        self._slots: dict = {}  # id(Target) -> (file, slot)
        self.part = None  # the files of a `--part` (write_only), or None for all
        self.out: Path | None = None
        files = {f: _File(f, Path(RELEASE, f.dir_name(layout), FILE_NAME), [OrderedDict() for _ in range(layout.vpp)])
                 for f in layout.rank_files()}
        self.files = list(files.values())
        # local module names of the modules that carry an _extra_state with parameters: Megatron's parallel
        # linears, and with TransformerEngine every TE module
        self.linears: set[str] = set()
        self.te = getattr(args, "transformer_impl", te_spec.LOCAL) == te_spec.TRANSFORMER_ENGINE
        moe_layers = set(shape.moe.layers) if shape.moe is not None else set()
        homes = layout.layer_homes(shape.num_layers)
        last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
        # MindSpeed-LLM's MLA ("pack_mla"): the two down-projections as one replicated linear_qkv
        fused = (lambda n: n.endswith(".self_attention.linear_qkv.weight")) if fused_mla else None
        for rule, names, hf_prefix in iter_rules(arch, shape, fused):
            if isinstance(rule, (Skip, SharedCopy)):
                continue
            if self.te:
                rule = te_spec.placed_rule(rule)
            name = names[0]
            layer = int(hf_prefix.split(".")[2]) if hf_prefix else None  # HF_LAYER: model.layers.{i}.
            if layer is not None and layer >= shape.num_layers:  # an MTP layer: the last stage's last chunk
                stage, chunk, local_name = last_stage, last_chunk, mtp_megatron_name(name, shape.num_layers)
            elif layer is not None:  # a decoder layer's parameter: its stage, chunk and local number
                stage, chunk, local = homes[layer]
                local_name = MEGATRON_LAYER.format(i=local) + name[len(MEGATRON_LAYER.format(i=layer)):]
            elif name.startswith("embedding."):
                stage, chunk, local_name = 0, 0, name
            else:
                stage, chunk, local_name = last_stage, last_chunk, name
            if self.te and layer is not None:  # (an MTP layer is built with the last decoder layer's spec)
                local_name = te_spec.te_name(local_name, mla=shape.mla is not None,
                                             moe=min(layer, shape.num_layers - 1) in moe_layers)
            expert, block = is_expert_name(name), None
            if expert:
                e = int(name.split(".mlp.experts.")[1].split(".")[0])
                ep_rank, k = layout.expert_home(e, shape.moe.num_experts)
                if grouped_experts and isinstance(rule, ExpertSlab):  # (refused with its reason by check_target)
                    raise MergeError(f"{name}: a stacked expert tensor is not written as GroupedMLP (layout error)")
                if grouped_experts and self.te:  # TEGroupedMLP: mlp.experts.{e}.linear_fc1.weight -> linear_fc1.weight{k}
                    head, tail = local_name.split(f".mlp.experts.{e}.")
                    module, what = tail.rsplit(".", 1)
                    local_name = f"{head}.mlp.experts.{module}.{what}{k}"
                    self.linears.add(f"{head}.mlp.experts.{module}")
                elif grouped_experts:  # mlp.experts.{e}.linear_fc1.weight -> mlp.experts.weight1, block k
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
            if isinstance(rule, VocabParallel) and name.startswith("embedding.") and shape.mtp_in_source and (
                    layout.pp > 1 or layout.vpp > 1):
                # the MTP layers' chunk keeps its own copy of the embedding (Megatron-Core ties it to the first
                # stage's); a strict load expects it
                self._place(rule, hf_prefix, name, name, tp, dtypes, padded_vocab,
                            [f for f in self.files if f.rank.pp == last_stage], last_chunk)
        for t in self.targets:
            if not isinstance(t, Block):
                t.padding = self._slots[id(t)][1].nbytes - t.due  # the vocabulary padding rows: zero
        order = self._stream_order(list(dtypes))
        for f in self.files:
            f.chunks = [_with_extra_state(chunk, self.linears, self.te) for chunk in f.chunks]
            if shape.tied and f.rank.pp == last_stage:
                # With tied embeddings the output layer of a stage holding the embedding has no weight of its
                # own, but it is a parallel linear: Megatron saves its _extra_state, and a strict load expects it
                f.chunks[last_chunk].setdefault("output_layer._extra_state", None)
            models = {"model": f.chunks[0]} if layout.vpp == 1 else {f"model{v}": c for v, c in enumerate(f.chunks)}
            f.archive = TorchArchive({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, **models},
                                     name=FILE_NAME.removesuffix(".pt"), order=order[id(f)])

    def _stream_order(self, plan_order: list[str]) -> dict[int, list[TensorSlot]]:
        """Each file's tensors in the order their bytes arrive, so that it is written front to back."""
        order, unreached = self.stream_order(plan_order, lambda t: id(self._slots[id(t)][0]))
        self._unreached = {id(f): unreached.get(id(f), []) for f in self.files}
        return {id(f): [self._slots[id(t)][1] for t in order.get(id(f), []) + unreached.get(id(f), [])]
                for f in self.files}

    def _place(self, rule, hf_prefix, name, local_name, tp, dtypes, padded_vocab, files, chunk, block=None) -> None:
        if not files:
            raise MergeError(f"{name}: no rank file of the target layout holds it (layout error)")
        shard_shapes = target_shard_shapes(rule, self.shape, tp, padded_vocab, f"{name} at the target layout {self.layout}")
        dtype = tensor_dtype(rule, hf_prefix, dtypes, name)
        if (rule.parallel != "replicated" or rule.instead_of) and not local_name.startswith("embedding.") \
                and block is None and local_name.endswith(".weight"):
            # (MindSpeed's fused MLA linear_qkv is a parallel linear, whole on every rank; a linear has a weight: a
            # split parameter without one, gpt-oss's core_attention.softmax_offset, is no linear's)
            self.linears.add(local_name.rsplit(".", 1)[0])
        module = local_name.rsplit(".", 1)[0]
        if self.te and block is None and (te_spec.is_norm_module(module) or te_spec.is_linear_module(module)):
            self.linears.add(module)  # a TENorm, or a TE linear (MLA's duplicated down-projections too)
        by_rank: dict[int, list] = {}
        for f in files:
            rank = f.rank.etp if tp != self.layout.tp else f.rank.tp
            shape = shard_shapes[rank]
            if block is not None:
                by_rank.setdefault(rank, []).append(self._expert_block(f, chunk, local_name, shape, dtype, block))
                continue
            if local_name in f.chunks[chunk]:
                raise MergeError(f"{local_name}: planned twice in {f.path.parent.name} (layout error)")
            by_rank.setdefault(rank, []).append(self._tensor(f, chunk, local_name, tuple(shape), dtype))
        self.route(rule, hf_prefix, name, shard_shapes, by_rank)

    def _tensor(self, f: _File, chunk: int, name: str, shape: tuple, dtype) -> Target:
        slot = TensorSlot(shape, dtype)
        f.chunks[chunk][name] = slot
        target = Target(slot.nbytes // shape[0] if shape and shape[0] else 0, slot.nbytes)
        self._slots[id(target)] = (f, slot)
        return target

    def _expert_block(self, f: _File, chunk: int, name: str, shard: tuple, dtype, k: int) -> Block:
        """Expert k's block of a file's GroupedMLP weight1/weight2 (planned with the first expert met)."""
        local = self.shape.moe.num_experts // self.layout.ep
        rows, cols = shard  # the Megatron shard [out, in]; the block holds it transposed
        key = (id(f), chunk, name)
        grouped = self._grouped.get(key)
        if grouped is None:
            whole = (cols, local * rows) if name.endswith("weight1") else (local * cols, rows)
            grouped = self._grouped[key] = self._tensor(f, chunk, name, whole, dtype)
            self.targets.append(grouped)
        nbytes = rows * cols * dtype.itemsize
        return Block(grouped, k, nbytes, cols * dtype.itemsize)

    # --- writing ------------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(f.archive.size for f in self.files)

    # --- a part of the files (`--part`) -----------------------------------------------------------------

    def file_names(self) -> list[str]:
        """The rank files, as paths relative to the checkpoint dir (the tracker file aside)."""
        return [str(f.path) for f in self.files]

    def file_sizes(self) -> list[int]:
        return [f.archive.size for f in self.files]

    def tracker_text(self) -> str:
        return RELEASE

    def files_of(self, hf_name: str) -> set[int]:
        """The rank files (by index) that rows of this HF tensor go to."""
        index = {id(f): i for i, f in enumerate(self.files)}
        return {index[id(self._slots[id(t.grouped if isinstance(t, Block) else t)][0])]
                for dest in self.hf[hf_name].destinations for targets in dest.targets.values() for t in targets}

    def write_only(self, part) -> None:
        """Write the rank files `part.files` (indices) only, each under `part.temporary(name)`, renamed into place
        and reported to `part.written(name, sha256)` once complete; rows bound for the others are dropped."""
        self.part = part
        own = {id(self.files[i]) for i in part.files}
        for t in self.targets:
            if id(self._slots[id(t.grouped if isinstance(t, Block) else t)][0]) not in own:
                self.ignored.add(id(t))

    def _own(self) -> list[_File]:
        return self.files if self.part is None else [self.files[i] for i in sorted(self.part.files)]

    def _path(self, f: _File) -> Path:
        return self.out / (f.path if self.part is None else self.part.temporary(str(f.path)))

    # --- writing ------------------------------------------------------------------------------------

    def start(self, out: Path) -> None:
        """Open every rank file for writing front to back (O_DIRECT where the file system allows)."""
        self.out = Path(out)
        (self.out / RELEASE).mkdir(exist_ok=self.part is not None)  # parts share one directory
        own = self._own()
        buffer = max(1 << 20, STREAM_BUFFER_BYTES // max(1, len(own))) // ALIGN * ALIGN
        for f in own:
            (self.out / f.path).parent.mkdir(exist_ok=self.part is not None)
            file = OutputFile(self._path(f), buffer)
            f.stream = ArchiveStream(f.archive, file if self.part is None else HashedFile(file))
        for t in self.targets:
            if not isinstance(t, Block) and id(t) not in self.ignored:
                f, slot = self._slots[id(t)]
                t.append = partial(f.stream.append, slot)

    def finish(self) -> list[str]:
        self.check_complete(self.out)
        for f in self._own():
            for t in self._unreached[id(f)]:
                self._complete(t)
            f.stream.close()
        if self.part is not None:  # the tracker file is written once every part's files are (`lora-merge finish`)
            for f in self._own():
                self.part.written(str(f.path), f.stream.out.sha256.hexdigest())
            return [str(f.path) for f in self._own()]
        with open(self.out / TRACKER, "x") as tracker:
            tracker.write(RELEASE)
        return [TRACKER] + [str(f.path) for f in self.files]

    def abort(self) -> None:
        for f in self.files:
            if f.stream is not None:
                f.stream.out.abort()
                if self.part is not None:  # not in a directory of its own that goes with the run
                    self._path(f).unlink(missing_ok=True)
                f.stream = None


# The order in which Megatron-Core's modules register their parameters (and so state_dict's order), within
# a decoder layer: attention's output projection comes before its input projections.
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.linear_q_proj.", "self_attention.linear_q_down_proj.",
                "self_attention.linear_q_up_proj.", "self_attention.linear_kv_down_proj.",
                "self_attention.linear_kv_up_proj.", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                "self_attention.kv_layernorm.", "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.",
                "mlp.router.", "mlp.experts.", "mlp.shared_experts.gate_weight", "mlp.shared_experts.")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.)?")


_MTP_ORDER = ("enorm.", "hnorm.", "eh_proj.", "transformer_layer.", "final_layernorm.")


def _megatron_order(name: str):
    """GPTModel registers embedding, decoder (layers, final norm), mtp (each layer: enorm, hnorm, eh_proj, its
    decoder layer, final norm), output_layer."""
    group, outer = 1, 0
    if name.startswith("mtp.layers."):
        group, (_, _, layer, rest) = 1.7, name.split(".", 3)
        outer = next(i for i, prefix in enumerate(_MTP_ORDER) if rest.startswith(prefix))
        rest = rest.removeprefix("transformer_layer.")
    elif name.startswith("decoder.layers."):
        _, _, layer, rest = name.split(".", 3)
    else:
        return (0 if name.startswith("embedding.") else 2 if name.startswith("output_layer.") else 1.5,) + (0,) * 4
    place = next(i for i, prefix in enumerate(_LAYER_ORDER + ("",)) if rest.startswith(prefix))
    expert = _EXPERT.match(rest)
    return (group, int(layer), outer, place, int(expert.group(1)) if expert and expert.group(1) else 0)


def _with_extra_state(chunk: OrderedDict, linears: set[str], te: bool = False) -> OrderedDict:
    """The chunk in Megatron's state_dict order, with the `_extra_state` of None that Megatron-Core's parallel
    linears (local spec) save after their parameters (TransformerEngine keeps FP8 metadata there); a strict
    load expects the key. With TransformerEngine (`te`) every attention's core attention has one too, parameters
    or not."""
    entries = dict(chunk)
    if te:
        modules = {name.rsplit(".", 1)[0] for name in chunk}
        for attention in {te_spec.core_attention(m) for m in modules} - {None}:
            if attention not in modules:  # (gpt-oss's has its softmax offset: then after it)
                entries[attention + "._extra_state"] = None
        linears = linears | {m for m in modules if m.endswith(".self_attention.core_attention")}
    out, names = OrderedDict(), sorted(entries, key=_megatron_order)  # stable: a module's own order is kept
    for i, name in enumerate(names):
        out[name] = entries[name]
        module = name.rsplit(".", 1)[0]
        following = names[i + 1].rsplit(".", 1)[0] if i + 1 < len(names) else None
        if module in linears and following != module:
            out[module + "._extra_state"] = None
    return out
