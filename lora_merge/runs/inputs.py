"""Every run's first step: the inputs opened and checked against each other (the reference's config, the
base, the LoRA), the paths the run reads (which no output may touch), and what the output is checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lora_merge.model.architectures import Architecture, architecture_for
from lora_merge.errors import MergeError, UsageError
from lora_merge.model.hf_config import check_same_model, read_hf_config
from lora_merge.lora import LoraSettings, resolve_settings
from lora_merge.model.megatron_args import check_against_args
from lora_merge.merge_plan import check_lora_targets
from lora_merge.model.model_shape import DTYPES, ModelShape
from lora_merge.model.mtp import args_mtp_layers
from lora_merge.options import argument_name
from lora_merge.readers.detect import (HF_BASES, HF_DIR, PEFT_DIR, check_input_dir, input_kind, is_megatron_checkpoint,
                                       open_checkpoint, read_hf_base)
from lora_merge.readers.peft import combine, read_peft_adapter
from lora_merge.readers.source import Source
from lora_merge.files.targets import InputPaths
from lora_merge.writers.model_card import checked_base_model_id, resolve_base_model

# What each path argument names, for the message when it is missing or not a path.
LORA = "the LoRA dir (a Megatron checkpoint or a PEFT adapter)"
HF_REF = "the HF model dir of the base model"
BASE = "the base checkpoint dir"
OUT = "the output dir"



class Progress:
    """`progress(done_bytes, total_bytes)` called as bytes are written."""

    def __init__(self, callback, total: int):
        self.callback, self.total, self.done = callback, total, 0

    def update(self, n: int) -> None:
        self.done += n
        self.callback(self.done, self.total)



@dataclass
class Inputs:
    shape: ModelShape
    hf_config: dict
    arch: Architecture
    base: Source | None
    lora: Source | None
    settings: LoraSettings | None

    def __post_init__(self):
        self.shape = carried_mtp(self.shape, self.arch, self.base or self.lora)


def carried_mtp(shape: ModelShape, arch: Architecture, source: Source | None) -> ModelShape:
    """The shape with `mtp_in_source` set where the run carries the multi-token-prediction layers through the
    layout rules: a Megatron source built them (args.mtp_num_layers, checked against the HF config), or an HF
    base stores them and this family's MTP layout is known (else an HF base's are copied as stored)."""
    if not shape.mtp_layers or source is None or (source.hf_named and not arch.mtp_rules):
        return shape
    if source.hf_named:
        carried = any(name.startswith(shape.mtp_prefixes) for name in source.tensors)
    else:
        carried = args_mtp_layers(source.args) > 0
        if carried and not arch.mtp_rules:
            raise MergeError(f"{source.path}: multi-token-prediction layers (args.mtp_num_layers) in a {shape.model_type} "
                             "model, whose MTP layout this tool does not know")
    return replace(shape, mtp_in_source=carried)


def open_inputs(hf_dir: Path, base_dir: Path | None, lora_dir: Path | None, opts, need_base: bool,
                lora_optional: bool = False) -> Inputs:
    """The reference's config, the model's architecture, the base and the LoRA opened (headers only) and
    checked against each other; `need_base`: the run needs base weights; `lora_optional`: a conversion without
    a LoRA is a run of its own (HF → Megatron), not a missing argument."""
    notes: list[str] = []
    shape, hf_config = read_hf_config(hf_dir, notes)
    for note in notes:
        opts.warn(note)
    arch = architecture_for(shape)
    if lora_dir is not None and input_kind(lora_dir) == PEFT_DIR:
        return _open_peft(shape, hf_config, arch, hf_dir, base_dir, lora_dir, opts)
    if getattr(opts, "more_loras", ()) or getattr(opts, "lora_weights", None):
        raise MergeError(f"{lora_dir}: several adapters, or a weight on one, are merged from PEFT adapter dirs; a "
                         "Megatron LoRA checkpoint is merged alone, at weight 1")
    lora = open_checkpoint(lora_dir) if lora_dir else None
    if base_dir is not None and input_kind(base_dir) in HF_BASES:
        if lora is None and not lora_optional and input_kind(base_dir) == HF_DIR:  # (a DCP: converted to safetensors)
            raise MergeError(f"{base_dir}: an HF model as --base needs a Megatron --lora to merge")
        if input_kind(base_dir) == HF_DIR:  # (a DCP has no config of its own: --hf-ref's describes it)
            check_same_model(shape, hf_dir, base_dir)
        if lora is None:  # a conversion of the HF weights as they are
            return Inputs(shape, hf_config, arch, read_hf_base(base_dir, shape.multimodal), None, None)
        base = read_hf_base(base_dir, shape.multimodal)
        for note in check_against_args(shape, lora.args, str(lora.path)):
            opts.warn(note)
        shape = carried_mtp(shape, arch, base)
        if args_mtp_layers(lora.args) and not shape.mtp_in_source:
            raise MergeError(f"{lora.path}: the LoRA trained {args_mtp_layers(lora.args)} multi-token-prediction "
                             f"layer(s) (args.mtp_num_layers), but the base {base_dir} has none; give a base with "
                             "its MTP layers")
        check_lora_targets(lora, arch, shape, opts.allow_partial_lora)
        settings = resolve_settings(lora.args, opts.lora_r, opts.lora_alpha, str(lora_dir))
        for warning in settings.warnings:
            opts.warn(warning)
        return Inputs(shape, hf_config, arch, base, lora, settings)
    base = open_checkpoint(base_dir) if base_dir else lora
    if base_dir and not base.params:
        raise MergeError(f"{base_dir}: holds no base weights (is it a filtered LoRA checkpoint?)")
    if need_base and base is lora and lora is not None and not lora.params:
        raise MergeError(f"{lora_dir}: holds only LoRA weights (a filtered checkpoint); pass --base with the base model")
    if base is not None and not base.params:
        base = None
    for ckpt in {id(c): c for c in (base, lora) if c is not None}.values():
        for note in check_against_args(shape, ckpt.args, str(ckpt.path)):
            opts.warn(note)
    shape = carried_mtp(shape, arch, base or lora)
    settings = None
    if lora is not None:
        check_lora_targets(lora, arch, shape, opts.allow_partial_lora)
        settings = resolve_settings(lora.args, opts.lora_r, opts.lora_alpha, str(lora_dir))
        for warning in settings.warnings:
            opts.warn(warning)
    return Inputs(shape, hf_config, arch, base, lora, settings)


def _open_peft(shape, hf_config, arch, hf_dir: Path, base_dir: Path | None, lora_dir: Path, opts) -> Inputs:
    """A PEFT adapter goes onto HF weights: --base, or the reference's own when --base is not given."""
    if opts.lora_r is not None or opts.lora_alpha is not None:
        raise MergeError(f"{lora_dir}: --lora-r/--lora-alpha set a Megatron LoRA's settings; a PEFT adapter's r and "
                         "lora_alpha (and rank/alpha patterns) come from its adapter_config.json")
    base_dir = base_dir or hf_dir
    if input_kind(base_dir) not in HF_BASES:
        raise MergeError(f"{base_dir}: a PEFT adapter is merged onto an HF model: --base (or --hf-ref) must be an HF "
                         "model dir with safetensors weights, or a torch distributed checkpoint of HF-named tensors")
    if input_kind(base_dir) == HF_DIR:
        check_same_model(shape, hf_dir, base_dir)
    more = tuple(getattr(opts, "more_loras", ()))
    for other in more:
        if input_kind(other) != PEFT_DIR:
            raise MergeError(f"{other}: several adapters are merged from PEFT adapter dirs; this is not one (a Megatron "
                             "LoRA checkpoint is merged alone)")
    adapters = [read_peft_adapter(path, arch, shape) for path in (lora_dir, *more)]
    weights = list(getattr(opts, "lora_weights", None) or [1.0] * len(adapters))
    adapter = combine(adapters, weights) if more or weights != [1.0] else adapters[0]
    config = adapter.config
    settings = LoraSettings(r=config["r"], alpha=float(config["lora_alpha"]), rslora=bool(config.get("use_rslora")),
                            source="adapter_config.json" + (", rsLoRA" if config.get("use_rslora") else "")
                            + (", per-module patterns" if config.get("rank_pattern") or config.get("alpha_pattern")
                               else "") + ("; DoRA" if config.get("use_dora") else "")
                            + (f"; {len(adapters)} adapters weighted {', '.join(f'{w:g}' for w in weights)}, each with "
                               "its own r and lora_alpha" if adapter is not adapters[0] else ""))
    return Inputs(shape, hf_config, arch, read_hf_base(base_dir, shape.multimodal), adapter, settings)


def output_dtype(choice: str, shape: ModelShape, base: Source | None, lora: Source | None) -> torch.dtype:
    """The dtype asked for; for "auto" the reference config's, else the base's weights' (an HF base's as stored,
    a Megatron run's training dtype), else the LoRA checkpoint's run's, else float32."""
    if choice != "auto":
        return DTYPES[choice]
    if shape.dtype is not None:
        return shape.dtype
    for source in (base, lora):
        if source is not None and source.weights_dtype is not None:
            return source.weights_dtype
    return torch.float32


def has_weights(hf_dir: Path | None) -> bool:
    return hf_dir is not None and any(hf_dir.glob("*.safetensors"))


def given_paths(*paths) -> InputPaths:
    """The input paths as given, for the checks made before anything is opened."""
    found = InputPaths()
    for path in paths:
        found.add(path)
    return found


def input_paths(inp: Inputs, hf_dirs, base_dir: Path | None, lora_dir: Path | None) -> InputPaths:
    """Every file and directory the run reads, for the checks on what it writes (`hf_dirs`: HF-layout dirs
    read: the reference, and for verify the output being checked)."""
    found = given_paths(base_dir, lora_dir)
    for ckpt in (inp.base, inp.lora):
        for source in getattr(ckpt, "adapters", None) or ([ckpt] if ckpt is not None else []):
            found.add(source.path)
            found.add_tree(source.path, source.sources)
    for hf_dir in [hf_dirs] if isinstance(hf_dirs, Path) else hf_dirs:
        if hf_dir is not None and hf_dir.is_dir():
            found.add_tree(hf_dir, [hf_dir / name for name in ("config.json", "model.safetensors.index.json")]
                           + sorted(hf_dir.iterdir()) + sorted(hf_dir.glob("additional_chat_templates/*")))
    return found


def baseline_dir(inp: Inputs, hf_ref: Path | None) -> Path | None:
    """The HF weights a merged output is checked against: those the LoRA went onto when the base is HF (an
    HF --base, or --hf-ref's own for a PEFT adapter given without --base), else the reference's, if any."""
    if inp.base is not None and inp.base.hf_named:
        return inp.base.path
    return hf_ref if has_weights(hf_ref) else None


def check_input_dirs(opts) -> None:
    for path, what in ((opts.base, BASE), (opts.lora, LORA), *((p, LORA) for p in getattr(opts, "more_loras", ())),
                       (opts.hf_ref, HF_REF)):
        check_input_dir(path, what)


def reference_dir(base: Path | None, hf_ref: Path | None) -> Path:
    """The HF dir whose config.json describes the model: --hf-ref, else an HF --base (for --to megatron)."""
    if hf_ref is None and base is not None and input_kind(base) == HF_DIR:
        return base
    if hf_ref is None:
        raise UsageError(f"{argument_name('hf_ref')}: required unless {argument_name('base')} is an HF model dir (its "
                         "config.json describes the model)")
    return hf_ref


def refuse_peft_lora(lora_dir: Path) -> None:
    """export-adapter writes PEFT adapters; one given as its input is already one."""
    if input_kind(lora_dir) == PEFT_DIR:
        raise MergeError(f"{lora_dir}: a PEFT adapter (adapter_config.json), already what export-adapter writes; "
                         "expected a Megatron LoRA checkpoint dir (PEFT and vLLM load this adapter as it is)")


def check_merged_dir(out: Path) -> None:
    """What verify reads is a merged HF model dir; a Megatron checkpoint is said to be one."""
    if not (out / "config.json").is_file():
        if is_megatron_checkpoint(out):
            raise MergeError(f"{out}: a Megatron checkpoint; verify checks HF outputs only (verifying a Megatron "
                             "output is not supported: convert it to HF with `lora-merge --base OUT --hf-ref HF_DIR "
                             "--out HF_OUT` and verify that)")
        raise MergeError(f"{out}: no config.json; not a merged model directory")


def verified_base_dir(base: Path | None, lora: Path | None, hf_ref: Path | None) -> Path | None:
    """The base an output was merged onto, as the merge took it: a PEFT adapter given without --base went onto
    --hf-ref's weights."""
    if base is None and lora is not None and input_kind(lora) == PEFT_DIR and has_weights(hf_ref):
        return hf_ref
    return base


def inside_dir(path: Path | None, directory: Path) -> bool:
    return path is not None and os.path.realpath(path.parent) == os.path.realpath(directory)


def card_base_model(opts, inp: Inputs, reference: Path) -> tuple[str | None, str | None]:
    """The Hub id for the card's base_model (and the adapter's base_model_name_or_path), and the warning to
    give when only local paths are known: once the output is complete (it is about the published card, and
    would only clutter a failure) but before it is published, as every warning is, so that a `warn` that
    raises (or `warnings.simplefilter("error")`) stops the run with nothing published."""
    explicit = checked_base_model_id(opts.base_model_id)
    hf_base = inp.base.path if inp.base is not None and inp.base.hf_named else None
    recorded = [getattr(source.megatron_args, "hf_model_id", None) for source in (inp.base, inp.lora)
                if source is not None and source.megatron_args is not None]
    return resolve_base_model(explicit, [hf_base, reference], inp.hf_config, recorded)
