"""Llama-4 text (`llama4_text`: the language model of Llama 4 Scout/Maverick saved on its own), on the HF routes (an
HF base with a PEFT adapter; `hf_only`): Llama attention (biases where `attention_bias` says; the q/k norm of the
RoPE layers has no weights), and in the layers `moe_layers` names (from `interleave_moe_layer_step`) a router,
experts stored stacked as transformers holds them (`feed_forward.experts.gate_up_proj` [E, hidden, 2·ffn], in →
out, gate and up halves; `down_proj` [E, ffn, hidden]; PEFT's target_parameters LoRA on them merged expert by
expert) and a shared expert; the other layers a dense MLP of `intermediate_size_mlp`. Chunked attention, the NoPE
layers and the RoPE scaling act in the forward only.

No Megatron form is read or written: no Megatron checkpoint of its NoPE and chunked-attention layers could be made
here to prove a layout. The multimodal checkpoints (`llama4`, the language model under `language_model.`) are not
read. Names of what Megatron lacks are this table's own keys."""

from lora_merge.errors import MergeError
from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import EMBEDDING, FINAL, INPUT_NORM, O_PROJ, PRE_MLP_NORM, QKV
from lora_merge.model.layout import GatedColumn, Replicated, RowParallel
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown


def read_moe(fields, num_layers: int) -> MoeShape:
    layers = getattr(fields.config, "moe_layers", None)  # transformers' list (from interleave_moe_layer_step)
    if not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
        raise MergeError(f"{fields.path}: moe_layers={shown(layers)}; expected layer numbers below {num_layers}")
    ffn = fields.positive_int("intermediate_size")
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"), ffn, ffn,
                    False, False, frozenset(layers))


def hf_tensor(name: str, dims: tuple[str, ...], **kw) -> Replicated:
    return Replicated(f"hf.{name}", dims, hf=name, **kw)


CONFIG = HfConfig(
    "llama4_text", causal_lm="Llama4ForCausalLM", family="llama", qkv_bias="attention_bias",
    examined_keys=frozenset({"num_local_experts", "num_experts_per_tok", "intermediate_size_mlp", "moe_layers",
                             "interleave_moe_layer_step", "no_rope_layers", "attention_chunk_size", "use_qk_norm",
                             "attn_temperature_tuning", "floor_scale", "attn_scale", "attention_bias",
                             "router_aux_loss_coef", "router_jitter_noise", "layer_types"}),
    read_moe=read_moe, fused_experts="feed_forward.experts", peft=PeftQuirks(), dense_ffn_key="intermediate_size_mlp",
    hf_only="no Megatron checkpoint of its NoPE and chunked-attention layers could be made here to prove a layout",
)

ARCHITECTURE = Architecture(
    name="llama4_text", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM, *QKV, O_PROJ, hf_tensor("self_attn.o_proj.bias", ("hidden",), requires="qkv_bias"), PRE_MLP_NORM,
        GatedColumn("mlp.linear_fc1.weight", ("gated_ffn", "hidden"), gate="feed_forward.gate_proj.weight",
                    up="feed_forward.up_proj.weight", layers="dense"),
        RowParallel("mlp.linear_fc2.weight", ("hidden", "ffn"), hf="feed_forward.down_proj.weight", layers="dense"),
        hf_tensor("feed_forward.router.weight", ("experts", "hidden"), layers="moe"),
        hf_tensor("feed_forward.experts.gate_up_proj", ("experts", "hidden", "gated_moe_ffn"), layers="moe"),
        hf_tensor("feed_forward.experts.down_proj", ("experts", "moe_ffn", "hidden"), layers="moe"),
        GatedColumn("mlp.shared_experts.linear_fc1.weight", ("gated_shared_ffn", "hidden"),
                    gate="feed_forward.shared_expert.gate_proj.weight", up="feed_forward.shared_expert.up_proj.weight",
                    layers="moe"),
        RowParallel("mlp.shared_experts.linear_fc2.weight", ("hidden", "shared_ffn"),
                    hf="feed_forward.shared_expert.down_proj.weight", layers="moe"),
    ),
)
