"""Handing pages of a memory-mapped checkpoint back to the OS once they have been used."""

from __future__ import annotations

import ctypes
import mmap

import torch

PAGE = mmap.PAGESIZE
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
except (OSError, AttributeError):  # not on Linux: nothing to release
    def _madvise(*_):
        return 0


def release_pages(tensor: torch.Tensor) -> None:
    """Give the pages of a view into a memory-mapped checkpoint back to the OS (they stay in the page cache).

    Pages of a file mapping count in the process's RSS once read; without this, RSS would grow to the size
    of the checkpoint. Dropping clean private file pages is safe: a later read faults them in again. Only
    for tensors whose memory is such a mapping (`TensorRef.mapped`): on ordinary memory it would zero it.
    """
    if tensor.numel():
        # The whole memory span the view touches: for a strided view (a transposed expert of a grouped
        # tensor) that is more than nbytes.
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
        start = tensor.data_ptr() & ~(PAGE - 1)
        end = tensor.data_ptr() + span * tensor.element_size()
        _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
