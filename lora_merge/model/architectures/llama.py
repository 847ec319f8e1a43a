"""Llama (and so Llama-architecture fine-tunes such as DeepSeek-R1-Distill-Llama): the dense decoder."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.dense import DENSE_DECODER

ARCHITECTURE = DENSE_DECODER.of(HfConfig(
    "llama", causal_lm="LlamaForCausalLM", family="llama",
))
