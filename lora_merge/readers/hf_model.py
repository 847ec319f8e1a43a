"""An HF model directory as the base of a merge (`--base HF_DIR`): its safetensors tensors by HF name, each
a view of the mapped file, so a Megatron LoRA merges straight onto the original HF weights.

Headers and the index are checked as `verify` checks them (sizes, offsets, no gaps, files inside the
directory); symlinks into an HF cache are followed. Tensors no rule writes are an error, as for a
Megatron base, except the rotary tables some exporters save (recomputed from the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import TensorRef
from lora_merge.readers.safetensors_file import tensor_refs
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
    from lora_merge.readers.safetensors_dir import SafetensorsDir

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
    return tensor_refs(file, "the HF base's weights")
