"""A PEFT LoRA adapter directory as `--lora` (`adapter_config.json` + `adapter_model.safetensors`, or
`adapter_model.bin` read weights-only): factors by the HF tensor they adapt, each with its own scale.

Honoured as PEFT computes them: `r` and `lora_alpha`, `rank_pattern`/`alpha_pattern` (PEFT's own key
matching), `use_rslora` (alpha/sqrt(r)), biases trained with `bias: "all"`/`"lora_only"` (they replace the
base's), `layers_to_transform`/`target_modules` (the saved keys say which modules were adapted).
`fan_in_fan_out` only applies to Conv1D layers; PEFT turns it off for Linear, as every layer here is.
Refused with one line: other PEFT types, DoRA, `modules_to_save`, LoRA on embeddings or on parameters.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import TensorRef
from lora_merge.readers.hf_model import _tensors
from lora_merge.safe_load import load_pt

CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def is_peft_adapter_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file()


@dataclass(frozen=True)
class Factors:
    b: TensorRef
    a: TensorRef
    scale: float
    r: int


@dataclass
class PeftAdapter:
    path: Path
    config: dict
    factors: dict[str, Factors] = field(default_factory=dict)  # by the HF weight they adapt ("….q_proj.weight")
    biases: dict[str, TensorRef] = field(default_factory=dict)  # trained biases, by HF name
    sources: list = field(default_factory=list)
    format: str = "PEFT"

    def describe(self) -> str:
        return (f"PEFT adapter {self.path} ({len(self.factors)} LoRA modules, r={self.config.get('r')}, "
                f"lora_alpha={self.config.get('lora_alpha')}{', rsLoRA' if self.config.get('use_rslora') else ''})")


def read_peft_adapter(path: Path) -> PeftAdapter:
    path = Path(path)
    config = _config(path / CONFIG)
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        tensors = _tensors(weights)
    elif (path / "adapter_model.bin").is_file():
        weights = path / "adapter_model.bin"
        state = load_pt(weights)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MergeError(f"{weights}: expected a dict of tensors")
        tensors = {k: TensorRef.of(f"{weights}[{k}]", v, mapped=False) for k, v in state.items()}
    else:
        raise MergeError(f"{path}: no adapter_model.safetensors or adapter_model.bin next to {CONFIG}")
    adapter = PeftAdapter(path=path, config=config, sources=[path / CONFIG, weights])
    pairs: dict[str, dict[str, TensorRef]] = {}
    for key, ref in tensors.items():
        if not key.startswith(PREFIX):
            raise MergeError(f"{weights}: key {key!r} does not start with {PREFIX!r}; not a PEFT adapter's state")
        name = key[len(PREFIX):]
        for marker, what in ((".lora_embedding_", "LoRA on embeddings"), (".lora_magnitude_vector", "DoRA"),
                             (".modules_to_save.", "modules_to_save")):
            if marker in name:
                raise MergeError(f"{weights}: {key}: {what} is not supported; only plain LoRA on Linear layers")
        if m := KEY.match(name):
            pairs.setdefault(m.group("module"), {})[m.group("ab")] = ref
        elif name.endswith(".bias") and config.get("bias") in ("all", "lora_only"):
            adapter.biases[name.replace(".base_layer.", ".")] = ref  # an adapted layer's own bias
        else:
            raise MergeError(f"{weights}: {key} is neither a LoRA factor nor a trained bias; cannot merge it")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            have = "lora_A" if "A" in ab else "lora_B"
            raise MergeError(f"{weights}: {module} has {have} but not the other factor")
        r, alpha = _pattern(config, "rank_pattern", module, config["r"]), _pattern(config, "alpha_pattern", module,
                                                                                   config["lora_alpha"])
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise MergeError(f"{weights}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, but its r is "
                             f"{r} (adapter_config.json)")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        adapter.factors[f"{module}.weight"] = Factors(b=b, a=a, scale=scale, r=r)
    if not adapter.factors:
        raise MergeError(f"{weights}: no LoRA factors")
    return adapter


def _config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise MergeError(f"{path}: not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise MergeError(f"{path}: peft_type {kind!r}; only LORA adapters can be merged")
    if config.get("use_dora"):
        raise MergeError(f"{path}: use_dora=true: DoRA is not supported")
    if config.get("modules_to_save"):
        raise MergeError(f"{path}: modules_to_save={config['modules_to_save']!r}: fully trained module copies are not "
                         "supported")
    if config.get("target_parameters"):
        raise MergeError(f"{path}: target_parameters={config['target_parameters']!r}: LoRA on parameters (fused "
                         "experts) is not supported as input yet")
    for key, what in (("layer_replication", "layer replication (layers duplicated in the adapted model)"),
                      ("trainable_token_indices", "trainable tokens (embedding rows trained outside LoRA)")):
        if config.get(key):
            raise MergeError(f"{path}: {key}={config[key]!r}: {what} is not supported")
    if config.get("lora_bias"):
        raise MergeError(f"{path}: lora_bias=true (a bias on lora_B) is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise MergeError(f"{path}: {key}={value!r}; expected a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise MergeError(f"{path}: {key} must be an object {{pattern: value}}")
    return config


def _pattern(config: dict, key: str, module: str, default):
    """PEFT's rule: the first pattern that matches the end of the module's name (a full-name regex)."""
    for pattern, value in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
