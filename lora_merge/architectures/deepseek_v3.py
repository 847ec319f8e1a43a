"""DeepSeek-V3 / R1: multi-latent attention, dense MLPs then routed experts with a shared expert; sigmoid
scores with the aux-free expert bias, group-limited choice (a group scores by its best two experts),
renormalised and scaled weights.

The router's expert bias only chooses experts, so rounding it could change which experts a token gets: it
stays fp32, as in the released checkpoints.
"""

import torch

from lora_merge.architectures.base import HfConfig
from lora_merge.architectures.mla import (DEEPSEEK_MOE_KEYS, MLA_DEFAULTS, MLA_KEYS, deepseek_decoder,
                                          dense_layer_count, expected_values, read_mla, shared_experts_count)
from lora_merge.architectures.moe import TRAINING_ONLY_KEYS
from lora_merge.errors import MergeError
from lora_merge.layout import Replicated
from lora_merge.moe_shape import MoeShape


def read_mla_v3(fields):
    if fields.cfg.get("rope_interleave", True) is not True:
        raise MergeError(f"{fields.path}: rope_interleave={fields.cfg['rope_interleave']!r}; Megatron's MLA rotates "
                         "the interleaved rope dims as rope_interleave=true does")
    return read_mla(fields)


def read_moe(fields, num_layers: int) -> MoeShape:
    expected_values(fields, "deepseek_v3", {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1})
    groups = fields.positive_int("n_group"), fields.positive_int("topk_group")
    ffn = fields.positive_int("moe_intermediate_size")
    return MoeShape(fields.positive_int("n_routed_experts"), fields.positive_int("num_experts_per_tok"), ffn,
                    shared_experts_count(fields) * ffn, False, fields.flag("norm_topk_prob"),
                    frozenset(range(dense_layer_count(fields), num_layers)), score="sigmoid", expert_bias=True,
                    groups=groups if groups[0] > 1 else None, group_score_top=2,
                    scaling=fields.number("routed_scaling_factor"))


CONFIG = HfConfig(
    "deepseek_v3", causal_lm="DeepseekV3ForCausalLM", family="llama",
    defaults={**MLA_DEFAULTS, "num_key_value_heads": 128, "head_dim": None, "max_position_embeddings": 4096, "n_routed_experts": 256,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True,
              "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
              "q_lora_rank": 1536},
    own_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS | TRAINING_ONLY_KEYS | {"rope_interleave"}, read_moe=read_moe,
    read_mla=read_mla_v3, fused_experts="mlp.experts",
)

ARCHITECTURE = deepseek_decoder(
    CONFIG, Replicated("mlp.router.expert_bias", ("experts",), hf="mlp.gate.e_score_correction_bias", layers="moe",
                       keep_dtype=torch.float32))
