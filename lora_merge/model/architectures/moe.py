"""Building blocks of the Mixture-of-Experts architectures: a routed-expert MLP under any HF naming, and
the config fields MoE model types share.

Expert rules are templates over `{expert}`; readers present every expert layout (SequentialMLP,
GroupedMLP, TEGroupedMLP, MindSpeed's grouped LoRA) as `mlp.experts.{expert}.linear_fc1/fc2` with global
expert numbers, so one rule serves them all.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lora_merge.model.architectures.base import Architecture, HfConfig
from lora_merge.model.architectures.dense import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, PRE_MLP_NORM
from lora_merge.errors import MergeError
from lora_merge.model.layout import GatedColumn, Replicated, RowParallel
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown

# Qwen's MoE configs: which layers have experts, and how many experts of what size.
QWEN_MOE_KEYS = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "decoder_sparse_step", "mlp_only_layers"})


def routed_experts(router: str, gate: str, up: str, down: str) -> tuple:
    """Router and experts of a MoE layer, the HF names given relative to the layer (with `{expert}`).
    The router is kept in fp32 during training; it is written in the output dtype like every tensor."""
    return (
        Replicated("mlp.router.weight", ("experts", "hidden"), hf=router, layers="moe"),
        GatedColumn("mlp.experts.{expert}.linear_fc1.weight", ("gated_moe_ffn", "hidden"), gate=gate, up=up,
                    layers="moe"),
        RowParallel("mlp.experts.{expert}.linear_fc2.weight", ("hidden", "moe_ffn"), hf=down, layers="moe"),
    )


def shared_expert(gate: str, up: str, down: str, gate_weight: str | None = None) -> tuple:
    """The shared expert(s) of a MoE layer (Megatron fuses DeepSeek's several into one wider MLP, as HF
    does); `gate_weight`: the HF name of Qwen2-MoE's sigmoid gate on its output."""
    rules = (
        GatedColumn("mlp.shared_experts.linear_fc1.weight", ("gated_shared_ffn", "hidden"), gate=gate, up=up,
                    layers="moe", requires="shared_expert"),
        RowParallel("mlp.shared_experts.linear_fc2.weight", ("hidden", "shared_ffn"), hf=down, layers="moe",
                    requires="shared_expert"),
    )
    if gate_weight is None:
        return rules
    return rules + (Replicated("mlp.shared_experts.gate_weight", ("one", "hidden"), hf=gate_weight, layers="moe",
                               requires="shared_expert"),)


def moe_decoder(config: HfConfig, *moe_rules) -> Architecture:
    """A decoder whose layers are dense or MoE as the config says (mlp_only_layers, decoder_sparse_step)."""
    dense = tuple(replace(rule, layers="dense") for rule in DENSE_MLP)
    # torch_dist names a MoE layer's pre-MLP norm linear_fc1.layer_norm_weight too (PRE_MLP_NORM's alias).
    return Architecture(name=config.model_type, before_layers=EMBEDDING,
                        layer_rules=(*ATTENTION, PRE_MLP_NORM, *dense, *moe_rules), after_layers=FINAL, config=config)


def qwen_moe(fields, num_layers: int, shared_ffn: int = 0, shared_gate: bool = False) -> MoeShape:
    """Qwen2-MoE / Qwen3-MoE: experts in the layers not in `mlp_only_layers` whose number + 1 is a multiple
    of `decoder_sparse_step`."""
    step = fields.positive_int("decoder_sparse_step")
    dense = fields.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise MergeError(f"{fields.path}: 'mlp_only_layers' must be a list of layer numbers, found {shown(dense)}")
    layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeShape(_num_experts(fields), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("moe_intermediate_size"), shared_ffn, shared_gate, fields.flag("norm_topk_prob"),
                    layers)


def _num_experts(fields) -> int:
    # transformers 5 names Qwen3-MoE's count num_local_experts; released configs say num_experts
    stated = {k: fields.raw[k] for k in ("num_experts", "num_local_experts") if k in fields.raw}
    if len(set(map(repr, stated.values()))) > 1:
        raise MergeError(f"{fields.path}: num_experts={shown(stated['num_experts'])} and num_local_experts="
                         f"{shown(stated['num_local_experts'])} disagree; expected one number of experts")
    return fields.positive_int("num_experts")


def moe_config(model_type: str, causal_lm: str, family: str, examined_keys, read_moe, **more) -> HfConfig:
    return HfConfig(model_type, causal_lm=causal_lm, family=family, examined_keys=frozenset(examined_keys),
                    read_moe=read_moe, fused_experts="mlp.experts", **more)  # Mixtral's too (transformers 5 renamed block_sparse_moe)


# ---------------------------------------------------------------------------------------------------------
# DeepSeek's MoE layout, shared by DeepSeek-V2/V3 (with MLA) and GLM-4.5 (with grouped-query attention)

# The MoE fields of DeepSeek's configs (GLM-4.5's are a subset). scoring_func, topk_method and moe_layer_freq
# are read by DeepSeek's own code (and vLLM), not by transformers' class: each architecture checks they say
# what the class computes. ep_size, aux_loss_alpha and seq_aux act only in training; the MTP layers
# transformers does not load (Megatron's are refused by the args check).
DEEPSEEK_MOE_KEYS = frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                               "moe_intermediate_size", "norm_topk_prob", "routed_scaling_factor", "n_group",
                               "topk_group", "first_k_dense_replace", "topk_method", "scoring_func",
                               "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers"})


def expected_values(fields, model_type: str, expected: dict) -> None:
    """Fields of the released config.json that only DeepSeek's own modeling code reads: they must say what
    transformers' class computes, or the model would differ between loaders."""
    for key, value in expected.items():
        if key in fields.raw and fields.raw[key] != value:
            raise MergeError(f"{fields.path}: {key}={shown(fields.raw[key])}; transformers' {model_type} computes "
                             f"{key}={shown(value)}")


def dense_layer_count(fields) -> int:
    return fields.count("first_k_dense_replace")


def shared_experts_count(fields) -> int:
    return fields.count("n_shared_experts")


# The aux-free expert bias of sigmoid routing (DeepSeek-V3, GLM-4.5). It only chooses experts, so rounding it
# could change which experts a token gets: it stays fp32, as in the released checkpoints.
EXPERT_BIAS = Replicated("mlp.router.expert_bias", ("experts",), hf="mlp.gate.e_score_correction_bias", layers="moe",
                         keep_dtype=torch.float32)


def sigmoid_moe(fields, num_layers: int) -> MoeShape:
    """DeepSeek-V3's routing, GLM-4.5's too: sigmoid scores plus the expert bias choose the experts,
    group-limited (a group scores by its best two experts), weights renormalised where norm_topk_prob says so
    and scaled by routed_scaling_factor; dense MLPs below first_k_dense_replace."""
    groups = fields.positive_int("n_group"), fields.positive_int("topk_group")
    ffn = fields.positive_int("moe_intermediate_size")
    return MoeShape(fields.positive_int("n_routed_experts"), fields.positive_int("num_experts_per_tok"), ffn,
                    shared_experts_count(fields) * ffn, False, fields.flag("norm_topk_prob"),
                    frozenset(range(dense_layer_count(fields), num_layers)), score="sigmoid", expert_bias=True,
                    groups=groups if groups[0] > 1 else None, group_score_top=2,
                    scaling=fields.number("routed_scaling_factor"))


def deepseek_moe_decoder(config: HfConfig, attention: tuple, *router_rules) -> Architecture:
    """`attention`, dense MLPs below first_k_dense_replace, then routed experts (`router_rules`: what the router
    has beside its weight) and their shared experts (Megatron fuses DeepSeek's several shared experts into one
    wider MLP, as HF does)."""
    moe = (
        *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                        up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
        *router_rules,
        *shared_expert(gate="mlp.shared_experts.gate_proj.weight", up="mlp.shared_experts.up_proj.weight",
                       down="mlp.shared_experts.down_proj.weight"),
    )
    dense = tuple(replace(rule, layers="dense") for rule in DENSE_MLP)
    return Architecture(name=config.model_type, before_layers=EMBEDDING,
                        layer_rules=(*attention, PRE_MLP_NORM, *dense, *moe), after_layers=FINAL, config=config)
