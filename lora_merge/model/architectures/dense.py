"""Llama, Mistral, Qwen2 and Qwen3 (and so the DeepSeek-R1-Distill models) share one dense decoder layout;
q/k/v biases exist when the config says so (always for Qwen2), q/k norms for Qwen3. Its parts are the
building blocks of the Mixture-of-Experts tables too."""

from __future__ import annotations

from lora_merge.model.architectures.base import Architecture
from lora_merge.model.layout import GatedColumn, QkvColumn, Replicated, RowParallel, Skip, VocabParallel

EMBEDDING = (
    VocabParallel("embedding.word_embeddings.weight", ("vocab", "hidden"), hf="model.embed_tokens.weight"),
)
# TransformerEngine fuses the norms into the next linear; torch_dist always uses those names.
INPUT_NORM = Replicated("input_layernorm.weight", ("hidden",), hf="input_layernorm.weight",
                        aliases=("self_attention.linear_qkv.layer_norm_weight",))
O_PROJ = RowParallel("self_attention.linear_proj.weight", ("hidden", "q"), hf="self_attn.o_proj.weight")
DOWN_PROJ = RowParallel("mlp.linear_fc2.weight", ("hidden", "ffn"), hf="mlp.down_proj.weight")
QKV = (
    QkvColumn("self_attention.linear_qkv.weight", ("qkv", "hidden"),
              q="self_attn.q_proj.weight", k="self_attn.k_proj.weight", v="self_attn.v_proj.weight"),
    QkvColumn("self_attention.linear_qkv.bias", ("qkv",), requires="qkv_bias",
              q="self_attn.q_proj.bias", k="self_attn.k_proj.bias", v="self_attn.v_proj.bias"),
)
ATTENTION = (
    INPUT_NORM,
    *QKV,
    Replicated("self_attention.q_layernorm.weight", ("head_dim",), requires="qk_norm", hf="self_attn.q_norm.weight"),
    Replicated("self_attention.k_layernorm.weight", ("head_dim",), requires="qk_norm", hf="self_attn.k_norm.weight"),
    O_PROJ,
)
PRE_MLP_NORM = Replicated("pre_mlp_layernorm.weight", ("hidden",), hf="post_attention_layernorm.weight",
                          aliases=("mlp.linear_fc1.layer_norm_weight",))
DENSE_MLP = (
    GatedColumn("mlp.linear_fc1.weight", ("gated_ffn", "hidden"), gate="mlp.gate_proj.weight", up="mlp.up_proj.weight"),
    DOWN_PROJ,
)
FINAL = (
    Replicated("decoder.final_layernorm.weight", ("hidden",), hf="model.norm.weight"),
    VocabParallel("output_layer.weight", ("vocab", "hidden"), requires="untied", hf="lm_head.weight"),
    # With tied embeddings and PP>1 the last stage keeps its own copy of the embedding as output_layer.
    Skip("output_layer.weight", (), requires="tied", reason="copy of the tied embedding",
         same_as="embedding.word_embeddings.weight"),
)

DENSE_DECODER = Architecture(name="dense-decoder", before_layers=EMBEDDING,
                             layer_rules=(*ATTENTION, PRE_MLP_NORM, *DENSE_MLP), after_layers=FINAL)
