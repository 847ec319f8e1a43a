"""What an input path is — a PEFT adapter, an HF model, a Megatron checkpoint — decided here only, with the
checks every input dir gets before it is read (`check_input_dir`) and the words for what is at a path."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lora_merge.errors import MergeError

HF_DIR, PEFT_DIR, MEGATRON_DIR = "HF model", "PEFT adapter", "Megatron checkpoint"
HF_DCP = "HF-named torch distributed checkpoint"  # an FSDP run's DCP of a transformers model (readers/dcp_hf.py)
HF_BASES = (HF_DIR, HF_DCP)  # what is merged as HF weights


def read_hf_base(path: Path, multimodal: str = ""):
    """An HF base: a model dir's safetensors, or an HF-named DCP (`multimodal`: the release type the config names,
    whose in-memory names a DCP would hold: not read)."""
    from lora_merge.errors import UnsupportedInput
    from lora_merge.readers.dcp_hf import read_dcp_hf
    from lora_merge.readers.hf_model import read_hf_model

    if input_kind(path) != HF_DCP:
        return read_hf_model(path)
    if multimodal:
        raise UnsupportedInput(f"{path}: a torch distributed checkpoint of a {multimodal} model (its state dict's "
                               "in-memory names) is not read; give its safetensors")
    return read_dcp_hf(path)


def input_kind(path: Path | None) -> str | None:
    """What an input dir is, decided here only: a PEFT adapter (adapter_config.json), an HF model (config.json
    and safetensors weights), a torch distributed checkpoint of HF-named tensors, or else a Megatron checkpoint
    (whose reader says so if it is not one)."""
    from lora_merge.readers.dcp_hf import is_hf_dcp_dir
    from lora_merge.readers.hf_model import is_hf_model_dir  # the readers import this module
    from lora_merge.readers.peft import is_peft_adapter_dir

    if path is None:
        return None
    if is_peft_adapter_dir(path):
        return PEFT_DIR
    if is_hf_model_dir(path):
        return HF_DIR
    if is_hf_dcp_dir(path):
        return HF_DCP
    return MEGATRON_DIR


def is_megatron_checkpoint(path: Path) -> bool:
    """Whether `path` leads to a Megatron iteration dir (legacy or torch_dist), for messages only: what is
    not one is said by the reader that opens it."""
    from lora_merge.readers.iteration import find_iteration_dir
    from lora_merge.readers.legacy import is_legacy_iteration
    from lora_merge.readers.torch_dist import is_torch_dist_iteration

    try:
        it_dir = find_iteration_dir(Path(path))
        return is_torch_dist_iteration(it_dir) or is_legacy_iteration(it_dir)
    except (MergeError, OSError):
        return False


def what_is(path: Path, follow: bool = False) -> str:
    """What is at `path`, as words for a message ("a FIFO", "a symlink to /x", "a character device");
    `follow`: what a symlink leads to."""
    try:
        mode = os.stat(path).st_mode if follow else os.lstat(path).st_mode
    except FileNotFoundError:
        return "nothing (it does not exist)"
    except OSError as exc:
        return f"something that cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(mode):
        try:
            return f"a symlink to {os.readlink(path)}"
        except OSError:
            return "a symlink"
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "a special file"


def check_input_dir(path: Path | None, what: str) -> None:
    """An input that must be a directory and exists as something else is named for what it is (`inspect
    /dev/null` is a character device, not "no such checkpoint directory"). A missing one is left to the
    reader, which says what it looked for."""
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        via = f" (a symlink to {os.readlink(path)})" if os.path.islink(path) else ""
        raise MergeError(f"{path}: is {what_is(path, follow=True)}{via}, not a directory; expected {what}")


def open_checkpoint(path: Path):
    """Detect the checkpoint format and open it (reading only pickles and metadata, no tensor data)."""
    from lora_merge.readers.iteration import find_iteration_dir
    from lora_merge.readers.legacy import is_legacy_iteration, read_legacy
    from lora_merge.readers.torch_dist import is_torch_dist_iteration, read_torch_dist

    path = Path(path)
    if not path.exists():
        raise MergeError(f"{path}: does not exist")
    it_dir = find_iteration_dir(path)
    if is_torch_dist_iteration(it_dir):
        from lora_merge.readers.dcp_hf import refuse_foreign_dcp

        refuse_foreign_dcp(it_dir)
        return _floats_only(read_torch_dist(path))
    if is_legacy_iteration(it_dir):
        return _floats_only(read_legacy(path))
    raise MergeError(f"{path}: not a Megatron checkpoint (expected latest_checkpointed_iteration.txt, "
                     "an iter_*/release dir, mp_rank_* dirs or a torch_dist .metadata)")


def _floats_only(ckpt):
    """Every tensor a merge may use is a float (torch_dist: as its metadata says; each chunk read is checked
    to have that dtype); checked before any is read, so nothing is cast."""
    from lora_merge.readers.checkpoint import require_float

    for pieces in ckpt.params.values():
        for ref in pieces:
            require_float(ref.where, ref.dtype)
    for module in ckpt.lora.values():
        for ref in module.refs:
            require_float(ref.where, ref.dtype)
    return ckpt
