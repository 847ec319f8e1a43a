"""Building blocks of the Mixture-of-Experts tables: a routed-expert MLP under any HF naming.

Expert rules are templates over `{expert}`; readers present every expert layout (SequentialMLP,
GroupedMLP, TEGroupedMLP, MindSpeed's grouped LoRA) as `mlp.experts.{expert}.linear_fc1/fc2` with global
expert numbers, so one rule serves them all.
"""

from __future__ import annotations

from dataclasses import replace

from lora_merge.architectures.base import Architecture
from lora_merge.architectures.dense import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, PRE_MLP_NORM
from lora_merge.layout import GatedColumn, Replicated, RowParallel


def routed_experts(router: str, gate: str, up: str, down: str) -> tuple:
    """Router and experts of a MoE layer, the HF names given relative to the layer (with `{expert}`).
    The router is kept in fp32 during training; it is written in the output dtype like every tensor."""
    return (
        Replicated("mlp.router.weight", ("experts", "hidden"), hf=router, layers="moe"),
        GatedColumn("mlp.experts.{expert}.linear_fc1.weight", ("gated_moe_ffn", "hidden"), gate=gate, up=up,
                    layers="moe"),
        RowParallel("mlp.experts.{expert}.linear_fc2.weight", ("hidden", "moe_ffn"), hf=down, layers="moe"),
    )


def shared_expert(gate: str, up: str, down: str, gate_weight: str) -> tuple:
    return (
        GatedColumn("mlp.shared_experts.linear_fc1.weight", ("gated_shared_ffn", "hidden"), gate=gate, up=up,
                    layers="moe", requires="shared_expert"),
        RowParallel("mlp.shared_experts.linear_fc2.weight", ("hidden", "shared_ffn"), hf=down, layers="moe",
                    requires="shared_expert"),
        Replicated("mlp.shared_experts.gate_weight", ("one", "hidden"), hf=gate_weight, layers="moe",
                   requires="shared_expert"),
    )


def moe_decoder(name: str, *moe_rules) -> Architecture:
    """A decoder whose layers are dense or MoE as the config says (mlp_only_layers, decoder_sparse_step)."""
    dense = tuple(replace(rule, layers="dense") for rule in DENSE_MLP)
    # torch_dist names a MoE layer's pre-MLP norm linear_fc1.layer_norm_weight too (PRE_MLP_NORM's alias).
    return Architecture(name=name, before_layers=EMBEDDING, layer_rules=(*ATTENTION, PRE_MLP_NORM, *dense, *moe_rules),
                        after_layers=FINAL)
