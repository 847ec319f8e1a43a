import torch

from transformer_engine import __getattr__  # noqa: F401


class QuantizedTensor(torch.Tensor):
    """TE's quantized tensors: none exist without FP8 (Megatron only asks isinstance of them)."""
