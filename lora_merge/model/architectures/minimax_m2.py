"""MiniMax-M2 (`minimax_m2`), on the HF routes (an HF base with a PEFT adapter; `hf_only`): grouped-query attention
without biases whose q and k norms run over the whole projection (q_norm [heads·head_dim], k_norm
[kv heads·head_dim]: the statistics span every head, so a tensor-parallel split would need their all-reduce),
partial RoPE (the release's `rotary_dim`, read by transformers as partial_rotary_factor), and in every layer
Mixtral-named routed experts (`block_sparse_moe`, w1 gate, w3 up, w2 down) chosen by sigmoid scores plus the
expert bias (`block_sparse_moe.e_score_correction_bias`, written fp32: it only chooses experts, and vLLM and
SGLang keep it fp32; transformers casts it to the model's dtype as it loads).
The block-FP8 release is read as the other block-FP8 releases are.

No Megatron form is read or written: megatron-core (0.16.1) normalises q and k per head only, so no Megatron
model of it can be built to prove a layout. Names of what Megatron lacks are this table's own keys."""

import torch

from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import EMBEDDING, FINAL, INPUT_NORM, O_PROJ, PRE_MLP_NORM, QKV
from lora_merge.model.architectures.moe import expected_values, routed_experts
from lora_merge.model.layout import Replicated
from lora_merge.model.moe_shape import MoeShape


def read_moe(fields, num_layers: int) -> MoeShape:
    expected_values(fields, "minimax_m2", {"scoring_func": "sigmoid", "use_routing_bias": True,
                                           "shared_intermediate_size": 0})
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("intermediate_size"), 0, False, True, frozenset(range(num_layers)),
                    score="sigmoid", expert_bias=True)


CONFIG = HfConfig(
    "minimax_m2", causal_lm="MiniMaxM2ForCausalLM", family="mistral",
    examined_keys=frozenset({"num_local_experts", "num_experts_per_tok", "scoring_func", "use_routing_bias",
                             "shared_intermediate_size", "rotary_dim", "use_qk_norm", "qk_norm_type", "attn_type_list",
                             "use_mtp", "num_mtp_modules", "mtp_transformer_layers", "mlp_intermediate_size",
                             "shared_moe_mode", "layernorm_full_attention_beta", "layernorm_linear_attention_beta",
                             "layernorm_mlp_beta", "router_jitter_noise"}),
    partial_rope=True, read_moe=read_moe, fused_experts="mlp.experts", peft=PeftQuirks(converts_expert_targets=True),
    hf_only="megatron-core (0.16.1) normalises q and k per head only, not over the whole projection as MiniMax-M2 "
            "does, so no Megatron model of it can be built to prove a layout",
)

ARCHITECTURE = Architecture(
    name="minimax_m2", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM,
        QKV[0],  # (no biases)
        Replicated("hf.self_attn.q_norm.weight", ("q",), hf="self_attn.q_norm.weight"),
        Replicated("hf.self_attn.k_norm.weight", ("kv",), hf="self_attn.k_norm.weight"),
        O_PROJ,
        PRE_MLP_NORM,
        *routed_experts(router="block_sparse_moe.gate.weight", gate="block_sparse_moe.experts.{expert}.w1.weight",
                        up="block_sparse_moe.experts.{expert}.w3.weight",
                        down="block_sparse_moe.experts.{expert}.w2.weight"),
        Replicated("mlp.router.expert_bias", ("experts",), hf="block_sparse_moe.e_score_correction_bias", layers="moe",
                   keep_dtype=torch.float32),
    ),
)
