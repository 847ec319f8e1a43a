"""The JSON report of a run (`--report FILE`): what went in, what came out, and how to check it later."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lora_merge.version import __version__
from lora_merge.files import remote
from lora_merge.interrupts import ignore_signals
from lora_merge.files.ownership import REPORT_FORMAT, REPORT_MARKER
from lora_merge.files.staged_dir import SideFile
from lora_merge.merge_plan import MergePlan
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.verification import VerifyReport


def hash_files(directory: Path, names) -> dict[str, str]:
    hashes = {}
    for name in names:
        h = hashlib.sha256()
        remote.ensure_whole(directory / name)  # (verify's report of an output at a URL: fetched first)
        with open(directory / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        hashes[name] = h.hexdigest()
    return hashes


def _describe(ckpt: Checkpoint | None) -> dict | None:
    if ckpt is None:
        return None
    if ckpt.format in ("HF", "PEFT"):
        return {"path": str(ckpt.path), "format": ckpt.format, "files": [str(p) for p in ckpt.sources]}
    return {"path": str(ckpt.path), "format": ckpt.format, "iteration": ckpt.iteration, "tp": ckpt.tp,
            "pp": ckpt.pp, "vpp": ckpt.vpp, "layout_note": ckpt.note or None, "adapter": ckpt.adapter_name}


def report_text(inp, hf_ref: Path | None, plan: MergePlan | None, file_of: dict, hashes: dict,
                verify: VerifyReport | None, reference_files=None) -> str:
    return finished_report(report_data(inp, hf_ref, plan, file_of, verify, reference_files), hashes)


def finished_report(data: dict, hashes: dict) -> str:
    """The report from its data (`report_data`) and the files' digests."""
    data = dict(data)
    data["files"] = {name: {"sha256": digest} for name, digest in sorted(hashes.items())}
    return json.dumps(data, indent=2) + "\n"


def _with_urls(value):
    """Every path below an input URL's local shadow, named by the URL instead (files/remote.py)."""
    if isinstance(value, str):
        return remote.shown_text(value)
    if isinstance(value, dict):
        return {k: _with_urls(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_with_urls(v) for v in value]
    return value


def report_data(inp, hf_ref: Path | None, plan: MergePlan | None, file_of: dict, verify: VerifyReport | None,
                reference_files=None) -> dict:
    """inputs, LoRA settings, every output tensor with its source and status, every file's sha256. Tensors by the
    names the files hold them under (a multimodal release's own: `file_of` is by those)."""
    renamed = getattr(inp.base, "names", None)
    stored = renamed.stored if renamed is not None else (lambda name: name)
    tensors = {}
    if plan is not None:
        for task in plan.tasks:
            for t in task.outputs:
                merged = task.lora is not None or t.name[len(task.hf_prefix):] in (task.delta or {})
                if not task.opens_outputs:  # a later expert of a stacked tensor
                    if merged:
                        tensors[stored(t.name)]["status"] = "merged with LoRA"
                    continue
                tensors[stored(t.name)] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                           "file": file_of.get(stored(t.name)), "source": task.source,
                                           "status": "merged with LoRA" if merged else "converted"}
    if verify is not None:
        for name, status in verify.statuses.items():
            tensors.setdefault(stored(name), {})["verify"] = status
    report = {
        REPORT_MARKER: REPORT_FORMAT,  # first: how --force recognises a report it may replace (ownership.py)
        "tool": f"lora-merge {__version__}",
        "inputs": {"base": _describe(inp.base), "lora": _describe(inp.lora), "hf_ref": str(hf_ref or "")},
        "lora_settings": None if inp.settings is None else {"r": inp.settings.r, "alpha": inp.settings.alpha,
                                                            "scale": inp.settings.scale, "source": inp.settings.source},
        "skipped": dict(plan.skipped) if plan is not None else {},
        "tensors": tensors,
        "files": None,  # filled in by finished_report
        # What of the reference directory the output holds, and what it left out with the reason.
        "reference_files": None if reference_files is None else {
            "directory": str(reference_files.directory), "copied": sorted(reference_files.copied),
            "left_out": dict(sorted(reference_files.left_out.items()))},
        "verify": None if verify is None else {"ok": verify.ok, "baseline": verify.baseline,
                                               "problems": verify.problems, "notes": verify.notes},
    }
    return _with_urls(report)


def write_report(path: Path, text: str, force: bool = False) -> None:
    """Write a report outside any output directory (verify's): complete or not at all, and with --force over
    nothing but an earlier report of lora-merge."""
    side = SideFile(path)
    try:
        side.write(text)
        ignore_signals()  # the point of no return, as for an output (interrupts.py)
    except BaseException:
        side.discard()
        raise
    side.publish(force)
