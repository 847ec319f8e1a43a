"""Read a merged output back and check it, independently of how it was written.

- every tensor the HF config implies is there, with its shape and dtype, and nothing else;
- every value is finite;
- with a baseline (the reference model's own weights when --hf-ref holds them, else the Megatron base):
  tensors LoRA did not touch are bit-identical to it, and LoRA-touched tensors equal
  baseline + (alpha/r)·B·A to within one rounding to the output dtype.
A layout mistake anywhere (swapped q/k, shifted vocab, wrong layer) shows up here at full scale
without running the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from lora_merge.architectures import Architecture
from lora_merge.errors import MergeError
from lora_merge.layout import Skip
from lora_merge.lora import LoraSettings, hf_factors
from lora_merge.architectures import iter_rules, pick_name
from lora_merge.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.writers.safetensors_stream import SAFETENSORS_DTYPES


@dataclass
class VerifyReport:
    baseline: str
    statuses: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class SafetensorsDir:
    """The tensors of an HF model directory (sharded or not), opened lazily by name."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            self.file_of = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(path, framework="pt") as f:
                    self.file_of.update({name: path.name for name in f.keys()})
        self._open = {}

    def __bool__(self) -> bool:
        return bool(self.file_of)

    def _handle(self, name: str):
        file = self.file_of[name]
        if file not in self._open:
            path = self.directory / file
            if not path.is_file():
                raise MergeError(f"{path}: listed in the index but missing")
            self._open[file] = safe_open(path, framework="pt")
        return self._open[file]

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        s = self._handle(name).get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def within_one_rounding(out: torch.Tensor, expected: torch.Tensor, noise: torch.Tensor) -> bool:
    """`out` is `expected` (float32) rounded once to out's dtype, allowing float32 summation noise."""
    eps = torch.finfo(out.dtype).eps
    tol = eps * expected.abs() + 16 * torch.finfo(torch.float32).eps * noise
    return bool(((out.float() - expected).abs() <= tol).all())


def verify_output(out_dir: Path, arch: Architecture, shape: ModelShape, dtype: torch.dtype,
                  lora: Checkpoint | None, settings: LoraSettings | None,
                  reference: Path | None = None, base: Checkpoint | None = None) -> VerifyReport:
    out = SafetensorsDir(out_dir)
    ref = SafetensorsDir(reference) if reference is not None else None
    if ref:
        baseline = f"reference weights in {reference}"
    elif base is not None:
        baseline = f"Megatron base {base.path}"
    else:
        baseline = "none (structure and finiteness only)"
    report = VerifyReport(baseline=baseline)
    if not out:
        report.problems.append(f"{out_dir}: no safetensors files")
        return report

    expected_names = set()
    want_dtype = SAFETENSORS_DTYPES[dtype]
    for rule, names, prefix in iter_rules(arch, shape):
        if isinstance(rule, Skip):
            continue
        megatron = (pick_name(names, base.params, base.path) if base is not None else None) or names[0]
        factors = {}
        module = megatron.removesuffix(".weight")
        if lora is not None and megatron.endswith(".weight") and module in lora.lora:
            factors = hf_factors(rule, lora.lora[module], shape, module)
        base_hf = None
        if not ref and base is not None and megatron in base.params:
            base_hf = rule.to_hf([r.load() for r in base.params[megatron]], shape, megatron)
        for name, dims in rule.hf_shapes(shape).items():
            full = prefix + name
            expected_names.add(full)
            if full not in out.file_of:
                report.problems.append(f"{full}: missing from the output")
                continue
            got_shape, got_dtype = out.meta(full)
            if got_shape != dims or got_dtype != want_dtype:
                report.problems.append(f"{full}: shape {list(got_shape)} {got_dtype}, the config implies "
                                       f"{list(dims)} {want_dtype}")
                continue
            tensor = out.get(full)
            if not torch.isfinite(tensor).all():
                report.problems.append(f"{full}: non-finite values")
                continue
            baseline_t = ref.get(full) if (ref and full in ref.file_of) else (base_hf[name] if base_hf else None)
            report.statuses[full] = _check_value(full, tensor, baseline_t, factors.get(name), settings, report)

    for extra in sorted(set(out.file_of) - expected_names):
        report.problems.append(f"{extra}: in the output but not part of a {shape.model_type} model with this config")
    return report


def _check_value(name, tensor, baseline, factors, settings, report) -> str:
    if baseline is None:
        return "merged (no baseline to compare)" if factors is not None else "present (no baseline to compare)"
    if tuple(baseline.shape) != tuple(tensor.shape):
        report.problems.append(f"{name}: baseline has shape {list(baseline.shape)}, output {list(tensor.shape)}")
        return "shape differs from baseline"
    if factors is None:
        if torch.equal(tensor, baseline.to(tensor.dtype)):
            return "identical to baseline"
        report.problems.append(f"{name}: LoRA does not touch it, but it differs from the baseline "
                               f"(max abs diff {(tensor.float() - baseline.float()).abs().max().item():.3g})")
        return "differs from baseline"
    b, a = factors
    expected = torch.addmm(baseline.float(), b.float(), a.float(), alpha=settings.scale)
    noise = baseline.float().abs() + settings.scale * (b.float().abs() @ a.float().abs())
    if within_one_rounding(tensor, expected, noise):
        return "merged: baseline + (alpha/r)·B·A within one rounding"
    report.problems.append(f"{name}: differs from baseline + (alpha/r)·B·A by up to "
                           f"{(tensor.float() - expected).abs().max().item():.3g}")
    return "merged value wrong"
