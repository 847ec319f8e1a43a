import torch

from transformer_engine import __getattr__  # noqa: F401


class _SplitAlongDim:
    """Megatron splits the fused QKV with TE's `_SplitAlongDim.apply(x, dim, sizes)`: torch.split's views."""

    @staticmethod
    def apply(x, dim, sizes):
        return torch.split(x, list(sizes), dim=dim)
