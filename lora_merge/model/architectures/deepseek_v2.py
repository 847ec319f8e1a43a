"""DeepSeek-V2 / V2-Lite: multi-latent attention (V2-Lite without a q LoRA rank), dense MLPs then routed
experts with shared experts; softmax over all experts, top-k without renormalisation (transformers'
class never renormalises, whatever norm_topk_prob says), scaled weights; group-limited choice scores a
group by its best expert."""

from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.mla import MLA_KEYS, deepseek_decoder, read_mla
from lora_merge.model.architectures.moe import (DEEPSEEK_MOE_KEYS, dense_layer_count, expected_values,
                                                shared_experts_count)
from lora_merge.errors import MergeError
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown


def read_moe(fields, num_layers: int) -> MoeShape:
    expected_values(fields, "deepseek_v2", {"scoring_func": "softmax", "moe_layer_freq": 1})
    if fields.flag("norm_topk_prob"):
        raise MergeError(f"{fields.path}: norm_topk_prob=true, which transformers' deepseek_v2 ignores (it never "
                         "renormalises) but DeepSeek's own code and vLLM honour: the model would depend on the "
                         "loader; expected false")
    method = fields.get("topk_method", "greedy")
    if method == "greedy":
        groups = None
    elif method == "group_limited_greedy":
        groups = fields.positive_int("n_group"), fields.positive_int("topk_group")
    else:
        raise MergeError(f"{fields.path}: topk_method={shown(method)}; transformers' deepseek_v2 computes 'greedy' or "
                         "'group_limited_greedy'")
    ffn = fields.positive_int("moe_intermediate_size")
    return MoeShape(fields.positive_int("n_routed_experts"), fields.positive_int("num_experts_per_tok"), ffn,
                    shared_experts_count(fields) * ffn, False, False,
                    frozenset(range(dense_layer_count(fields), num_layers)),
                    groups=groups if groups and groups[0] > 1 else None, group_score_top=1,
                    scaling=fields.number("routed_scaling_factor"))


CONFIG = HfConfig(
    "deepseek_v2", causal_lm="DeepseekV2ForCausalLM", family="llama",
    examined_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS, read_moe=read_moe, read_mla=read_mla,
    fused_experts="mlp.experts",
    peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
)

ARCHITECTURE = deepseek_decoder(CONFIG)
