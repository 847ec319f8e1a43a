"""Gemma 3 text (`gemma3_text`: Gemma 3 1B, and the language model of the larger ones), on the HF routes: Gemma 2's
layer (four norms stored as the w of (1 + w), GELU-tanh gated MLP, tied embeddings) with q/k norms over head_dim.
The local/global attention pattern (layer_types, sliding_window_pattern), the local RoPE base and the RoPE scaling
of the global layers act in the forward only: the config keeps them as published. Megatron checkpoints of it are
refused for Gemma 2's reason."""

from lora_merge.model.architectures.base import HfConfig
from lora_merge.model.architectures.gemma2 import ARCHITECTURE as GEMMA2, GEMMA_KEYS, NO_MEGATRON_FORM

CONFIG = HfConfig("gemma3_text", causal_lm="Gemma3ForCausalLM", family="llama", qk_norm=True,
                  examined_keys=GEMMA_KEYS | {"rope_local_base_freq", "sliding_window_pattern", "layer_types"},
                  hf_only=NO_MEGATRON_FORM)

ARCHITECTURE = GEMMA2.of(CONFIG)
