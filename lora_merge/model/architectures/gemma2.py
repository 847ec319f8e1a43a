"""Gemma 2 (`gemma2`), on the HF routes (an HF base with a PEFT adapter; `hf_only`): megatron-core (0.16.1)
has neither the post-attention and post-feedforward norms of Gemma 2's layers nor its (1 + w) RMSNorm, so no
Megatron model of it can be built to prove a layout. Four norms per layer, stored as the w of (1 + w) and
copied as stored; q/k/v/o without biases; head_dim apart from hidden / heads; the GELU-tanh gated MLP;
embeddings tied unless the config says otherwise. query_pre_attn_scalar, soft-capping and the alternating
sliding windows act in the forward only: the config keeps them as published.

The Megatron names of the two norms Megatron-Core lacks (`post_self_attn_layernorm`, `post_mlp_layernorm`)
are this table's own keys, never read from or written to a Megatron checkpoint."""

from lora_merge.model.architectures.base import Architecture, HfConfig
from lora_merge.model.architectures.dense import ATTENTION, DENSE_MLP, EMBEDDING, FINAL
from lora_merge.model.layout import Replicated

GEMMA_KEYS = frozenset({"hidden_activation", "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping",
                        "attn_logit_softcapping", "use_bidirectional_attention", "cache_implementation"})
NO_MEGATRON_FORM = ("megatron-core (0.16.1) has no post-attention or post-feedforward norm in its decoder layer and no "
                    "(1 + w) RMSNorm, so no Megatron model of it can be built to prove a layout")

CONFIG = HfConfig("gemma2", causal_lm="Gemma2ForCausalLM", family="llama", examined_keys=GEMMA_KEYS,
                  hf_only=NO_MEGATRON_FORM)

ARCHITECTURE = Architecture(
    name="gemma2", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        *ATTENTION,
        Replicated("post_self_attn_layernorm.weight", ("hidden",), hf="post_attention_layernorm.weight"),
        Replicated("pre_mlp_layernorm.weight", ("hidden",), hf="pre_feedforward_layernorm.weight"),
        *DENSE_MLP,
        Replicated("post_mlp_layernorm.weight", ("hidden",), hf="post_feedforward_layernorm.weight"),
    ),
)
