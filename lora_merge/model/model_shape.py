"""The architecture of the model being merged, as values: sizes, optional parts, RoPE, experts, MLA.

`hf_config` reads them from the reference config.json (through transformers' own config class);
`megatron_args` checks them against what the Megatron run recorded; the layout rules size tensors by them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_merge.model.mla_shape import MlaShape
from lora_merge.model.moe_shape import MoeShape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers applies it, defaults filled in: the type and its parameters
    (factor, original_max_position_embeddings, low/high_freq_factor, beta_fast/slow, attention_factor)."""
    type: str
    params: tuple[tuple[str, float], ...]

    def get(self, name: str) -> float | None:
        return dict(self.params).get(name)

    def __str__(self) -> str:
        return f"{self.type} ({', '.join(f'{k}={v:g}' for k, v in self.params)})"


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """The linear-attention (Gated DeltaNet) layers of a hybrid model (Qwen3-Next): heads and their sizes, the
    causal convolution's kernel, and which layers have it instead of attention."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: frozenset[int]

    def dims(self) -> dict[str, int]:
        key, value = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        return {"gdn_qkvz": 2 * key + 2 * value, "gdn_ba": 2 * self.value_heads, "gdn_conv": 2 * key + value,
                "gdn_value": value, "gdn_heads": self.value_heads, "gdn_head_v": self.value_head_dim,
                "gdn_kernel": self.conv_kernel}


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (Megatron's query groups)
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: torch.dtype | None  # the reference's dtype, if it names one
    rope_theta: float | None = None
    norm_eps: float | None = None
    rope_scaling: RopeScaling | None = None
    rotary_percent: float = 1.0  # the fraction of each head's dims RoPE rotates (HF partial_rotary_factor)
    tokenizer_vocab: int | None = None  # ids tokenizer.json can produce, when the reference has one
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder (num_nextn_predict_layers)
    mtp_in_source: bool = False  # the source holds them and the layout rules carry them (model/mtp.py)
    mtp_prefix: str = ""  # where an HF release stores them: "" for decoder layers L+k (model.layers.{L+k}.)
    mtp_key: str = "num_nextn_predict_layers"  # the config key that counts them
    hf_only: str = ""  # why this model has no proven Megatron form ("" where it has one): HF routes only
    defaulted: frozenset[str] = frozenset()  # HF keys absent from config.json, so the config class's default
    moe: MoeShape | None = None  # routed experts, for a Mixture-of-Experts model
    mla: MlaShape | None = None  # multi-latent attention (DeepSeek) instead of grouped-query attention
    linear_attention: GatedDeltaNetShape | None = None  # layers with Gated DeltaNet instead of attention
    config_features: frozenset[str] = frozenset()  # the family's own config flags that are on (HfConfig.flags)
    multimodal: str = ""  # the multimodal model type wrapping this language model (model/multimodal.py), if any
    # the family's own mechanics as its Megatron run records them (HfConfig.read_mechanics), or None
    own_mechanics: object | None = None

    @property
    def mtp_prefixes(self) -> tuple[str, ...]:
        """HF name prefixes of the multi-token-prediction layers: decoder layers after the decoder's, or the
        family's own prefix."""
        if self.mtp_prefix:
            return (self.mtp_prefix,)
        return tuple(f"model.layers.{i}." for i in range(self.num_layers, self.num_layers + self.mtp_layers))

    @property
    def features(self) -> frozenset[str]:
        """Optional parts of the architecture that some rules depend on."""
        shared = self.moe is not None and self.moe.shared_ffn > 0
        return frozenset(name for name, on in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                               ("untied", not self.tied), ("tied", self.tied),
                                               ("shared_expert", shared), ("mla", self.mla is not None),
                                               ("q_lora", self.mla is not None and bool(self.mla.q_lora)),
                                               ("no_q_lora", self.mla is not None and not self.mla.q_lora),
                                               ("indexer", self.mla is not None and bool(self.mla.index_heads))) if on) \
            | self.config_features

    def mechanics(self) -> list[str]:
        """What the model computes beyond a plain decoder layer, in words (the dry run's model line)."""
        n = self.mtp_layers
        return [text for text, on in (("qkv bias", self.qkv_bias), ("q/k norms", self.qk_norm),
                                      (f"partial RoPE {self.rotary_percent:g}", self.rotary_percent != 1.0),
                                      (f"RoPE scaling {self.rope_scaling}", self.rope_scaling is not None),
                                      (f"Gated DeltaNet in {len(self.linear_attention.layers)} of {self.num_layers} "
                                       "layers" if self.linear_attention else "", self.linear_attention is not None),
                                      (f"MTP {n} layer{'s' if n != 1 else ''}", n > 0),
                                      (f"the language model of a {self.multimodal} release (its towers carried)",
                                       bool(self.multimodal))) if on] + \
            (self.own_mechanics.mechanics() if self.own_mechanics is not None else [])

    @property
    def mtp_label(self) -> str:
        """The MTP layers in words: their HF layer numbers, or the prefix they are stored under."""
        return f"{self.mtp_prefix}*" if self.mtp_prefix else ", ".join(p.split(".")[2] for p in self.mtp_prefixes)

    def mixer(self, layer: int) -> str:
        """What mixes the tokens in a decoder layer: "attention", or "linear" (Gated DeltaNet)."""
        return "linear" if self.linear_attention is not None and layer in self.linear_attention.layers else "attention"

    def layer_kinds(self, layer: int) -> frozenset[str]:
        """What a decoder layer is, for the rules that exist in some layers only (Rule.layers)."""
        indexer = self.mla is not None and self.mla.index_heads and (
            self.mla.indexer_layers is None or layer in self.mla.indexer_layers)
        return frozenset(("moe" if self.is_moe_layer(layer) else "dense", self.mixer(layer))
                         + (("indexer",) if indexer else ()))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers
