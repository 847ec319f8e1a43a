"""Mixtral: Mistral attention, every layer routed experts under `block_sparse_moe` (w1 gate, w3 up, w2 down),
the top-k probabilities always renormalised."""

from lora_merge.model.architectures.base import PeftQuirks
from lora_merge.model.architectures.moe import moe_config, moe_decoder, routed_experts
from lora_merge.model.moe_shape import MoeShape


def read_moe(fields, num_layers):
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("intermediate_size"), 0, False, True, frozenset(range(num_layers)))


ARCHITECTURE = moe_decoder(
    moe_config("mixtral",
               peft=PeftQuirks(converts_expert_targets=True), causal_lm="MixtralForCausalLM", family="mistral",
               examined_keys={"num_local_experts", "num_experts_per_tok"}, read_moe=read_moe),
    *routed_experts(router="block_sparse_moe.gate.weight", gate="block_sparse_moe.experts.{expert}.w1.weight",
                    up="block_sparse_moe.experts.{expert}.w3.weight", down="block_sparse_moe.experts.{expert}.w2.weight"),
)
