"""Architectures, each a short module owning how its HF config reads and its table of layout rules
(see `base.Architecture`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_merge.architectures import deepseek_v2, deepseek_v3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from lora_merge.architectures.base import Architecture, HfConfig, iter_rules, pick_name  # noqa: F401
from lora_merge.errors import MergeError
from lora_merge.shown import shown

if TYPE_CHECKING:
    from lora_merge.model_shape import ModelShape

ARCHITECTURES = {module.ARCHITECTURE.name: module.ARCHITECTURE
                 for module in (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, deepseek_v2, deepseek_v3)}


def architecture_for(shape: ModelShape) -> Architecture:
    try:
        return ARCHITECTURES[shape.model_type]
    except KeyError:
        raise MergeError(f"HF config model_type {shown(shape.model_type)} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
