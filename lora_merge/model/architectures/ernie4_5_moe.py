"""ERNIE-4.5-MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B, 300B-A47B), on the HF routes (an HF base with a PEFT adapter;
`hf_only`): GQA without biases (`use_bias` refused when true: it would add biases to every linear and lm_head),
dense MLPs outside [moe_layer_start_index, moe_layer_end_index] every moe_layer_interval, and there routed experts
(softmax scores; the aux-free `mlp.moe_statics.e_score_correction_bias` [1, experts] chooses them) with shared
experts (moe_num_shared_experts × moe_intermediate_size wide); the router's weight and the bias stay fp32, as
transformers keeps and stores them; embeddings usually tied.

No Megatron form is read or written: no Megatron run here trains its routing (softmax scores with the expert bias),
so no checkpoint of it could prove a layout. Its MTP modules (`mtp_block`, `mtp_emb_norm`, `mtp_hidden_norm`,
`mtp_linear_proj`) are not in the table: a base holding them is refused by name."""

from dataclasses import replace

import torch

from lora_merge.errors import MergeError
from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, PRE_MLP_NORM
from lora_merge.model.architectures.moe import routed_experts, shared_expert
from lora_merge.model.layout import Replicated
from lora_merge.model.moe_shape import MoeShape


def read_moe(fields, num_layers: int) -> MoeShape:
    start, interval = fields.count("moe_layer_start_index"), fields.positive_int("moe_layer_interval")
    end = getattr(fields.config, "moe_layer_end_index", None)  # transformers resolves -1 to the last layer
    if not isinstance(end, int) or isinstance(end, bool) or not start <= end < num_layers:
        raise MergeError(f"{fields.path}: moe_layer_end_index={end!r}; expected a layer from moe_layer_start_index "
                         f"({start}) to the last ({num_layers - 1})")
    ffn = fields.positive_int("moe_intermediate_size")
    return MoeShape(fields.positive_int("moe_num_experts"), fields.positive_int("moe_k"), ffn,
                    fields.count("moe_num_shared_experts") * ffn, False, True,
                    frozenset(i for i in range(start, end + 1) if (i + 1) % interval == 0), expert_bias=True)


CONFIG = HfConfig(
    "ernie4_5_moe", causal_lm="Ernie4_5_MoeForCausalLM", family="llama",
    examined_keys=frozenset({"moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
                             "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "moe_norm_min",
                             "use_bias", "num_nextn_predict_layers", "router_aux_loss_coef"}),
    must_be_false=("use_bias",), read_moe=read_moe, fused_experts="mlp.experts", peft=PeftQuirks(drops_per_expert=True),
    hf_only="no Megatron run here trains its routing (softmax scores with the aux-free expert bias), so no "
            "Megatron checkpoint of it could prove a layout",
)

ROUTER = tuple(replace(rule, keep_dtype=torch.float32) if rule.megatron == "mlp.router.weight" else rule
               for rule in routed_experts(router="mlp.gate.weight", gate="mlp.experts.{expert}.gate_proj.weight",
                                          up="mlp.experts.{expert}.up_proj.weight",
                                          down="mlp.experts.{expert}.down_proj.weight"))

ARCHITECTURE = Architecture(
    name="ernie4_5_moe", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        *ATTENTION, PRE_MLP_NORM, *(replace(rule, layers="dense") for rule in DENSE_MLP), *ROUTER,
        Replicated("hf.mlp.moe_statics.e_score_correction_bias", ("one", "experts"),
                   hf="mlp.moe_statics.e_score_correction_bias", layers="moe", keep_dtype=torch.float32),
        *shared_expert(gate="mlp.shared_experts.gate_proj.weight", up="mlp.shared_experts.up_proj.weight",
                       down="mlp.shared_experts.down_proj.weight"),
    ),
)
