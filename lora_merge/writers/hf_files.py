"""Copy the reference model's config, generation config, tokenizer and chat-template files (never its
weights), adjusting the config's dtype when the output dtype differs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json",
)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def copy_reference_files(hf_dir: Path, out_dir: Path, config: dict, dtype: torch.dtype) -> list[str]:
    config = dict(config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = DTYPE_NAMES[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = ["config.json"]
    names = list(COPIED_FILES) + sorted(p.name for p in hf_dir.glob("*.py"))  # remote-code models
    for name in names:
        src = hf_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            written.append(name)
    return written
