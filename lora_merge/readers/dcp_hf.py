"""A torch distributed checkpoint (DCP) of a transformers model, keyed by HF names, as an HF base (`--base DIR`,
with `--hf-ref` for the config): what FSDP / FSDP2 training saves with `torch.distributed.checkpoint.save` of
`{"model": model_state_dict}` (accelerate's SHARDED_STATE_DICT, MindSpeed-LLM's FSDP2 backend, a hand-written loop).

    DIR/.metadata              the global shape, dtype and chunks of every key (a pickle, read by allow-list)
    DIR/__{rank}_{i}.distcp    each rank's chunks, one torch.save archive each

Keys are the model's state-dict names under the app-state prefix `model.` (`model.model.layers.0…`,
`model.lm_head.weight`), or without it. FSDP2 shards every parameter along dim 0 across the ranks: those pieces are
consecutive rows, kept as they are stored (each its own mapped view, `Pieces.split`), so memory stays bounded; a
cut along dim 1 is joined row by row, any other grid assembled once. Everything else in the checkpoint (optimizer
state, schedulers, dataloaders, RNG) is skipped and counted. Names are taken as the HF checkpoint's: a model whose
transformers class renames its weights in memory (transformers 5's fused experts of Qwen-MoE, Mixtral, DeepSeek)
saves names no HF checkpoint has, and the plan refuses them by name.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import TensorRef, require_float
from lora_merge.readers.hf_model import DERIVED, HfModel
from lora_merge.readers.torch_dist import METADATA, DistcpFile, _piece_refs, chunk_opener, read_metadata

APP_PREFIX = "model."  # {"model": state_dict}: the model's keys under it
HF_ROOTS = ("model.", "lm_head.")  # where a causal LM's HF names start
MEGATRON_ROOTS = ("decoder.", "embedding.", "output_layer.", "module.", "mtp.")


def is_hf_dcp_dir(path: Path) -> bool:
    """A directory holding a DCP whose tensors are named as a transformers model's (Megatron's torch_dist is DCP
    too, under Megatron's names)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        return False
    entries, _ = read_metadata(path / METADATA)  # (damaged: said here, whatever the checkpoint is)
    model = _model_keys(entries)
    return bool(model) and not any(k.startswith(MEGATRON_ROOTS) for k in entries)


def refuse_foreign_dcp(path: Path) -> None:
    """A DCP whose tensors are named neither as Megatron's nor as an HF model's (torchtitan's own names,
    `layers.0.attention.wq.weight`) is refused by name, before it is read as a Megatron checkpoint."""
    entries, _ = read_metadata(Path(path) / METADATA)
    tensors = sorted(k for k, info in entries.items() if info != "bytes")
    if tensors and not any(k.startswith(MEGATRON_ROOTS) for k in tensors) and not _model_keys(entries):
        model = [k for k in tensors if not k.startswith(("optim", "lr_scheduler", "dataloader", "rng", "train_state"))]
        raise MergeError(f"{path}: a torch distributed checkpoint whose tensors are named neither as Megatron's "
                         f"(decoder.layers.…) nor as an HF model's (model.layers.…): {', '.join((model or tensors)[:3])}"
                         " …; convert it to HF safetensors first (torchtitan: its HF export, last_save_in_hf; a "
                         "wrapped model's keys, model.module.… or _orig_mod.…, are not unwrapped)")


def _model_keys(entries: dict) -> dict[str, str]:
    """HF name -> key, for the tensors of the model (under the app-state prefix where the keys have one)."""
    tensors = [k for k, info in entries.items() if info != "bytes"]
    prefixed = any(k.startswith((APP_PREFIX + "model.", APP_PREFIX + "lm_head.")) for k in tensors)
    names = {}
    for key in tensors:
        name = key[len(APP_PREFIX):] if prefixed and key.startswith(APP_PREFIX) else None if prefixed else key
        if name is not None and name.startswith(HF_ROOTS):
            names[name] = key
    # an HF causal LM's state dict names its token embedding so (not torchtitan's tok_embeddings, nor the keys of a
    # wrapped model: model.module.…, _orig_mod.…, a PEFT model's base_model.model.…)
    return names if "model.embed_tokens.weight" in names else {}


def read_dcp_hf(path: Path) -> HfModel:
    path = Path(path)
    entries, storage = read_metadata(path / METADATA)
    names = _model_keys(entries)
    if not names:
        raise MergeError(f"{path}: a torch distributed checkpoint without HF-named model tensors (expected keys such "
                         "as model.model.layers.0.self_attn.q_proj.weight)")
    model = HfModel(path=path, sources=[path / METADATA], format="DCP")
    files: dict[str, DistcpFile] = {}
    skipped = Counter()
    for key, info in entries.items():
        if key in names.values():
            continue
        skipped[f"{re.split(r'[./]', key)[0]} (not model weights)"] += 1
    for name, key in sorted(names.items()):
        info = entries[key]
        where = f"{path.name}/{METADATA}[{key}]"
        require_float(where, info["dtype"])
        if name.endswith(DERIVED):
            skipped["rotary tables (recomputed from the config)"] += 1
            continue
        refs, dim = _pieces_of(path, storage, files, key, info, where)
        model.tensors[name] = refs[0] if len(refs) == 1 else PiecedRef.of(refs, dim)
    model.sources += [path / rel for rel in sorted(files)]
    model.skipped = dict(skipped)
    return model


def _pieces_of(path: Path, storage: dict, files: dict, key: str, info: dict, where: str):
    """(a mapped reference to each saved piece of `key`, the dimension they cut it along)."""
    pieces = []
    for offsets, sizes in info["chunks"]:
        get, records, _, _ = chunk_opener(path, storage, files, key, offsets, sizes, info["dtype"])
        pieces.append((get, [slice(o, o + n) for o, n in zip(offsets, sizes)], records))
    refs, dim = _piece_refs(where, info["shape"], info["dtype"], pieces)
    if dim is not None:  # (FSDP2 gives a rank past a tensor's last row an empty piece)
        refs = [r for r in refs if r.shape[dim]] or refs[:1]
    return refs, dim


class PiecedRef(TensorRef):
    """A tensor stored as pieces cut along one dimension (`dim`: 0, FSDP2's rows; or 1): each piece a mapped view;
    `load()` joins them (a copy), the HF plan takes the pieces themselves (merge_plan._hf_pieces)."""

    pieces: tuple = ()
    dim: int = 0

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) from the pieces holding them (a copy; the pages read are released)."""
        if self.dim == 1:
            parts = [p.load()[start:stop].clone() for p in self.pieces]
            for p in self.pieces:
                p.release()
            return torch.cat(parts, dim=1)
        out, offset = [], 0
        for p in self.pieces:
            lo, hi = max(start, offset), min(stop, offset + p.shape[0])
            if lo < hi:
                out.append(p.load()[lo - offset:hi - offset].clone())
                p.release()
            offset += p.shape[0]
        return torch.cat(out)

    @classmethod
    def of(cls, refs: list[TensorRef], dim: int) -> "PiecedRef":
        from lora_merge.readers.checkpoint import joined_ref

        joined = joined_ref(refs, dim)
        ref = cls(joined.where, joined.shape, joined.dtype, joined.loader, False, joined.records, joined.spans)
        object.__setattr__(ref, "pieces", tuple(refs))
        object.__setattr__(ref, "dim", dim)
        return ref


class DcpBaseline:
    """An HF-named DCP as verify's baseline, read as verification reads a reference's safetensors (by name, rows
    at a time from the pieces that hold them)."""

    problems: list = []
    carried: frozenset = frozenset()

    def __init__(self, model: HfModel):
        self.model = model
        self.file_of = {name: model.path.name for name in model.tensors}

    def __bool__(self) -> bool:
        return bool(self.model.tensors)

    def readable(self, name: str) -> bool:
        return name in self.model.tensors

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        from lora_merge.writers.safetensors_stream import SAFETENSORS_DTYPES

        ref = self.model.tensors[name]
        return tuple(ref.shape), SAFETENSORS_DTYPES[ref.dtype]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        ref = self.model.tensors[name]
        if isinstance(ref, PiecedRef):
            return ref.rows(start, stop)
        rows = ref.load()[start:stop].clone()
        ref.release()
        return rows


def peft_dcp_tensors(path: Path) -> tuple[dict[str, TensorRef], Counter, list[Path]]:
    """A PEFT model's adapter from its torch distributed checkpoint (FSDP/FSDP2 training of a PeftModel saves its
    state dict, the base's weights and the adapter's factors alike, as accelerate's sharded checkpoints do): the
    adapter's tensors under the names PEFT's save_pretrained gives them (`….lora_A.weight`: the adapter's own name
    dropped, one adapter only), each a reference joining its pieces; the base's weights (`….base_layer.weight`,
    embeddings, norms), and anything else, skipped and counted. r and alpha come from the adapter_config.json
    beside it, as for a saved adapter."""
    from lora_merge.readers.checkpoint import joined_ref

    path = Path(path)
    entries, storage = read_metadata(path / METADATA)
    tensors = [k for k, info in entries.items() if info != "bytes"]
    prefixed = any(k.startswith(APP_PREFIX + PEFT_ROOT) for k in tensors)
    files: dict[str, DistcpFile] = {}
    out, skipped, adapters = {}, Counter(), set()
    for key in sorted(entries):
        name = key[len(APP_PREFIX):] if prefixed and key.startswith(APP_PREFIX) else key
        m = PEFT_TENSOR.match(name) if name.startswith(PEFT_ROOT) else None
        if m is None or entries[key] == "bytes":
            skipped["base model weights" if name.startswith(PEFT_ROOT) else
                    f"{re.split(r'[./]', key)[0]} (not model weights)"] += 1
            continue
        adapters.add(m.group("adapter"))
        info = entries[key]
        where = f"{path.name}/{METADATA}[{key}]"
        refs, dim = _pieces_of(path, storage, files, key, info, where)
        out[f"{m.group('module')}.{m.group('kind')}" + (".weight" if m.group("kind") != "lora_magnitude_vector"
                                                        else "")] = joined_ref(refs, dim)
    if len(adapters) > 1:
        raise MergeError(f"{path}: a PEFT model's checkpoint with several adapters ({', '.join(sorted(adapters))}); "
                         "expected one")
    if not out:
        raise MergeError(f"{path}: a torch distributed checkpoint without a PEFT model's LoRA factors (expected keys "
                         f"such as {PEFT_ROOT}model.layers.0.self_attn.q_proj.lora_A.default.weight)")
    return out, skipped, [path / rel for rel in sorted(files)]


PEFT_ROOT = "base_model.model."  # a PeftModel's state dict
PEFT_TENSOR = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_magnitude_vector)\.(?P<adapter>[^.]+)"
                         r"(?:\.weight)?$")
