"""The Mixture-of-Experts part of a model: read from the HF config and checked against the Megatron args,
so that routing computes what was trained (same experts per layer, same top-k, same normalisation)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from lora_merge.errors import MergeError

# HF config keys each MoE model type reads (besides the dense ones); router_aux_loss_coef,
# output_router_logits and router_jitter_noise only act in training.
MOE_CONFIG_KEYS = {
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers"},
    "qwen2_moe": {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"},
    "mixtral": {"num_local_experts", "num_experts_per_tok"},
}
TRAINING_ONLY_KEYS = {"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}
# transformers' defaults for them (Qwen3MoeConfig, Qwen2MoeConfig, MixtralConfig)
MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "shared_expert_intermediate_size": 5632,
                  "qkv_bias": True},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    topk: int
    ffn: int  # per routed expert
    shared_ffn: int  # the shared expert's (0: none)
    shared_gate: bool  # the shared expert's output is scaled by sigmoid(x·gate)
    norm_topk: bool  # the top-k probabilities are renormalised (Megatron: moe_router_pre_softmax=False)
    layers: frozenset[int]  # decoder layers with routed experts; the others have a dense MLP

    def __str__(self) -> str:
        return (f"{self.num_experts} experts, top-{self.topk}, expert ffn {self.ffn}"
                + (f", shared expert ffn {self.shared_ffn}" if self.shared_ffn else ""))


def read_moe(fields, model_type: str, num_layers: int) -> MoeShape | None:
    """`fields`: model_shape's typed config access (defaults already those of the model type)."""
    if model_type not in MOE_CONFIG_KEYS:
        return None
    path = fields.path
    if model_type == "mixtral":
        return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                        fields.positive_int("intermediate_size"), 0, False, True, frozenset(range(num_layers)))
    experts = _num_experts(fields, path)
    step = fields.positive_int("decoder_sparse_step")
    dense = fields.null_or("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise MergeError(f"{path}: 'mlp_only_layers' must be a list of layer numbers, found {dense!r}")
    layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = fields.positive_int("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    return MoeShape(experts, fields.positive_int("num_experts_per_tok"), fields.positive_int("moe_intermediate_size"),
                    shared, model_type == "qwen2_moe", fields.flag("norm_topk_prob"), layers)


def _num_experts(fields, path) -> int:
    # transformers 5 names Qwen3-MoE's count num_local_experts; released configs say num_experts
    stated = {k: fields.positive_int(k) for k in ("num_experts", "num_local_experts") if k in fields.cfg}
    if len(set(stated.values())) > 1:
        raise MergeError(f"{path}: num_experts={stated['num_experts']} and num_local_experts="
                         f"{stated['num_local_experts']} disagree; expected one number of experts")
    return next(iter(stated.values()), None) or fields.positive_int("num_experts")


def megatron_moe_layers(args, num_layers: int, where: str) -> frozenset[int]:
    """Which layers Megatron gave routed experts: moe_layer_freq is an int k (every k-th layer, from 0),
    a list of 0/1 per layer, or that list as a string."""
    freq = getattr(args, "moe_layer_freq", None)
    if freq is None:
        freq = 1
    if isinstance(freq, str):
        try:
            freq = ast.literal_eval(freq.strip())
        except (ValueError, SyntaxError) as exc:
            raise MergeError(f"{where}: args.moe_layer_freq={freq!r} is not a number or a list") from exc
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return frozenset(i for i in range(num_layers) if i % freq == 0)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        return frozenset(i for i, v in enumerate(freq) if v == 1)
    raise MergeError(f"{where}: args.moe_layer_freq={freq!r}; expected a positive int or {num_layers} zeros and ones")


def check_moe_args(moe: MoeShape | None, args, num_layers: int, where: str) -> None:
    experts = getattr(args, "num_experts", None)
    if moe is None:
        if experts:
            raise MergeError(f"{where}: args.num_experts={experts}, but the HF config describes a dense model")
        return
    if not experts:
        raise MergeError(f"{where}: the HF config describes a Mixture-of-Experts model, but the args have no num_experts")

    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    checks = [("num_experts", experts, moe.num_experts, "num_experts"),
              ("moe_router_topk", arg("moe_router_topk", 2), moe.topk, "num_experts_per_tok"),
              ("moe_ffn_hidden_size", arg("moe_ffn_hidden_size", arg("ffn_hidden_size")), moe.ffn, "moe_intermediate_size"),
              ("moe_shared_expert_intermediate_size", arg("moe_shared_expert_intermediate_size", 0), moe.shared_ffn,
               "shared_expert_intermediate_size")]
    for name, theirs, ours, hf in checks:
        if theirs is not None and int(theirs) != ours:
            raise MergeError(f"{where}: args.{name}={theirs} but the HF config's {hf} is {ours}")
    if moe.shared_ffn and bool(arg("moe_shared_expert_gate", False)) != moe.shared_gate:
        raise MergeError(f"{where}: args.moe_shared_expert_gate={arg('moe_shared_expert_gate', False)} but the HF "
                         f"model {'gates' if moe.shared_gate else 'does not gate'} its shared expert")
    trained = megatron_moe_layers(args, num_layers, where)
    if trained != moe.layers:
        raise MergeError(f"{where}: the args put routed experts in layers {sorted(trained)}, the HF config in "
                         f"{sorted(moe.layers)} (mlp_only_layers / decoder_sparse_step)")
    pre_softmax = bool(arg("moe_router_pre_softmax", False))
    if pre_softmax == moe.norm_topk:
        raise MergeError(f"{where}: args.moe_router_pre_softmax={pre_softmax} but the HF config "
                         f"{'renormalises' if moe.norm_topk else 'does not renormalise'} the top-k probabilities "
                         f"(norm_topk_prob); routing would differ")
    for name, allowed, what in (("moe_router_score_function", (None, "softmax"), "router score function"),
                                ("moe_router_topk_scaling_factor", (None, 1, 1.0), "top-k scaling"),
                                ("moe_router_enable_expert_bias", (None, False), "router expert bias"),
                                ("moe_router_num_groups", (None, 0, 1), "grouped routing"),
                                ("moe_expert_capacity_factor", (None,), "token dropping (capacity factor)")):
        value = getattr(args, name, None)
        if value not in allowed:
            raise MergeError(f"{where}: args.{name}={value!r}: this {what} has no equivalent in the HF model")
