"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, routed experts, no shared expert."""

from lora_merge.architectures.moe import moe_decoder, routed_experts

ARCHITECTURE = moe_decoder(
    "qwen3_moe",
    *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                    up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
)
