"""A Megatron LoRA written as an unmerged PEFT adapter: the inputs opened, the adapter planned from headers,
its factors brought to HF names and layout and streamed into the adapter file, its config and card staged and
published."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lora_merge.merge_plan import build_plan
from lora_merge.model.model_shape import DTYPES
from lora_merge.model.mtp import in_mtp_layer
from lora_merge.peft_adapter import ADAPTER_FILE, adapter_config, plan_adapter, write_config
from lora_merge.readers.detect import check_input_dir
from lora_merge.report import hash_files, report_text
from lora_merge.runs.inputs import (LORA, card_base_model, check_input_dirs, given_paths, input_paths, inside_dir,
                                    open_inputs, refuse_peft_lora)
from lora_merge.runs.options import ExportOptions
from lora_merge.runs.stream import stream_tensors
from lora_merge.writers.model_card import adapter_card, checked_base_model_id
from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
from lora_merge.files.ownership import PEFT_ADAPTER
from lora_merge.files.staged_dir import (StagedOutput, check_free_space, check_output_target,
                                         remove_abandoned_side_files, remove_abandoned_staging)
from lora_merge.files.targets import check_report_path


@dataclass
class ExportResult:
    out: Path
    lora: str
    tensors: int
    bytes: int
    r: int
    alpha: float
    target_modules: list[str]
    target_parameters: list[str]
    files: list[str]


def run_export(opts: ExportOptions) -> ExportResult:
    check_input_dir(opts.lora, LORA)
    refuse_peft_lora(opts.lora)
    checked_base_model_id(opts.base_model_id)
    check_input_dirs(opts)
    roots = given_paths(opts.base, opts.lora, opts.hf_ref)
    check_output_target(opts.out, opts.force, roots, early=True, kind=PEFT_ADAPTER)
    check_report_path(opts.report, opts.force, roots, opts.out, early=True)
    inp = open_inputs(opts.hf_ref, opts.base, opts.lora, opts, need_base=False)
    inputs = input_paths(inp, opts.hf_ref, opts.base, opts.lora)
    check_output_target(opts.out, opts.force, inputs, kind=PEFT_ADAPTER)
    check_report_path(opts.report, opts.force, inputs, opts.out)
    dtype = None if opts.dtype == "auto" else DTYPES[opts.dtype]
    if inp.base is not None and inp.base is not inp.lora and inp.lora.params:
        # an unfiltered LoRA holds the base it was trained on: a --base with other weights is refused, as the
        # merge refuses it (the plan's checks compare the two; nothing of the plan is run)
        build_plan(inp.base, inp.lora, inp.shape, inp.arch, inp.settings, torch.float32)
    shape = inp.shape
    mtp = [module for module in inp.lora.lora if in_mtp_layer(module, shape.num_layers)]
    if mtp:  # transformers builds no MTP layers, so no adapter loader has modules for their factors
        for module in mtp:
            del inp.lora.lora[module]
        shape = replace(shape, mtp_in_source=False)
        opts.warn(f"the LoRA of the multi-token-prediction layers ({len(mtp)} modules) is not in the adapter: PEFT and "
                  "vLLM apply an adapter to the main model only; merge the LoRA to keep it")
    adapter = plan_adapter(inp.lora, shape, inp.arch, inp.settings, dtype, opts.expert_format,
                           opts.allow_partial_lora)
    for warning in adapter.warnings:
        opts.warn(warning)
    base_model, base_model_warning = card_base_model(opts, inp, opts.hf_ref)
    remove_abandoned_staging(opts.out, inputs)  # space held by killed runs is given back before it is counted
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
    check_free_space(opts.out, adapter.total_bytes, 0)
    with StagedOutput(opts.out, opts.force, inputs, kind=PEFT_ADAPTER) as stage:
        # one file whatever its size: PEFT reads adapter_model.safetensors alone
        writer = ShardedSafetensorsWriter(stage.dir, adapter.tensors, adapter.total_bytes + 1, hash_files=True,
                                          single_file=ADAPTER_FILE)
        files = stream_tensors(writer, stage.dir, adapter.produce())
        files.append(write_config(stage.dir, adapter_config(inp.settings, adapter, base_model)))
        hashes = writer.sha256 | hash_files(stage.dir, [f for f in files if f not in writer.sha256])
        later = (opts.report.name,) if inside_dir(opts.report, opts.out) else ()
        with (stage.dir / "README.md").open("x") as f:
            f.write(adapter_card(opts.out.name, inp.lora, inp.settings, adapter.target_modules + adapter.target_parameters,
                                 hashes, base_model, later))
        files.append("README.md")
        if opts.report:
            stage.side_file(opts.report, report_text(inp, opts.hf_ref, None, {}, hashes, None))
        if base_model_warning:  # once the adapter is complete, before it is published
            opts.warn(base_model_warning)
    return ExportResult(out=opts.out, lora=inp.lora.describe(), tensors=len(adapter.tensors),
                        bytes=adapter.total_bytes, r=inp.settings.r, alpha=inp.settings.alpha,
                        target_modules=adapter.target_modules, target_parameters=adapter.target_parameters,
                        files=files)
