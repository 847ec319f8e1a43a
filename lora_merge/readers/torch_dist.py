"""Reader for Megatron's distributed checkpoint (`--ckpt-format torch_dist`), without Megatron and
without a process group.

The iteration dir holds `.metadata` (a pickled torch.distributed.checkpoint Metadata: every tensor's
global shape and the chunks it was saved in), `__R_K.distcp` files (each chunk a small `torch.save`
archive at some offset) and `common.pt` (args etc.; from Megatron-Core 0.19 a `common_state` bytes
entry instead). Tensors are global, so this reader presents them as TP=1 shards: the un-sharding
rules then see the TP=1 layout, which is exactly the torch_dist global layout (QKV group-interleaved,
fc1 `[all gate; all up]`).

Safety: torch's own reader unpickles `.metadata` with plain `pickle.load`; here it goes through an
allow-list unpickler that builds only inert stand-ins, and chunk archives through torch's weights-only
unpickler. Memory: each .distcp file is memory-mapped once and chunks are views into it, so a stacked
`[layers, …]` tensor is never read whole: one layer's slice is taken at a time.
"""

from __future__ import annotations

import math
import io
import pickle
import re
import threading
from collections import OrderedDict, defaultdict
from pathlib import Path

import torch

from lora_merge.model.mtp import args_mtp_layers, canonical as mtp_canonical, is_mtp
from lora_merge.errors import MergeError
from lora_merge.model.layer_numbering import numbering_from_args
from lora_merge.readers import bridge
from lora_merge.readers.checkpoint import GLOBAL, Checkpoint, LoraCollector, Pieces, TensorRef, joined_ref, release_pages
from lora_merge.readers.experts import expert_layout
from lora_merge.readers.iteration import TRACKER, resolve_iteration_dir
from lora_merge.files.torch_archive import MappedFile, Record, TorchArchive
from lora_merge.files import remote
from lora_merge.files.safe_load import StandIn, load_archive, load_pt, stand_in_class
from lora_merge.shown import shown
from lora_merge.files.small_files import read_bytes

METADATA = ".metadata"
SKIPPED_PREFIXES = ("optimizer", "rng_state", "rerun_state_machine", "common_state", "opt_param_scheduler")
SINGLETON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
STACKED_LAYER = "decoder.layers."
# (a Megatron-Bridge LoRA's per-expert factors too, under the names bridge.lora_name gives them)
GLOBAL_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\."
                            r"(linear_fc[12]\.(?:weight|bias|lora_[AB]\.default\.weight|dora_magnitude))$")
# singleton_local_shards saves each expert on its own, numbered globally (fc1 as weight_w/weight_v, its bias as bias_w/bias_v)
SINGLETON_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias)(?:_[wv])?)$")


def is_torch_dist_iteration(path: Path) -> bool:
    # any entry named .metadata (a device, a FIFO, a broken link too): reading it says what is wrong with it
    return (path / METADATA).exists() or (path / METADATA).is_symlink()


# --- .metadata: allow-list unpickler ---------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch dtypes/sizes for real and everything from torch.distributed.checkpoint or Megatron as
    inert stand-ins; refuses any other global."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if full == "collections.OrderedDict":
            return OrderedDict
        if full == "torch.serialization._get_layout":  # how torch.strided pickles
            return _layout
        if module.startswith(("torch.distributed.checkpoint", "megatron.", "pathlib")):
            return stand_in_class(full)
        raise MergeError(f"{self.where}: refusing to load: the pickle references {shown(full)}, which is not "
                         "checkpoint metadata")

    def persistent_load(self, pid):
        raise MergeError(f"{self.where}: unexpected persistent reference in checkpoint metadata")


def _layout(name: str) -> torch.layout:
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise MergeError(f"checkpoint metadata names an unknown tensor layout {shown(name)}")
    return layout


def _state(obj, where: str) -> dict:
    if not isinstance(obj, StandIn) or not isinstance(getattr(obj, "state", {}), (dict, tuple)):
        raise MergeError(f"{where}: unexpected object in checkpoint metadata: {shown(obj)}")
    state = getattr(obj, "state", {})  # a dataclass without fields pickles without state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]  # (dict, slots) form
    return state


def read_metadata(path: Path) -> tuple[dict, dict]:
    """(key -> global tensor info or 'bytes', (key, chunk offsets) -> (file, offset, length))."""
    where = str(path)
    try:
        # read whole under its cap first: a device, FIFO or huge file named .metadata is never unpickled
        meta = _MetadataUnpickler(io.BytesIO(read_bytes(path, ".metadata", expected="torch.distributed.checkpoint "
                                                        "metadata (a pickle)")), where).load()
        return _parse_metadata(meta, path)
    except MergeError:
        raise
    except Exception as exc:  # a truncated, foreign or incomplete pickle
        raise MergeError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from exc


def _parse_metadata(meta, path: Path) -> tuple[dict, dict]:
    where = str(path)
    state = _state(meta, where)
    entries = {}
    for key, md in state.get("state_dict_metadata", {}).items():
        md_state = _state(md, where)
        if "chunks" not in md_state:
            entries[key] = "bytes"
            continue
        props = md_state["properties"]
        props_state = props.state if isinstance(props, StandIn) else None
        dtype = props_state[0] if isinstance(props_state, tuple) else _state(props, where).get("dtype")
        chunks = [(tuple(_state(c, where)["offsets"]), tuple(_state(c, where)["sizes"])) for c in md_state["chunks"]]
        entries[key] = {"shape": tuple(md_state["size"]), "dtype": dtype, "chunks": chunks}
    storage = {}
    for index, info in (state.get("storage_data") or {}).items():
        i, s = _state(index, where), _state(info, where)
        if s.get("transform_descriptors"):
            raise MergeError(f"{path}: {i['fqn']} is stored with transforms {s['transform_descriptors']}, "
                             "which this tool does not read")
        storage[(i["fqn"], tuple(i["offset"]) if i.get("offset") is not None else None)] = (
            s["relative_path"], int(s["offset"]), int(s["length"]))
    return entries, storage


# --- chunks: torch.save archives inside .distcp files, mapped not read --------------------------------

class DistcpFile:
    """One .distcp file, mapped once; each chunk is a torch.save archive at some offset in it, and comes
    out as a tensor viewing the mapping, with the archive member it lives in."""

    def __init__(self, path: Path):
        self.path = path
        self._mapped = None

    @property
    def size(self) -> int:
        return self.mapped.size

    @property
    def mapped(self) -> MappedFile:
        if self._mapped is None:
            self._mapped = MappedFile(self.path)
        return self._mapped

    def chunk(self, offset: int, length: int, where: str) -> tuple[torch.Tensor, Record | None]:
        archive = TorchArchive(self.mapped, offset, length, where=f"{self.path}: {where}")
        tensor = load_archive(archive)
        if not isinstance(tensor, torch.Tensor):
            raise MergeError(f"{self.path}: {where}: record holds a {type(tensor).__name__}, expected a tensor")
        return tensor, archive.record_of(tensor)


# --- the reader ---------------------------------------------------------------------------------------

def chunk_opener(it_dir: Path, storage: dict, files: dict, key: str, offsets, sizes, dtype):
    """(get, records, file, length) of one chunk of `key`: `get()` opens it once (checked against the metadata's
    shape and dtype) and returns the tensor viewing the mapped file, `records()` its archive member for the CRC check.
    `files`: the DistcpFiles opened so far, shared by the chunks."""
    loc = storage.get((key, offsets)) or storage.get((key, None))
    if loc is None:
        raise MergeError(f"{it_dir / METADATA}: no storage recorded for {key} chunk at {list(offsets)}")
    rel, off, length = loc
    file = files.setdefault(rel, DistcpFile(it_dir / rel))
    if not file.path.is_file():
        raise MergeError(f"{it_dir}: missing {rel}, which holds {key}")
    if off + length > file.size:
        raise MergeError(f"{file.path}: {key} lies past the end of the file (truncated checkpoint?)")
    cache = {}
    lock = threading.Lock()  # the CRC checker may open a chunk while the merge does

    def opened():
        with lock:
            if "t" not in cache:
                tensor, record = file.chunk(off, length, f"{key}{list(offsets)}")
                if tuple(tensor.shape) != tuple(sizes) or tensor.dtype != dtype:
                    raise MergeError(f"{file.path}: {key} chunk at {list(offsets)} holds {list(tensor.shape)} "
                                     f"{tensor.dtype}, but the metadata says {list(sizes)} {dtype}")
                cache["t"] = tensor, record
        return cache["t"]
    def get():
        # each load makes the chunk readable first: at a URL its bytes may have been handed back since the chunk was
        # opened (files/handback.py), and the view kept here would read zeros
        remote.ensure(file.path, off, length)
        return opened()[0]
    return get, ChunkRecords(opened, (file.mapped, off, length)), rel, length


class ChunkRecords:
    """A chunk's archive member for the CRC check (the chunk opened on first call), and the chunk's bytes in
    its file (known from the metadata: reading ahead and counting reads need not open it)."""

    def __init__(self, opened, span: tuple):
        self._opened, self.span = opened, span

    def __call__(self) -> tuple:
        return tuple(r for r in self._opened()[1:] if r is not None)




def _slice_loader(pieces, shape, dtype):
    """Assemble a global (sub)tensor from chunk views of any grid (a copy)."""
    def load():
        out = torch.empty(shape, dtype=dtype)
        for get, region, _ in pieces:
            view = get()
            out[tuple(region)] = view
            release_pages(view)
        return out
    return load


def _piece_refs(where, shape, dtype, pieces) -> tuple[list[TensorRef], int | None]:
    """The chunks of one tensor as mapped views, when they cut it along a single dimension (as TP does):
    (refs in order, that dimension). Any other grid is assembled into one copy."""
    shape = tuple(shape)
    cut = [d for d in range(len(shape)) if any(r[d].start != 0 or r[d].stop != shape[d] for _, r, _ in pieces)]
    if len(cut) <= 1:
        dim = cut[0] if cut else None
        ordered = sorted(pieces, key=lambda p: p[1][dim].start if dim is not None else 0)
        refs = [TensorRef(where=f"{where}{'' if dim is None else f' piece {i}'}",
                          shape=tuple(r.stop - r.start for r in region), dtype=dtype, loader=get, mapped=True,
                          records=records, spans=lambda records=records: (records.span,))
                for i, (get, region, records) in enumerate(ordered)]
        return refs, dim
    return [TensorRef(where=where, shape=shape, dtype=dtype, loader=_slice_loader(pieces, shape, dtype),
                      records=lambda: tuple(rec for _, _, records in pieces for rec in records()),
                      spans=lambda: tuple(dict.fromkeys(records.span for _, _, records in pieces)))], None


def read_torch_dist(path: Path) -> Checkpoint:
    it_dir, iteration = resolve_iteration_dir(path, is_torch_dist_iteration)
    entries, storage = read_metadata(it_dir / METADATA)
    from_bridge = bridge.is_bridge_iteration(it_dir)
    args, common_where = (bridge.bridge_args(it_dir), None) if from_bridge else _common_args(it_dir, entries, storage)
    if getattr(args, "noop_layers", None):
        raise MergeError(f"{it_dir}: noop_layers in a torch_dist checkpoint are not supported (their stacked layer "
                         "numbering is not documented); convert it to the legacy format")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    ckpt = Checkpoint(path=path, format="torch_dist", iteration=iteration, args=args, tp=1, pp=1, vpp=1,
                      args_recorded=not from_bridge)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    ckpt.note = (("Megatron-Bridge, " if from_bridge else "") + f"saved from TP={tp} PP={pp}"
                 + (f" VPP={vpp}" if vpp > 1 else "") + (f" EP={ep}" if ep > 1 else "") + "; tensors are global")
    ckpt.numbering = numbering_from_args(args, pp, vpp)
    ckpt.experts = expert_layout(args, tp, str(it_dir), torch_dist=True)  # informational: tensors are global (one shard each)
    files: dict[str, DistcpFile] = {}
    lora = LoraCollector(str(it_dir))
    bridge_parts = bridge.AdapterParts(args, str(it_dir)) if from_bridge else None
    per_file = defaultdict(lambda: [0, 0])

    def chunk_getter(key, offsets, sizes, dtype):
        get, records, rel, length = chunk_opener(it_dir, storage, files, key, offsets, sizes, dtype)
        per_file[rel][1] += length
        return get, records

    def add(name: str, where: str, shape, dtype, pieces):
        refs, dim = _piece_refs(where, shape, dtype, pieces)
        if bridge_parts is not None and bridge_parts.take(name, refs, dim):
            return
        joined = joined_ref(refs, dim)  # LoRA factors are small: one tensor each
        if lora.add(name, 0, joined):
            return
        name = name.replace(".base_layer.", ".")
        if name in ckpt.params:
            raise MergeError(f"{where}: parameter stored twice")
        ckpt.params[name] = Pieces(refs, GLOBAL, dim)

    for key, info in sorted(entries.items()):
        if key.startswith(SKIPPED_PREFIXES) or key.endswith("_extra_state") or "._extra_state" in key:
            ckpt.skipped[re.split(r"[./]", key)[0] if key.startswith(SKIPPED_PREFIXES) else "_extra_state"] += 1
            continue
        if info == "bytes":
            raise MergeError(f"{it_dir}: {key} is a bytes entry where a tensor was expected")
        if info["dtype"] is None or not isinstance(info["dtype"], torch.dtype):
            raise MergeError(f"{it_dir}: {key} has no readable dtype")
        name = key[len("module."):] if key.startswith("module.") else key
        if bridge_parts is not None:
            name = bridge_parts.lora_name(name, f"{it_dir.name}/{METADATA}[{key}]")
        if is_mtp(name):  # per-layer keys of the MTP layers, named as decoder layers L+k from here on
            name = mtp_canonical(name, ckpt.numbering.hf_layers, args_mtp_layers(args), f"{it_dir.name}[{key}]")
        chunks = [(*chunk_getter(key, off, size, info["dtype"]), off, size) for off, size in info["chunks"]]
        for rel in {storage.get((key, off), storage.get((key, None)))[0] for off, _ in info["chunks"]}:
            per_file[rel][0] += 1
        where = f"{it_dir.name}/{METADATA}[{key}]"
        _check_cover(info, key, where)
        def emit(name, where, shape, chunks):
            # Experts of every implementation are saved as one global [E, …] tensor per projection.
            m = GLOBAL_EXPERTS.match(name)
            if m and from_bridge and ".lora_" in name and len(shape) == 2:
                # an older Megatron-Bridge save of the adapter every grouped expert shares: one 2-D tensor, no
                # expert axis (its newer saves repeat it along the axis); it is each expert's LoRA, at EP=1 only
                for e in range(bridge.shared_adapter_experts(args, where)):
                    add(f"{m.group(1)}.{e}.{m.group(2)}", f"{where}[shared by expert {e}]", shape, info["dtype"],
                        _pieces(chunks))
            elif m:
                for e in range(shape[0]):
                    add(f"{m.group(1)}.{e}.{m.group(2)}", f"{where}[expert {e}]", shape[1:], info["dtype"],
                        _pieces(_select(chunks, e)))
            elif m := SINGLETON_EXPERT.match(name):
                add(f"{m.group(1)}.{m.group(2)}.{m.group(3)}", where, shape, info["dtype"], _pieces(chunks))
            else:
                add(name, where, shape, info["dtype"], _pieces(chunks))

        if name.startswith(STACKED_LAYER) and not SINGLETON_LAYER.match(name):
            rest = name[len(STACKED_LAYER):]
            for layer in range(info["shape"][0]):
                emit(f"{STACKED_LAYER}{layer}.{rest}", f"{where}[{layer}]", info["shape"][1:], _select(chunks, layer))
        else:
            emit(name, where, info["shape"], chunks)

    _join_singleton_fc1(ckpt)
    lora.finish(ckpt, lambda module: (GLOBAL, 1))
    if bridge_parts is not None:
        bridge_parts.finish(ckpt)
    ckpt.files = [(str(it_dir / rel), n, nbytes) for rel, (n, nbytes) in sorted(per_file.items())]
    ckpt.sources = [path / TRACKER, it_dir, it_dir / METADATA, it_dir / "common.pt", it_dir / bridge.RUN_CONFIG,
                    *(it_dir / rel for rel in sorted({loc[0] for loc in storage.values()}))]
    if common_where:
        ckpt.files.insert(0, (common_where, 0, 0))
    return ckpt


def _region(offsets, sizes):
    return [slice(o, o + s) for o, s in zip(offsets, sizes)]


def _select(chunks, index: int):
    """The chunks of a tensor's slice `index` along its first dimension (a stacked layer, an expert)."""
    return [(_view(get, off[0], index), records, off[1:], size[1:])
            for get, records, off, size in chunks if off[0] <= index < off[0] + size[0]]


def _view(get, first: int, index: int):
    return lambda: get()[index - first]


def _pieces(chunks):
    return [(get, _region(off, size), records) for get, records, off, size in chunks]


def _check_cover(info, key, where):
    """The chunks must tile the global tensor exactly (inside it, disjoint, nothing missing): a gap would be
    uninitialized memory in the output."""
    shape, chunks = info["shape"], info["chunks"]
    for off, size in chunks:
        if len(off) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(off, size, shape)):
            raise MergeError(f"{where}: chunk at {list(off)} of size {list(size)} lies outside {key}'s global shape "
                             f"{list(shape)}")
    for i, (off_a, size_a) in enumerate(chunks):
        for off_b, size_b in chunks[i + 1:]:
            if all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(off_a, size_a, off_b, size_b)):
                raise MergeError(f"{where}: chunks at {list(off_a)} and {list(off_b)} of {key} overlap")
    total = sum(math.prod(size) for _, size in chunks)
    if total != math.prod(shape):
        raise MergeError(f"{where}: saved chunks cover {total} elements of {key}, global shape "
                         f"{list(shape)} has {math.prod(shape)}")


def _join_singleton_fc1(ckpt: Checkpoint) -> None:
    """`singleton_local_shards` saves swiglu fc1 as weight_w (all gate rows) and weight_v (all up rows), and its bias
    (gpt-oss's experts) as bias_w / bias_v (megatron-core's MLP applies the swiglu factory to both): together, in that
    order, they are the pieces of the global `[gate; up]` tensor."""
    for name in [n for n in ckpt.params if n.endswith((".weight_w", ".bias_w"))]:
        base, other = name[: -len("_w")], name[: -len("_w")] + "_v"
        kind = base.rsplit(".", 1)[1]
        if other not in ckpt.params:
            raise MergeError(f"{ckpt.params[name][0].where}: {name} without its {other}")
        if base in ckpt.params:
            raise MergeError(f"{ckpt.params[name][0].where}: {base} stored both whole and as {kind}_w/{kind}_v")
        # cut across rows: only whole rows can be stacked as pieces
        w, v = ckpt.params.pop(name).fitted(0), ckpt.params.pop(other).fitted(0)
        ckpt.params[base] = Pieces(w.refs + v.refs, GLOBAL, 0)


def _common_args(it_dir: Path, entries: dict, storage: dict):
    """args from common.pt (Megatron-Core ≤ 0.18) or the common_state bytes entry (0.19+)."""
    common = it_dir / "common.pt"
    if common.is_file():
        state = load_pt(common)
        where = str(common)
    else:
        keys = [k for k, v in entries.items() if k.startswith("common_state") and v == "bytes"]
        if not keys:
            raise MergeError(f"{it_dir}: torch_dist checkpoint without common.pt or a common_state entry; "
                             "cannot read its args")
        rel, off, length = storage.get((keys[0], None)) or next(v for k, v in storage.items() if k[0] == keys[0])
        where = f"{it_dir / rel}[{keys[0]}]"
        state = load_archive(TorchArchive(MappedFile(it_dir / rel), off, length, where=where))
    args = state.get("args") if isinstance(state, dict) else None
    if args is None:
        raise MergeError(f"{where}: no 'args'; cannot tell the model's architecture")
    return args, where
