"""Building blocks of the DeepSeek architectures (V2, V3/R1): multi-latent attention in both namings, and
a decoder of dense MLP layers below `first_k_dense_replace`, then routed experts with shared experts.

MLA in Megatron-Core's naming (`linear_q_down_proj`, `linear_kv_down_proj`, …) or MindSpeed-LLM's, which
fuses the down-projections into one replicated `linear_qkv` = [q_a_proj; kv_a_proj_with_mqa], or
[q_proj; kv_a_proj_with_mqa] without a q LoRA rank (V2-Lite), and names the rest `linear_qb`,
`linear_kvb` and `k_layernorm` (the kv norm). The down-projections are replicated linears with TE (its
duplicated mode) and in MindSpeed (a plain Linear), but column-parallel in Megatron-Core's local spec.
"""

from __future__ import annotations

from dataclasses import replace

from lora_merge.model.architectures.base import Architecture, HfConfig
from lora_merge.model.architectures.dense import DENSE_MLP, EMBEDDING, FINAL, PRE_MLP_NORM
from lora_merge.model.architectures.moe import routed_experts, shared_expert
from lora_merge.errors import MergeError
from lora_merge.model.layout import ColumnParallel, DuplicatedOrColumn, Replicated, ReplicatedRows, RowParallel
from lora_merge.model.mla_shape import MlaShape
from lora_merge.shown import shown

ATTN = "self_attention."
Q_DOWN, KV_DOWN, Q_PROJ = ATTN + "linear_q_down_proj.weight", ATTN + "linear_kv_down_proj.weight", ATTN + "linear_q_proj.weight"
MLA_ATTENTION = (
    Replicated("input_layernorm.weight", ("hidden",), hf="input_layernorm.weight"),
    DuplicatedOrColumn(Q_DOWN, ("q_lora", "hidden"), hf="self_attn.q_a_proj.weight", requires="q_lora"),
    Replicated(ATTN + "q_layernorm.weight", ("q_lora",), hf="self_attn.q_a_layernorm.weight", requires="q_lora",
               aliases=(ATTN + "linear_q_up_proj.layer_norm_weight",)),
    ColumnParallel(ATTN + "linear_q_up_proj.weight", ("q_heads", "q_lora"), hf="self_attn.q_b_proj.weight",
                   requires="q_lora", aliases=(ATTN + "linear_qb.weight",)),
    ColumnParallel(Q_PROJ, ("q_heads", "hidden"), hf="self_attn.q_proj.weight", requires="no_q_lora"),
    DuplicatedOrColumn(KV_DOWN, ("kv_down", "hidden"), hf="self_attn.kv_a_proj_with_mqa.weight"),
    Replicated(ATTN + "kv_layernorm.weight", ("kv_lora",), hf="self_attn.kv_a_layernorm.weight",
               aliases=(ATTN + "linear_kv_up_proj.layer_norm_weight", ATTN + "k_layernorm.weight")),
    ColumnParallel(ATTN + "linear_kv_up_proj.weight", ("kv_heads", "kv_lora"), hf="self_attn.kv_b_proj.weight",
                   aliases=(ATTN + "linear_kvb.weight",)),
    RowParallel(ATTN + "linear_proj.weight", ("hidden", "v_heads"), hf="self_attn.o_proj.weight"),
    # MindSpeed-LLM's naming, used in a layer where the checkpoint has it: one replicated linear for both
    # down-projections; its LoRA has one A, and B splits at the q rows like the weight.
    ReplicatedRows(ATTN + "linear_qkv.weight", ("q_kv_down", "hidden"), requires="q_lora",
                   parts=(("self_attn.q_a_proj.weight", "q_lora"), ("self_attn.kv_a_proj_with_mqa.weight", "kv_down")),
                   instead_of=(Q_DOWN, KV_DOWN)),
    ReplicatedRows(ATTN + "linear_qkv.weight", ("q_kv_down", "hidden"), requires="no_q_lora",
                   parts=(("self_attn.q_proj.weight", "q_heads"), ("self_attn.kv_a_proj_with_mqa.weight", "kv_down")),
                   instead_of=(Q_PROJ, KV_DOWN)),
)

MLA_KEYS = frozenset({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "qk_head_dim"})
# DeepSeek's MoE fields. scoring_func, topk_method and moe_layer_freq are read by DeepSeek's own code (and
# vLLM), not by transformers' class: each architecture checks they say what the class computes. ep_size,
# aux_loss_alpha and seq_aux act only in training; the MTP layers transformers does not load (Megatron's
# are refused by the args check).
DEEPSEEK_MOE_KEYS = frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                               "moe_intermediate_size", "norm_topk_prob", "routed_scaling_factor", "n_group",
                               "topk_group", "first_k_dense_replace", "topk_method", "scoring_func",
                               "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers"})


def read_mla(fields) -> MlaShape:
    return MlaShape(fields.positive_int("q_lora_rank", nullable=True), fields.positive_int("kv_lora_rank"),
                    fields.positive_int("qk_nope_head_dim"), fields.positive_int("qk_rope_head_dim"),
                    fields.positive_int("v_head_dim"))


def expected_values(fields, model_type: str, expected: dict) -> None:
    """Fields of the released config.json that only DeepSeek's own modeling code reads: they must say what
    transformers' class computes, or the model would differ between loaders."""
    for key, value in expected.items():
        if key in fields.raw and fields.raw[key] != value:
            raise MergeError(f"{fields.path}: {key}={shown(fields.raw[key])}; transformers' {model_type} computes "
                             f"{key}={shown(value)}")


def dense_layer_count(fields) -> int:
    return fields.count("first_k_dense_replace")


def shared_experts_count(fields) -> int:
    return fields.count("n_shared_experts")


def deepseek_decoder(config: HfConfig, *router_rules) -> Architecture:
    """MLA attention, dense MLPs below first_k_dense_replace, then routed experts and their shared experts
    (Megatron fuses DeepSeek's several shared experts into one wider MLP, as HF does)."""
    moe = (
        *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                        up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
        *router_rules,
        *shared_expert(gate="mlp.shared_experts.gate_proj.weight", up="mlp.shared_experts.up_proj.weight",
                       down="mlp.shared_experts.down_proj.weight"),
    )
    dense = tuple(replace(rule, layers="dense") for rule in DENSE_MLP)
    return Architecture(name=config.model_type, before_layers=EMBEDDING,
                        layer_rules=(*MLA_ATTENTION, PRE_MLP_NORM, *dense, *moe), after_layers=FINAL, config=config)
