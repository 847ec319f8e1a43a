"""Architectures as tables of layout rules. A new architecture is a new table, not new code."""

from __future__ import annotations

from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.layout import (GatedColumn, QkvColumn, Replicated, RowParallel, Rule, Skip,
                               VocabParallel)
from lora_merge.model_shape import ModelShape

MEGATRON_LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."


@dataclass(frozen=True)
class Architecture:
    name: str
    before_layers: tuple[Rule, ...]  # full names
    layer_rules: tuple[Rule, ...]  # names relative to MEGATRON_LAYER / HF_LAYER
    after_layers: tuple[Rule, ...]

    def active(self, rules: tuple[Rule, ...], shape: ModelShape) -> list[Rule]:
        return [r for r in rules if r.requires is None or r.requires in shape.features]


# Llama, Mistral, Qwen2 and Qwen3 (and so the DeepSeek-R1-Distill models) share one dense decoder
# layout; q/k/v biases exist when the config says so (always for Qwen2), q/k norms for Qwen3.
DENSE_DECODER = Architecture(
    name="dense-decoder",
    before_layers=(
        VocabParallel("embedding.word_embeddings.weight", ("vocab", "hidden"), hf="model.embed_tokens.weight"),
    ),
    layer_rules=(
        # TransformerEngine fuses the norms into the next linear; torch_dist always uses those names.
        Replicated("input_layernorm.weight", ("hidden",), hf="input_layernorm.weight",
                   aliases=("self_attention.linear_qkv.layer_norm_weight",)),
        QkvColumn("self_attention.linear_qkv.weight", ("qkv", "hidden"),
                  q="self_attn.q_proj.weight", k="self_attn.k_proj.weight", v="self_attn.v_proj.weight"),
        QkvColumn("self_attention.linear_qkv.bias", ("qkv",), requires="qkv_bias",
                  q="self_attn.q_proj.bias", k="self_attn.k_proj.bias", v="self_attn.v_proj.bias"),
        Replicated("self_attention.q_layernorm.weight", ("head_dim",), requires="qk_norm", hf="self_attn.q_norm.weight"),
        Replicated("self_attention.k_layernorm.weight", ("head_dim",), requires="qk_norm", hf="self_attn.k_norm.weight"),
        RowParallel("self_attention.linear_proj.weight", ("hidden", "q"), hf="self_attn.o_proj.weight"),
        Replicated("pre_mlp_layernorm.weight", ("hidden",), hf="post_attention_layernorm.weight",
                   aliases=("mlp.linear_fc1.layer_norm_weight",)),
        GatedColumn("mlp.linear_fc1.weight", ("gated_ffn", "hidden"),
                    gate="mlp.gate_proj.weight", up="mlp.up_proj.weight"),
        RowParallel("mlp.linear_fc2.weight", ("hidden", "ffn"), hf="mlp.down_proj.weight"),
    ),
    after_layers=(
        Replicated("decoder.final_layernorm.weight", ("hidden",), hf="model.norm.weight"),
        VocabParallel("output_layer.weight", ("vocab", "hidden"), requires="untied", hf="lm_head.weight"),
        # With tied embeddings and PP>1 the last stage keeps its own copy of the embedding as output_layer.
        Skip("output_layer.weight", (), requires="tied", reason="copy of the tied embedding",
             same_as="embedding.word_embeddings.weight"),
    ),
)

ARCHITECTURES = {
    "llama": DENSE_DECODER,
    "mistral": DENSE_DECODER,
    "qwen2": DENSE_DECODER,
    "qwen3": DENSE_DECODER,
}


def architecture_for(shape: ModelShape) -> Architecture:
    try:
        return ARCHITECTURES[shape.model_type]
    except KeyError:
        raise MergeError(f"HF config model_type {shape.model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None


def iter_rules(arch: Architecture, shape: ModelShape):
    """(rule, full Megatron names it may have, HF name prefix) for every parameter, in output order."""
    for rule in arch.active(arch.before_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""
    for i in range(shape.num_layers):
        prefix = MEGATRON_LAYER.format(i=i)
        for rule in arch.active(arch.layer_rules, shape):
            yield rule, tuple(prefix + n for n in (rule.megatron, *rule.aliases)), HF_LAYER.format(i=i)
    for rule in arch.active(arch.after_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""


def pick_name(names: tuple[str, ...], available, where) -> str | None:
    """The one of a parameter's names that the checkpoint uses (None if none; an error if several)."""
    present = [n for n in names if n in available]
    if len(present) > 1:
        raise MergeError(f"{where}: holds the same parameter twice, as {' and '.join(present)}")
    return present[0] if present else None


