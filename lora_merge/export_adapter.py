"""Export the LoRA as an unmerged PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`) that
PEFT, vLLM and SGLang load on top of the HF base model.

A fused Megatron LoRA maps onto HF's separate projections exactly: linear_qkv's A is shared by
q_proj/k_proj/v_proj and its B rows are regrouped like the weight's; linear_fc1 likewise becomes
gate_proj/up_proj. No arithmetic is done, so the factors keep their bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_merge.architectures import Architecture
from lora_merge.errors import MergeError
from lora_merge.integrity import check_finite, check_records
from lora_merge.lora import LoraSettings, check_factor_shapes, hf_factors
from lora_merge.architectures import iter_rules
from lora_merge.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.readers.experts import is_expert_name

PEFT_PREFIX = "base_model.model."
VLLM_DEFAULT_MAX_LORA_RANK = 16


def adapter_tensors(lora: Checkpoint, shape: ModelShape, arch: Architecture, settings: LoraSettings,
                    dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A/lora_B tensors for every adapted HF projection, in HF layout."""
    experts = sorted(m for m in lora.lora if is_expert_name(m))
    if experts:
        # transformers 5 fuses each layer's experts into 3-D parameters, onto which PEFT does not load
        # per-expert LoRA keys: the expert deltas would be dropped without an error. Merging is exact.
        raise MergeError(f"{lora.path}: LoRA on routed experts ({len(experts)} modules, e.g. {experts[0]}) cannot be "
                         "exported as an adapter that PEFT applies to transformers' fused experts; merge it instead")
    tensors = {}
    remaining = dict(lora.lora)
    for rule, names, prefix in iter_rules(arch, shape):
        module = names[0].removesuffix(".weight")
        if not names[0].endswith(".weight") or module not in remaining:
            continue
        factors = remaining.pop(module)
        check_factor_shapes(rule, factors, shape, settings.r, module)
        check_records(factors.refs)
        for hf_name, (b, a) in hf_factors(rule, factors, shape, module).items():
            key = PEFT_PREFIX + prefix + hf_name.removesuffix(".weight")
            for name, factor in ((f"{key}.lora_A.weight", a), (f"{key}.lora_B.weight", b)):
                tensors[name] = factor.to(dtype or factor.dtype).clone()  # q/k/v share A: one copy each
                check_finite(tensors[name], name, "non-finite values (NaN or Inf) in the LoRA factor"
                             + ("" if dtype is None or dtype == factor.dtype else
                                f" as {str(dtype).removeprefix('torch.')}"))
    if remaining:
        raise MergeError(f"{lora.path}: LoRA weights for modules that have no HF counterpart: "
                         f"{', '.join(sorted(remaining)[:3])}")
    return tensors


def target_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in tensors if key.endswith(".lora_A.weight")})


def check_every_layer_adapted(tensors: dict[str, torch.Tensor], shape: ModelShape, where: str) -> None:
    """PEFT applies target_modules to every layer; an adapter covering only some layers would load with
    missing keys, so refuse it rather than write something that loads with silently fresh factors."""
    for target in target_modules(tensors):
        layers = {int(k.split(".layers.")[1].split(".")[0]) for k in tensors if f".{target}.lora_A" in k}
        if layers != set(range(shape.num_layers)):
            missing = sorted(set(range(shape.num_layers)) - layers)
            raise MergeError(f"{where}: LoRA on {target} is missing in layers {missing[:5]}; a PEFT adapter "
                             "targets every layer")


def adapter_config(settings: LoraSettings, targets: list[str], hf_config: dict, hf_ref: Path) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": hf_config.get("_name_or_path") or str(hf_ref),
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["adapter_model.safetensors", "adapter_config.json"]
