"""An HF model directory as the base of a merge (`--base HF_DIR`): its safetensors tensors by HF name, each
a view of the mapped file, so a Megatron LoRA merges straight onto the original HF weights.

Headers and the index are checked as `verify` checks them (sizes, offsets, no gaps, files inside the
directory); symlinks into an HF cache are followed. Tensors no rule writes are an error, as for a
Megatron base, except the rotary tables some exporters save (recomputed from the config).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import TensorRef
from lora_merge.torch_archive import MappedFile

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX = "model.safetensors.index.json"
DERIVED = (".rotary_emb.inv_freq",)  # buffers computed from the config, not weights


def is_hf_model_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / INDEX).exists() or any(path.glob("*.safetensors")))


@dataclass
class HfModel:
    """What the merge needs of a base: tensors by (HF) name, what was skipped, what was read."""

    path: Path
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    format: str = "HF"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most of its bytes have."""
        weight: dict[torch.dtype, int] = {}
        for ref in self.tensors.values():
            weight[ref.dtype] = weight.get(ref.dtype, 0) + ref.nbytes
        return max(weight, key=weight.get)

    def describe(self) -> str:
        return f"HF model {self.path} ({len(self.tensors)} tensors in {len(self.sources) - 1} file(s))"


def read_hf_model(path: Path) -> HfModel:
    from lora_merge.verification import SafetensorsDir  # its header and index checks

    path = Path(path)
    found = SafetensorsDir(path)
    if found.problems:
        raise MergeError(f"{found.problems[0]}; the HF base's weights must be intact")
    if not found:
        raise MergeError(f"{path}: no safetensors weights (an HF base needs model.safetensors or an index)")
    model = HfModel(path=path, sources=[path / "config.json"])
    for file in sorted(set(found.file_of.values())):
        model.sources.append(path / file)
        for name, ref in _tensors(path / file).items():
            if name.endswith(DERIVED):
                model.skipped["rotary tables (recomputed from the config)"] = \
                    model.skipped.get("rotary tables (recomputed from the config)", 0) + 1
            else:
                model.tensors[name] = ref
    if (path / INDEX).exists():
        model.sources.append(path / INDEX)
    return model


def _tensors(file: Path) -> dict[str, TensorRef]:
    mapped = MappedFile(file)
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    start, refs = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise MergeError(f"{file}: {name} is {entry['dtype']}; an HF base must hold float weights "
                             "(quantized bases cannot be merged exactly)")
        shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
        refs[name] = TensorRef(where=f"{file}[{name}]", shape=shape, dtype=dtype, mapped=True,
                               loader=_view(mapped, start + begin, end - begin, dtype, shape))
    return refs


def _view(mapped: MappedFile, offset: int, nbytes: int, dtype: torch.dtype, shape):
    def load() -> torch.Tensor:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        data = mapped.bytes_view(offset, nbytes)
        if offset % dtype.itemsize:  # safetensors does not promise aligned data: a copy then
            data = data.clone()
        return data.view(dtype).reshape(shape)
    return load
