"""Input readers: each turns a checkpoint on disk into named, still-sharded tensors (see `Checkpoint`)."""

from __future__ import annotations

from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.readers.legacy import is_legacy_checkpoint, read_legacy


def open_checkpoint(path: Path) -> Checkpoint:
    """Detect the checkpoint format and open it (reading only pickles and metadata, no tensor data)."""
    path = Path(path)
    if not path.exists():
        raise MergeError(f"{path}: does not exist")
    if (path / ".metadata").is_file() or (path / "metadata.json").is_file():
        raise MergeError(f"{path}: torch_dist (distributed) checkpoints are not supported yet; "
                         "convert to the legacy format or use the per-rank model_optim_rng.pt layout")
    if is_legacy_checkpoint(path):
        return read_legacy(path)
    raise MergeError(f"{path}: not a Megatron checkpoint (expected latest_checkpointed_iteration.txt, "
                     "iter_*/release dirs, or mp_rank_* dirs)")
