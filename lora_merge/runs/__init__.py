"""The runs: one module per kind of run, each the same skeleton — open the inputs (`inputs`), plan, stream the
plan through the pipeline into its output, publish — on one typed options object (`options`) that the API
builds from its keywords (the command line calls the API):

- `to_hf`: a merge or a conversion into an HF model (`lora_merge.merge`);
- `to_megatron`: the same into a Megatron checkpoint at any layout (`lora_merge.to_megatron`);
- `export`: a Megatron LoRA as an unmerged PEFT adapter (`lora_merge.export_adapter`);
- `verify`: an HF output read back against its inputs (`lora_merge.verify`).
"""
