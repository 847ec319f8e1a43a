"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, routed experts and one gated shared expert."""

from lora_merge.architectures.moe import moe_decoder, routed_experts, shared_expert

ARCHITECTURE = moe_decoder(
    "qwen2_moe",
    *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                    up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
    *shared_expert(gate="mlp.shared_expert.gate_proj.weight", up="mlp.shared_expert.up_proj.weight",
                   down="mlp.shared_expert.down_proj.weight", gate_weight="mlp.shared_expert_gate.weight"),
)
