"""Benchmark: merge time, peak memory and throughput against a plain copy and the PEFT route.

Generates a synthetic checkpoint with DeepSeek-R1-Distill-Qwen-32B layer shapes (hidden 5120, 40 heads,
8 query groups, ffn 27648, vocab 152064, bf16, TP=4, LoRA r=8 on all four targets) for each layer count,
then measures, each in a fresh process:
  copy   `cp -r` of the input checkpoint files, then `sync` (the I/O floor: read and write every byte
         once, durably — the merge fsyncs its output before publishing it)
         (copy and merge run alternately --repeat times; the fastest of each counts)
  ours   `lora-merge` (peak RSS of the process)
  peft   the usual way: transformers from_pretrained + PEFT get_peft_model + merge_and_unload +
         save_pretrained, on the same model in HF form with a same-shaped adapter

    python scripts/bench.py --layers 2 4 [--workdir DIR] [--skip-peft] [--moe]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PEFT_ROUTE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
base, out = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
model = get_peft_model(model, config)
for name, p in model.named_parameters():
    if "lora_B" in name:
        torch.nn.init.normal_(p, std=0.02)  # PEFT starts B at zero; a trained adapter does not
model = model.merge_and_unload()
model.save_pretrained(out)
"""


def measure(cmd: list[str]) -> dict:
    """Run cmd in a fresh process; wall seconds and its own peak RSS."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
    return {"seconds": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def best_of(repeat: int, *cmds: list[str]) -> list[dict]:
    """Run the commands alternately `repeat` times; the fastest run of each (this machine is noisy, and
    alternating keeps a slow minute from favouring one side)."""
    runs = [[] for _ in cmds]
    for _ in range(repeat):
        for i, (cmd, before, after) in enumerate(cmds):
            before()
            runs[i].append(measure(cmd))
            after()
    return [min(r, key=lambda m: m["seconds"]) | {"peak_rss_mb": max(m["peak_rss_mb"] for m in r)} for r in runs]


def bench(layers: int, work: Path, skip_peft: bool, repeat: int = 1, moe_layout: str | None = None) -> dict:
    root = work / f"L{layers}{moe_layout or ''}"
    drop(root)
    # Generated in a child: Linux reports a child's peak RSS as at least its parent's RSS at fork time,
    # so this process must stay small (it never imports torch).
    if moe_layout:
        subprocess.run([sys.executable, str(HERE / "synthetic_moe_checkpoint.py"), str(root), "--layers", str(layers),
                        "--ep", "4", "--layout", moe_layout], check=True)
        skip_peft = True  # the PEFT route below is written for dense models
    else:
        subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(root), "--preset", "qwen32b",
                        "--layers", str(layers), "--tp", "4", "--dtype", "bfloat16"], check=True)
    in_bytes = dir_bytes(root / "base") + dir_bytes(root / "lora")
    subprocess.run(["sync"], check=True)

    lora_merge = [str(Path(sys.executable).parent / "lora-merge")]
    merge_cmd = lora_merge + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
                              str(root / "hf_ref"), "--out", str(root / "merged"), "--no-progress"]
    copy, ours = best_of(
        repeat,
        (["sh", "-c", 'cp -r "$0" "$1" "$2"/ && sync', str(root / "base"), str(root / "lora"), str(root / "copy_target")],
         lambda: (root / "copy_target").mkdir(), lambda: drop(root / "copy_target")),
        (merge_cmd, lambda: drop(root / "merged"), lambda: None))
    out_bytes = dir_bytes(root / "merged")
    result = {"layers": layers, "layout": moe_layout or "dense", "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "copy": copy, "ours": ours}
    result["ours"]["gb_per_s"] = (in_bytes + out_bytes) / 1e9 / ours["seconds"]
    result["ratio_to_copy"] = ours["seconds"] / copy["seconds"]
    drop(root / "merged")

    if not skip_peft:
        # A model of the same shapes in HF form — setup for the PEFT route, not timed.
        subprocess.run(lora_merge + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
                                     str(root / "hf_ref"), "--out", str(root / "hf_base"), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        peft = measure([sys.executable, "-c", PEFT_ROUTE, str(root / "hf_base"), str(root / "peft_out")])
        result["peft"] = peft
        result["peft_rss_over_ours"] = peft["peak_rss_mb"] / ours["peak_rss_mb"]
    drop(root)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--workdir", type=Path, default=Path("bench-out"))
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--repeat", type=int, default=2, help="runs of copy and merge, alternating; the fastest counts")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B layer shapes at EP=4 instead, in both expert "
                   "layouts (SequentialMLP + PEFT LoRA, GroupedMLP + MindSpeed grouped LoRA)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    layouts = ["sequential", "grouped"] if args.moe else [None]
    results = [bench(n, args.workdir, args.skip_peft, args.repeat, layout) for layout in layouts for n in args.layers]
    print("| layout | layers | input GB | copy s | ours s | ours / copy | ours GB/s (read+write) | ours peak RSS MB | PEFT s | PEFT peak RSS MB | PEFT RSS / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peft = r.get("peft", {})
        print(f"| {r['layout']} | {r['layers']} | {r['input_gb']:.2f} | {r['copy']['seconds']:.1f} | {r['ours']['seconds']:.1f} | "
              f"{r['ratio_to_copy']:.2f} | {r['ours']['gb_per_s']:.2f} | {r['ours']['peak_rss_mb']:.0f} | "
              f"{peft.get('seconds', float('nan')):.1f} | {peft.get('peak_rss_mb', float('nan')):.0f} | "
              f"{r.get('peft_rss_over_ours', float('nan')):.1f} |")
    for layout in layouts:
        rows = [r for r in results if r["layout"] == (layout or "dense")]
        if len(rows) >= 2:
            a, b = rows[0]["ours"]["peak_rss_mb"], rows[-1]["ours"]["peak_rss_mb"]
            print(f"{layout or 'dense'}: peak RSS growth from {rows[0]['layers']} to {rows[-1]['layers']} layers: "
                  f"{100 * (b - a) / a:+.1f}%")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
