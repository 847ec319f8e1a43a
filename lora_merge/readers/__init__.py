"""Input readers: each turns a checkpoint on disk into named, still-sharded tensors (see `Checkpoint`)."""

from __future__ import annotations

from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import Checkpoint, require_float
from lora_merge.readers.iteration import find_iteration_dir
from lora_merge.readers.legacy import is_legacy_iteration, read_legacy
from lora_merge.readers.torch_dist import is_torch_dist_iteration, read_torch_dist


HF_DIR, PEFT_DIR, MEGATRON_DIR = "HF model", "PEFT adapter", "Megatron checkpoint"


def input_kind(path: Path | None) -> str | None:
    """What an input dir is, decided here only: a PEFT adapter (adapter_config.json), an HF model (config.json
    and safetensors weights), or else a Megatron checkpoint (whose reader says so if it is not one)."""
    from lora_merge.readers.hf_model import is_hf_model_dir
    from lora_merge.readers.peft import is_peft_adapter_dir

    if path is None:
        return None
    if is_peft_adapter_dir(path):
        return PEFT_DIR
    if is_hf_model_dir(path):
        return HF_DIR
    return MEGATRON_DIR


def is_megatron_checkpoint(path: Path) -> bool:
    """Whether `path` leads to a Megatron iteration dir (legacy or torch_dist), for messages only: what is
    not one is said by the reader that opens it."""
    try:
        it_dir = find_iteration_dir(Path(path))
        return is_torch_dist_iteration(it_dir) or is_legacy_iteration(it_dir)
    except (MergeError, OSError):
        return False


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
