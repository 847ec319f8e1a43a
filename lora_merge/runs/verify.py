"""`verify`: a merged HF output read back against its inputs (see verification.py for the checks)."""

from __future__ import annotations

import torch

from lora_merge.readers.detect import check_input_dir
from lora_merge.report import hash_files, report_text, write_report
from lora_merge.runs.inputs import (baseline_dir, check_input_dirs, check_merged_dir, given_paths, input_paths, open_inputs,
                                    verified_base_dir)
from lora_merge.runs.options import VerifyOptions
from lora_merge.verification import VerifyReport, check_output_files, verify_output
from lora_merge.writers.hf_files import reference_files
from lora_merge.files.staged_dir import remove_abandoned_side_files
from lora_merge.files.targets import check_report_path


def run_verify(opts: VerifyOptions) -> VerifyReport:
    out = opts.out
    check_input_dir(out, "the merged HF model dir")
    check_input_dirs(opts)
    roots = given_paths(out, opts.base, opts.lora, *opts.more_loras, opts.hf_ref)
    check_report_path(opts.report, opts.force, roots, early=True)
    check_merged_dir(out)
    base_dir = verified_base_dir(opts.base, opts.lora, opts.hf_ref)
    inp = open_inputs(out, base_dir, opts.lora, opts, need_base=False)
    inputs = input_paths(inp, [out, opts.hf_ref], opts.base, opts.lora)
    check_report_path(opts.report, opts.force, inputs)
    dtype = inp.shape.dtype or torch.float32
    hf_base = inp.base is not None and inp.base.hf_named
    # A PEFT adapter with neither --base nor weights in --hf-ref is opened onto the output itself: no baseline.
    reference = None if hf_base and inp.base.path == out else baseline_dir(inp, opts.hf_ref)
    report = verify_output(out, inp.arch, inp.shape, dtype, inp.lora, inp.settings, reference=reference,
                           base=None if hf_base else inp.base)
    for note in report.notes:  # what is right but will be misread by some loader (a merge warns of it in its plan)
        opts.warn(note)
    # The reference's files as the merge copied them (the merge copies from --hf-ref only, never from --base).
    report.problems += check_output_files(out, reference_files(opts.hf_ref) if opts.hf_ref else None, card=True,
                                          known=report.problems)
    if opts.report:
        remove_abandoned_side_files(opts.report, inputs)
        files = sorted(p.name for p in out.iterdir() if p.is_file())
        write_report(opts.report, report_text(inp, opts.hf_ref, None, {}, hash_files(out, files), report),
                     opts.force)
    return report
