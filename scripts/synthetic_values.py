"""Fast stand-in values for the synthetic benchmark checkpoints: slices of one pool of normal samples,
scaled, instead of drawing every element (torch's generator draws ~0.1-0.2 GB/s on one core; a 14 GB
DeepSeek-shaped input took 300 s to generate). What a merge costs does not depend on the values, only on
their bytes; the values stay finite, varied and deterministic (the slice is chosen by the tensor's key)."""

from __future__ import annotations

import math
import zlib

import torch

POOL_ELEMENTS = (1 << 24) + 4093  # 64 MB of float32; not a power of two, so rows do not repeat in step
_pools: dict[torch.dtype, torch.Tensor] = {}


def _pool(dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _pools:
        _pools[dtype] = torch.randn(POOL_ELEMENTS, generator=torch.Generator().manual_seed(1234)).to(dtype)
    return _pools[dtype]


def normal_like(shape, dtype: torch.dtype, std: float = 0.02, mean: float = 0.0, key: object = "") -> torch.Tensor:
    """A tensor of `shape` holding mean + std · (normal samples), taken from the pool at an offset set by `key`."""
    shape = tuple(shape)
    n = math.prod(shape)
    pool = _pool(dtype)
    out = torch.empty(n, dtype=dtype)
    start = zlib.crc32(repr(key).encode()) % POOL_ELEMENTS
    done = 0
    while done < n:
        take = min(n - done, POOL_ELEMENTS - start)
        out[done:done + take].copy_(pool[start:start + take])
        done += take
        start = (start + 7919) % POOL_ELEMENTS if start + take >= POOL_ELEMENTS else start + take
    out.mul_(std)
    if mean:
        out.add_(mean)
    return out.view(shape)
