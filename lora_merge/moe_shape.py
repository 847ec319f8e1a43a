"""The Mixture-of-Experts part of a model (read from the HF config by its architecture module) and its
check against the Megatron args, so that routing computes what was trained (same experts per layer, same
top-k, same normalisation)."""

from __future__ import annotations

import ast
import math
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
    # Routing beyond top-k of softmax scores (DeepSeek-V3): sigmoid scores, a bias added for the choice
    # only (aux-free balancing), group-limited choice (n_group, topk_group), scaled probabilities.
    score: str = "softmax"
    expert_bias: bool = False
    groups: tuple[int, int] | None = None
    scaling: float = 1.0

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
    score = arg("moe_router_score_function", "softmax")
    if score != moe.score:
        raise MergeError(f"{where}: args.moe_router_score_function={score!r} but the HF model scores experts with "
                         f"{moe.score}; routing would differ")
    # Megatron renormalises the top-k probabilities unless softmax comes first (moe_router_pre_softmax);
    # sigmoid scores are always renormalised (top-k > 1).
    renormalised = not bool(arg("moe_router_pre_softmax", False)) if score == "softmax" else moe.topk > 1
    if renormalised != moe.norm_topk:
        raise MergeError(f"{where}: the args {'renormalise' if renormalised else 'do not renormalise'} the top-k "
                         f"probabilities (moe_router_pre_softmax={arg('moe_router_pre_softmax', False)}, "
                         f"{score} scores) but the HF config has norm_topk_prob={moe.norm_topk}; routing would differ")
    bias = bool(arg("moe_router_enable_expert_bias", False))
    if bias != moe.expert_bias:
        raise MergeError(f"{where}: args.moe_router_enable_expert_bias={bias} but the HF model "
                         f"{'adds a' if moe.expert_bias else 'has no'} router expert bias (e_score_correction_bias)")
    groups = arg("moe_router_num_groups", 1) or 1
    theirs = (int(groups), int(arg("moe_router_group_topk", 1) or 1)) if int(groups) > 1 else None
    if theirs != moe.groups:
        raise MergeError(f"{where}: args.moe_router_num_groups/moe_router_group_topk={theirs} but the HF config's "
                         f"n_group/topk_group give {moe.groups}; routing would differ")
    scaling = float(arg("moe_router_topk_scaling_factor", 1.0))
    if not math.isclose(scaling, moe.scaling, rel_tol=1e-6):
        raise MergeError(f"{where}: args.moe_router_topk_scaling_factor={scaling:g} but the HF config's "
                         f"routed_scaling_factor is {moe.scaling:g}")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        raise MergeError(f"{where}: args.moe_expert_capacity_factor={args.moe_expert_capacity_factor!r}: token "
                         "dropping (capacity factor) has no equivalent in the HF model")
