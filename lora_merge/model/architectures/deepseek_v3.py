"""DeepSeek-V3 / R1: multi-latent attention, dense MLPs then routed experts with a shared expert; sigmoid
scores with the aux-free expert bias, group-limited choice (a group scores by its best two experts),
renormalised and scaled weights.

The router's expert bias only chooses experts, so rounding it could change which experts a token gets: it
stays fp32, as in the released checkpoints.
"""

import torch

from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.mla import (DEEPSEEK_MOE_KEYS, MLA_KEYS, deepseek_decoder, dense_layer_count,
                                          expected_values, read_mla, shared_experts_count)
from lora_merge.errors import MergeError
from lora_merge.model.layout import Replicated
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown


def read_mla_v3(fields):
    if fields.get("rope_interleave", True) is not True:
        raise MergeError(f"{fields.path}: rope_interleave={shown(fields.get('rope_interleave'))}; Megatron's MLA rotates "
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
    examined_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS | {"rope_interleave"}, read_moe=read_moe,
    read_mla=read_mla_v3, fused_experts="mlp.experts",
    peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
)

ARCHITECTURE = deepseek_decoder(
    CONFIG, Replicated("mlp.router.expert_bias", ("experts",), hf="mlp.gate.e_score_correction_bias", layers="moe",
                       keep_dtype=torch.float32))
