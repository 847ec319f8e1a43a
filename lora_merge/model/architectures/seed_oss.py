"""Seed-OSS (ByteDance-Seed/Seed-OSS-36B): Llama's decoder with q/k/v biases (attention_bias), head_dim apart
from hidden_size / heads; an o_proj bias (attention_out_bias) is not a Megatron weight and is refused.
residual_dropout acts only in training."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.dense import DENSE_DECODER

CONFIG = HfConfig("seed_oss", causal_lm="SeedOssForCausalLM", family="llama", qkv_bias="attention_bias",
                  examined_keys=frozenset({"attention_out_bias", "residual_dropout"}),
                  must_be_false=("attention_out_bias",))

ARCHITECTURE = DENSE_DECODER.of(CONFIG)
