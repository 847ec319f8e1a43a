"""Building blocks of the DeepSeek architectures (V2, V3/R1): multi-latent attention in both namings, in
DeepSeek's MoE decoder (moe.deepseek_moe_decoder).

MLA in Megatron-Core's naming (`linear_q_down_proj`, `linear_kv_down_proj`, …) or MindSpeed-LLM's, which
fuses the down-projections into one replicated `linear_qkv` = [q_a_proj; kv_a_proj_with_mqa], or
[q_proj; kv_a_proj_with_mqa] without a q LoRA rank (V2-Lite), and names the rest `linear_qb`,
`linear_kvb` and `k_layernorm` (the kv norm). The down-projections are replicated linears with TE (its
duplicated mode) and in MindSpeed (a plain Linear), but column-parallel in Megatron-Core's local spec.
"""

from __future__ import annotations

from lora_merge.model.architectures.base import Architecture, HfConfig
from lora_merge.model.architectures.moe import deepseek_moe_decoder
from lora_merge.model.layout import ColumnParallel, DuplicatedOrColumn, Replicated, ReplicatedRows, RowParallel
from lora_merge.model.mla_shape import MlaShape

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
def read_mla(fields) -> MlaShape:
    return MlaShape(fields.positive_int("q_lora_rank", nullable=True), fields.positive_int("kv_lora_rank"),
                    fields.positive_int("qk_nope_head_dim"), fields.positive_int("qk_rope_head_dim"),
                    fields.positive_int("v_head_dim"))


def deepseek_decoder(config: HfConfig, *router_rules) -> Architecture:
    """MLA attention, then DeepSeek's MoE layout (moe.deepseek_moe_decoder)."""
    return deepseek_moe_decoder(config, MLA_ATTENTION, *router_rules)
