"""Qwen3-Next (`qwen3_next`), on the HF routes (an HF base with a PEFT adapter; `hf_only`): a hybrid decoder whose
layers mix tokens by Gated DeltaNet (`linear_attn`) or by gated attention (`self_attn`) as `layer_types` says
(from `full_attention_interval` where absent), each followed by Qwen2-MoE's MLP: routed experts and a shared
expert behind a sigmoid gate (a plain MLP in `mlp_only_layers`).

- Gated attention: q_proj holds each head's query and its output gate ([2 * heads * head_dim, hidden]); q/k
  norms over head_dim; partial RoPE (partial_rotary_factor, 0.25 in the release).
- Gated DeltaNet: in_proj_qkvz [2 * key + 2 * value, hidden] and in_proj_ba [2 * value heads, hidden] (its
  rows grouped per key head, which is what a tensor-parallel split has to respect; copied and merged whole
  here), the depthwise causal conv1d [2 * key + value, 1, kernel], dt_bias and A_log per value head, the gated
  RMSNorm over a value head, out_proj.
- Every RMSNorm but the gated one is zero-centred: the model computes x·(1 + w) and the checkpoint stores w (the
  gated norm stores its weight as it multiplies). Norms are copied as stored, so nothing is converted.
- The MTP layer is stored under `mtp.*` and copied as stored.

No Megatron form is read or written: megatron-core (0.16.1) builds Gated DeltaNet only with the
flash-linear-attention kernels, which need a GPU, so no Megatron checkpoint of it could be made here to prove how
it splits the fused projections. The layer rules' Megatron names are this table's own keys (`hf.…`)."""

from dataclasses import replace

from lora_merge.errors import MergeError
from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import DENSE_MLP, EMBEDDING, FINAL, INPUT_NORM, PRE_MLP_NORM
from lora_merge.model.architectures.moe import QWEN_MOE_KEYS, qwen_moe, routed_experts, shared_expert
from lora_merge.model.layout import Replicated
from lora_merge.model.model_shape import GatedDeltaNetShape
from lora_merge.shown import shown

MIXERS = {"linear_attention": "linear", "full_attention": "attention"}


def read_moe(fields, num_layers):
    return qwen_moe(fields, num_layers, shared_ffn=fields.positive_int("shared_expert_intermediate_size"),
                    shared_gate=True)


def read_linear_attention(fields, num_layers: int) -> GatedDeltaNetShape:
    types = getattr(fields.config, "layer_types", None)  # what the class builds each layer as
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(MIXERS):
        raise MergeError(f"{fields.path}: layer_types={shown(types)}; expected 'linear_attention' or 'full_attention' "
                         f"for each of the {num_layers} layers")
    return GatedDeltaNetShape(
        key_heads=fields.positive_int("linear_num_key_heads"), value_heads=fields.positive_int("linear_num_value_heads"),
        key_head_dim=fields.positive_int("linear_key_head_dim"),
        value_head_dim=fields.positive_int("linear_value_head_dim"),
        conv_kernel=fields.positive_int("linear_conv_kernel_dim"),
        layers=frozenset(i for i, kind in enumerate(types) if kind == "linear_attention"))


def hf_tensor(name: str, dims: tuple[str, ...], **kw) -> Replicated:
    """A tensor of the HF layout under its own name (no Megatron form: see the module's docstring)."""
    return Replicated(f"hf.{name}", dims, hf=name, **kw)


GATED_ATTENTION = tuple(hf_tensor(name, dims, layers="attention") for name, dims in (
    ("self_attn.q_proj.weight", ("gated_q", "hidden")),
    ("self_attn.k_proj.weight", ("kv", "hidden")),
    ("self_attn.v_proj.weight", ("kv", "hidden")),
    ("self_attn.q_norm.weight", ("head_dim",)),
    ("self_attn.k_norm.weight", ("head_dim",)),
    ("self_attn.o_proj.weight", ("hidden", "q")),
))
GATED_DELTA_NET = tuple(hf_tensor(name, dims, layers="linear") for name, dims in (
    ("linear_attn.in_proj_qkvz.weight", ("gdn_qkvz", "hidden")),
    ("linear_attn.in_proj_ba.weight", ("gdn_ba", "hidden")),
    ("linear_attn.conv1d.weight", ("gdn_conv", "one", "gdn_kernel")),
    ("linear_attn.dt_bias", ("gdn_heads",)),
    ("linear_attn.A_log", ("gdn_heads",)),
    ("linear_attn.norm.weight", ("gdn_head_v",)),
    ("linear_attn.out_proj.weight", ("hidden", "gdn_value")),
))

CONFIG = HfConfig(
    "qwen3_next", causal_lm="Qwen3NextForCausalLM", family="qwen",
    examined_keys=QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "layer_types", "full_attention_interval",
                                   "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                                   "linear_num_key_heads", "linear_num_value_heads", "mtp_num_hidden_layers",
                                   "mtp_use_dedicated_embeddings", "attention_bias"},
    partial_rope=True, must_be_false=("attention_bias",), read_moe=read_moe,
    read_linear_attention=read_linear_attention, fused_experts="mlp.experts", peft=PeftQuirks(drops_per_expert=True),
    mtp_key="mtp_num_hidden_layers", mtp_prefix="mtp.",
    hf_only="megatron-core (0.16.1) builds Gated DeltaNet only with the flash-linear-attention kernels, which need "
            "a GPU, so no Megatron checkpoint of it could be made here to prove how it splits the fused projections",
)

ARCHITECTURE = Architecture(
    name="qwen3_next", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM, *GATED_ATTENTION, *GATED_DELTA_NET, PRE_MLP_NORM,
        *(replace(rule, layers="dense") for rule in DENSE_MLP),
        *routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                        up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight"),
        *shared_expert(gate="mlp.shared_expert.gate_proj.weight", up="mlp.shared_expert.up_proj.weight",
                       down="mlp.shared_expert.down_proj.weight", gate_weight="mlp.shared_expert_gate.weight"),
    ),
)
