"""Copy the reference model's config, generation config, tokenizer and chat-template files (never its
weights), adjusting the config's dtype when the output dtype differs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lora_merge.errors import MergeError

COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json",
)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
COPY_CHUNK = 1 << 20


def reference_files(hf_dir: Path) -> list[str]:
    """The names of the reference files to copy, each checked to be a readable regular file.

    A name that exists but cannot be copied is an error, not a silent skip: a model whose tokenizer went
    missing on the way would load and then fail, or worse, tokenize differently.
    """
    names = list(COPIED_FILES) + sorted(p.name for p in hf_dir.glob("*.py"))  # remote-code models
    present = [name for name in names if os.path.lexists(hf_dir / name)]
    for name in present:
        _check_copyable(hf_dir / name)
    return present


def _check_copyable(src: Path) -> None:
    if src.is_symlink() and not src.exists():
        raise MergeError(f"{src}: broken symlink (to {os.readlink(src)}); the reference file cannot be copied "
                         "to the output: restore it or remove the link")
    if src.is_dir():
        raise MergeError(f"{src}: a directory; expected the reference's {src.name} file")
    if not src.is_file():
        raise MergeError(f"{src}: not a regular file; expected the reference's {src.name} file")


def copy_reference_files(hf_dir: Path, out_dir: Path, config: dict, dtype: torch.dtype) -> list[str]:
    config = dict(config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = DTYPE_NAMES[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = ["config.json"]
    for name in reference_files(hf_dir):
        _copy_content(hf_dir / name, out_dir / name)
        written.append(name)
    return written


def _copy_content(src: Path, dst: Path) -> None:
    """Copy what `src` leads to (HF cache files are symlinks into ../../blobs/) as a regular file.

    Read errors name the reference file; write errors stay OSErrors (disk full is about the output).
    """
    try:
        fsrc = src.open("rb")
    except OSError as exc:
        raise MergeError(f"{src}: cannot be read ({exc.strerror or exc}); the reference file must be "
                         "readable to be copied") from exc
    with fsrc, dst.open("xb") as fdst:  # "x": never write through something already at dst
        while True:
            try:
                chunk = fsrc.read(COPY_CHUNK)
            except OSError as exc:
                raise MergeError(f"{src}: read failed ({exc.strerror or exc}); the reference file must be "
                                 "readable to be copied") from exc
            if not chunk:
                return
            fdst.write(chunk)
