"""The Mixture-of-Experts part of a model (read from the HF config by its architecture module) and its
check against the Megatron args, so that routing computes what was trained (same experts per layer, same
top-k, same normalisation)."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.value_checks import finite_number, non_negative_int, positive_int
from lora_merge.shown import shown

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
    group_score_top: int = 2  # a group scores as the sum of its best this-many experts' scores
    scaling: float = 1.0

    def describe_groups(self) -> str:
        return f"model by its best {self.group_score_top}"

    def __str__(self) -> str:
        routing = [f"{self.score} scores"] if self.score != "softmax" else []
        routing += ["expert bias"] * self.expert_bias
        routing += [f"best {self.groups[1]} of {self.groups[0]} groups"] if self.groups else []
        routing += [f"weights x{self.scaling:g}"] if self.scaling != 1 else []
        return (f"{self.num_experts} experts, top-{self.topk}, expert ffn {self.ffn}"
                + (f", shared expert ffn {self.shared_ffn}" if self.shared_ffn else "")
                + (f" ({', '.join(routing)})" if routing else ""))


def megatron_moe_layers(args, num_layers: int, where: str) -> frozenset[int]:
    """Which layers Megatron gave routed experts: moe_layer_freq is an int k (every k-th layer, from 0),
    a list of 0/1 per layer, or that list as a string; MindSpeed's first_k_dense_replace layers are dense."""
    freq = getattr(args, "moe_layer_freq", None)
    if freq is None:
        freq = 1
    if isinstance(freq, str):
        try:
            freq = ast.literal_eval(freq.strip())
        except (ValueError, SyntaxError) as exc:
            raise MergeError(f"{where}: args.moe_layer_freq={shown(freq)} is not a number or a list") from exc
    # MindSpeed-LLM's --first-k-dense-replace keeps the first k layers dense on top of the frequency rule
    dense = getattr(args, "first_k_dense_replace", None) or 0
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise MergeError(f"{where}: args.first_k_dense_replace={shown(dense)}; expected a layer count")
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return frozenset(i for i in range(dense, num_layers) if i % freq == 0)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        return frozenset(i for i, v in enumerate(freq) if v == 1 and i >= dense)
    raise MergeError(f"{where}: args.moe_layer_freq={shown(freq)}; expected a positive int or {num_layers} zeros and ones")


def check_moe_args(moe: MoeShape | None, args, num_layers: int, where: str) -> None:
    experts = getattr(args, "num_experts", None)
    if moe is None:
        if experts:
            raise MergeError(f"{where}: args.num_experts={shown(experts)}, but the HF config describes a dense model")
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
        if theirs is not None and (non_negative_int(theirs, f"args.{name}", where) if name.startswith("moe_shared")
                                   else positive_int(theirs, f"args.{name}", where)) != ours:
            raise MergeError(f"{where}: args.{name}={theirs} but the HF config's {hf} is {ours}")
    if moe.shared_ffn and bool(arg("moe_shared_expert_gate", False)) != moe.shared_gate:
        raise MergeError(f"{where}: args.moe_shared_expert_gate={shown(arg('moe_shared_expert_gate', False))} but the HF "
                         f"model {'gates' if moe.shared_gate else 'does not gate'} its shared expert")
    trained = megatron_moe_layers(args, num_layers, where)
    if trained != moe.layers:
        raise MergeError(f"{where}: the args put routed experts in layers {sorted(trained)}, the HF config in "
                         f"{sorted(moe.layers)} (mlp_only_layers / decoder_sparse_step)")
    _check_routing(moe, trained_routing(args, moe.topk, where), where)
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        raise MergeError(f"{where}: args.moe_expert_capacity_factor={shown(args.moe_expert_capacity_factor)}: token "
                         "dropping (capacity factor) has no equivalent in the HF model")


@dataclass(frozen=True)
class TrainedRouting:
    """How the training run routed tokens, each fact with the args that say so (for messages)."""
    score: tuple[str, str]
    renormalised: tuple[bool, str]
    expert_bias: tuple[bool, str]
    groups: tuple[tuple[int, int] | None, str]
    group_score_top: tuple[int, str]  # a group scores as the sum of its best this-many experts
    scaling: tuple[float, str]


def trained_routing(args, topk: int, where: str) -> TrainedRouting:
    """Megatron-Core's router, or MindSpeed-LLM's own where its --moe-router-load-balancing-type selects
    one (its releases on Megatron 0.8: noaux_tc for DeepSeek-V3, group_limited_greedy and
    pai_megatron_aux_loss for DeepSeek-V2, softmax_topk)."""
    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    kind = arg("moe_router_load_balancing_type", "aux_loss")
    score = arg("moe_router_score_function", "softmax")
    bias = bool(arg("moe_router_enable_expert_bias", False))
    said = {"score": (score, f"args.moe_router_score_function={shown(score)}"),
            "expert_bias": (bias, f"args.moe_router_enable_expert_bias={shown(bias)}")}
    balancing = f"args.moe_router_load_balancing_type={shown(kind)}"
    # MindSpeed's groups: n_group defaults to the expert-parallel size; grouping needs topk_group
    ms_groups = None
    if arg("topk_group") is not None and kind in ("noaux_tc", "group_limited_greedy"):
        n_group = positive_int(arg("n_group", arg("expert_model_parallel_size", 1)), "args.n_group", where)
        ms_groups = (n_group, positive_int(arg("topk_group"), "args.topk_group", where)) if n_group > 1 else None
    ms_group_desc = f"args.n_group/topk_group={ms_groups}"
    if kind == "noaux_tc":  # sigmoid (+ bias) choice, best-2 group scores, always renormalised, scaled if set
        scaling = finite_number(arg("routed_scaling_factor", 1.0), "args.routed_scaling_factor", where, 0, low_open=True)
        return TrainedRouting(**said, renormalised=(topk > 1, f"{balancing} (always renormalised)"),
                              groups=(ms_groups, ms_group_desc), group_score_top=(2, f"{balancing} (its best 2)"),
                              scaling=(scaling, f"args.routed_scaling_factor={scaling:g}"))
    if kind == "group_limited_greedy":  # softmax, best-1 group scores; renormalised or else scaled
        if score != "softmax":
            raise MergeError(f"{where}: {balancing} with args.moe_router_score_function={shown(score)}; MindSpeed's "
                             "group_limited_greedy scores with softmax")
        norm = bool(arg("norm_topk_prob", False)) and topk > 1
        scaling = 1.0 if norm else finite_number(arg("routed_scaling_factor", 1.0), "args.routed_scaling_factor", where, 0, low_open=True)
        return TrainedRouting(**said, renormalised=(norm, f"{balancing} with args.norm_topk_prob={norm}"),
                              groups=(ms_groups, ms_group_desc), group_score_top=(1, f"{balancing} (its best 1)"),
                              scaling=(scaling, f"{balancing} scales by {scaling:g}"))
    if kind == "pai_megatron_aux_loss":  # softmax over all, top-k, neither renormalised nor scaled
        return TrainedRouting(**said, renormalised=(False, f"{balancing} (never renormalised)"),
                              groups=(None, f"{balancing} (no groups)"), group_score_top=(2, balancing),
                              scaling=(1.0, f"{balancing} (never scaled)"))
    if kind == "softmax_topk":  # MindSpeed's: softmax over all, top-k, renormalised if norm_topk_prob
        norm = bool(arg("norm_topk_prob", False)) and topk > 1
        scaling = finite_number(arg("moe_router_topk_scaling_factor", 1.0), "args.moe_router_topk_scaling_factor", where, 0, low_open=True)
        return TrainedRouting(**said, renormalised=(norm, f"{balancing} with args.norm_topk_prob={norm}"),
                              groups=(None, f"{balancing} (no groups)"), group_score_top=(2, balancing),
                              scaling=(scaling, f"args.moe_router_topk_scaling_factor={scaling:g}"))
    if kind not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise MergeError(f"{where}: {balancing}: its routing cannot be shown to equal a HF model's; expected "
                         "aux_loss, seq_aux_loss, global_aux_loss, none, or MindSpeed's noaux_tc, "
                         "group_limited_greedy, pai_megatron_aux_loss, softmax_topk")
    # Megatron-Core's TopKRouter: softmax renormalises the top-k unless it comes first (pre_softmax);
    # sigmoid scores are always renormalised (top-k > 1); a group scores by its best topk // group_topk.
    pre = bool(arg("moe_router_pre_softmax", False))
    renormalised = not pre if score == "softmax" else topk > 1
    groups = arg("moe_router_num_groups", 1) or 1
    group_topk = positive_int(arg("moe_router_group_topk", 1) or 1, "args.moe_router_group_topk", where)
    groups = positive_int(groups, "args.moe_router_num_groups", where)
    theirs = (groups, group_topk) if groups > 1 else None
    scaling = finite_number(arg("moe_router_topk_scaling_factor", 1.0), "args.moe_router_topk_scaling_factor", where, 0, low_open=True)
    return TrainedRouting(
        **said, renormalised=(renormalised, f"the args {'renormalise' if renormalised else 'do not renormalise'} "
                                            f"the top-k probabilities (moe_router_pre_softmax={pre}, {score} scores)"),
        groups=(theirs, f"args.moe_router_num_groups/moe_router_group_topk={theirs}"),
        group_score_top=(topk // group_topk, f"Megatron scores an expert group by its best moe_router_topk // "
                                             f"moe_router_group_topk = {topk // group_topk} experts"),
        scaling=(scaling, f"args.moe_router_topk_scaling_factor={scaling:g}"))


def _check_routing(moe: MoeShape, trained: TrainedRouting, where: str) -> None:
    (score, said), hf = trained.score, moe.score
    if score != hf:
        raise MergeError(f"{where}: {said} but the HF model scores experts with {hf}; routing would differ")
    (norm, said) = trained.renormalised
    if norm != moe.norm_topk:
        raise MergeError(f"{where}: {said} but the HF config has norm_topk_prob={moe.norm_topk}; routing would differ")
    (bias, said) = trained.expert_bias
    if bias != moe.expert_bias:
        raise MergeError(f"{where}: {said} but the HF model {'adds a' if moe.expert_bias else 'has no'} router "
                         "expert bias (e_score_correction_bias)")
    (groups, said) = trained.groups
    if groups != moe.groups:
        raise MergeError(f"{where}: {said} but the HF config's n_group/topk_group give {moe.groups}; routing would "
                         "differ")
    (top, said) = trained.group_score_top
    if groups is not None and top != moe.group_score_top:
        raise MergeError(f"{where}: {said}, the HF {moe.describe_groups()}; routing would differ")
    (scaling, said) = trained.scaling
    if not math.isclose(scaling, moe.scaling, rel_tol=1e-6):
        raise MergeError(f"{where}: {said} but the HF config's routed_scaling_factor is {moe.scaling:g}")


def megatron_moe_args(moe: MoeShape, num_layers: int) -> dict:
    """The args that record this MoE shape for Megatron-Core's router and experts (what `check_moe_args`
    reads back)."""
    if moe.groups and moe.topk // moe.groups[1] != moe.group_score_top:
        raise MergeError(f"the model's router scores an expert group by its best {moe.group_score_top} experts; "
                         "Megatron's scores it by its best moe_router_topk // moe_router_group_topk = "
                         f"{moe.topk // moe.groups[1]}, so no Megatron args describe this model")
    return dict(
        num_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn,
        moe_shared_expert_intermediate_size=moe.shared_ffn or None, moe_shared_expert_gate=moe.shared_gate,
        moe_layer_freq=[int(i in moe.layers) for i in range(num_layers)],
        moe_router_score_function=moe.score, moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_pre_softmax=moe.score == "softmax" and not moe.norm_topk,
        moe_router_num_groups=moe.groups[0] if moe.groups else None,
        moe_router_group_topk=moe.groups[1] if moe.groups else None,
        moe_router_topk_scaling_factor=moe.scaling if moe.scaling != 1 else None,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall",
    )
