"""Mixtral: Mistral attention, every layer routed experts under `block_sparse_moe` (w1 gate, w3 up, w2 down)."""

from lora_merge.architectures.moe import moe_decoder, routed_experts

ARCHITECTURE = moe_decoder(
    "mixtral",
    *routed_experts(router="block_sparse_moe.gate.weight", gate="block_sparse_moe.experts.{expert}.w1.weight",
                    up="block_sparse_moe.experts.{expert}.w3.weight", down="block_sparse_moe.experts.{expert}.w2.weight"),
)
