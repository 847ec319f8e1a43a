"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 plus the sparse-attention indexer (DSA) of every layer:
`self_attn.indexer.wq_b` (from the q LoRA space), `wk`, the LayerNorm `k_norm` (weight and bias) and
`weights_proj`, which transformers keeps in fp32 and so does the output (an fp32 copy of any stored dtype is
exact). The dense/MoE split is transformers' `mlp_layer_types` (from first_k_dense_replace when absent).

Megatron checkpoints of it are refused (`hf_only`): megatron-core builds the indexer with TransformerEngine
only, so its layout could not be proven here. The Megatron names below are those of
megatron-core 0.16.1's DSA module (`self_attention.core_attention.indexer.*`, transformer/
experimental_attention_variant/dsa.py), kept so the table is whole; HF bases with PEFT adapters are merged.
"""

import torch

from lora_merge.errors import MergeError
from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.mtp import MTP_LAYER
from lora_merge.model.architectures.mla import MLA_ATTENTION, MLA_KEYS
from lora_merge.model.architectures.moe import (DEEPSEEK_MOE_KEYS, EXPERT_BIAS, deepseek_moe_decoder, expected_values,
                                                sigmoid_moe)
from lora_merge.model.architectures.deepseek_v3 import read_mla_v3
from lora_merge.model.layout import Replicated
from lora_merge.model.mla_shape import MlaShape
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown

INDEXER_KEYS = frozenset({"index_n_heads", "index_head_dim", "index_topk", "mlp_layer_types", "rope_interleave",
                          "qk_head_dim"})


def read_mla_v32(fields) -> MlaShape:
    mla = read_mla_v3(fields)
    return MlaShape(mla.q_lora, mla.kv_lora, mla.nope, mla.rope, mla.v, index_heads=fields.positive_int("index_n_heads"),
                    index_head_dim=fields.positive_int("index_head_dim"))


def read_moe(fields, num_layers: int) -> MoeShape:
    expected_values(fields, "deepseek_v32", {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1})
    return sparse_layers(fields, num_layers)


def sparse_layers(fields, num_layers: int) -> MoeShape:
    """DeepSeek-V3's routing in the layers transformers' `mlp_layer_types` makes sparse."""
    moe = sigmoid_moe(fields, num_layers)
    types = getattr(fields.config, "mlp_layer_types", None)  # what the class builds each layer as
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise MergeError(f"{fields.path}: mlp_layer_types={shown(types)}; expected 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers")
    layers = frozenset(i for i, kind in enumerate(types) if kind == "sparse")
    return MoeShape(moe.num_experts, moe.topk, moe.ffn, moe.shared_ffn, moe.shared_gate, moe.norm_topk, layers,
                    score=moe.score, expert_bias=moe.expert_bias, groups=moe.groups,
                    group_score_top=moe.group_score_top, scaling=moe.scaling)


CONFIG = HfConfig(
    "deepseek_v32", causal_lm="DeepseekV32ForCausalLM", family="llama",
    examined_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS | INDEXER_KEYS, read_moe=read_moe, read_mla=read_mla_v32,
    fused_experts="mlp.experts", peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
    hf_only="megatron-core (0.16.1) builds its sparse-attention indexer (DSA) with TransformerEngine only, so no "
            "Megatron checkpoint of it could prove the layout",
)

INDEXER = "self_attention.core_attention.indexer."
INDEXER_RULES = (
    Replicated(INDEXER + "linear_wq_b.weight", ("index_q", "q_lora"), hf="self_attn.indexer.wq_b.weight",
               requires="indexer"),
    Replicated(INDEXER + "linear_wk.weight", ("index_head", "hidden"), hf="self_attn.indexer.wk.weight",
               requires="indexer"),
    Replicated(INDEXER + "k_norm.weight", ("index_head",), hf="self_attn.indexer.k_norm.weight", requires="indexer"),
    Replicated(INDEXER + "k_norm.bias", ("index_head",), hf="self_attn.indexer.k_norm.bias", requires="indexer"),
    Replicated(INDEXER + "linear_weights_proj.weight", ("index_heads", "hidden"),
               hf="self_attn.indexer.weights_proj.weight", requires="indexer", keep_dtype=torch.float32),
)

ARCHITECTURE = deepseek_moe_decoder(CONFIG, MLA_ATTENTION + INDEXER_RULES, EXPERT_BIAS).with_mtp(MTP_LAYER)
