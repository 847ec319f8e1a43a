"""DeepSeek-V3 / R1: multi-latent attention, dense MLPs then routed experts with a shared expert; sigmoid
scores with the aux-free expert bias, group-limited choice (a group scores by its best two experts),
renormalised and scaled weights.
"""

from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.mtp import MTP_LAYER
from lora_merge.model.architectures.mla import MLA_KEYS, deepseek_decoder, read_mla
from lora_merge.model.architectures.moe import DEEPSEEK_MOE_KEYS, EXPERT_BIAS, expected_values, sigmoid_moe
from lora_merge.errors import MergeError
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown


def read_mla_v3(fields):
    if fields.get("rope_interleave", True) is not True:
        raise MergeError(f"{fields.path}: rope_interleave={shown(fields.get('rope_interleave'))}; Megatron's MLA rotates "
                         "the interleaved rope dims as rope_interleave=true does")
    return read_mla(fields)


def read_moe(fields, num_layers: int) -> MoeShape:
    expected_values(fields, "deepseek_v3", {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1})
    return sigmoid_moe(fields, num_layers)


CONFIG = HfConfig(
    "deepseek_v3", causal_lm="DeepseekV3ForCausalLM", family="llama",
    examined_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS | {"rope_interleave"}, read_moe=read_moe,
    read_mla=read_mla_v3, fused_experts="mlp.experts",
    peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
)

ARCHITECTURE = deepseek_decoder(CONFIG, EXPERT_BIAS).with_mtp(MTP_LAYER)
