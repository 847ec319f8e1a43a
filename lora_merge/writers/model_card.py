"""The merged model's README.md: the HF model-card header (so a hub shows what it is and what it came from)
and a provenance block — inputs, iteration, parallel layout, LoRA settings, and every output file's sha256
(README.md itself aside: it cannot hold its own digest)."""

from __future__ import annotations

import re

from lora_merge import __version__

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub names repositories


def model_card(out_name: str, base, lora, hf_config: dict, settings, dtype: str, modules: int, hashes: dict) -> str:
    source = str(hf_config.get("_name_or_path") or "")
    header = ["---"]
    if HUB_ID.match(source):  # a local path names no hub model
        header.append(f"base_model: {source}")
    header += ["library_name: transformers", "tags:", "  - lora-merge", "  - merged-lora", "  - megatron", "---", ""]
    lines = [f"# {out_name}", "",
             f"{hf_config.get('model_type', 'A')} model with a LoRA fine-tune merged in by lora-merge {__version__}: "
             f"W' = W + (alpha/r)·B·A in float32, rounded once to {dtype}.", "", "## Provenance", "",
             "| | |", "|---|---|",
             f"| base | {_cell(base.describe())} |",
             f"| LoRA | {_cell(lora.describe())} |",
             f"| LoRA settings | r={settings.r}, alpha={settings.alpha:g}, scale {settings.scale:g} ({_cell(settings.source)}) "
             f"on {modules} modules |"]
    experts = getattr(base, "experts", None) or getattr(lora, "experts", None)
    if experts is not None:
        lines.append(f"| experts | {_cell(str(experts))} |")
    lines += [f"| output dtype | {dtype} |", "", "## Files", "", "| file | sha256 |", "|---|---|"]
    lines += [f"| {name} | " + (f"`{digest}` |" if digest else "not computed (--no-sha256) |")
              for name, digest in sorted(hashes.items())]
    return "\n".join(header + lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
