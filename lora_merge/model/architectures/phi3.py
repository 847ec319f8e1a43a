"""Phi-3-architecture models (`phi3`: Phi-4, and Phi-3 / 3.5 / 4-mini configs where they qualify): Llama's
decoder with HF's projections fused, qkv_proj = [all q rows; all k rows; all v rows] and gate_up_proj = [gate
rows; up rows], taken from Megatron's group-interleaved linear_qkv and per-rank-halved linear_fc1 and laid end
to end (exactly, both ways); partial RoPE where partial_rotary_factor says, as Megatron's rotary_percent.
resid_pdrop and embd_pdrop act only in training. A sliding window (Phi-3-mini's 2047) is refused like
Mistral's, and longrope scaling (Phi-3.5-mini, Phi-4-mini) with every scaling Megatron cannot be shown to
have trained."""

from lora_merge.model.architectures.base import Architecture, HfConfig
from lora_merge.model.architectures.dense import DOWN_PROJ, EMBEDDING, FINAL, INPUT_NORM, O_PROJ, PRE_MLP_NORM
from lora_merge.model.layout import FusedGatedColumn, FusedQkvColumn

CONFIG = HfConfig("phi3", causal_lm="Phi3ForCausalLM", family="mistral", partial_rope=True,
                  examined_keys=frozenset({"resid_pdrop", "embd_pdrop"}))

ARCHITECTURE = Architecture(
    name="phi3", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM,
        FusedQkvColumn("self_attention.linear_qkv.weight", ("qkv", "hidden"), hf="self_attn.qkv_proj.weight"),
        O_PROJ,
        PRE_MLP_NORM,
        FusedGatedColumn("mlp.linear_fc1.weight", ("gated_ffn", "hidden"), hf="mlp.gate_up_proj.weight"),
        DOWN_PROJ,
    ),
)
