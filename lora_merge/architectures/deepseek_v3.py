"""DeepSeek-V3 / R1: multi-latent attention, dense MLPs below `first_k_dense_replace` then routed experts
with shared experts, sigmoid routing with the aux-free expert bias, group-limited choice, scaled weights.

MLA in Megatron-Core's naming (`linear_q_down_proj`, `linear_kv_down_proj`, …) or MindSpeed-LLM's, which
fuses the two down-projections into one replicated `linear_qkv` = [q_a_proj; kv_a_proj_with_mqa]. The
down-projections are replicated linears (TE's duplicated mode, MindSpeed's plain Linear). The router's
expert bias only chooses experts, so rounding it could change which experts a token gets: it stays fp32,
as in the released checkpoints.
"""

import torch

from lora_merge.architectures.base import HfConfig
from lora_merge.architectures.dense import DENSE_MLP, EMBEDDING, FINAL, PRE_MLP_NORM
from lora_merge.architectures.moe import TRAINING_ONLY_KEYS, routed_experts, shared_expert
from lora_merge.architectures.base import Architecture
from lora_merge.errors import MergeError
from lora_merge.layout import ColumnParallel, Replicated, ReplicatedRows, RowParallel
from lora_merge.mla_shape import MlaShape
from lora_merge.moe_shape import MoeShape
from dataclasses import replace

ATTN = "self_attention."
MLA_ATTENTION = (
    Replicated("input_layernorm.weight", ("hidden",), hf="input_layernorm.weight"),
    Replicated(ATTN + "linear_q_down_proj.weight", ("q_lora", "hidden"), hf="self_attn.q_a_proj.weight",
               requires="q_lora"),
    Replicated(ATTN + "q_layernorm.weight", ("q_lora",), hf="self_attn.q_a_layernorm.weight", requires="q_lora",
               aliases=(ATTN + "linear_q_up_proj.layer_norm_weight",)),
    ColumnParallel(ATTN + "linear_q_up_proj.weight", ("q_heads", "q_lora"), hf="self_attn.q_b_proj.weight",
                   requires="q_lora"),
    ColumnParallel(ATTN + "linear_q_proj.weight", ("q_heads", "hidden"), hf="self_attn.q_proj.weight",
                   requires="no_q_lora"),
    Replicated(ATTN + "linear_kv_down_proj.weight", ("kv_down", "hidden"), hf="self_attn.kv_a_proj_with_mqa.weight"),
    Replicated(ATTN + "kv_layernorm.weight", ("kv_lora",), hf="self_attn.kv_a_layernorm.weight",
               aliases=(ATTN + "linear_kv_up_proj.layer_norm_weight",)),
    ColumnParallel(ATTN + "linear_kv_up_proj.weight", ("kv_heads", "kv_lora"), hf="self_attn.kv_b_proj.weight"),
    RowParallel(ATTN + "linear_proj.weight", ("hidden", "v_heads"), hf="self_attn.o_proj.weight"),
)
# MindSpeed-LLM's naming: one replicated linear for both down-projections (its LoRA: one A, B split at q_lora).
MINDSPEED_QKV = ReplicatedRows(ATTN + "linear_qkv.weight", ("q_kv_down", "hidden"), requires="q_lora",
                               parts=(("self_attn.q_a_proj.weight", "q_lora"),
                                      ("self_attn.kv_a_proj_with_mqa.weight", "kv_down")),
                               instead_of=(ATTN + "linear_q_down_proj.weight", ATTN + "linear_kv_down_proj.weight"))

MOE = (
    *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                    up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
    Replicated("mlp.router.expert_bias", ("experts",), hf="mlp.gate.e_score_correction_bias", layers="moe",
               keep_dtype=torch.float32),
    *shared_expert(gate="mlp.shared_experts.gate_proj.weight", up="mlp.shared_experts.up_proj.weight",
                   down="mlp.shared_experts.down_proj.weight"),
)

MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
            "rope_interleave"}
MOE_KEYS = {"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
            # in the released config.json, read by DeepSeek's own modeling code; checked below
            "scoring_func", "topk_method", "moe_layer_freq",
            # parallelism and load-balancing loss of the original training code; MTP layers (not loaded by
            # transformers; Megatron's are refused by the args check)
            "ep_size", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers"}


def read_mla(fields) -> MlaShape:
    if fields.cfg.get("rope_interleave", True) is not True:
        raise MergeError(f"{fields.path}: rope_interleave={fields.cfg['rope_interleave']!r}; Megatron's MLA rotates "
                         "the interleaved rope dims as rope_interleave=true does")
    return MlaShape(fields.positive_int("q_lora_rank", nullable=True), fields.positive_int("kv_lora_rank"),
                    fields.positive_int("qk_nope_head_dim"), fields.positive_int("qk_rope_head_dim"),
                    fields.positive_int("v_head_dim"))


def read_moe(fields, num_layers: int) -> MoeShape:
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if key in fields.cfg and fields.cfg[key] != expected:
            raise MergeError(f"{fields.path}: {key}={fields.cfg[key]!r}; transformers' deepseek_v3 computes "
                             f"{key}={expected!r}")
    experts, ffn = fields.positive_int("n_routed_experts"), fields.positive_int("moe_intermediate_size")
    groups = fields.positive_int("n_group"), fields.positive_int("topk_group")
    dense = fields.cfg.get("first_k_dense_replace", fields.default("first_k_dense_replace"))
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise MergeError(f"{fields.path}: 'first_k_dense_replace' must be a layer count, found {dense!r}")
    shared = fields.cfg.get("n_shared_experts", fields.default("n_shared_experts")) or 0
    return MoeShape(experts, fields.positive_int("num_experts_per_tok"), ffn, shared * ffn, False,
                    fields.flag("norm_topk_prob"), frozenset(range(dense, num_layers)), score="sigmoid",
                    expert_bias=True, groups=groups if groups[0] > 1 else None,
                    scaling=fields.number("routed_scaling_factor"))


CONFIG = HfConfig(
    "deepseek_v3", causal_lm="DeepseekV3ForCausalLM", family="llama",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096,
              "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
              "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128},
    own_keys=frozenset(MLA_KEYS | MOE_KEYS | TRAINING_ONLY_KEYS), read_moe=read_moe, read_mla=read_mla,
    fused_experts="mlp.experts",
)

ARCHITECTURE = Architecture(
    name="deepseek_v3", before_layers=EMBEDDING,
    layer_rules=(*MLA_ATTENTION, MINDSPEED_QKV, PRE_MLP_NORM, *(replace(rule, layers="dense") for rule in DENSE_MLP), *MOE),
    after_layers=FINAL, config=CONFIG)
