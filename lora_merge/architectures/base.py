"""What an architecture is: a table of layout rules, expanded over layers and experts in output order."""

from __future__ import annotations

from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.layout import Rule
from lora_merge.model_shape import ModelShape

MEGATRON_LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."


@dataclass(frozen=True)
class Architecture:
    name: str
    before_layers: tuple[Rule, ...]  # full names
    layer_rules: tuple[Rule, ...]  # names relative to MEGATRON_LAYER / HF_LAYER; `{expert}` per routed expert
    after_layers: tuple[Rule, ...]

    def active(self, rules: tuple[Rule, ...], shape: ModelShape) -> list[Rule]:
        return [r for r in rules if r.requires is None or r.requires in shape.features]


def iter_rules(arch: Architecture, shape: ModelShape):
    """(rule, full Megatron names it may have, HF name prefix) for every parameter, in output order; rules
    with `{expert}` come once per routed expert, bound to its number."""
    for rule in arch.active(arch.before_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""
    for i in range(shape.num_layers):
        prefix, kind = MEGATRON_LAYER.format(i=i), "moe" if shape.is_moe_layer(i) else "dense"
        for rule in arch.active(arch.layer_rules, shape):
            if rule.layers not in ("all", kind):
                continue
            for bound in ([rule.bind(expert=e) for e in range(shape.moe.num_experts)] if rule.per_expert else [rule]):
                yield bound, tuple(prefix + n for n in (bound.megatron, *bound.aliases)), HF_LAYER.format(i=i)
    for rule in arch.active(arch.after_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""


def pick_name(names: tuple[str, ...], available, where) -> str | None:
    """The one of a parameter's names that the checkpoint uses (None if none; an error if several)."""
    present = [n for n in names if n in available]
    if len(present) > 1:
        raise MergeError(f"{where}: holds the same parameter twice, as {' and '.join(present)}")
    return present[0] if present else None
