"""A Megatron-Core distributed checkpoint (`--ckpt-format torch_dist`) written in place: laid out as
`megatron.core.dist_checkpointing.save` (megatron-core 0.16.1, torch_dist backend, torch's FileSystemWriter)
lays out a TP=1 PP=1 EP=1 save, with every file and chunk planned from names and shapes before any data
exists, and the tensor bytes then written by the caller into their reserved spans, in any order, in
constant memory.

What the iteration dir holds (confirmed by saving small GPTModels with the real megatron-core on gloo):

- `metadata.json`: `{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
  "common_backend_version": 1}`; its presence is what makes Megatron-LM treat the dir as torch_dist.
- `common.pt`: a torch.save of the non-sharded state (`args`, `checkpoint_version` 3.0, `iteration`, …) and
  `content_metadata`, the flags the model's `sharded_state_dict` was built with, which Megatron-LM's load
  builds its own with (here `{"singleton_local_shards": False, "chained_optim_avoid_prefix": True}`).
- `.metadata`: a pickled `torch.distributed.checkpoint.metadata.Metadata`: each key's global shape, dtype and
  chunks (`TensorStorageMetadata`) or `BytesStorageMetadata`; `storage_data` maps each (key, chunk offsets)
  to (file, offset, length); `version` "1.0.0"; no `planner_data`.
- `__0_K.distcp`: each chunk a complete torch.save archive of the chunk tensor (member prefix `archive/`),
  each `_extra_state` a torch.save archive of `[None]` (what the local spec's linears hold).

Keys (megatron-core 0.16.1, local spec; `TransformerBlock.sharded_state_dict`):

- Homogeneous layers (`moe_layer_freq` an int equal to 1: every dense model, and MoE models whose every
  layer has experts): a layer's tensors are stacked, `decoder.layers.<rest>` of shape `[L, …]`, saved as
  one chunk per layer (`[1, …]` at offset `(layer, 0, …)`). Experts are `decoder.layers.mlp.experts.experts.
  linear_fc1.weight` `[L, E, 2F, H]`, one chunk per (layer, expert).
- Non-homogeneous layers (`moe_layer_freq` a list, as for a dense first layer, or an int > 1): per-layer keys
  `decoder.layers.<i>.<rest>` of the layer's own shape, one chunk each; experts `decoder.layers.<i>.mlp.
  experts.experts.linear_fc1.weight` `[E, 2F, H]`, one chunk per expert.
- The local spec's norm names are mapped to TransformerEngine's (`sharded_state_dict_keys_map`) except in
  multi-latent attention layers: `input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`,
  `pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_` (in MoE layers too).
- Every column/row-parallel linear (not the router, norms, embedding or output layer) has an `_extra_state`
  ShardedObject: `<module key>._extra_state/shard_<offsets>_<shape>`, offsets and shape being the layer
  (and expert) axes: `shard_3_4` (stacked layer 3 of 4), `shard_3.1_4.8` (stacked layer 3, expert 1 of
  8), `shard_1_8` (per-layer, expert 1), `shard_0_1` (per-layer, not an expert). Megatron's load requests
  them (with the default strictness a missing one fails the load), so they are written.
- `embedding.word_embeddings.weight` and `output_layer.weight` are the padded `[V_pad, H]`; a model with
  tied embeddings has no `output_layer.weight`.

One deliberate difference from Megatron's own save: Megatron's swiglu factory saves each fc1 (dense, shared
expert, expert) as two chunks, its gate rows and its up rows; here it is one chunk `[gate; up]`, so that the
whole tensor is one contiguous region. The torch_dist loader reads any chunk grid (it copies the overlap of
each saved chunk with each requested shard), and TP=2 loads are tested that way.

Files: every `_extra_state` archive first in `__0_0.distcp`, then the chunks in the order of the tensors given,
a new file once one holds `file_bytes`; each archive starts at a multiple of 64 bytes (its tensor data is
64-byte aligned within it), so the tensor data is 64-byte aligned in the file; the data spans are left as
holes for the caller. Megatron names its files `__<rank>_<thread>.distcp`; the loader only follows
`storage_data`. `done(name)` takes a tensor's CRC32 as soon as its bytes are written (`finish` does it for
the rest, reading them back).

What Megatron-LM's `load_checkpoint` needs (megatron-core 0.16.1 / Megatron-LM core_v0.16.1): the tracker
`latest_checkpointed_iteration.txt` beside the iteration dir (the caller's), `metadata.json`, and in
`common.pt` `args` (its TP/PP sizes decide whether RNG state is requested; `no_save_rng` / `no_save_optim`
True in them keep a plain resume from asking for the RNG or optimizer state this checkpoint lacks), and
`checkpoint_version` 3.0. No optimizer, scheduler or RNG state is written: load with `--finetune`, or with
`--no-load-optim --no-load-rng`, or from a `release` dir, or with `no_save_optim`/`no_save_rng` set in the
saved args.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import threading
import uuid
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from lora_merge.model import te_spec
from lora_merge.model.mtp import OWN as MTP_OWN, args_mtp_layers
from lora_merge.errors import MergeError
from lora_merge.model.moe_shape import megatron_moe_layers
from lora_merge.files.output_file import ALIGN as ALIGN_DIRECT, HashedFile, OutputFile
from lora_merge.files.torch_zip import ArchiveStream, TensorSlot, TorchArchive, pwrite_all
from lora_merge.writers.megatron_legacy import RELEASE
from lora_merge.writers.row_scatter import RowScatter, Target, target_shard_shapes, tensor_dtype

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # torch < 2.6 wrote no version
    CURRENT_DCP_VERSION = "1.0.0"

METADATA = ".metadata"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
# megatron.core.dist_checkpointing's CheckpointingConfig of a torch_dist save, as its json.dump writes it
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                        "common_backend_version": 1}
# Megatron-LM's _build_sharded_state_dict_metadata without a distributed optimizer: the key layout written here
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
FILE_BYTES = 4 << 30  # a new .distcp file once one holds this much (Megatron writes two per rank)
ALIGN = 64  # each archive starts at a multiple of this in its file (gaps are allowed: storage_data says where)

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
# The local spec's TransformerLayer keys map (get_gpt_layer_local_spec, not for MLA layers)
NORM_KEYS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
# Modules that are Megatron ColumnParallelLinear / RowParallelLinear in the local spec: each has an _extra_state
LINEARS = frozenset({"self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_q_proj",
                     "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                     "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj",
                     "mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1",
                     "mlp.shared_experts.linear_fc2"})
EXPERT_LINEARS = frozenset({"linear_fc1", "linear_fc2"})
MLA_MODULES = ("self_attention.linear_q_proj.", "self_attention.linear_q_down_proj.", "self_attention.linear_q_up_proj.",
               "self_attention.linear_kv_down_proj.", "self_attention.linear_kv_up_proj.", "self_attention.kv_layernorm.")
# TransformerEngine fuses norms into the next linear; the same tensors under the local spec's names
TE_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
            ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
            ("self_attention.linear_q_up_proj.layer_norm_", "self_attention.q_layernorm."),
            ("self_attention.linear_kv_up_proj.layer_norm_", "self_attention.kv_layernorm."))


@dataclass(frozen=True)
class DistTensor:
    """One tensor to write: its canonical global Megatron name (`decoder.layers.{i}.…` with the global layer
    number, `….mlp.experts.{e}.…` with the global expert number, norms as `input_layernorm` /
    `pre_mlp_layernorm`), its full TP=1 shape and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DistModelFacts:
    """What the key naming needs beyond the tensors' names.

    per_layer_keys: Megatron's non-homogeneous layers (`moe_layer_freq` a list or an int > 1): keys per
    layer instead of stacked `decoder.layers.*` tensors. `moe_layers`: the layers with routed experts.
    `multi_latent_attention`: MLA layers keep their norm names. Only the local spec (`--transformer-impl
    local`) is laid out: TransformerEngine adds `_extra_state` entries (core attention) and names MLA
    and MoE norms differently."""

    num_layers: int
    moe_layers: frozenset[int] = frozenset()
    num_experts: int = 0
    per_layer_keys: bool = False
    multi_latent_attention: bool = False
    transformer_impl: str = "local"
    mtp_layers: int = 0  # Megatron-Core's MTP layers: per-layer keys mtp.layers.{k}.… (model/mtp.py)

    @classmethod
    def from_args(cls, args) -> "DistModelFacts":
        """The facts of a Megatron-LM training run, from its args (as saved in a checkpoint)."""
        impl = getattr(args, "transformer_impl", "local") or "local"
        for name in ("heterogeneous_layers_config_path", "linear_attention_freq"):
            if getattr(args, name, None):
                raise MergeError(f"writing a torch_dist checkpoint: args.{name} is set; layers of that kind are not "
                                 "laid out by this writer")
        num_layers = int(args.num_layers)
        num_experts = int(getattr(args, "num_experts", None) or 0)
        # which layers have experts: the one reading of the args every reader uses; keyed per layer as
        # megatron-core keys them (TransformerBlock.sharded_state_dict: moe_layer_freq a list, or an int > 1)
        moe = megatron_moe_layers(args, num_layers, "writing a torch_dist checkpoint")
        freq = getattr(args, "moe_layer_freq", None)
        per_layer = not (freq is None or (isinstance(freq, int) and freq <= 1))
        mtp = args_mtp_layers(args)  # built with the last decoder layer's spec
        if mtp and num_experts and num_layers - 1 in moe:
            moe = set(moe) | set(range(num_layers, num_layers + mtp))
        return cls(num_layers, frozenset(moe) if num_experts else frozenset(), num_experts, per_layer,
                   bool(getattr(args, "multi_latent_attention", False)), impl, mtp)


@dataclass
class _Key:
    """One sharded key of the checkpoint: a global tensor and its chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list = field(default_factory=list)  # _Chunk


@dataclass
class _Frame:
    """The archive of a chunk of some shape and dtype: chunks alike share it (its frame is a function of the
    file offset; the CRC32 of the one tensor member is taken and written for each chunk, under the lock)."""

    archive: TorchArchive
    slot: TensorSlot | None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Chunk:
    name: str | None  # the caller's name for the tensor (None for an _extra_state entry)
    key: str
    offsets: tuple[int, ...] | None  # None: a bytes entry
    frame: _Frame
    file: int = 0
    base: int = 0
    done: bool = False  # its CRC32 is written

    @property
    def size(self) -> int:
        return self.frame.archive.size


class DistCheckpointWriter:
    """Plans and frames a torch_dist checkpoint in `iter_dir` (created if missing; no file of it may exist).

    After construction, `region(name)` gives where tensor `name`'s bytes go (C order, its shape, its dtype);
    once every byte is written, `finish()` fills in the CRC32s and writes `.metadata`, `common.pt` and
    `metadata.json`, all flushed. `abort()` removes what was created. `common` is the non-sharded state
    (`args`, `iteration`, …); `checkpoint_version` 3.0 and the content metadata are added when missing."""

    def __init__(self, iter_dir: Path, tensors: list[DistTensor], common: dict, model: DistModelFacts,
                 file_bytes: int = FILE_BYTES, streamed: bool = False, opened: bool = True):
        """`streamed`: the files are written front to back (O_DIRECT where allowed) by `append(name, bytes)`,
        the tensors' bytes in the order `tensors` lists them, instead of pwritten into `region`s. `opened=False`:
        planned only, until `open(iter_dir, part)` (streamed)."""
        self.streamed = streamed
        self.part = None  # the files of a `--part` (`open`), or None for all
        self._sequences: list[_Sequence] = []
        self.iter_dir = Path(iter_dir)
        self.model = model
        self.common = self._common(common)
        self._fds: list[int] = []
        self._created: list[Path] = []
        self._made_dir = False
        self._finished = False
        self.keys: dict[str, _Key] = {}
        self.extra: dict[str, _Chunk] = {}  # "<module>._extra_state/shard_…" -> its archive
        self._by_name: dict[str, _Chunk] = {}
        self._frames: dict[tuple, _Frame] = {}
        self._extra_frame = _Frame(TorchArchive([None]), None)  # every _extra_state entry: the same bytes
        if model.transformer_impl not in te_spec.IMPLS:
            raise MergeError(f"writing a torch_dist checkpoint for transformer_impl {model.transformer_impl!r}: "
                             f"expected one of {', '.join(te_spec.IMPLS)}")
        self._plan(tensors)
        self.files = self._place(file_bytes)
        if opened:
            self.open(self.iter_dir)

    def open(self, iter_dir: Path, part=None) -> None:
        """Create the files in `iter_dir`; with `part` (streamed only) those of `part.files` only, indices into
        `all_files()`, each under `part.temporary(name)` and reported to `part.written(name, sha256)` once
        complete (names relative to iter_dir's parent, as `release/__0_0.distcp`)."""
        self.iter_dir, self.part = Path(iter_dir), part
        try:
            self._open_and_frame()
        except BaseException:
            self.abort()
            raise

    SMALL = (COMMON, METADATA, METADATA_JSON)  # written by finish(), in this order

    def all_files(self) -> list[tuple[str, int]]:
        """(name, size) of every file: the .distcp files, then the small ones."""
        sizes = [0] * len(self.files)
        for chunk in [*self.extra.values(), *self._by_name.values()]:
            sizes[chunk.file] = max(sizes[chunk.file], chunk.base + chunk.size)
        return [*zip(self.files, sizes), *((name, len(data)) for name, data in zip(self.SMALL, self._small_bytes()))]

    def _small_bytes(self) -> list[bytes]:
        return [self._common_bytes(), pickle.dumps(self.metadata()), json.dumps(CHECKPOINTING_CONFIG).encode()]

    def _own(self, index: int) -> bool:
        return self.part is None or index in self.part.files

    def _path(self, name: str) -> Path:
        if self.part is None:
            return self.iter_dir / name
        return self.iter_dir.parent / self.part.temporary(f"{self.iter_dir.name}/{name}")

    # --- planning ------------------------------------------------------------------------------------

    def _common(self, common: dict) -> dict:
        if not isinstance(common, dict):
            raise TypeError("common must be a dict")
        common = dict(common)
        given = common.get("content_metadata")
        if given is not None and any(given.get(k, v) != v for k, v in CONTENT_METADATA.items()):
            raise MergeError(f"writing a torch_dist checkpoint: content_metadata {given!r:.200} describes another key "
                             f"layout than the one written ({CONTENT_METADATA})")
        common["content_metadata"] = {**(given or {}), **CONTENT_METADATA}
        common.setdefault("checkpoint_version", 3.0)
        for sharded in ("model", "optimizer", "rng_state"):
            if sharded in common:
                raise MergeError(f"writing a torch_dist checkpoint: common state holds '{sharded}', which is "
                                 "sharded state")
        return common

    def _plan(self, tensors: list[DistTensor]) -> None:
        seen: dict[str, str] = {}
        layer_sets: dict[int, dict[str, tuple]] = {}
        experts: dict[tuple[int, str], set[int]] = {}
        for t in tensors:
            shape, dtype = tuple(int(d) for d in t.shape), t.dtype
            if not isinstance(dtype, torch.dtype) or any(d < 0 for d in shape):
                raise MergeError(f"writing a torch_dist checkpoint: {t.name} has shape {list(t.shape)} dtype {dtype}")
            layer, rest = self._split(t.name)
            key, gshape, offsets, extra = self._locate(t.name, layer, rest, shape)
            canon = f"{layer}:{rest}" if layer is not None else rest
            if canon in seen:
                raise MergeError(f"writing a torch_dist checkpoint: {t.name} given twice (also as {seen[canon]})")
            seen[canon] = t.name
            if layer is not None:
                layer_sets.setdefault(layer, {})[self._stack_name(rest)] = (shape, dtype)
                if (e := EXPERT.match(rest)) is not None:
                    experts.setdefault((layer, e.group(2)), set()).add(int(e.group(1)))
            entry = self.keys.get(key)
            if entry is None:
                entry = self.keys[key] = _Key(key, gshape, dtype)
            elif entry.shape != gshape or entry.dtype != dtype:
                raise MergeError(f"writing a torch_dist checkpoint: {t.name} is {list(shape)} {dtype}, but the other "
                                 f"tensors stacked in {key} make it {list(entry.shape)} {entry.dtype}")
            sizes = tuple(1 for _ in range(len(gshape) - len(shape))) + shape
            frame = self._frames.get((sizes, dtype))
            if frame is None:
                slot = TensorSlot(sizes, dtype)
                frame = self._frames[(sizes, dtype)] = _Frame(TorchArchive(slot), slot)
            chunk = _Chunk(t.name, key, offsets, frame)
            entry.chunks.append(chunk)
            self._by_name[t.name] = chunk
            for key in (extra,) if isinstance(extra, str) else extra or ():
                if key not in self.extra:
                    self.extra[key] = _Chunk(None, key, None, self._extra_frame)
        self._check_layers(layer_sets, experts)
        for entry in self.keys.values():
            entry.chunks.sort(key=lambda c: c.offsets)
            _check_cover(entry)

    @staticmethod
    def _split(name: str) -> tuple[int | None, str]:
        match = LAYER.match(name)
        if match is None:
            return None, name
        rest = match.group(2)
        # TransformerEngine's names of the norms (as torch_dist readers present them) are the same tensors
        for te, local in TE_NORMS:
            if rest.startswith(te):
                rest = local + rest[len(te):]
        return int(match.group(1)), rest

    @staticmethod
    def _stack_name(rest: str) -> str:
        e = EXPERT.match(rest)
        return f"mlp.experts.*.{e.group(2)}" if e else rest

    def _locate(self, name: str, layer: int | None, rest: str, shape: tuple[int, ...]):
        """(sharded key, its global shape, this tensor's chunk offsets, its module's _extra_state key (or keys) or
        None)."""
        m = self.model
        te = m.transformer_impl == te_spec.TRANSFORMER_ENGINE
        if layer is None:  # (TransformerEngine's final norm is a TENorm)
            extra = _object_key(f"{name.rsplit('.', 1)[0]}._extra_state", (0,), (1,)) \
                if te and te_spec.is_norm_module(name.rsplit(".", 1)[0]) and name.endswith(".weight") else None
            return name, shape, (0,) * len(shape), extra
        if layer >= m.num_layers + m.mtp_layers:
            raise MergeError(f"writing a torch_dist checkpoint: {name} is in layer {layer}, but the model has "
                             f"{m.num_layers} layers" + (f" and {m.mtp_layers} MTP layers" if m.mtp_layers else ""))
        mtp = layer >= m.num_layers  # MultiTokenPredictionLayer: keys per layer, its decoder layer's inside
        if mtp and rest.startswith(MTP_OWN):
            module = rest.rsplit(".", 1)[0]
            key = f"mtp.layers.{layer - m.num_layers}.{rest}"
            extra = _object_key(f"mtp.layers.{layer - m.num_layers}.{module}._extra_state", (0,), (1,)) \
                if module == "eh_proj" or (te and te_spec.is_norm_module(module) and rest.endswith(".weight")) else None
            return key, shape, (0,) * len(shape), extra
        if not m.multi_latent_attention and rest.startswith(MLA_MODULES):
            raise MergeError(f"writing a torch_dist checkpoint: {name} is multi-latent attention, but the model "
                             "facts say the model has none")
        if m.multi_latent_attention and rest.startswith("self_attention.linear_qkv."):
            raise MergeError(f"writing a torch_dist checkpoint: {name} in a multi-latent attention model (Megatron-Core's "
                             "MLA has linear_q_down_proj / linear_kv_down_proj, not MindSpeed's fused linear_qkv)")
        if te:  # (an MTP layer is built with the last decoder layer's spec)
            rest = te_spec.layer_name(rest, mla=m.multi_latent_attention,
                                      moe=min(layer, m.num_layers - 1) in m.moe_layers)
        elif not m.multi_latent_attention:
            for local, fused in NORM_KEYS:
                if rest.startswith(local):
                    rest = fused + rest[len(local):]
        stacked = "decoder.layers." if not m.per_layer_keys else f"decoder.layers.{layer}."
        lead_shape, lead_offsets = ((m.num_layers,), (layer,)) if not m.per_layer_keys else ((), ())
        if mtp:
            stacked, lead_shape, lead_offsets = f"mtp.layers.{layer - m.num_layers}.transformer_layer.", (), ()
        expert = EXPERT.match(rest)
        if expert is not None:
            e, tail = int(expert.group(1)), expert.group(2)
            if layer not in m.moe_layers:
                raise MergeError(f"writing a torch_dist checkpoint: {name} is an expert of layer {layer}, which is not "
                                 f"a MoE layer ({sorted(m.moe_layers)})")
            if e >= m.num_experts:
                raise MergeError(f"writing a torch_dist checkpoint: {name}: expert {e} of {m.num_experts}")
            module = tail.rsplit(".", 1)[0]
            key = f"{stacked}mlp.experts.experts.{tail}"
            gshape, offsets = (*lead_shape, m.num_experts, *shape), (*lead_offsets, e, *(0,) * len(shape))
            extra = None
            if module in EXPERT_LINEARS and tail.endswith(".weight"):
                extra = _object_key(f"{stacked}mlp.experts.experts.{module}._extra_state",
                                    (*lead_offsets, e), (*lead_shape, m.num_experts))
            return key, gshape, offsets, extra
        if rest.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts.")) and layer not in m.moe_layers:
            raise MergeError(f"writing a torch_dist checkpoint: {name} belongs to a MoE layer, but layer {layer} is "
                             f"dense ({sorted(m.moe_layers)} have experts)")
        module = rest.rsplit(".", 1)[0]
        extra = None
        # TransformerEngine: its norms, and a core attention with a learnable softmax offset (TEDotProductAttention
        # shards its state then) have an _extra_state too
        te_module = te and ((te_spec.is_norm_module(module) and rest.endswith(".weight"))
                            or rest == "self_attention.core_attention.softmax_offset")
        if (module in LINEARS and rest.endswith(".weight")) or te_module:
            extra = _object_key(f"{stacked}{module}._extra_state", lead_offsets or (0,), lead_shape or (1,))
        if te and mtp and rest == "self_attention.linear_proj.weight":
            # an MTP layer's decoder layer shards its core attention's _extra_state too (megatron-core 0.16.1
            # asks for it there, and only there)
            extra = [extra, _object_key(f"{stacked}self_attention.core_attention._extra_state", (0,), (1,))]
        return f"{stacked}{rest}", (*lead_shape, *shape), (*lead_offsets, *(0,) * len(shape)), extra

    def _check_layers(self, layer_sets: dict, experts: dict) -> None:
        m = self.model
        tails = {tail for _, tail in experts}
        for layer in sorted(m.moe_layers):
            have = {tail for (at, tail) in experts if at == layer}
            if have != tails or not have:
                raise MergeError(f"writing a torch_dist checkpoint: MoE layer {layer} has experts' "
                                 f"{sorted(have) or 'nothing'}, other MoE layers {sorted(tails)}")
        for (layer, tail), numbers in experts.items():
            if numbers != set(range(m.num_experts)):
                missing = sorted(set(range(m.num_experts)) - numbers)
                raise MergeError(f"writing a torch_dist checkpoint: layer {layer} has no {tail} for experts "
                                 f"{missing[:8]}")
        if not layer_sets:
            return
        absent = [layer for layer in range(m.num_layers) if layer not in layer_sets]
        if absent:
            raise MergeError(f"writing a torch_dist checkpoint: no tensors of layer {absent[0]} (the model has "
                             f"{m.num_layers} layers)")
        if m.per_layer_keys:
            return
        first = min(layer_sets)
        for layer in range(m.num_layers):
            if layer_sets[layer] != layer_sets[first]:
                mine, theirs = set(layer_sets[layer]), set(layer_sets[first])
                differ = sorted(mine ^ theirs) or sorted(k for k in mine if layer_sets[layer][k] != layer_sets[first][k])
                raise MergeError(f"writing a torch_dist checkpoint with stacked layer keys: layer {layer} differs from "
                                 f"layer {first} ({', '.join(differ[:3])}); layers of different kinds need per-layer "
                                 "keys (moe_layer_freq given as a list)")

    def _place(self, file_bytes: int) -> list[str]:
        """Archives into files: every _extra_state first (in file 0), then the chunks in the caller's order."""
        files, size = ["__0_0.distcp"], 0
        order = list(self.extra.values()) + list(self._by_name.values())
        for i, chunk in enumerate(order):
            length = chunk.size
            if size and size + length > file_bytes and i >= len(self.extra):
                files.append(f"__0_{len(files)}.distcp")
                size = 0
            size += (-size) % ALIGN
            chunk.file, chunk.base = len(files) - 1, size
            size += length
        return files

    # --- writing -------------------------------------------------------------------------------------

    def _open_and_frame(self) -> None:
        try:
            self.iter_dir.mkdir()
            self._made_dir = True
        except FileExistsError:
            if not self.iter_dir.is_dir():
                raise
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        for name in (METADATA, METADATA_JSON, COMMON) if self.part is None else ():  # parts share the directory
            if os.path.lexists(self.iter_dir / name):
                raise FileExistsError(17, "already exists", str(self.iter_dir / name))
        if self.streamed:
            template = _render(self._extra_frame.archive) if self.extra else b""
            chunks = sorted(list(self.extra.values()) + list(self._by_name.values()), key=lambda c: (c.file, c.base))
            own = [i for i in range(len(self.files)) if self._own(i)]
            buffer = max(1 << 20, (32 << 20) // max(1, len(own))) // ALIGN_DIRECT * ALIGN_DIRECT
            for i, name in enumerate(self.files):
                if not self._own(i):
                    self._sequences.append(None)
                    continue
                path = self._path(name)
                if os.path.lexists(path):
                    raise FileExistsError(17, "already exists", str(path))
                self._created.append(path)
                out = OutputFile(path, buffer)
                self._sequences.append(_Sequence(out if self.part is None else HashedFile(out),
                                                 [c for c in chunks if c.file == i], template))
            return
        for name in self.files:
            path = self.iter_dir / name
            fd = os.open(path, flags, 0o666)
            self._created.append(path)
            self._fds.append(fd)
        ends = [0] * len(self.files)
        template = _render(self._extra_frame.archive) if self.extra else b""  # every _extra_state: these bytes
        for chunk in self.extra.values():
            pwrite_all(self._fds[chunk.file], template, chunk.base)
            ends[chunk.file] = max(ends[chunk.file], chunk.base + chunk.size)
        for chunk in self._by_name.values():
            chunk.frame.archive.write_frame(self._fds[chunk.file], chunk.base)
            ends[chunk.file] = max(ends[chunk.file], chunk.base + chunk.size)
        for fd, end in zip(self._fds, ends):
            os.ftruncate(fd, end)  # the data spans are holes until written

    def append(self, name: str, data) -> None:
        """Streamed: the next bytes of tensor `name`, which must be the tensor whose turn it is."""
        chunk = self._by_name[name]
        self._sequences[chunk.file].append(chunk, data)

    def region(self, name: str) -> tuple[int, int]:
        """(fd, absolute file offset) where tensor `name`'s bytes go: C-contiguous, its shape, its dtype."""
        chunk = self._by_name[name]
        return self._fds[chunk.file], chunk.base + chunk.frame.archive.data_offset(chunk.frame.slot)

    def done(self, name: str) -> None:
        """Optional: tensor `name`'s bytes are all written; its CRC32 is taken now, while they are still in the
        page cache (`finish` reads back those of the tensors not reported done)."""
        chunk = self._by_name[name]
        frame = chunk.frame
        with frame.lock:
            if not chunk.done:
                frame.archive.finish_member(self._fds[chunk.file], chunk.base, frame.slot)
                frame.archive.finish(self._fds[chunk.file], chunk.base)
                chunk.done = True

    def finish(self) -> None:
        """After every tensor byte is written: CRC32s, then common.pt, .metadata and metadata.json, all flushed."""
        if self.part is not None:
            self._finish_part()
            return
        if self.streamed:
            for sequence in self._sequences:
                sequence.close()
            self._sequences = []
        for name in self._by_name:
            if not self.streamed:
                self.done(name)
        self._write_small(COMMON, self._common_bytes())
        for fd in self._fds:
            os.fsync(fd)
        self._write_small(METADATA, pickle.dumps(self.metadata()))
        self._write_small(METADATA_JSON, json.dumps(CHECKPOINTING_CONFIG).encode())
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        _fsync_dir(self.iter_dir)
        self._finished = True

    def _finish_part(self) -> None:
        """A part's files: each closed (its bytes hashed as they were written), renamed into place and reported;
        the small files where they are the part's, hashed from their bytes."""
        prefix = self.iter_dir.name + "/"
        for name, sequence in zip(self.files, self._sequences):
            if sequence is not None:
                sequence.close()
                self.part.written(prefix + name, sequence.out.sha256.hexdigest())
        self._sequences = []
        for i, (name, data) in enumerate(zip(self.SMALL, self._small_bytes()), start=len(self.files)):
            if self._own(i):
                path = self._path(name)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
                self._created.append(path)
                try:
                    pwrite_all(fd, data, 0)
                finally:
                    os.close(fd)
                self.part.written(prefix + name, hashlib.sha256(data).hexdigest())
        self._finished = True

    def abort(self) -> None:
        """Close and remove every file this writer created (and the iteration dir, if it made it); after a
        successful `finish` the checkpoint is complete and stays."""
        if self._finished:
            return
        for sequence in self._sequences:
            if sequence is None:
                continue
            sequence.out.abort()
        self._sequences = []
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        for path in self._created:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self._created = []
        if self._made_dir:
            try:
                self.iter_dir.rmdir()
            except OSError:
                pass
            self._made_dir = False

    # --- the small files -----------------------------------------------------------------------------

    def metadata(self) -> Metadata:
        """torch.distributed.checkpoint's Metadata of what is planned, as FileSystemWriter.finish pickles it."""
        state, storage = {}, {}
        for entry in self.keys.values():
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.frame.slot.shape)) for c in entry.chunks]
            state[entry.key] = TensorStorageMetadata(TensorProperties(dtype=entry.dtype), torch.Size(entry.shape),
                                                     chunks)
            for c in entry.chunks:
                storage[MetadataIndex(entry.key, torch.Size(c.offsets))] = _StorageInfo(
                    self.files[c.file], c.base, c.size)
        for key, chunk in self.extra.items():
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(self.files[chunk.file], chunk.base, chunk.size)
        plan = hashlib.sha256(repr(sorted((k, str(v)) for k, v in state.items())).encode()).hexdigest()
        meta = StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid5(uuid.NAMESPACE_OID, plan)))
        metadata = Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage, storage_meta=meta)
        if hasattr(metadata, "version"):
            metadata.version = CURRENT_DCP_VERSION
        return metadata

    def _common_bytes(self) -> bytes:
        return _render(TorchArchive(self.common))

    def _write_small(self, name: str, data: bytes) -> None:
        """A whole small file, flushed, under its final name only once complete."""
        path, tmp = self.iter_dir / name, self.iter_dir / f"{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._created.append(tmp)
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        self._created[self._created.index(tmp)] = path


def _object_key(key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """ShardedObject.unique_key: `<key>/shard_<offsets joined by .>_<shape joined by .>`."""
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _check_cover(entry: _Key) -> None:
    """The chunks of a key tile its global shape (stacked keys need every layer / expert present)."""
    total = sum(math.prod(c.frame.slot.shape) for c in entry.chunks)
    if total != math.prod(entry.shape):
        lead = sorted({c.offsets[0] for c in entry.chunks})
        raise MergeError(f"writing a torch_dist checkpoint: {entry.key} {list(entry.shape)} is not covered by the "
                         f"tensors given (first-axis indices present: {lead[:12]})")


class _Sequence:
    """One .distcp file written front to back: its archives in file order (each _extra_state's bytes as they
    are, each chunk's tensor streamed through its archive, alignment gaps zero)."""

    def __init__(self, out: OutputFile, chunks: list, template: bytes):
        self.out, self.chunks, self.template = out, chunks, template
        self.pos, self.index, self.stream = 0, 0, None
        self._open_next()

    def _open_next(self) -> None:
        while self.index < len(self.chunks):
            chunk = self.chunks[self.index]
            self.out.write(bytes(chunk.base - self.pos))
            self.pos = chunk.base
            if chunk.name is None:  # an _extra_state entry: the same bytes every time
                self.out.write(self.template)
                self.pos += len(self.template)
                self.index += 1
                continue
            self.stream = ArchiveStream(chunk.frame.archive, self.out, close_file=False)
            return

    def append(self, chunk, data) -> None:
        if self.index >= len(self.chunks) or self.chunks[self.index] is not chunk:
            raise ValueError(f"{chunk.key}: bytes out of their turn")
        self.stream.append(chunk.frame.slot, data)
        if self.stream.finished:
            self.stream.close()
            chunk.done = True
            self.pos += chunk.size
            self.index += 1
            self.stream = None
            self._open_next()

    def close(self) -> None:
        if self.index < len(self.chunks):
            raise MergeError(f"{self.out.path}: closed with tensors not written (plan error)")
        self.out.close()


def _render(archive: TorchArchive) -> bytes:
    """The bytes of an archive without tensors (framed in an in-memory file)."""
    fd = os.memfd_create("torch-archive", getattr(os, "MFD_CLOEXEC", 0)) if hasattr(os, "memfd_create") else None
    if fd is None:
        import tempfile

        fd, path = tempfile.mkstemp()
        os.unlink(path)
    try:
        archive.write_frame(fd, 0)
        archive.finish(fd, 0)
        return os.pread(fd, archive.size, 0)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MegatronDistOutput(RowScatter):
    """`--ckpt-format torch_dist`: the whole model as TP=1 global tensors in a DistCheckpointWriter (the
    torch_dist loader reshards to whatever layout loads it), filled from HF row pieces as they stream.
    Same interface as the legacy writer: `start(dir)`, `write`, `finish()`, `abort()`."""

    def __init__(self, arch, shape, dtypes: dict, args, padded_vocab: int):
        from lora_merge.model.architectures import iter_rules
        from lora_merge.model.layout import SharedCopy, Skip

        super().__init__(shape)
        self.args, self.out, self.writer = args, None, None
        self.tensors: list[DistTensor] = []
        self._named: list[tuple[str, Target]] = []
        for rule, names, hf_prefix in iter_rules(arch, shape):
            if isinstance(rule, (Skip, SharedCopy)):  # (Megatron shares what the MTP layers' copies copy)
                continue
            name = names[0]
            shard_shapes = target_shard_shapes(rule, shape, 1, padded_vocab, name)
            dtype = tensor_dtype(rule, hf_prefix, dtypes, name)
            size = shard_shapes[0]
            nbytes = dtype.itemsize * math.prod(size)
            target = Target(nbytes // size[0] if size and size[0] else 0, nbytes)
            self.tensors.append(DistTensor(name, tuple(size), dtype))
            self._named.append((name, target))
            target.padding = nbytes  # less the rows routed to it (route sets `due` to those)
            self.route(rule, hf_prefix, name, shard_shapes, {0: [target]})
            target.padding -= target.due
        self.facts = DistModelFacts.from_args(args)
        self.total_bytes = sum(t.due + t.padding for _, t in self._named)  # data; the frames add little
        # the files are written front to back: the tensors in the order their bytes arrive
        order, unreached = self.stream_order(list(dtypes), lambda t: 0)
        self._unreached = unreached.get(0, [])
        position = {id(t): i for i, t in enumerate(order.get(0, []) + self._unreached)}
        by_target = {id(t): spec for spec, (_, t) in zip(self.tensors, self._named)}
        self.tensors = [by_target[id(t)] for t in sorted((t for _, t in self._named), key=lambda t: position[id(t)])]
        common = {"args": self.args, "checkpoint_version": 3.0, "iteration": 0}
        self.writer = DistCheckpointWriter(Path(RELEASE), self.tensors, common, self.facts, file_bytes=FILE_BYTES,
                                           streamed=True, opened=False)
        self.part = None

    # --- a part of the files (`--part`), as the legacy writer's -----------------------------------------

    def file_names(self) -> list[str]:
        return [f"{RELEASE}/{name}" for name, _ in self.writer.all_files()]

    def file_sizes(self) -> list[int]:
        return [size for _, size in self.writer.all_files()]

    def tracker_text(self) -> str:
        return RELEASE

    def files_of(self, hf_name: str) -> set[int]:
        by_target = {id(t): name for name, t in self._named}
        return {self.writer._by_name[by_target[id(t)]].file for dest in self.hf[hf_name].destinations
                for targets in dest.targets.values() for t in targets}

    def write_only(self, part) -> None:
        self.part = part
        for name, target in self._named:
            if self.writer._by_name[name].file not in part.files:
                self.ignored.add(id(target))

    # --- writing ------------------------------------------------------------------------------------

    def start(self, out: Path) -> None:
        self.out = Path(out)
        self.writer.open(self.out / RELEASE, self.part)
        for name, target in self._named:
            if id(target) not in self.ignored:
                target.append = partial(self.writer.append, name)

    def finish(self) -> list[str]:
        self.check_complete(self.out)
        for target in self._unreached:  # all padding
            if id(target) not in self.ignored:
                self._complete(target)
        self.writer.finish()
        if self.part is not None:  # the tracker file is written once every part's files are (`lora-merge finish`)
            names = self.file_names()
            return [names[i] for i in sorted(self.part.files)]
        with open(self.out / "latest_checkpointed_iteration.txt", "x") as tracker:
            tracker.write(RELEASE)
        return ["latest_checkpointed_iteration.txt"] + sorted(
            str(p.relative_to(self.out)) for p in (self.out / RELEASE).iterdir())

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
