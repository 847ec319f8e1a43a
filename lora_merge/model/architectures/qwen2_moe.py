"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, routed experts and one gated shared expert."""

from lora_merge.model.architectures.base import PeftQuirks
from lora_merge.model.architectures.moe import QWEN_MOE_KEYS, moe_config, moe_decoder, qwen_moe, routed_experts, shared_expert


def read_moe(fields, num_layers):
    return qwen_moe(fields, num_layers, shared_ffn=fields.positive_int("shared_expert_intermediate_size"),
                    shared_gate=True)


ARCHITECTURE = moe_decoder(
    moe_config("qwen2_moe",
               peft=PeftQuirks(drops_per_expert=True), causal_lm="Qwen2MoeForCausalLM", family="qwen", qkv_bias="qkv_bias",
               examined_keys=QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"}, read_moe=read_moe),
    *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                    up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
    *shared_expert(gate="mlp.shared_expert.gate_proj.weight", up="mlp.shared_expert.up_proj.weight",
                   down="mlp.shared_expert.down_proj.weight", gate_weight="mlp.shared_expert_gate.weight"),
)
