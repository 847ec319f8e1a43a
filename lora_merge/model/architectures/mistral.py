"""Mistral: the dense decoder. Its config class turns sliding-window attention on (4096) unless the
config says null, which model_shape refuses: Megatron trained full attention."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.dense import DENSE_DECODER

ARCHITECTURE = DENSE_DECODER.of(HfConfig(
    "mistral", causal_lm="MistralForCausalLM", family="mistral",
))
