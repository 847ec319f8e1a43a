"""Merge a Megatron-Core / MindSpeed-LLM LoRA checkpoint into a HuggingFace model on a CPU host."""

__version__ = "0.1.0"
