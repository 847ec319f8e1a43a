"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen): the dense decoder, always with q/k/v biases."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.dense import DENSE_DECODER

ARCHITECTURE = DENSE_DECODER.of(HfConfig(
    "qwen2", causal_lm="Qwen2ForCausalLM", family="qwen", qkv_bias=True,
))
