"""Input readers: each turns a checkpoint on disk into named, still-sharded tensors (see `Checkpoint`)."""

from __future__ import annotations

from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import Checkpoint, require_float
from lora_merge.readers.iteration import find_iteration_dir
from lora_merge.readers.legacy import is_legacy_iteration, read_legacy
from lora_merge.readers.torch_dist import is_torch_dist_iteration, read_torch_dist


def open_checkpoint(path: Path) -> Checkpoint:
    """Detect the checkpoint format and open it (reading only pickles and metadata, no tensor data)."""
    path = Path(path)
    if not path.exists():
        raise MergeError(f"{path}: does not exist")
    it_dir = find_iteration_dir(path)
    if is_torch_dist_iteration(it_dir):
        return _floats_only(read_torch_dist(path))
    if is_legacy_iteration(it_dir):
        return _floats_only(read_legacy(path))
    raise MergeError(f"{path}: not a Megatron checkpoint (expected latest_checkpointed_iteration.txt, "
                     "an iter_*/release dir, mp_rank_* dirs or a torch_dist .metadata)")


def _floats_only(ckpt: Checkpoint) -> Checkpoint:
    """Every tensor a merge may use is a float (torch_dist: as its metadata says; each chunk read is checked
    to have that dtype); checked before any is read, so nothing is cast."""
    for pieces in ckpt.params.values():
        for ref in pieces:
            require_float(ref.where, ref.dtype)
    for module in ckpt.lora.values():
        for ref in module.refs:
            require_float(ref.where, ref.dtype)
    return ckpt
