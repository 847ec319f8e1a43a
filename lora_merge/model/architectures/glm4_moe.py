"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (`glm4_moe`): grouped-query attention with q/k/v biases (attention_bias;
o_proj has none), head_dim apart from hidden_size / heads, q/k norms where use_qk_norm says (on in GLM-4.5,
off in Air), and partial RoPE: the first partial_rotary_factor of each head's dims rotated with their halves
paired, as Megatron's rotary_percent does, so q/k rows keep their order. The MLP is DeepSeek-V3's: dense
below first_k_dense_replace, then sigmoid routing with the fp32 expert bias, renormalised and scaled
weights, and a shared expert. Its multi-token-prediction layers (num_nextn_predict_layers) are left as
DeepSeek's are."""

from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.mtp import MTP_LAYER
from lora_merge.model.architectures.dense import ATTENTION
from lora_merge.model.architectures.moe import EXPERT_BIAS, deepseek_moe_decoder, sigmoid_moe

GLM_MOE_KEYS = frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
                          "num_nextn_predict_layers", "use_qk_norm"})

CONFIG = HfConfig(
    "glm4_moe", causal_lm="Glm4MoeForCausalLM", family="llama", examined_keys=GLM_MOE_KEYS,
    qkv_bias="attention_bias", qk_norm="use_qk_norm", partial_rope=True, read_moe=sigmoid_moe,
    fused_experts="mlp.experts", peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
)

ARCHITECTURE = deepseek_moe_decoder(CONFIG, ATTENTION, EXPERT_BIAS).with_mtp(MTP_LAYER)
