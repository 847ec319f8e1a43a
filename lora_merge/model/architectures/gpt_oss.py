"""gpt-oss (`gpt_oss`: gpt-oss-20b, -120b), on the HF routes (an HF base with a PEFT adapter; `hf_only`): GQA with
biases on q/k/v/o and a learned attention sink per head (`self_attn.sinks`), alternating sliding-window layers
(config only), and in every layer a router with a bias and experts stored stacked as transformers holds them:
`mlp.experts.gate_up_proj` [E, hidden, 2·ffn] (in → out; gate and up columns interleaved, which a merge of the
whole stacked tensor never has to take apart), `down_proj` [E, ffn, hidden], and their biases. PEFT adapts the
stacked parameters through target_parameters, each expert by its own factors (lora.StackedExpertsDelta).

The MXFP4 release (`_blocks`/`_scales`) is read dequantized expert by expert (lora_merge/mxfp4.py). No Megatron
form is read or written: no Megatron checkpoint of its clamped SwiGLU and sinks could be made here to prove a
layout. Names of what Megatron lacks are this table's own keys."""

from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import EMBEDDING, FINAL, INPUT_NORM, O_PROJ, PRE_MLP_NORM, QKV
from lora_merge.model.layout import Replicated
from lora_merge.model.moe_shape import MoeShape


def read_moe(fields, num_layers: int) -> MoeShape:
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("intermediate_size"), 0, False, True, frozenset(range(num_layers)))


def hf_tensor(name: str, dims: tuple[str, ...], **kw) -> Replicated:
    return Replicated(f"hf.{name}", dims, hf=name, **kw)


CONFIG = HfConfig(
    "gpt_oss", causal_lm="GptOssForCausalLM", family="mistral", qkv_bias="attention_bias",
    examined_keys=frozenset({"num_local_experts", "num_experts_per_tok", "attention_bias", "swiglu_limit",
                             "swiglu_alpha", "layer_types", "sliding_window", "router_aux_loss_coef"}),
    read_moe=read_moe, fused_experts="mlp.experts", peft=PeftQuirks(stacked_in_out=True),
    hf_only="no Megatron checkpoint of its clamped SwiGLU and attention sinks could be made here to prove a layout",
)

ARCHITECTURE = Architecture(
    name="gpt_oss", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM,
        *QKV,
        O_PROJ,
        hf_tensor("self_attn.o_proj.bias", ("hidden",), requires="qkv_bias"),
        hf_tensor("self_attn.sinks", ("heads",)),
        PRE_MLP_NORM,
        hf_tensor("mlp.router.weight", ("experts", "hidden"), layers="moe"),
        hf_tensor("mlp.router.bias", ("experts",), layers="moe"),
        hf_tensor("mlp.experts.gate_up_proj", ("experts", "hidden", "gated_moe_ffn"), layers="moe"),
        hf_tensor("mlp.experts.gate_up_proj_bias", ("experts", "gated_moe_ffn"), layers="moe"),
        hf_tensor("mlp.experts.down_proj", ("experts", "moe_ffn", "hidden"), layers="moe"),
        hf_tensor("mlp.experts.down_proj_bias", ("experts", "hidden"), layers="moe"),
    ),
)
