"""Read a merged output back and check it, independently of how it was written.

- every tensor the HF config implies is there, with its shape and dtype, and nothing else;
- every value is finite;
- with a baseline: tensors LoRA did not touch are bit-identical to it, and LoRA-touched tensors equal
  baseline + (alpha/r)·B·A to within one rounding to the output dtype.
The strongest baseline is the reference model's own weights (when --hf-ref holds them): they share no
code with the merge, so a layout mistake anywhere (swapped q/k, shifted vocab, a layer off by one) shows
up at full scale without running the model. Without them the Megatron base is un-sharded again with the
same layout rules, which checks the written files and the merge arithmetic, not the rules.

Everything is compared a chunk of rows at a time, with file handles held one tensor at a time, so
memory stays bounded whatever the model size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lora_merge.architectures import Architecture, iter_rules, pick_name
from lora_merge.errors import MergeError
from lora_merge.layout import RowBlock, Skip
from lora_merge.lora import LoraSettings, hf_factors
from lora_merge.merge import fitted_shards
from lora_merge.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint, release_pages
from lora_merge.writers.safetensors_stream import SAFETENSORS_DTYPES

CHUNK_BYTES = 64 << 20


@dataclass
class VerifyReport:
    baseline: str
    statuses: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class SafetensorsDir:
    """The tensors of an HF model directory (sharded or not), read by name and row range."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        try:
            if index.is_file():
                self.file_of = dict(json.loads(index.read_text())["weight_map"])
            else:
                self.file_of = {}
                for path in sorted(directory.glob("*.safetensors")):
                    with safe_open(path, framework="pt") as f:
                        self.file_of.update({name: path.name for name in f.keys()})
        except (KeyError, TypeError, ValueError, SafetensorError, OSError) as exc:
            raise MergeError(f"{directory}: unreadable safetensors index or file ({exc})") from exc

    def __bool__(self) -> bool:
        return bool(self.file_of)

    def _open(self, name: str):
        path = self.directory / self.file_of[name]
        if not path.is_file():
            raise MergeError(f"{path}: listed in the index but missing")
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError) as exc:
            raise MergeError(f"{path}: unreadable safetensors file ({exc})") from exc

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        with self._open(name) as f:
            s = f.get_slice(name)
            return tuple(s.get_shape()), s.get_dtype()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        # A handle per read: safetensors maps the file, and a handle kept open would keep every page
        # read so far resident.
        with self._open(name) as f:
            try:
                return f.get_slice(name)[start:stop]
            except SafetensorError as exc:
                raise MergeError(f"{self.directory / self.file_of[name]}: {name} unreadable ({exc})") from exc


def within_one_rounding(out: torch.Tensor, expected: torch.Tensor, noise: torch.Tensor) -> bool:
    """`out` is `expected` (float32) rounded once to out's dtype, allowing float32 summation noise."""
    eps = torch.finfo(out.dtype).eps
    tol = eps * expected.abs() + 16 * torch.finfo(torch.float32).eps * noise
    return bool(((out.float() - expected).abs() <= tol).all())


class _BlockRows:
    """Row ranges across a list of RowBlocks (the Megatron baseline of one HF tensor)."""

    def __init__(self, blocks: list[RowBlock], mapped: bool):
        self.blocks, self.mapped = blocks, mapped

    def rows(self, start: int, stop: int) -> torch.Tensor:
        pieces, offset = [], 0
        for block in self.blocks:
            lo, hi = max(start, offset), min(stop, offset + block.rows)
            if lo < hi:
                pieces.append(block.take(lo - offset, hi - offset).clone())
                if self.mapped:
                    for part in block.parts:
                        release_pages(part[lo - offset: hi - offset])
            offset += block.rows
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


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
        megatron_blocks = None
        if not ref and base is not None and megatron in base.params:
            refs = fitted_shards(base, megatron, rule)
            blocks = rule.hf_blocks([r.load() for r in refs], shape, megatron, base.global_layout)
            megatron_blocks = {n: _BlockRows(b, all(r.mapped for r in refs)) for n, b in blocks.items()}
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
            if ref and full in ref.file_of:
                ref_shape, _ = ref.meta(full)
                if ref_shape != dims:
                    report.problems.append(f"{full}: the reference has shape {list(ref_shape)}, expected {list(dims)}")
                    continue
                source = lambda a, b, n=full: ref.rows(n, a, b)  # noqa: E731
            elif megatron_blocks is not None:
                source = megatron_blocks[name].rows
            else:
                source = None
            report.statuses[full] = _check_tensor(full, dims, out, source, factors.get(name), settings, report)

    for extra in sorted(set(out.file_of) - expected_names):
        report.problems.append(f"{extra}: in the output but not part of a {shape.model_type} model with this config")
    return report


def _check_tensor(name, dims, out: SafetensorsDir, baseline, factors, settings, report) -> str:
    """Compare one output tensor with its baseline, a chunk of rows at a time."""
    row_numel = math.prod(dims[1:]) if len(dims) > 1 else 1
    step = max(1, CHUNK_BYTES // (4 * row_numel))
    worst = 0.0
    for start in range(0, dims[0], step):
        stop = min(start + step, dims[0])
        tensor = out.rows(name, start, stop)
        if not torch.isfinite(tensor).all():
            report.problems.append(f"{name}: non-finite values")
            return "non-finite"
        if baseline is None:
            continue
        base = baseline(start, stop)
        if factors is None:
            if not torch.equal(tensor, base.to(tensor.dtype)):
                diff = (tensor.float() - base.float()).abs().max().item()
                report.problems.append(f"{name}: LoRA does not touch it, but it differs from the baseline "
                                       f"(max abs diff {diff:.3g} in rows {start}..{stop - 1})")
                return "differs from baseline"
            continue
        b, a = factors
        b_rows = b[start:stop].float()
        expected = torch.addmm(base.float(), b_rows, a.float(), alpha=settings.scale)
        noise = base.float().abs() + settings.scale * (b_rows.abs() @ a.float().abs())
        if not within_one_rounding(tensor, expected, noise):
            worst = max(worst, (tensor.float() - expected).abs().max().item())
    if baseline is None:
        return "merged (no baseline to compare)" if factors is not None else "present (no baseline to compare)"
    if factors is None:
        return "identical to baseline"
    if worst:
        report.problems.append(f"{name}: differs from baseline + (alpha/r)·B·A by up to {worst:.3g}")
        return "merged value wrong"
    return "merged: baseline + (alpha/r)·B·A within one rounding"
