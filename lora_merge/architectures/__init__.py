"""Architectures, each a short module with its table of layout rules (see `base.Architecture`)."""

from __future__ import annotations

from lora_merge.architectures import mixtral, qwen2_moe, qwen3_moe
from lora_merge.architectures.base import Architecture, iter_rules, pick_name  # noqa: F401
from lora_merge.architectures.dense import DENSE_DECODER
from lora_merge.errors import MergeError
from lora_merge.model_shape import ModelShape

ARCHITECTURES = {
    "llama": DENSE_DECODER,
    "mistral": DENSE_DECODER,
    "qwen2": DENSE_DECODER,
    "qwen3": DENSE_DECODER,
    "qwen3_moe": qwen3_moe.ARCHITECTURE,
    "qwen2_moe": qwen2_moe.ARCHITECTURE,
    "mixtral": mixtral.ARCHITECTURE,
}


def architecture_for(shape: ModelShape) -> Architecture:
    try:
        return ARCHITECTURES[shape.model_type]
    except KeyError:
        raise MergeError(f"HF config model_type {shape.model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
