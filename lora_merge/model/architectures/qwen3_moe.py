"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, routed experts, no shared expert."""

from lora_merge.model.architectures.base import PeftQuirks
from lora_merge.model.architectures.moe import QWEN_MOE_KEYS, moe_config, moe_decoder, qwen_moe, routed_experts

ARCHITECTURE = moe_decoder(
    moe_config("qwen3_moe",
               peft=PeftQuirks(converts_expert_targets=True), causal_lm="Qwen3MoeForCausalLM", family="qwen", qk_norm=True,
               examined_keys=QWEN_MOE_KEYS | {"num_local_experts"}, read_moe=qwen_moe),
    *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                    up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
)
