"""Model cards (README.md) of the merged model and of the exported adapter: the Hub's metadata header, built
with huggingface_hub's ModelCardData (so the Hub and `ModelCard.load` read what we meant), and a provenance
block: inputs, iteration, parallel layout, LoRA settings, and every output file's sha256 (README.md itself
aside: it cannot hold its own digest).

Local paths stay out of the card: an input is shown by its directory's name, and `base_model` is set only
to a Hub model id (`base_model_id`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lora_merge.version import __version__
from lora_merge.errors import MergeError
from lora_merge.files import remote

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub names repositories
# huggingface_hub's cache: HF_HOME/hub/models--ORG--NAME/snapshots/REVISION/ (a repo id never holds "--").
CACHE_REPO = re.compile(r"^models--(.+)$")
MAX_CARD_BYTES = 64 << 20  # read whole only below this (a card listing 100,000 files is ~10 MB)
NOT_HASHED = "not computed (--no-sha256)"
WRITTEN_AFTER = "written after this card (this run's --report)"
FILES_HEADING = "## Files"
FILE_ROW = re.compile(r"^\| ((?:[^|\\]|\\.)+) \| (?:`([0-9a-f]{64})`|(" + re.escape(NOT_HASHED) + r")|("
                      + re.escape(WRITTEN_AFTER) + r")) \|$")


def valid_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def checked_base_model_id(value) -> str | None:
    """The --base-model-id / base_model_id argument, or one line saying what was expected."""
    if value is None:
        return None
    if not isinstance(value, str) or not HUB_ID.match(value) or not valid_hub_id(value):
        raise MergeError(f"base model id {value!r}: expected a Hugging Face Hub model id ORG/NAME "
                         "(e.g. Qwen/Qwen2.5-7B)")
    return value


def cache_hub_id(directory: Path) -> str | None:
    """The model id of an HF cache snapshot dir (`.../models--ORG--NAME/snapshots/REV`), as given or
    as it resolves (a link to a snapshot counts as the snapshot)."""
    for path in dict.fromkeys((Path(os.path.abspath(directory)), Path(os.path.realpath(directory)))):
        if len(path.parts) >= 3 and path.parent.name == "snapshots":
            match = CACHE_REPO.match(path.parent.parent.name)
            if match:
                repo_id = match.group(1).replace("--", "/")
                if valid_hub_id(repo_id):
                    return repo_id
    return None


def resolve_base_model(explicit: str | None, dirs, hf_config: dict, recorded=()) -> tuple[str | None, str | None]:
    """(Hub id of the base model or None, a warning when none is known): --base-model-id, else an HF cache
    snapshot among `dirs` (the HF base first, then the reference), else the HF model a training run recorded
    importing (`recorded`: Megatron-Bridge's hf_model_id), else a Hub-id-looking `_name_or_path` in the
    reference's config (older transformers wrote it on save_pretrained)."""
    if explicit:
        return explicit, None
    for directory in dirs:
        if directory is not None:
            found = cache_hub_id(directory)
            if found:
                return found, None
    for source in (*recorded, hf_config.get("_name_or_path")):
        if isinstance(source, str) and HUB_ID.match(source) and not os.path.isabs(source) and valid_hub_id(source):
            return source, None
    shown = next((d for d in dirs if d is not None), None)
    url = shown is not None and remote.is_url(remote.source_name(shown))  # (an input at a URL: named by it)
    what = "the reference" if shown is None else remote.source_name(shown) if url else str(shown)
    kind = "a URL" if url else "a local directory"
    return None, (f"{what} is {kind} that names no Hub model (not an HF cache snapshot, no "
                  "_name_or_path): the model card gets no base_model; pass --base-model-id ORG/NAME to set it")


def _card(data, title: str, body: list[str]) -> str:
    from huggingface_hub import ModelCard

    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join([f"# {title}", ""] + body) + "\n"))


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def shown_input(ckpt) -> str:
    """An input's description with its path replaced by its directory's name (no local paths in a card)."""
    text = ckpt.describe()
    path = str(ckpt.path)
    name = Path(os.path.abspath(path)).name or path
    return text.replace(path, name)


def _files_table(hashes: dict, later: tuple[str, ...] = ()) -> list[str]:
    lines = [FILES_HEADING, "", "| file | sha256 |", "|---|---|"]
    lines += [f"| {_cell(name)} | " + (f"`{digest}` |" if digest else f"{NOT_HASHED} |")
              for name, digest in sorted(hashes.items())]
    lines += [f"| {_cell(name)} | {WRITTEN_AFTER} |" for name in later]
    return lines


def input_tags(base, lora) -> list[str]:
    """Tags naming the kinds of input actually merged: Megatron checkpoints, a PEFT adapter, HF weights."""
    kinds = {getattr(c, "format", None) for c in (base, lora) if c is not None}
    tags = []
    if kinds - {"HF", "PEFT", None}:  # legacy / torch_dist: Megatron-Core (MindSpeed-LLM) checkpoints
        tags.append("megatron")
    if "PEFT" in kinds:
        tags.append("peft")
    return tags


def _formula(lora, settings) -> str:
    """The merge in one formula: LoRA (alpha/r, or alpha/√r for rsLoRA), DoRA, or a weighted sum of adapters."""
    config = getattr(lora, "config", None) or {}
    scale = "alpha/√r" if (settings is not None and settings.rslora) or config.get("use_rslora") else "alpha/r"
    if getattr(lora, "adapters", None):
        return f"W' = W + Σ wᵢ·({scale})ᵢ·Bᵢ·Aᵢ over {len(lora.adapters)} adapters"
    if config.get("use_dora") or getattr(settings, "dora", False):
        return f"DoRA, W' = m / ‖W + ({scale})·B·A‖ · (W + ({scale})·B·A) per output row"
    return f"W' = W + ({scale})·B·A"


def model_card(out_name: str, base, lora, hf_config: dict, settings, dtype: str, modules: int, hashes: dict,
               base_model: str | None = None, later: tuple[str, ...] = ()) -> str:
    return finished_card(model_card_head(out_name, base, lora, hf_config, settings, dtype, modules, base_model),
                         hashes, later)


def finished_card(head: dict, hashes: dict, later: tuple[str, ...] = ()) -> str:
    """The card from its head (`model_card_head`) and the files' digests: the files table is its end."""
    from huggingface_hub import ModelCardData

    return _card(ModelCardData(**head["data"]), head["title"], head["lines"] + _files_table(hashes, later))


def model_card_head(out_name: str, base, lora, hf_config: dict, settings, dtype: str, modules: int,
                    base_model: str | None = None) -> dict:
    """What the card says but its files table, as JSON data (a run in parts records it for `finish`)."""

    data = dict(base_model=base_model, library_name="transformers", pipeline_tag="text-generation",
                tags=["lora-merge", "merged-lora", *input_tags(base, lora)])
    what = (f"with a LoRA fine-tune merged in by lora-merge {__version__}: {_formula(lora, settings)} in float32, "
            f"rounded once to {dtype}." if lora is not None else
            f"converted from a Megatron checkpoint by lora-merge {__version__} (no LoRA), in {dtype}.")
    lines = [f"{hf_config.get('model_type', 'A')} model {what}", "", "## Provenance", "", "| | |", "|---|---|"]
    if base_model:
        lines.append(f"| base model | {_cell(base_model)} |")
    lines += [f"| base | {_cell(shown_input(base))} |"]
    if lora is not None:
        lines += [f"| LoRA | {_cell(shown_input(lora))} |",
                  f"| LoRA settings | r={settings.r}, alpha={settings.alpha:g}, scale {settings.scale:g} "
                  f"({_cell(settings.source)}) on {modules} modules |"]
    experts = next((source.experts for source in (base, lora) if source is not None and source.experts), None)
    if experts is not None:
        lines.append(f"| experts | {_cell(str(experts))} |")
    lines += [f"| output dtype | {dtype} |", ""]
    return {"data": data, "title": out_name, "lines": lines}


def adapter_card(out_name: str, lora, settings, target_modules: list[str], hashes: dict,
                 base_model: str | None = None, later: tuple[str, ...] = ()) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(base_model=base_model, library_name="peft", pipeline_tag="text-generation",
                         tags=["lora-merge", "lora", *input_tags(None, lora)])
    lines = [f"A LoRA adapter for PEFT and vLLM, exported unmerged from a Megatron LoRA checkpoint by lora-merge "
             f"{__version__} (factors keep their bits).", "", "## Provenance", "", "| | |", "|---|---|"]
    if base_model:
        lines.append(f"| base model | {_cell(base_model)} |")
    lines += [f"| LoRA | {_cell(shown_input(lora))} |",
              f"| LoRA settings | r={settings.r}, alpha={settings.alpha:g}, scale {settings.scale:g} "
              f"({_cell(settings.source)}) |",
              f"| targets | {_cell(', '.join(target_modules))} |", ""] + _files_table(hashes, later)
    return _card(data, out_name, lines)


def card_reports(text: str) -> set[str]:
    """The files a card lists as written after it: the --report of the run that wrote the card."""
    lines = text.splitlines()
    if FILES_HEADING not in lines:
        return set()
    return {re.sub(r"\\(.)", r"\1", m.group(1)) for m in map(FILE_ROW.match, lines[lines.index(FILES_HEADING) + 1:])
            if m and m.group(4)}


def card_files(text: str) -> dict[str, str | None] | None:
    """The files a card lists under "## Files": name -> sha256 (None: not hashed, or written after the card);
    None when the card has no such list."""
    lines = text.splitlines()
    if FILES_HEADING not in lines:
        return None
    files = {}
    for line in lines[lines.index(FILES_HEADING) + 1:]:
        match = FILE_ROW.match(line)
        if match:
            files[re.sub(r"\\(.)", r"\1", match.group(1))] = match.group(2)
    return files
