"""Experts of a Mixture-of-Experts checkpoint, in one naming whatever layout saved them.

Every reader turns expert tensors into per-expert parameters with *global* expert numbers,
`decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight` (and `linear_fc2`, and their LoRA
factors), each still split over expert-tensor-parallel ranks like a dense layer's. This is the one
place that turns (expert-parallel rank, local expert) into a global expert, and that knows the three
layouts Megatron saves experts in:

- SequentialMLP: `mlp.experts.local_experts.{k}.linear_fc1.weight` [2F/etp, H] — already per expert;
- TEGroupedMLP: `mlp.experts.linear_fc1.weight{k}` — per expert under another name;
- GroupedMLP: `mlp.experts.weight1` [H, E_loc·2F/etp] and `weight2` [E_loc·F/etp, H], whose memory is
  expert-major (`view(E_loc, H, -1)[k]`, in→out); slicing their columns would give wrong experts. Each
  expert becomes a transposed view, so nothing is copied.

and MindSpeed's grouped LoRA (`LoraParallelGroupedMLP`): `weight1_lora_a` [H, r·E_loc] = view (E, H, r),
`weight1_lora_b` [r, E_loc·2F/etp] = view (E, r, 2F/etp), `weight2_lora_a` [E_loc·F/etp, r] = view
(E, F/etp, r), `weight2_lora_b` [r·E_loc, H] = view (E, r, H), in→out: ΔW1[e] = A1[e]@B1[e]. As PEFT
factors (B [out, r], A [r, in]) expert e's fc1 has lora_A = A1[e]ᵀ and lora_B = B1[e]ᵀ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from lora_merge.errors import MergeError
from lora_merge.shown import shown

EXPERT_KEY = re.compile(r"^(?P<layer>decoder\.layers\.\d+\.mlp\.experts)\.(?P<rest>.+)$")
SEQUENTIAL = re.compile(r"^local_experts\.(?P<k>\d+)\.(?P<rest>linear_fc[12]\..+)$")
TE_GROUPED = re.compile(r"^(?P<fc>linear_fc[12])\.(?P<what>weight|bias)(?P<k>\d+)$")
GROUPED = re.compile(r"^weight(?P<n>[12])$")
GROUPED_LORA = re.compile(r"^weight(?P<n>[12])_lora_(?P<ab>[ab])$")
GLOBAL_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def is_expert_name(name: str) -> bool:
    """A parameter (or LoRA module) of one routed expert, in the global naming."""
    return GLOBAL_EXPERT.search(name) is not None


@dataclass(frozen=True)
class ExpertLayout:
    """How the experts are spread over ranks, from the args."""

    num_experts: int
    ep: int
    etp: int
    tp: int
    # MindSpeed's --moe-tp-extend-ep: whole experts spread over TP × EP ranks, E / (EP·TP) each, rank (tp, ep)
    # holding global experts (ep·TP + tp)·n + i (its MoE layer's local_expert_indices, and its converters')
    tp_extend: bool = False
    seen: set = field(default_factory=set, compare=False)  # the expert layouts met while reading

    def __str__(self) -> str:
        return (f"{self.num_experts} experts, EP={self.ep} ETP={self.etp}"
                + (" over TP×EP (--moe-tp-extend-ep)" if self.tp_extend else "")
                + (f", {' + '.join(sorted(self.seen))}" if self.seen else ""))

    @property
    def local(self) -> int:
        return self.num_experts // (self.ep * self.tp if self.tp_extend else self.ep)

    def etp_rank(self, tp_rank: int) -> int:
        """The expert-TP shard a file of TP rank `tp_rank` holds (ETP is 1 or TP; whole experts when TP-extended)."""
        return tp_rank if self.etp == self.tp and not self.tp_extend else 0

    def global_expert(self, ep_rank: int, local: int, where: str, tp_rank: int = 0) -> int:
        if not 0 <= local < self.local:
            over = f"TP×EP={self.tp}×{self.ep}" if self.tp_extend else f"EP={self.ep}"
            raise MergeError(f"{where}: local expert {local}, but {self.num_experts} experts over {over} "
                             f"give {self.local} per rank")
        if self.tp_extend:
            return (ep_rank * self.tp + tp_rank) * self.local + local
        return ep_rank * self.local + local


def expert_layout(args, tp: int, where: str, torch_dist: bool = False) -> ExpertLayout | None:
    """None for a dense model; refuses what cannot be mapped exactly."""
    experts = getattr(args, "num_experts", None)
    ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
    if not experts:
        if ep > 1:
            raise MergeError(f"{where}: args.expert_model_parallel_size={shown(ep)} but no args.num_experts")
        return None
    experts = int(experts)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    etp = tp if etp is None else int(etp)
    if getattr(args, "moe_tp_extend_ep", False):
        return _tp_extended(args, experts, ep, tp, where, torch_dist)
    if experts % ep:
        raise MergeError(f"{where}: {experts} experts do not split over expert_model_parallel_size={ep}")
    if etp not in (1, tp):
        raise MergeError(f"{where}: expert_tensor_parallel_size={etp} with TP={tp}; only 1 or TP are supported")
    return ExpertLayout(experts, ep, etp, tp)


def _tp_extended(args, experts: int, ep: int, tp: int, where: str, torch_dist: bool) -> ExpertLayout:
    """MindSpeed's --moe-tp-extend-ep, which its MoE layer applies with the alltoall_seq dispatcher or its
    all-to-all / all-gather overlap (with another dispatcher the flag is saved but changes nothing: refused, not
    guessed)."""
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if torch_dist:
        raise MergeError(f"{where}: args.moe_tp_extend_ep=True in a torch_dist checkpoint: how MindSpeed shards its "
                         "experts there is not confirmed; save it in the legacy format (--ckpt-format torch)")
    if dispatcher != "alltoall_seq" and not (getattr(args, "moe_alltoall_overlap_comm", False)
                                             or getattr(args, "moe_allgather_overlap_comm", False)):
        raise MergeError(f"{where}: args.moe_tp_extend_ep=True with moe_token_dispatcher_type={shown(dispatcher)}: "
                         "MindSpeed spreads experts over TP×EP only with alltoall_seq (or its overlap dispatchers); "
                         "which layout this checkpoint has is not certain")
    if experts % (ep * tp):
        raise MergeError(f"{where}: {experts} experts do not split over TP×EP={tp}×{ep} (--moe-tp-extend-ep)")
    return ExpertLayout(experts, ep, 1, tp, tp_extend=True)


def expert_params(name: str, tensor: torch.Tensor, ep_rank: int, layout: ExpertLayout, adapter: str,
                  where: str, tp_rank: int = 0) -> list[tuple[str, torch.Tensor]] | None:
    """Per-expert (global name, tensor view) for an expert tensor of one rank file; None if `name` is
    not an expert tensor."""
    m = EXPERT_KEY.match(name)
    if m is None:
        return None
    prefix, rest = m.group("layer"), m.group("rest")

    def named(k: int, suffix: str) -> str:
        return f"{prefix}.{layout.global_expert(ep_rank, k, where, tp_rank)}.{suffix}"

    if s := SEQUENTIAL.match(rest):
        layout.seen.add("SequentialMLP")
        return [(named(int(s.group("k")), s.group("rest")), tensor)]
    if s := TE_GROUPED.match(rest):
        layout.seen.add("TEGroupedMLP")
        return [(named(int(s.group("k")), f"{s.group('fc')}.{s.group('what')}"), tensor)]
    if s := GROUPED.match(rest):
        layout.seen.add("GroupedMLP")
        fc = f"linear_fc{s.group('n')}.weight"
        experts = _expert_major(tensor, layout.local, 1 if s.group("n") == "1" else 0, name, where)
        return [(named(k, fc), t.t()) for k, t in enumerate(experts)]
    if s := GROUPED_LORA.match(rest):
        layout.seen.add("MindSpeed grouped LoRA")
        n, ab = s.group("n"), s.group("ab")
        peft = "lora_A" if ab == "a" else "lora_B"
        # a and b: which dim of the 2-D tensor carries E_loc·(something) (the other is H or r)
        grouped_dim = {("1", "a"): 1, ("1", "b"): 1, ("2", "a"): 0, ("2", "b"): 0}[(n, ab)]
        experts = _expert_major(tensor, layout.local, grouped_dim, name, where)
        return [(named(k, f"linear_fc{n}.{peft}.{adapter}.weight"), t.t()) for k, t in enumerate(experts)]
    raise MergeError(f"{where}: expert tensor {name} is in no expert layout this tool knows (SequentialMLP "
                     "local_experts.{k}, GroupedMLP weight1/weight2, TEGroupedMLP linear_fc1.weight{k})")


def _expert_major(tensor: torch.Tensor, local: int, grouped_dim: int, name: str, where: str) -> list[torch.Tensor]:
    """Split a grouped 2-D tensor whose memory is (E_loc, a, b) into its E_loc expert views [a, b]: the
    dimension holding E_loc·x is `grouped_dim` (1: [a, E·b]; 0: [E·a, b])."""
    if tensor.dim() != 2 or tensor.shape[grouped_dim] % local or not tensor.is_contiguous():
        raise MergeError(f"{where}: {name} has shape {list(tensor.shape)}, which does not hold {local} experts "
                         "in Megatron's grouped layout")
    if grouped_dim == 1:
        a, b = tensor.shape[0], tensor.shape[1] // local
    else:
        a, b = tensor.shape[0] // local, tensor.shape[1]
    grouped = tensor.view(local, a, b)
    return [grouped[k] for k in range(local)]
