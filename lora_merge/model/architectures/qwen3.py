"""Qwen3: the dense decoder with per-head q/k RMSNorm and no q/k/v biases."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.dense import DENSE_DECODER

ARCHITECTURE = DENSE_DECODER.of(HfConfig(
    "qwen3", causal_lm="Qwen3ForCausalLM", family="qwen", qk_norm=True,
))
