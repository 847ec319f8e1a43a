"""What an architecture is: how its HF config reads (`HfConfig`) and a table of layout rules, expanded
over layers and experts in output order."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from lora_merge.errors import MergeError
from lora_merge.model.layout import ExpertSlab, Rule, SharedCopy

if TYPE_CHECKING:
    from lora_merge.model.model_shape import ModelShape

MEGATRON_LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."


@dataclass(frozen=True)
class PeftQuirks:
    """What PEFT (0.21) on transformers 5 does with a model type's per-expert adapters (see peft_adapter.py).

    converts_expert_targets: its target_modules are rewritten onto the fused experts (transformers' conversion
    pattern is mixtral's or qwen2_moe's), so non-expert modules named like an expert projection get LoRA on their
    weights instead; remaps_every_mlp_target: every gate/up/down_proj target becomes a routed-expert parameter,
    so the dense layers' and shared experts' MLP LoRA is dropped unloaded; drops_per_expert: a per-expert
    adapter is not converted at all and dropped without an error; stacked_in_out: see below."""

    converts_expert_targets: bool = False
    remaps_every_mlp_target: bool = False
    drops_per_expert: bool = False
    # a stacked experts parameter [E, a, b] stored as it is: PEFT reads it as [E, out, in] (swapped) unless
    # transformers marks the experts class is_transposed (gpt-oss: [E, in, out])
    stacked_in_out: bool = False


@dataclass(frozen=True)
class HfConfig:
    """How one HF model type's config.json describes the model. `hf_config` reads it through transformers'
    own config class (its defaults, its validation) and refuses values this type cannot have trained."""

    model_type: str
    causal_lm: str  # the class `architectures` must name (loaders such as vLLM pick the model by it)
    family: str  # "qwen", "llama" or "mistral": which sliding-window fields it has
    examined_keys: frozenset = frozenset()  # keys only this type has, read by its readers below
    qkv_bias: bool | str = False  # q/k/v biases: always (True), never, or as this key says
    qk_norm: bool | str = False  # q/k norms: always, never, or as this key says
    partial_rope: bool = False  # its class rotates only partial_rotary_factor of each head's dims
    # flags of this type that add weights or computation a Megatron model does not have (refused when true)
    must_be_false: tuple[str, ...] = ()
    # why no Megatron form of this type is proven ("" where one is): then only its HF routes run, and the
    # checks of what Megatron can have trained (activation, sliding windows, layer types) do not apply
    hf_only: str = ""
    # (config fields, number of layers) -> moe_shape.MoeShape, for Mixture-of-Experts types
    read_moe: Callable | None = None
    read_mla: Callable | None = None  # (config fields) -> mla_shape.MlaShape, for multi-latent attention
    # (config fields, number of layers) -> model_shape.GatedDeltaNetShape, for hybrid linear-attention models
    read_linear_attention: Callable | None = None
    # the key that counts its multi-token-prediction layers, and the HF prefix they are stored under ("": as
    # decoder layers L+k)
    mtp_key: str = "num_nextn_predict_layers"
    mtp_prefix: str = ""
    flags: tuple[str, ...] = ()  # its config's booleans that add weights: each a feature (Rule.requires) when true
    dense_ffn_key: str = "intermediate_size"  # the key of its dense MLPs' width (Llama-4: intermediate_size_mlp)
    fused_experts: str | None = None  # where transformers 5 keeps the experts as 3-D gate_up_proj/down_proj
    peft: PeftQuirks = PeftQuirks()  # what PEFT (0.21, on transformers 5) does with this type's adapters
    # (config fields) -> the family's own mechanics that a Megatron run records in its args, checked and written by
    # that object (gpt_oss.GptOssMechanics: sinks, windows, its activation, YaRN); None where the generic checks do
    read_mechanics: Callable | None = None





@dataclass(frozen=True)
class Architecture:
    name: str
    before_layers: tuple[Rule, ...]  # full names
    layer_rules: tuple[Rule, ...]  # names relative to MEGATRON_LAYER / HF_LAYER; `{expert}` per routed expert
    after_layers: tuple[Rule, ...]
    config: HfConfig | None = None  # the HF model type it is; None for shared tables (dense.DENSE_DECODER)
    # a multi-token-prediction layer's own parameters beside its decoder layer (names relative to the layer, as
    # layer_rules'; SharedCopy rules name the shared parameter in full); () where no MTP layout is known
    mtp_rules: tuple[Rule, ...] = ()

    def of(self, config: HfConfig) -> "Architecture":
        """This table for one HF model type."""
        return replace(self, name=config.model_type, config=config)

    def with_mtp(self, rules: tuple[Rule, ...]) -> "Architecture":
        return replace(self, mtp_rules=rules)

    def active(self, rules: tuple[Rule, ...], shape: ModelShape) -> list[Rule]:
        return [r for r in rules if r.requires is None or r.requires in shape.features]


def iter_rules(arch: Architecture, shape: ModelShape, present: Callable[[str], bool] | None = None,
               stacked: bool = False):
    """(rule, full Megatron names it may have, HF name prefix) for every parameter, in output order; rules
    with `{expert}` come once per routed expert, bound to its number. With `stacked` (the HF view), the rules of
    an HF tensor that stacks every expert's parameter (ExpertSlab) come once, as that whole tensor.

    A rule with `instead_of` is another naming of some parameters (MindSpeed fusing two projections into
    one): it is used in a layer where `present` says the checkpoint has its name, and then replaces the
    rules it names; otherwise it is left out."""
    for rule in arch.active(arch.before_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""
    for i in range(shape.num_layers):
        yield from _layer(arch, shape, i, shape.layer_kinds(i), present, stacked)
    for rule in arch.active(arch.after_layers, shape):
        yield rule, (rule.megatron, *rule.aliases), ""
    # The multi-token-prediction layers the source holds, as decoder layers L+k (see model/mtp.py): built with
    # the last decoder layer's spec, and their own parameters beside it
    # (an MTP layer's attention stands alone: with an indexer model it runs its own indexer)
    last = shape.layer_kinds(shape.num_layers - 1) | (
        {"indexer"} if shape.mla is not None and shape.mla.index_heads else set())
    for i in range(shape.num_layers, shape.num_layers + shape.mtp_layers if shape.mtp_in_source else 0):
        prefix, hf_prefix = MEGATRON_LAYER.format(i=i), HF_LAYER.format(i=i)
        for rule in arch.active(arch.mtp_rules, shape)[:MTP_OWN_BEFORE]:
            yield rule, (prefix + rule.megatron,), hf_prefix
        yield from _layer(arch, shape, i, last, present, stacked)
        for rule in arch.active(arch.mtp_rules, shape)[MTP_OWN_BEFORE:]:
            names = (rule.megatron,) if isinstance(rule, SharedCopy) else (prefix + rule.megatron,)
            yield rule, names, hf_prefix


MTP_OWN_BEFORE = 3  # an MTP table's rules before its decoder layer (enorm, hnorm, eh_proj; HF's order)


def _layer(arch: Architecture, shape: ModelShape, i: int, kinds: frozenset[str], present, stacked: bool = False):
    prefix = MEGATRON_LAYER.format(i=i)
    rules = arch.active(arch.layer_rules, shape)
    chosen = [r for r in rules if r.instead_of and present is not None and present(prefix + r.megatron)]
    replaced = {name for r in chosen for name in r.instead_of}
    for rule in rules:
        if (rule.layers != "all" and rule.layers not in kinds) or rule.megatron in replaced \
                or (rule.instead_of and rule not in chosen):
            continue
        if stacked and isinstance(rule, ExpertSlab):
            whole = rule.bind(expert=0).whole()
            yield whole, (prefix + whole.megatron,), HF_LAYER.format(i=i)
            continue
        for bound in ([rule.bind(expert=e) for e in range(shape.moe.num_experts)] if rule.per_expert else [rule]):
            yield bound, tuple(prefix + n for n in (bound.megatron, *bound.aliases)), HF_LAYER.format(i=i)


def pick_name(names: tuple[str, ...], available, where) -> str | None:
    """The one of a parameter's names that the checkpoint uses (None if none; an error if several)."""
    present = [n for n in names if n in available]
    if len(present) > 1:
        raise MergeError(f"{where}: holds the same parameter twice, as {' and '.join(present)}")
    return present[0] if present else None
