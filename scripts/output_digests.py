#!/usr/bin/env python
"""A digest of every output lora-merge writes from the committed fixtures: for a refactor that must not change
a byte. Run it before and after, and compare the two files:

    .venv/bin/python scripts/output_digests.py --json before.json
    ... change the code ...
    .venv/bin/python scripts/output_digests.py --json after.json --compare before.json

Each case is one run (HF merge, Megatron output legacy and torch_dist, PEFT adapter export, FP8 output, a PEFT
adapter merged onto an HF base, verify's report) on one fixture, at 1 and 2 workers where the run takes
workers; its digest is the sha256 over the sorted (relative path, file sha256) of the whole output tree."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lora_merge  # noqa: E402

FIXTURES = sorted(p for group in ("fixtures", "fixtures_moe", "fixtures_deepseek")
                  for p in (ROOT / "tests" / group).iterdir() if (p / "fixture.json").is_file())


def quiet(message):
    pass


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def cases(fixture: Path, work: Path):
    """(name, run writing `out`) of every output made from `fixture`."""
    base, lora, ref = fixture / "base", fixture / "lora", fixture / "hf_ref"
    name = fixture.name
    layers = json.loads((ref / "config.json").read_text())["num_hidden_layers"]
    split = {} if layers % 2 == 0 else {"decoder_first_pipeline_num_layers": layers // 2}  # PP 2 either way
    for workers in (1, 2):
        yield f"{name}/hf/w{workers}", lambda out, w=workers: lora_merge.merge(
            base=base, lora=lora, hf_ref=ref, out=out, workers=w, warn=quiet)
        yield f"{name}/megatron/w{workers}", lambda out, w=workers: lora_merge.to_megatron(
            base=base, lora=lora, hf_ref=ref, out=out, tp=2, pp=2, workers=w, warn=quiet, **split)
    yield f"{name}/megatron-dist", lambda out: lora_merge.to_megatron(
        base=base, lora=lora, hf_ref=ref, out=out, ckpt_format="torch_dist", warn=quiet)
    yield f"{name}/adapter", lambda out: lora_merge.export_adapter(lora=lora, hf_ref=ref, out=out, warn=quiet)
    yield f"{name}/no-lora", lambda out: lora_merge.merge(base=base, hf_ref=ref, out=out, warn=quiet)
    if "deepseek_v3_ep2" == name or "qwen3moe_ep2" == name:
        yield f"{name}/fp8", lambda out: lora_merge.merge(base=base, lora=lora, hf_ref=ref, out=out, dtype="fp8",
                                                          warn=quiet)
    if name in ("qwen3_tp2_fp32", "qwen3moe_ep2", "deepseek_v3_ep2"):
        hf_base, adapter = work / f"{name}-hf-base", work / f"{name}-adapter"

        def peft(out):  # an HF base (this fixture converted) and the fixture's LoRA as a PEFT adapter
            if not hf_base.exists():
                lora_merge.merge(base=base, hf_ref=ref, out=hf_base, warn=quiet)
                lora_merge.export_adapter(lora=lora, hf_ref=ref, out=adapter, warn=quiet)
            lora_merge.merge(base=hf_base, lora=adapter, hf_ref=hf_base, out=out, warn=quiet)
            lora_merge.verify(out, lora=adapter, base=hf_base, report=out.parent / (out.name + ".report.json"),
                              warn=quiet)
            (out / "verify-report.json").write_bytes((out.parent / (out.name + ".report.json")).read_bytes())
        yield f"{name}/peft-onto-hf", peft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="write {case: digest} here")
    p.add_argument("--compare", type=Path, help="an earlier --json to compare with; exit 1 on any difference")
    p.add_argument("--only", nargs="*", help="fixture names")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lora_merge_output_digests",
                   help="where the outputs are written (emptied first, removed after): a fixed path, because model "
                        "cards name their inputs")
    opts = p.parse_args()
    digests, started = {}, time.monotonic()
    shutil.rmtree(opts.work, ignore_errors=True)
    opts.work.mkdir(parents=True)
    try:
        work = opts.work
        for fixture in FIXTURES:
            if opts.only and fixture.name not in opts.only:
                continue
            for name, run in cases(fixture, work):
                out = work / name.replace("/", "__")
                try:
                    run(out)
                    digests[name] = tree_digest(out)
                except lora_merge.MergeError as exc:  # a refusal is an outcome too (same message before and after)
                    digests[name] = "refused: " + str(exc)
                except Exception as exc:  # noqa: BLE001 - a crash too: it is reported, and the other cases still run
                    digests[name] = f"crashed: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(opts.work, ignore_errors=True)
    opts.json.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(f"{len(digests)} cases in {time.monotonic() - started:.0f} s -> {opts.json}")
    if opts.compare:
        before = json.loads(opts.compare.read_text())
        changed = sorted(k for k in set(before) | set(digests) if before.get(k) != digests.get(k))
        for k in changed:
            print(f"differs: {k}: {before.get(k)} -> {digests.get(k)}")
        print("identical" if not changed else f"{len(changed)} case(s) differ")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
