"""Multi-token-prediction layers: Megatron-Core's names for them, and the one naming the rest of the tool uses.

Megatron-Core keeps MTP layer k apart from the decoder, on the last pipeline stage (`--mtp-num-layers`):

    mtp.layers.{k}.enorm.weight, hnorm.weight      RMSNorms of the next token's embedding and of the hidden state
    mtp.layers.{k}.eh_proj.weight                  [H, 2H], column-parallel, input cat(enorm(emb), hnorm(h))
    mtp.layers.{k}.transformer_layer.*             a decoder layer with the last decoder layer's spec
    mtp.layers.{k}.final_layernorm.weight

HF releases (DeepSeek-V3's layer 61, GLM-4.5's 92) store the same layer as decoder layer L+k, with
`shared_head.norm` for the final norm and copies of the embedding and output head. So the tool names MTP layer k
as decoder layer L+k throughout (`decoder.layers.{L+k}.…`, the four MTP parameters under their own names):
readers turn Megatron's names into these, writers turn them back, and every layer-indexed rule (experts, norms,
LoRA) applies unchanged.
"""

from __future__ import annotations

import re

from lora_merge.errors import MergeError

PREFIX = "mtp."
MEGATRON_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
OWN = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")  # an MTP layer's parameters beside its decoder layer
INNER = "transformer_layer."
# MindSpeed-LLM's MTP: its final norm as mtp.final_layernorms.{k}, fed the hidden state before the main final norm
MINDSPEED_MTP = re.compile(r"^mtp\.final_layernorms\.\d+\.")


def is_mtp(name: str) -> bool:
    return name.startswith(PREFIX)


def canonical(name: str, num_layers: int, mtp_layers: int, where: str) -> str:
    """Megatron's `mtp.layers.{k}.…` -> `decoder.layers.{num_layers + k}.…` (the inner decoder layer's prefix
    dropped); anything else under `mtp.` is refused by name."""
    if MINDSPEED_MTP.match(name):
        raise MergeError(f"{where}: MindSpeed-LLM's MTP layout ({name}): its MTP layers read the hidden state before "
                         "the final norm, which HF releases and their loaders do not compute; merge a checkpoint "
                         "trained with Megatron-Core's MTP, or without MTP")
    m = MEGATRON_MTP.match(name)
    if m is None or not (m.group(2).startswith(INNER) or m.group(2).startswith(OWN)):
        raise MergeError(f"{where}: {name} is no multi-token-prediction parameter this tool knows "
                         f"(mtp.layers.<k>.{{{', '.join(o.rstrip('.') for o in OWN)}, transformer_layer.*}})")
    k, rest = int(m.group(1)), m.group(2)
    if k >= mtp_layers:
        raise MergeError(f"{where}: MTP layer {k}, but the args give mtp_num_layers={mtp_layers}")
    return f"decoder.layers.{num_layers + k}.{rest.removeprefix(INNER)}"


def megatron_name(name: str, num_layers: int) -> str:
    """`canonical`'s inverse: a name of decoder layer num_layers + k -> MTP layer k's; others unchanged."""
    if not name.startswith("decoder.layers."):
        return name
    layer, rest = name.split(".", 3)[2:]
    k = int(layer) - num_layers
    if k < 0:
        return name
    return f"mtp.layers.{k}.{rest if rest.startswith(OWN) else INNER + rest}"


def args_mtp_layers(args) -> int:
    """How many MTP layers the training args built (0 for none)."""
    value = getattr(args, "mtp_num_layers", None)
    return int(value) if value else 0


def in_mtp_layer(name: str, num_layers: int) -> bool:
    """A canonical name (`decoder.layers.{i}.…`) of an MTP layer (i >= num_layers)."""
    return name.startswith("decoder.layers.") and int(name.split(".", 3)[2]) >= num_layers
