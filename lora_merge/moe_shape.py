"""The Mixture-of-Experts part of a model (read from the HF config by its architecture module) and its
check against the Megatron args, so that routing computes what was trained (same experts per layer, same
top-k, same normalisation)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from lora_merge.errors import MergeError

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
