"""Read a merged output back and check it, independently of how it was written.

- every tensor the HF config implies is there, with its shape and dtype, and nothing else;
- every value is finite;
- with a baseline: tensors LoRA did not touch are bit-identical to it, and LoRA-touched tensors equal
  baseline + (alpha/r)·B·A to within one rounding to the output dtype.
The strongest baseline is the reference model's own weights (when --hf-ref holds them): they share no
code with the merge, so a layout mistake anywhere (swapped q/k, shifted vocab, a layer off by one) shows
up at full scale without running the model. Without them the Megatron base is un-sharded again with the
same layout rules, which checks the written files and the merge arithmetic, not the rules.

It walks the architecture's table itself instead of consuming the merge's plan, on purpose: a check that
read the plan would share the plan's mistakes (a tensor the plan forgot, a wrong shape it computed); this walk
shares only the table and, without reference weights, the layout rules.

Everything is compared a chunk of rows at a time, with file handles held one tensor at a time, so
memory stays bounded whatever the model size. A damaged output (a shard missing, truncated or with a
garbage header, an unusable index) is a problem in the report and the rest is still checked; the same
damage in the reference, which is the user's input, is an error.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lora_merge.files import remote
from lora_merge.model.multimodal import MULTIMODAL
from lora_merge.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, Mxfp4Weight, is_mxfp4_config, within_mxfp4_step
from lora_merge.model.architectures import Architecture, iter_rules, pick_name
from lora_merge.errors import MergeError
from lora_merge.fp8 import (SCALE_SUFFIX, is_loader_linear, loader_module, not_converted, partial_block_note, read_fp8_config,
                            skip_patterns)
from lora_merge.model.layout import RowBlock, SharedCopy, Skip, SlabBlock, StackedExperts
from lora_merge.lora import DoraDelta, ExpertLoras, LoraSettings, StackedExpertsDelta, megatron_factors
from lora_merge.merge_plan import fitted_pieces
from lora_merge.model.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint, release_pages
from lora_merge.readers.peft import PeftAdapter
from lora_merge.readers.safetensors_dir import SafetensorsDir, plain_file_name, read_bounded
from lora_merge.readers.safetensors_file import Damaged, shown_name
from lora_merge.readers.safetensors_file import shown as shown_value
from lora_merge.files.small_files import read_json
from lora_merge.writers.hf_files import COPIED_SUBDIRS
from lora_merge.writers.model_card import MAX_CARD_BYTES, card_files
from lora_merge.writers.safetensors_stream import SAFETENSORS_DTYPES

CHUNK_BYTES = 64 << 20


@dataclass
class VerifyReport:
    baseline: str
    statuses: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the user should know, not a failure (warnings)

    @property
    def ok(self) -> bool:
        return not self.problems


def _reference_weights(reference: Path, multimodal=None) -> SafetensorsDir:
    """The baseline: damage in it is an error in the user's input, not a finding about the output. (An HF-named
    DCP base's own tensors, where the merge went onto one.)"""
    from lora_merge.readers.dcp_hf import DcpBaseline, is_hf_dcp_dir, read_dcp_hf

    if is_hf_dcp_dir(reference):
        return DcpBaseline(read_dcp_hf(reference))
    ref = SafetensorsDir(reference, multimodal=multimodal)
    if ref.problems:
        more = f" (and {len(ref.problems) - 1} more problem(s))" if len(ref.problems) > 1 else ""
        raise MergeError(f"{ref.problems[0]}{more}; the reference's weights are verify's baseline and must be intact")
    return ref



def within_fp8_step(got: torch.Tensor, exact: torch.Tensor, scales: torch.Tensor, start: int, block) -> bool:
    """Dequantized FP8 rows within half an e4m3 step of the exact values: 2^-4 relative (3 mantissa bits),
    or 2^-10 of the block's scale among the subnormals; the float32 sums leave a little more, and float32
    itself no less than 2^-149 (q·s of a tiny scale is a float32 subnormal)."""
    first = start // block[0]
    s = scales[first:].repeat_interleave(block[0], 0)[start - first * block[0]: start - first * block[0] + got.shape[0]]
    s = s.repeat_interleave(block[1], 1)[:, :got.shape[1]]
    bound = (torch.maximum(exact.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5) + exact.abs() * 2.0 ** -20
             + 2.0 ** -149)
    return bool(((got.float() - exact).abs() <= bound).all())


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
                    for part in block.parts:  # (an expert's row of a stacked tensor is all of its tensor)
                        release_pages(part if isinstance(block, SlabBlock) else part[lo - offset: hi - offset])
            offset += block.rows
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _stacked_experts(rule: StackedExperts, name: str, shape: ModelShape, base: Checkpoint | None,
                     lora: Checkpoint | None, settings: LoraSettings | None):
    """A stacked experts tensor's factors (every expert's Megatron LoRA as one change) and its Megatron baseline
    (every expert's parameter as its row), by HF name; none where the inputs have none (an HF base's is read by
    name)."""
    layer = name[:len(name) - len(rule.slab.megatron)]
    rules = [replace(r, megatron=layer + r.megatron) for r in rule.expert_rules(shape.moe.num_experts)]
    factors, baseline = {}, None
    if lora is not None and not getattr(lora, "hf_named", False):
        modules = tuple(lora.lora.get(r.megatron.removesuffix(".weight")) for r in rules)
        if any(m is not None for m in modules):
            factors[rule.hf] = ExpertLoras(tuple(rules), modules).stacked_delta(settings.scale)
    if base is not None and not base.hf_named and all(r.megatron in base.params for r in rules):
        blocks, mapped = [], False
        for r in rules:
            pieces = fitted_pieces(base, r.megatron, r)
            blocks += r.hf_blocks([p.load() for p in pieces], shape, r.megatron, pieces.is_global)[r.hf]
            mapped = pieces.mapped
        baseline = {rule.hf: _BlockRows(blocks, mapped)}
    return factors, baseline


def verify_output(out_dir: Path, arch: Architecture, shape: ModelShape, dtype: torch.dtype,
                  lora: Checkpoint | PeftAdapter | None, settings: LoraSettings | None,
                  reference: Path | None = None, base: Checkpoint | None = None) -> VerifyReport:
    multimodal = MULTIMODAL.get(shape.multimodal) if shape.multimodal else None  # read by our names
    ref = _reference_weights(reference, multimodal) if reference is not None else None
    out = SafetensorsDir(out_dir, output=True, multimodal=multimodal)
    if ref:
        baseline = f"reference weights in {reference}"
    elif base is not None:
        baseline = f"Megatron base {base.path}"
    else:
        baseline = "none (structure and finiteness only)"
    report = VerifyReport(baseline=baseline)
    report.problems += out.problems + [f"{out_dir / name}: not listed in the index" for name in out.unlisted]
    if not out:
        if not report.problems:
            report.problems.append(f"{out_dir}: no safetensors files")
        return report

    expected_names = set()
    weights = {}  # every 2-D weight of the output: its shape, and whether it is block-FP8
    mxfp4_tensors = []  # stacked experts parameters stored as MXFP4 blocks and scales
    want_dtype = SAFETENSORS_DTYPES[dtype]
    peft = lora is not None and lora.hf_named  # factors by HF name, each with its own scale; trained biases
    for rule, names, prefix in iter_rules(arch, shape, lambda name: any(c.has(name) for c in (base, lora) if c),
                                          stacked=True):
        if isinstance(rule, Skip):
            continue
        if isinstance(rule, StackedExperts):  # every expert's Megatron parameter is a row of it
            factors, megatron_blocks = _stacked_experts(rule, names[0], shape, base if not ref else None,
                                                        lora if not peft else None, settings)
        else:
            megatron = (pick_name(names, base.params, base.path) if base is not None else None) or names[0]
            factors = {}
            module = megatron.removesuffix(".weight")
            if lora is not None and not peft and megatron.endswith(".weight") and module in lora.lora:
                own = lora.lora[module]
                factors = megatron_factors(rule, own, shape, module, settings.scale)
                if own.scale_factor != 1.0:  # a rank of its own (normalize_moe_lora): B carries the ratio
                    factors = {n: (f[0].float() * own.scale_factor, f[1]) if isinstance(f, tuple) else f
                               for n, f in factors.items()}
            megatron_blocks = None
            if not ref and base is not None and megatron in base.params:
                pieces = fitted_pieces(base, megatron, rule)
                blocks = rule.hf_blocks([r.load() for r in pieces], shape, megatron, pieces.is_global)
                megatron_blocks = {n: _BlockRows(b, pieces.mapped) for n, b in blocks.items()}
        for name, dims in rule.hf_shapes(shape).items():
            full = prefix + name
            copied = rule.copy_of if isinstance(rule, SharedCopy) else full  # whose factors it carries
            if isinstance(rule, SharedCopy) and full not in out.file_of and (ref is None or full not in ref.file_of):
                continue  # an MTP layer stored without this copy (GLM-4.6), and so written
            mxfp4 = full not in out.file_of and full + BLOCKS_SUFFIX in out.file_of  # stacked experts as MXFP4
            stored = (full + BLOCKS_SUFFIX, full + SCALES_SUFFIX) if mxfp4 else (full,)
            expected_names.update(stored)
            if full not in out.file_of and not mxfp4:
                report.problems.append(f"{full}: missing from the output")
                continue
            if not all(out.readable(n) for n in stored):  # its file's problem is already listed; one line per cause
                report.statuses[full] = "not checked: its file is missing or damaged"
                continue
            if mxfp4:
                mxfp4_tensors.append(full)
                problem = _mxfp4_shapes(out, full, dims)
                if problem:
                    report.problems.append(problem)
                    continue
                got_shape, got_dtype = dims, want_dtype
            else:
                got_shape, got_dtype = out.meta(full)
            wanted = SAFETENSORS_DTYPES[rule.keep_dtype] if rule.keep_dtype else want_dtype
            quantized = out.scales_of(full)  # a block-FP8 weight: read dequantized, checked within FP8's step
            if quantized is not None:
                expected_names.add(quantized)
                wanted = "F8_E4M3"
                try:
                    out.fp8_block(full)
                except MergeError as exc:
                    report.problems.append(str(exc))
                    continue
            if got_shape != dims or got_dtype != wanted:
                report.problems.append(f"{full}: shape {list(got_shape)} {got_dtype}, the config implies "
                                       f"{list(dims)} {wanted}")
                continue
            if len(dims) == 2 and full.endswith(".weight"):
                weights[full] = (tuple(dims), quantized is not None)
            if ref and full in ref.file_of:
                ref_shape, _ = ref.meta(full)
                if ref_shape != dims:
                    report.problems.append(f"{full}: the reference has shape {list(ref_shape)}, expected {list(dims)}")
                    continue
                source = lambda a, b, n=full: ref.rows(n, a, b)  # noqa: E731
            elif ref and full + BLOCKS_SUFFIX in ref.file_of and full + SCALES_SUFFIX in ref.file_of:
                blocks_shape = ref.meta(full + BLOCKS_SUFFIX)[0]  # an MXFP4 baseline: [E, out, in/32, 16]
                if len(blocks_shape) != 4 or (blocks_shape[0], blocks_shape[2] * 32, blocks_shape[1]) != tuple(dims):
                    report.problems.append(f"{full}: the reference's MXFP4 blocks {list(blocks_shape)} do not hold "
                                           f"{list(dims)}")
                    continue
                source = lambda a, b, n=full: Mxfp4Weight(  # noqa: E731
                    ref.rows(n + BLOCKS_SUFFIX, a, b), ref.rows(n + SCALES_SUFFIX, a, b)).rows(0, b - a)
            elif megatron_blocks is not None:
                source = megatron_blocks[name].rows
            else:
                source = None
            tensor_factors, scale = factors.get(name), settings.scale if settings else None
            if peft and copied in lora.factors:
                f = lora.factors[copied]
                tensor_factors, scale = (f.delta() if f.experts or f.magnitude is not None else (f.b.load(), f.a.load())), \
                    f.scale
            if peft and full in lora.biases:  # the trained bias replaces the base's
                source = lambda a, b, t=lora.biases[full].load(): t[a:b]  # noqa: E731
            report.statuses[full] = _check_tensor(full, dims, out, source, tensor_factors, scale, report,
                                                  quantized is not None, mxfp4)

    for missing in sorted(n for n in (ref.carried - set(out.file_of) if ref else ())
                          if not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in out.file_of)):
        report.problems.append(f"{multimodal.file_name(missing)}: the reference's {multimodal.model_type} release has "
                               "it, the output does not")
    for extra in sorted(set(out.file_of) - expected_names):
        carried = extra in out.carried  # a multimodal release's towers: as stored, or merged with a PEFT change
        if (extra.startswith(shape.mtp_prefixes) or carried) and out.readable(extra):  # kept from an HF base
            got = out.meta(extra)
            if ref and extra in ref.file_of:
                theirs = ref.meta(extra)
                if theirs[0] != got[0] or (theirs[1] != got[1] and not carried):  # towers: in the output's dtype
                    report.problems.append(f"{extra}: shape {list(got[0])} {got[1]}, the reference's "
                                           f"{list(theirs[0])} {theirs[1]}")
                    continue
                source = lambda a, b, n=extra: ref.rows(n, a, b)  # noqa: E731
            else:
                source = None
            factors, scale = None, None
            if carried and peft and extra in lora.factors:
                f = lora.factors[extra]
                factors, scale = (f.delta() if f.magnitude is not None else (f.b.load(), f.a.load())), f.scale
            if carried and peft and extra in lora.biases:
                source = lambda a, b, t=lora.biases[extra].load(): t[a:b]  # noqa: E731
            report.statuses[extra] = _check_tensor(extra, got[0], out, source, factors, scale, report)
            continue
        report.problems.append(f"{shown_name(extra)}: in the output but not part of a {shape.model_type} model "
                               "with this config")
    _check_quantization_config(out_dir, out, weights, report, mxfp4_tensors)
    return report


def _mxfp4_shapes(out: SafetensorsDir, name: str, dims) -> str | None:
    """What is wrong with the MXFP4 blocks and scales holding the [E, in, out] parameter `name`, if anything."""
    (blocks, blocks_dtype), (scales, scales_dtype) = out.meta(name + BLOCKS_SUFFIX), out.meta(name + SCALES_SUFFIX)
    if len(dims) != 3 or dims[1] % 32:
        return f"{name}: MXFP4 blocks for a parameter {list(dims)}; only stacked [E, in, out] experts with in a " \
               "multiple of 32 are MXFP4"
    want = [dims[0], dims[2], dims[1] // 32]
    if list(blocks) != want + [16] or list(scales) != want or blocks_dtype != "U8" or scales_dtype != "U8":
        return (f"{name}: MXFP4 blocks {list(blocks)} {blocks_dtype} and scales {list(scales)} {scales_dtype}, the "
                f"config implies {want + [16]} U8 and {want} U8")
    return None


def _check_quantization_config(out_dir: Path, out: SafetensorsDir, weights: dict, report: VerifyReport,
                               mxfp4: list) -> None:
    """The output's quantization_config against its tensors, both ways, as a loader reads it: block-FP8 weights
    need one (else transformers loads the e4m3 codes as the weights), one needs block-FP8 weights, and its
    modules_to_not_convert (matched as transformers matches it) must exclude exactly the linear modules that
    are not FP8. Also a note on the FP8 weights transformers' CPU loader would refuse or misread."""
    path = out_dir / "config.json"
    if not path.is_file():
        return  # verify refuses an output without config.json before it gets here
    raw = read_json(path)
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    fp8 = sorted(name for name, (_, quantized) in weights.items() if quantized)
    if is_mxfp4_config(q) or mxfp4:
        if not is_mxfp4_config(q):
            report.problems.append(f"{path}: {_count(mxfp4, 'experts parameter')} ({_first(mxfp4)}) {_are(mxfp4)} "
                                   "MXFP4 blocks and scales, but the quantization_config does not say mxfp4: "
                                   "transformers would not find the parameters")
        elif not mxfp4:
            report.problems.append(f"{path}: quantization_config says mxfp4, but no experts parameter is stored as "
                                   "MXFP4 blocks and scales; expected no quantization_config")
        if fp8:
            report.problems.append(f"{path}: block-FP8 weights ({_first(fp8)}) in an MXFP4 model")
        return
    if q is None:
        if fp8:
            report.problems.append(f"{path}: no quantization_config, but {_count(fp8, 'weight')} {_are(fp8)} "
                                   f"block-FP8 ({_first(fp8)}): transformers would load their e4m3 codes as the "
                                   "weights; expected the quantization_config of a block-FP8 model (quant_method fp8)")
        return
    try:
        block = read_fp8_config(q, path).block
    except MergeError as exc:
        report.problems.append(str(exc))
        return
    if not fp8:
        report.problems.append(f"{path}: quantization_config says block-FP8, but no weight is float8_e4m3fn with a "
                               "weight_scale_inv: loaders would look for scales it does not have; expected no "
                               "quantization_config")
        return
    patterns = skip_patterns(q)
    patterns = ["lm_head"] if patterns is None else patterns  # transformers' own default: the output layer
    excluded = {}
    for name in weights:
        module = loader_module(name)
        if module not in excluded:
            excluded[module] = not_converted(module, patterns)
    skipped = [name for name in fp8 if excluded[loader_module(name)]]
    if skipped:
        report.problems.append(f"{path}: {_count(skipped, 'block-FP8 weight')} ({_first(skipped)}) {_are(skipped)} "
                               "in modules the quantization_config's modules_to_not_convert excludes: transformers "
                               "and vLLM would load their e4m3 codes as the weights")
    converted = sorted(name for name, (dims, quantized) in weights.items()
                       if not quantized and is_loader_linear(name, dims) and not excluded[loader_module(name)])
    if converted:
        report.problems.append(f"{path}: {_count(converted, 'weight')} not in block-FP8 ({_first(converted)}) "
                               f"{_are(converted)} in linear modules the quantization_config's modules_to_not_convert "
                               "does not exclude: transformers would load them as FP8 and look for scales they lack")
    note = partial_block_note([(name, weights[name][0]) for name in fp8], block)
    if note is not None:
        report.notes.append(note)


def _count(names, what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) != 1 else ''}"


def _are(names) -> str:
    return "is" if len(names) == 1 else "are"


def _first(names) -> str:
    return ", ".join(names[:3]) + (", …" if len(names) > 3 else "")


def _check_tensor(name, dims, out: SafetensorsDir, baseline, factors, scale, report, fp8: bool = False,
                  mxfp4: bool = False) -> str:
    """Compare one output tensor with its baseline, a chunk of rows at a time (a block-FP8 one dequantized,
    within half an e4m3 step of its block, as one quantization of the exact value leaves it; an MXFP4 one
    likewise within half an E2M1 step of its group)."""
    row_numel = math.prod(dims[1:]) if len(dims) > 1 else 1
    step = max(1, CHUNK_BYTES // (4 * row_numel))
    worst = 0.0
    for start in range(0, dims[0], step):
        stop = min(start + step, dims[0])
        try:
            if mxfp4:
                scales = out.rows(name + SCALES_SUFFIX, start, stop)
                tensor = Mxfp4Weight(out.rows(name + BLOCKS_SUFFIX, start, stop), scales).rows(0, stop - start)
            else:
                tensor = out.rows(name, start, stop)
        except MergeError as exc:  # in the output, so a finding; the baseline's read errors stay errors
            report.problems.append(str(exc))
            return "unreadable"
        if not torch.isfinite(tensor).all():
            report.problems.append(f"{name}: non-finite values")
            return "non-finite"
        if baseline is None:
            continue
        base = baseline(start, stop)
        if fp8:
            if isinstance(factors, DoraDelta):
                exact = factors.merge_rows(base, start, stop, torch.float32, name)
            else:
                exact = base.float() if factors is None else torch.addmm(base.float(), factors[0][start:stop].float(),
                                                                         factors[1].float(), alpha=scale)
            if not within_fp8_step(tensor, exact, out.scales(name), start, out.fp8_block(name)):
                worst = max(worst, (tensor - exact).abs().max().item() or 1e-30)
            continue
        if factors is None and mxfp4:  # an MXFP4 base's bytes kept, or an unquantized base's quantized once
            if not within_mxfp4_step(tensor, base.float(), scales):
                worst = max(worst, (tensor - base.float()).abs().max().item() or 1e-30)
            continue
        if factors is None:
            if not torch.equal(tensor, base.to(tensor.dtype)):
                diff = (tensor.float() - base.float()).abs().max().item()
                report.problems.append(f"{name}: LoRA does not touch it, but it differs from the baseline "
                                       f"(max abs diff {diff:.3g} in rows {start}..{stop - 1})")
                return "differs from baseline"
            continue
        if isinstance(factors, DoraDelta):  # each row rescaled by its magnitude over its merged norm
            expected = factors.merge_rows(base, start, stop, torch.float32, name)
            noise = expected.abs() + scale * (factors.low_rank.b[start:stop].float().abs()
                                              @ factors.low_rank.a.float().abs())
        elif isinstance(factors, StackedExpertsDelta):  # each row one expert's [in, out] slab
            pairs = [tuple(f.float() for f in factors.factors_of(e)) for e in range(start, stop)]
            expected = torch.stack([torch.addmm(base[i].float(), b, a, alpha=scale) for i, (b, a) in enumerate(pairs)])
            noise = torch.stack([base[i].float().abs() + scale * (b.abs() @ a.abs()) for i, (b, a) in enumerate(pairs)])
        else:
            b, a = factors
            b_rows = b[start:stop].float()
            expected = torch.addmm(base.float(), b_rows, a.float(), alpha=scale)
            noise = base.float().abs() + scale * (b_rows.abs() @ a.float().abs())
        if mxfp4:
            if not within_mxfp4_step(tensor, expected, scales):
                worst = max(worst, (tensor - expected).abs().max().item() or 1e-30)
            continue
        if not within_one_rounding(tensor, expected, noise):
            worst = max(worst, (tensor.float() - expected).abs().max().item())
    if baseline is None:
        return "merged (no baseline to compare)" if factors is not None else "present (no baseline to compare)"
    if fp8 or mxfp4:  # quantized: within half a step of the format, of its block or group
        label, step, of = ("FP8", "an e4m3 step", "block") if fp8 else ("MXFP4", "an E2M1 step", "group")
        if worst:
            report.problems.append(f"{name}: its {label} values differ from the {'merged ' if factors else ''}baseline "
                                   f"by up to {worst:.3g}, more than half {step} of their {of}")
            return f"{label} value wrong"
        return f"{label}: within half {step} of " + ("baseline + (alpha/r)·B·A" if factors else "the baseline")
    if factors is None:
        return "identical to baseline"
    if worst:
        report.problems.append(f"{name}: differs from baseline + (alpha/r)·B·A by up to {worst:.3g}")
        return "merged value wrong"
    if isinstance(factors, DoraDelta):
        return "merged: DoRA, m / ‖baseline + (alpha/r)·B·A‖ · (baseline + (alpha/r)·B·A) within one rounding"
    return "merged: baseline + (alpha/r)·B·A within one rounding"


# --- the other files: the reference's copies, and the model card's sha256 list ------------------------

README = "README.md"
COMPARE_CHUNK = 1 << 20


def check_output_files(out_dir: Path, reference, card: bool, known: list[str] = ()) -> list[str]:
    """Problems with the output's non-tensor files, one line each.

    `reference` (hf_files.ReferenceFiles): every file the merge copies from it must be in the output, a
    regular file byte-identical to the reference's (config.json is the output's own, checked through the
    config). `card`: every file the model card lists must be there with the sha256 the card gives, and
    nothing else may be (a tokenizer file added or replaced after the merge changes what the model does).
    `known`: problems already found; a file one of them names gets no second line for the same cause.
    """
    problems = []
    if reference is not None:
        for name in reference.copied:
            problem = _compare_with_reference(out_dir / name, reference.directory / name)
            if problem:
                problems.append(problem)
    if card:
        seen = {k.split(": ", 1)[0] for k in known}  # the path each known problem starts with
        problems += [p for p in _check_card(out_dir) if p.split(": ", 1)[0] not in seen]
    return problems


def _compare_with_reference(path: Path, ref: Path) -> str | None:
    if not os.path.lexists(path):
        return f"{path}: missing; the reference has {ref}"
    if path.is_symlink() or not path.is_file():
        return f"{path}: not a regular file; expected a copy of {ref}"
    try:
        remote.ensure_whole(path)  # (either side at a URL: fetched first if it is read by ranges)
        remote.ensure_whole(ref)
        with path.open("rb") as mine:
            try:
                theirs = ref.open("rb")
            except OSError as exc:
                raise MergeError(f"{ref}: cannot be read ({exc.strerror or exc}); the reference's files are "
                                 "compared with the output's") from exc
            with theirs:
                offset = 0
                while True:
                    a, b = mine.read(COMPARE_CHUNK), theirs.read(COMPARE_CHUNK)
                    if a != b:
                        at = offset + next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        return f"{path}: differs from the reference's {ref} (from byte {at})"
                    if not a:
                        return None
                    offset += len(a)
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror or exc})"


def _card_name_ok(name: str) -> bool:
    parts = name.split("/")
    return (len(parts) == 1 or len(parts) == 2 and parts[0] in COPIED_SUBDIRS) and all(map(plain_file_name, parts))


def _check_card(out_dir: Path) -> list[str]:
    card = out_dir / README
    try:
        text = read_bounded(card, MAX_CARD_BYTES).decode("utf-8")
    except Damaged as exc:
        return [f"{card}: {exc}; the model card lists every output file with its sha256"]
    except UnicodeDecodeError:
        return [f"{card}: not UTF-8 text; expected the model card lora-merge wrote"]
    listed = card_files(text)
    if not listed:
        return [f"{card}: no file list (a \"## Files\" table); expected the model card lora-merge wrote"]
    problems = []
    for name, digest in sorted(listed.items()):
        path = out_dir / name
        if not _card_name_ok(name):
            problems.append(f"{card}: lists {shown_value(name)}, which is not a file of this directory")
        elif not os.path.lexists(path):
            problems.append(f"{path}: missing; the model card lists it")
        elif path.is_symlink() or not path.is_file():
            problems.append(f"{path}: not a regular file; the model card lists it as one")
        elif digest is not None:
            try:
                actual = _sha256(path)
            except OSError as exc:
                problems.append(f"{path}: cannot be read ({exc.strerror or exc})")
                continue
            if actual != digest:
                problems.append(f"{path}: sha256 {actual}, the model card says {digest}: changed after the merge")
    present = []
    for entry in sorted(os.listdir(out_dir)):
        if entry in COPIED_SUBDIRS and (out_dir / entry).is_dir() and not (out_dir / entry).is_symlink():
            present += [f"{entry}/{inner}" for inner in sorted(os.listdir(out_dir / entry))]
        elif entry != README:
            present.append(entry)
    for name in present:
        if name not in listed:
            problems.append(f"{out_dir / name}: not in the model card's file list: not written by the merge")
    return problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    remote.ensure_whole(path)  # (an output at a URL, verified: fetched first)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()
