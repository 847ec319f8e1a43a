"""A multi-token-prediction layer's own parameters (DeepSeek-V3/R1/V3.2, GLM-4.5), beside the decoder layer it
holds: HF releases store MTP layer k as decoder layer L+k (see model/mtp.py for Megatron's names).

eh_proj's input is cat(enorm(embedding of the next tokens), hnorm(hidden state)) in Megatron-Core, transformers'
MtpModel and vLLM alike, so its columns map unpermuted; it is column-parallel. The embedding and output head
are the main model's: HF stores copies under the layer (`embed_tokens`, `shared_head.head`), Megatron none.
"""

from lora_merge.model.layout import ColumnParallel, Replicated, SharedCopy

MTP_LAYER = (
    Replicated("enorm.weight", ("hidden",), hf="enorm.weight"),
    Replicated("hnorm.weight", ("hidden",), hf="hnorm.weight"),
    ColumnParallel("eh_proj.weight", ("hidden", "two_hidden"), hf="eh_proj.weight"),
    # (after the decoder layer)
    SharedCopy("embedding.word_embeddings.weight", ("vocab", "hidden"), hf="embed_tokens.weight",
               copy_of="model.embed_tokens.weight"),
    Replicated("final_layernorm.weight", ("hidden",), hf="shared_head.norm.weight"),
    SharedCopy("output_layer.weight", ("vocab", "hidden"), requires="untied", hf="shared_head.head.weight",
               copy_of="lm_head.weight"),
    SharedCopy("embedding.word_embeddings.weight", ("vocab", "hidden"), requires="tied", hf="shared_head.head.weight",
               copy_of="model.embed_tokens.weight"),
)
