"""TransformerEngine's spec (Megatron-LM's default `--transformer-impl transformer_engine`): the names a TE
GPTModel gives the local spec's parameters, and which of its modules carry an `_extra_state`. The one rule both
Megatron writers apply to the local names the architectures give (megatron-core 0.16.1's
`get_gpt_layer_with_transformer_engine_spec`, `TESpecProvider`, `get_gpt_mtp_block_spec`):

- A norm followed by a linear is fused into it (`TELayerNormColumnParallelLinear`), its weight becoming that
  linear's `layer_norm_weight` (and `layer_norm_bias`): `input_layernorm` into `self_attention.linear_qkv`
  (not in MLA layers, whose input norm stays a `TENorm`), `pre_mlp_layernorm` into `mlp.linear_fc1` in dense
  layers (a MoE layer keeps it a `TENorm`), MLA's `q_layernorm` / `kv_layernorm` into `linear_q_up_proj` /
  `linear_kv_up_proj`.
- Every TE module keeps FP8 metadata in an `_extra_state`: the linears (every parallel linear of the local spec,
  the routed experts' included), core attention, and the norms that stay `TENorm` (`te.pytorch.RMSNorm` /
  `LayerNorm` are fusible operations with an `_extra_state` since TransformerEngine 1.13): `q_layernorm`,
  `k_layernorm`, an MLA layer's `input_layernorm`, a MoE layer's `pre_mlp_layernorm`, the final norms, and
  the MTP layers' `enorm` / `hnorm`.
- MLA's down-projections are `TELinear`s in duplicated mode: whole on every TP rank (the local spec splits
  their rows, see `DuplicatedOrColumn`).
- TEGroupedMLP keeps a rank's experts in one module per linear: `mlp.experts.linear_fc1.weight{k}` ([out, in]
  each, k the local expert) with one `_extra_state`.

Without FP8 state the value is written as None, which `set_extra_state` of every TransformerEngine version
takes as "nothing to restore" (TE writes a pickled None, an empty uint8 tensor or a BytesIO, by version; none
of them holds weights). Core attention's `_extra_state` is in its `state_dict` (legacy files) but not in its
`sharded_state_dict` (torch_dist), which `TEDotProductAttention` limits to a learnable softmax offset's.
"""

from __future__ import annotations

import re
from dataclasses import fields

from lora_merge.model.layout import DuplicatedOrColumn, Replicated

LOCAL = "local"
TRANSFORMER_ENGINE = "transformer_engine"
IMPLS = (LOCAL, TRANSFORMER_ENGINE)

# (local module prefix, TE prefix, in which layers: (attention MLA?, MoE layer?) -> fused): the norms TE fuses
_FUSED = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_", lambda mla, moe: not mla),
          ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", lambda mla, moe: not moe),
          ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_", lambda mla, moe: mla),
          ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_", lambda mla, moe: mla))
# the norms that stay modules of their own (TENorm) once the others are fused, by their last name component
_NORMS = frozenset({"input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "final_layernorm",
                    "enorm", "hnorm"})
# a layer's own prefix in any Megatron name: a decoder layer, or an MTP layer's decoder layer
_LAYER = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.)(.*)$")


def layer_name(rest: str, *, moe: bool, mla: bool) -> str:
    """The TE name of a parameter of one decoder layer, `rest` relative to the layer (`input_layernorm.weight`)."""
    for local, te, fused in _FUSED:
        if rest.startswith(local) and fused(mla, moe):
            return te + rest[len(local):]
    return rest


def te_name(name: str, *, moe: bool, mla: bool) -> str:
    """The TE name of a whole Megatron name (`decoder.layers.3.input_layernorm.weight`); names outside layers
    are the same."""
    m = _LAYER.match(name)
    return name if m is None else m.group(1) + layer_name(m.group(2), moe=moe, mla=mla)


def is_norm_module(module: str) -> bool:
    """A norm module left after fusing (a TENorm, which has an `_extra_state`)."""
    return module.rsplit(".", 1)[-1] in _NORMS


def core_attention(module: str) -> str | None:
    """The core attention module beside an attention linear (`decoder.layers.3.self_attention.linear_proj` ->
    `decoder.layers.3.self_attention.core_attention`), or None."""
    head, sep, _ = module.rpartition(".self_attention.")
    return f"{head}.self_attention.core_attention" if sep else None


def is_linear_module(module: str) -> bool:
    """A TE linear (every linear of the spec is one; the router and the embedding are Megatron's own)."""
    last = module.rsplit(".", 1)[-1]
    return last.startswith("linear_") or last == "eh_proj"


def placed_rule(rule):
    """The rule as the TE spec places the parameter over TP ranks: MLA's down-projections duplicated."""
    if isinstance(rule, DuplicatedOrColumn):
        return Replicated(**{f.name: getattr(rule, f.name) for f in fields(rule)})
    return rule
