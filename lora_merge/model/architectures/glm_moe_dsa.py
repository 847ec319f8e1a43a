"""GLM-5 (`glm_moe_dsa`), on the HF routes (an HF base with a PEFT adapter; `hf_only`): DeepSeek-V3.2's layer —
multi-latent attention with the sparse-attention indexer (wq_b, wk, the LayerNorm k_norm, weights_proj kept fp32),
dense then routed-expert MLPs with sigmoid routing and the fp32 expert bias — with three differences in the
weights: only the layers `indexer_types` marks "full" have an indexer (a "shared" layer reuses the previous full
layer's choice), the router's weight is fp32 as transformers keeps it, and attention_bias gives q_a_proj,
kv_a_proj_with_mqa and o_proj biases. Both RoPEs are interleaved, which acts in the forward only. The MTP layer
(model.layers.{L}) is carried as DeepSeek's is.

Megatron checkpoints of it are refused for DeepSeek-V3.2's reason: megatron-core builds the indexer with
TransformerEngine only, so no Megatron checkpoint of it could prove the layout. Names of the attention biases
Megatron's MLA lacks are this table's own keys."""

from dataclasses import replace

import torch

from lora_merge.errors import MergeError
from lora_merge.model.architectures.base import HfConfig, PeftQuirks
from lora_merge.model.architectures.deepseek_v32 import INDEXER_KEYS, INDEXER_RULES, sparse_layers
from lora_merge.model.architectures.mla import MLA_ATTENTION, MLA_KEYS, read_mla
from lora_merge.model.architectures.moe import DEEPSEEK_MOE_KEYS, EXPERT_BIAS, deepseek_moe_decoder
from lora_merge.model.architectures.mtp import MTP_LAYER
from lora_merge.model.layout import Replicated
from lora_merge.model.mla_shape import MlaShape
from lora_merge.shown import shown


def read_mla_glm5(fields) -> MlaShape:
    mla = read_mla(fields)
    types = getattr(fields.config, "indexer_types", None)  # which layers run their own indexer
    layers = fields.count("num_hidden_layers")
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"full", "shared"}:
        raise MergeError(f"{fields.path}: indexer_types={shown(types)}; expected 'full' or 'shared' for each of the "
                         f"{layers} layers")
    return replace(mla, index_heads=fields.positive_int("index_n_heads"),
                   index_head_dim=fields.positive_int("index_head_dim"),
                   indexer_layers=frozenset(i for i, kind in enumerate(types) if kind == "full"))


CONFIG = HfConfig(
    "glm_moe_dsa", causal_lm="GlmMoeDsaForCausalLM", family="llama", qkv_bias="attention_bias",
    examined_keys=MLA_KEYS | DEEPSEEK_MOE_KEYS | INDEXER_KEYS | {"indexer_types", "index_topk_pattern",
                                                                "index_topk_freq", "index_skip_topk_offset",
                                                                "layer_types", "attention_bias", "mlp_bias"},
    must_be_false=("mlp_bias",), read_moe=sparse_layers, read_mla=read_mla_glm5, fused_experts="mlp.experts",
    peft=PeftQuirks(converts_expert_targets=True, remaps_every_mlp_target=True),
    hf_only="megatron-core (0.16.1) builds its sparse-attention indexer (DSA) with TransformerEngine only, so no "
            "Megatron checkpoint of it could prove the layout",
)

ATTENTION_BIASES = tuple(Replicated(f"hf.self_attn.{name}.bias", (dims,), hf=f"self_attn.{name}.bias", requires="qkv_bias")
                         for name, dims in (("q_a_proj", "q_lora"), ("kv_a_proj_with_mqa", "kv_down"),
                                            ("o_proj", "hidden")))


def _glm5_rule(rule):
    if getattr(rule, "hf", None) == "mlp.gate.weight":  # transformers keeps the router's weight in fp32 (strictly)
        return replace(rule, keep_dtype=torch.float32)
    return rule


_DSA = deepseek_moe_decoder(CONFIG, MLA_ATTENTION + ATTENTION_BIASES
                            + tuple(replace(rule, layers="indexer") for rule in INDEXER_RULES), EXPERT_BIAS)
ARCHITECTURE = replace(_DSA, layer_rules=tuple(_glm5_rule(rule) for rule in _DSA.layer_rules)).with_mtp(MTP_LAYER)
