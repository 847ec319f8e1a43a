"""Phi-3.5-MoE (`phimoe`), on the HF routes (an HF base with a PEFT adapter; `hf_only`): LayerNorms with biases
(input, post-attention, final), q/k/v/o biases where `attention_bias` says, an lm_head bias where `lm_head_bias`
says, and in every layer Mixtral-named experts (`block_sparse_moe`, w1 gate, w3 up, w2 down) routed by
SparseMixer. The LongRoPE scaling of the release acts in the forward only: the config keeps it as published.

No Megatron form is read or written: megatron-core (0.16.1) has no SparseMixer routing, so no Megatron model of it
can be built to prove a layout. Names of what Megatron lacks are this table's own keys."""

from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import O_PROJ, QKV
from lora_merge.model.architectures.moe import routed_experts
from lora_merge.model.layout import Replicated, VocabParallel
from lora_merge.model.moe_shape import MoeShape


def read_moe(fields, num_layers: int) -> MoeShape:
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("intermediate_size"), 0, False, False, frozenset(range(num_layers)))


def layer_norm(megatron: str, hf: str) -> tuple[Replicated, Replicated]:
    return (Replicated(f"{megatron}.weight", ("hidden",), hf=f"{hf}.weight"),
            Replicated(f"{megatron}.bias", ("hidden",), hf=f"{hf}.bias"))


CONFIG = HfConfig(
    "phimoe", causal_lm="PhimoeForCausalLM", family="mistral", qkv_bias="attention_bias",
    examined_keys=frozenset({"num_local_experts", "num_experts_per_tok", "attention_bias", "lm_head_bias",
                             "router_jitter_noise", "input_jitter_noise", "router_aux_loss_coef"}),
    read_moe=read_moe, fused_experts="mlp.experts", peft=PeftQuirks(converts_expert_targets=True), flags=("lm_head_bias",),
    hf_only="megatron-core (0.16.1) has no SparseMixer routing, so no Megatron model of it can be built to prove a "
            "layout",
)

ARCHITECTURE = Architecture(
    name="phimoe", config=CONFIG,
    before_layers=(VocabParallel("embedding.word_embeddings.weight", ("vocab", "hidden"), hf="model.embed_tokens.weight"),),
    layer_rules=(
        *layer_norm("input_layernorm", "input_layernorm"),
        *QKV,
        O_PROJ,
        Replicated("hf.self_attn.o_proj.bias", ("hidden",), hf="self_attn.o_proj.bias", requires="qkv_bias"),
        *layer_norm("pre_mlp_layernorm", "post_attention_layernorm"),
        *routed_experts(router="block_sparse_moe.gate.weight", gate="block_sparse_moe.experts.{expert}.w1.weight",
                        up="block_sparse_moe.experts.{expert}.w3.weight",
                        down="block_sparse_moe.experts.{expert}.w2.weight"),
    ),
    after_layers=(
        *layer_norm("decoder.final_layernorm", "model.norm"),
        VocabParallel("output_layer.weight", ("vocab", "hidden"), requires="untied", hf="lm_head.weight"),
        Replicated("hf.lm_head.bias", ("vocab",), hf="lm_head.bias", requires="lm_head_bias"),
    ),
)
