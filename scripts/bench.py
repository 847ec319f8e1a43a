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

--deepseek: DeepSeek-V3 layer shapes instead (scripts/synthetic_deepseek_checkpoint.py: 2 layers, layer 0
dense, layer 1 MoE with 256 experts + a shared expert, MLA, vocab 129280, bf16, EP=8): the base as a
Megatron torch_dist checkpoint (each tensor once, ~27.9 GB), the LoRA (r=8, alpha=16 on the MLA linears,
the dense MLP, every expert and the shared expert) legacy with one file per EP rank. The merge is
measured as it runs by default and with --no-sha256 (hashing the output is its largest stage on few cores),
alternating with the copy. Input, output and a
copy of it do not fit on a small disk together: every merge output is measured and deleted right after
its run, like every copy (this holds in all modes), so at most input + one output/copy is on disk.

--peft: the input is an HF base (the 32B-shaped model in HF form) + a PEFT adapter (the same LoRA written by
`lora-merge export-adapter`, r=8 on q/k/v/o/gate/up/down). lora-merge merges the two at constant memory;
"copy" copies both dirs; "peft" is PEFT's route for the same two dirs: from_pretrained +
PeftModel.from_pretrained + merge_and_unload + save_pretrained.

--to-megatron: the other direction. An HF model (the 32B-shaped merged model, or the DeepSeek-V3-shaped one
with --deepseek) converted to a Megatron legacy checkpoint at TP=4 (32B) or EP=8 (DeepSeek), against a copy of
the HF model, and beside it the in-memory route other converters take: every HF tensor loaded at once, then
each rank file built and torch.save'd (the same layout, computed from the same plan; legacy EP=8 rank files
for DeepSeek, whose lora-merge run writes torch_dist).

--glm: GLM-4.5-Air layer shapes (synthetic_moe_checkpoint.py --family glm4.5-air), GroupedMLP at EP=4.
--adapter-variants: 32B layer shapes, HF base + one PEFT adapter, a DoRA one, three weighted ones.
--gpt-oss: gpt-oss-20b shapes, an MXFP4 HF base + a PEFT adapter on every expert (synthetic_gpt_oss_checkpoint.py).
--cold (with any of the above): the page cache is dropped before every measured run (copy and merge alike), so
the inputs come from the disk, as on a user's first run (drop_caches where it may be written, else every file
under the workdir evicted with posix_fadvise DONTNEED). --cold inputs: only the files under the workdir are
evicted, the way a fresh checkpoint is cold while Python's and torch's libraries are cached (the tool ran before).

--parts N [N ...]: 32B layer shapes merged by one process, and as N parts run as N processes side by side
(--workers 1 each) followed by `lora-merge finish`.

--fp8: a block-FP8 DeepSeek-V3-shaped HF base (128x128 scales) + the Megatron LoRA, merged into bf16 and into
FP8, against a copy of the same inputs.

    python scripts/bench.py --layers 2 4 [--workdir DIR] [--skip-peft] [--moe | --glm | --deepseek | --peft | --to-megatron | --fp8]
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

# PEFT's route for an adapter a user already has: load the base, load the adapter, merge, save.
PEFT_ADAPTER_ROUTE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
model.merge_and_unload().save_pretrained(out)
"""

# The usual converter's route: load the whole HF model, then build each rank file in memory and torch.save it.
# It uses lora-merge's own plan for the layout (what goes where), so only the memory strategy differs.
IN_MEMORY_ROUTE = r"""
import sys, glob, os, torch
from collections import OrderedDict
from safetensors.torch import load_file
import lora_merge
src, out, tp, ep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
planned = lora_merge.to_megatron(base=src, out=out, tp=tp, ep=ep, dry_run=True, warn=lambda m: None).writer
hf = {}
for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
    hf.update(load_file(f))  # every tensor in memory at once
shards = {}
for name, entry in planned.hf.items():
    rows = hf[name]
    for dest in entry.destinations:
        seg = dest.segment
        piece = rows[seg.hf_start: seg.hf_start + seg.rows]
        if seg.col_start is not None:
            piece = piece[:, seg.col_start: seg.col_stop]
        for targets in dest.targets.values():
            for t in targets:
                slot = planned._slots[id(t)][1]
                whole = shards.setdefault(id(slot), torch.zeros(slot.shape, dtype=slot.dtype))
                whole[seg.shard_start: seg.shard_start + seg.rows] = piece
for f in planned.files:
    models = []
    for chunk in f.chunks:
        models.append(OrderedDict((k, None if v is None else shards[id(v)]) for k, v in chunk.items()))
    path = os.path.join(out, str(f.path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"args": planned.args, "checkpoint_version": 3.0, "iteration": 0,
                **({"model": models[0]} if len(models) == 1 else {f"model{v}": m for v, m in enumerate(models)})}, path)
"""

# The merge's computing alone, without the disk: the plan run with a writer that drops every piece (the
# pages are still read and CRC-checked), so the cores it uses show even where the disk binds the real run.
COMPUTE_ONLY = r"""
import sys
import lora_merge
from lora_merge.merge_pipeline import execute
from lora_merge.stage_clock import write_if_asked
base, lora, hf_ref, out, workers = sys.argv[1:6]
plan = lora_merge.merge(base=base, lora=lora, hf_ref=hf_ref, out=out, dry_run=True, warn=lambda message: None).plan
def drop(name, piece, then):
    if then is not None:
        then()
execute(plan, drop, workers=None if workers == "default" else int(workers))
write_if_asked()
"""

# Run from the checkout (no install needed: a host with torch, safetensors and transformers is enough).
LORA_MERGE = [sys.executable, "-m", "lora_merge"]
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
# --workers values measured for every input: "default" is the tool's own choice
WORKER_SETTINGS = ["1", "default"]
STAGES = ("merge", "dispatch", "writer", "io", "sha256", "crc32", "prefetch", "early-reads")


def merge_variants(cmd: list[str], no_sha256: bool = False) -> list[tuple[str, list[str]]]:
    """(label, command) for each worker setting (and with --no-sha256 where asked)."""
    variants = []
    for workers in WORKER_SETTINGS:
        flags = [] if workers == "default" else ["--workers", workers]
        label = f"workers {workers}"
        variants.append((label, cmd + flags))
        if no_sha256:
            variants.append((label + ", --no-sha256", cmd + flags + ["--no-sha256"]))
    return variants


COLD: list[str] = []  # ["all"] or ["inputs"] with --cold: the page cache is dropped before every measured run


COLD_ROOTS: list[Path] = []  # where the inputs live (the workdir), for the per-file eviction


def drop_page_cache() -> None:
    """Write back, then drop the page cache, so that a run reads its inputs from the disk as a user's first run
    does: all of it where /proc/sys/vm/drop_caches may be written (root on a host), else each file under the
    workdir evicted with posix_fadvise(DONTNEED), which drops a file's clean cached pages (a container's root
    cannot write /proc/sys, but may do this to its own files)."""
    os.sync()
    if COLD != ["inputs"]:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        except OSError:
            pass
    for root in COLD_ROOTS:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def allocated_bytes(dirs: list[Path]) -> int:
    """Disk blocks held by the files under `dirs` (a sparse file counts what is written, not its size)."""
    total = 0
    for top in dirs:
        for root, _, names in os.walk(top):
            for name in names:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def measure(cmd: list[str], allow_failure: bool = False, disk_of: list[Path] | None = None) -> dict:
    """Run cmd in a fresh process; wall seconds, its CPU seconds (user + system) and its own peak RSS, and
    for a lora-merge run the CPU seconds of each of its stages. With --cold, from an empty page cache.
    `disk_of`: also the peak of the local disk the files under these directories held (sampled every 0.2 s)."""
    import threading

    peak_disk = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak_disk[0] = max(peak_disk[0], allocated_bytes(disk_of))
    stage_file = Path(f"/tmp/lora-merge-bench-stages-{os.getpid()}.json")
    stage_file.unlink(missing_ok=True)
    if COLD:
        drop_page_cache()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "LORA_MERGE_STAGE_TIMES": str(stage_file)})
    sampler = threading.Thread(target=sample, daemon=True) if disk_of else None
    if sampler is not None:
        sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    done.set()
    if sampler is not None:
        sampler.join()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and allow_failure:
        return {"failed": f"killed by signal {-code}" if code < 0 else f"exit status {code}: {err[-300:]}",
                "seconds": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_seconds": usage.ru_utime + usage.ru_stime}
    if code != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
    result = {"seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}
    if disk_of:
        result["peak_disk_mb"] = peak_disk[0] / 1e6
    if stage_file.exists():
        result["stages"] = json.loads(stage_file.read_text())
        stage_file.unlink()
    return result


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def best_of(repeat: int, *cmds: list[str]) -> list[dict]:
    """Run the commands alternately `repeat` times; the fastest run of each (this machine is noisy, and
    alternating keeps a slow minute from favouring one side), with the peak RSS of all its runs and every
    run's seconds."""
    runs = [[] for _ in cmds]
    for _ in range(repeat):
        for i, (cmd, before, after) in enumerate(cmds):
            before()
            runs[i].append(measure(cmd))
            after()
    return [min(r, key=lambda m: m["seconds"]) | {"peak_rss_mb": max(m["peak_rss_mb"] for m in r),
                                                   "all_seconds": [m["seconds"] for m in r]} for r in runs]


def copy_and_merge(root: Path, inputs: list[Path], merge_cmds: list[list[str]], repeat: int) -> tuple[dict, list, int]:
    """The plain copy of `inputs` and each merge command (writing root/merged), alternately; and the output's
    size. Each copy and output is deleted right after it is measured: never an output and a copy on disk at once."""
    out_sizes = []

    def measured_and_dropped():
        if (root / "merged").exists():  # a compute-only run writes nothing
            out_sizes.append(dir_bytes(root / "merged"))
        drop(root / "merged")

    copy, *merges = best_of(
        repeat,
        (["sh", "-c", 'cp -r "$@" && sync', "cp", *map(str, inputs), str(root / "copy_target") + "/"],
         lambda: (root / "copy_target").mkdir(), lambda: drop(root / "copy_target")),
        *((cmd, lambda: drop(root / "merged"), measured_and_dropped) for cmd in merge_cmds))
    return copy, merges, out_sizes[-1]


def copy_vs_merge(root: Path, base: Path, lora: Path, hf_ref: Path, repeat: int, result: dict,
                  no_sha256: bool = False) -> dict:
    """`result` with the input/output sizes, the copy and the merge (into root/merged) timings, and their ratio;
    with `no_sha256` also a merge with --no-sha256 (result["ours_no_sha256"]), alternating with the others."""
    in_bytes = dir_bytes(base) + dir_bytes(lora)
    check_free(root, in_bytes)
    merge_cmd = LORA_MERGE + ["--base", str(base), "--lora", str(lora), "--hf-ref", str(hf_ref), "--out",
                              str(root / "merged"), "--no-progress"]
    variants = merge_variants(merge_cmd, no_sha256)
    variants += [(f"compute only, workers {w}", [sys.executable, "-c", COMPUTE_ONLY, str(base), str(lora), str(hf_ref),
                                                 str(root / "merged"), w]) for w in WORKER_SETTINGS]
    copy, merges, out_bytes = copy_and_merge(root, [base, lora], [cmd for _, cmd in variants], repeat)
    result |= {"input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "copy": copy, "runs": {}}
    add_runs(result, variants, merges, copy, out_bytes)
    for ours in merges:
        ours["gb_per_s"] = (in_bytes + out_bytes) / 1e9 / ours["seconds"]
    return result


def add_runs(result: dict, variants, merges: list[dict], copy: dict, per_bytes: int) -> None:
    """Each run under its label with its ratio to the copy and CPU seconds per GB (of `per_bytes`), overall and
    per stage; `ours` is the run with the tool's defaults."""
    for (label, _), ours in zip(variants, merges):
        ours["ratio_to_copy"] = ours["seconds"] / copy["seconds"]
        ours["cpu_s_per_gb"] = ours["cpu_seconds"] / (per_bytes / 1e9)
        ours["stage_cpu_s_per_gb"] = {k: v / (per_bytes / 1e9) for k, v in ours.get("stages", {}).items()}
        result["runs"][label] = ours
    result["ours"] = result["runs"].get("workers default", merges[0])
    result["ratio_to_copy"] = result["ours"]["ratio_to_copy"]


def print_runs(title: str, r: dict) -> None:
    """One row per lora-merge run of an input: wall, ratio to the copy, CPU per GB written, cores used, RSS,
    and each stage's CPU per GB written."""
    print(f"\n{title}: {r['input_gb']:.2f} GB in, {r['output_gb']:.2f} GB out; copy + sync "
          f"{r['copy']['seconds']:.1f} s ({r['copy']['cpu_seconds'] / (r['output_gb']):.2f} CPU s/GB)")
    print("| run | wall s | / copy | CPU s | CPU s/GB | CPU / wall | peak RSS MB | " +
          " | ".join(f"{s} s/GB" for s in STAGES) + " | other s/GB |")
    print("|---|" + "---|" * (6 + len(STAGES) + 1))
    for label, ours in r["runs"].items():
        stages = ours.get("stage_cpu_s_per_gb", {})
        other = ours["cpu_s_per_gb"] - sum(stages.values())
        print(f"| {label} | {ours['seconds']:.1f} | {ours['ratio_to_copy']:.2f} | {ours['cpu_seconds']:.1f} | "
              f"{ours['cpu_s_per_gb']:.2f} | {ours['cpu_seconds'] / ours['seconds']:.1f} | {ours['peak_rss_mb']:.0f} | " +
              " | ".join(f"{stages.get(s, 0.0):.2f}" for s in STAGES) + f" | {other:.2f} |")
    print("every run, s: copy " + ", ".join(f"{x:.1f}" for x in r["copy"]["all_seconds"]) +
          "".join(f"; {label} " + ", ".join(f"{x:.1f}" for x in ours["all_seconds"]) for label, ours in r["runs"].items()))


def check_free(root: Path, in_bytes: int) -> None:
    subprocess.run(["sync"], check=True)
    free = shutil.disk_usage(root).free
    if free < in_bytes + 2e9:  # a copy of the input, or an output (no bigger than the input), must fit
        drop(root)
        raise SystemExit(f"{root}: {free / 1e9:.1f} GB free, a copy of the {in_bytes / 1e9:.1f} GB input needs more")


def variants_against_copy(root: Path, inputs: list[Path], variants, repeat: int, result: dict,
                          per_output_gb: bool) -> dict:
    """Each (label, merge command) alternating with a copy of `inputs`, into `result`; CPU per GB written
    (`per_output_gb`), else per GB read (when the variants' outputs differ in size); root is removed after."""
    in_bytes = sum(dir_bytes(p) for p in inputs)
    copy, merges, out_bytes = copy_and_merge(root, inputs, [c for _, c in variants], repeat)
    result |= {"input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "copy": copy, "runs": {}}
    add_runs(result, variants, merges, copy, out_bytes if per_output_gb else in_bytes)
    drop(root)
    return result


def make_peft_input(root: Path, layers: int, preset: str) -> None:
    """root/hf_base (the synthetic Megatron base converted to HF) and root/adapter (its LoRA written by
    export-adapter); the Megatron dirs are removed."""
    drop(root)
    subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(root), "--preset", preset,
                    "--layers", str(layers), "--tp", "4", "--dtype", "bfloat16"], check=True)
    quiet = {"check": True, "stdout": subprocess.DEVNULL}
    subprocess.run(LORA_MERGE + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
                                 str(root / "hf_ref"), "--out", str(root / "hf_base"), "--no-progress"], **quiet)
    subprocess.run(LORA_MERGE + ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                                 "--out", str(root / "adapter")], **quiet)
    drop(root / "base")
    drop(root / "lora")


def bench_peft_input(layers: int, work: Path, repeat: int, preset: str = "qwen32b") -> dict:
    """An HF base + a PEFT adapter (the 32B-shaped model in HF form and its LoRA exported by export-adapter)
    merged by lora-merge, against a plain copy of both and against PEFT's own route on the same two dirs."""
    root = work / f"L{layers}peft"
    generate_start = time.monotonic()
    make_peft_input(root, layers, preset)
    generate_seconds = time.monotonic() - generate_start
    result = copy_vs_merge(root, root / "hf_base", root / "adapter", root / "hf_base", repeat,
                           {"layers": layers, "layout": "HF base + PEFT adapter", "generate_seconds": generate_seconds})
    peft = measure([sys.executable, "-c", PEFT_ADAPTER_ROUTE, str(root / "hf_base"), str(root / "adapter"),
                    str(root / "peft_out")])
    drop(root / "peft_out")
    result["peft"] = peft
    result["peft_rss_over_ours"] = peft["peak_rss_mb"] / result["ours"]["peak_rss_mb"]
    drop(root)
    return result


def bench_dcp(layers: int, work: Path, repeat: int, preset: str = "qwen32b") -> dict:
    """The --peft input with its HF base saved as FSDP2 training saves it (fsdp2_save.py: 2 gloo ranks, every
    parameter in two dim-0 pieces, torch.distributed.checkpoint), merged with the PEFT adapter from the DCP and, for
    comparison, from the safetensors, alternating with a plain copy of the DCP and the adapter."""
    root = work / f"L{layers}dcp"
    generate_start = time.monotonic()
    make_peft_input(root, layers, preset)
    subprocess.run([sys.executable, str(HERE / "fsdp2_save.py"), str(root / "hf_base"), str(root / "dcp")], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    inputs = [root / "dcp", root / "adapter"]
    variants = [(f"{label}, {wlabel}", c) for label, base in (("from the DCP", "dcp"), ("from the safetensors", "hf_base"))
                for wlabel, c in merge_variants(LORA_MERGE + ["--base", str(root / base), "--lora", str(root / "adapter"),
                                                              "--hf-ref", str(root / "hf_ref"), "--out",
                                                              str(root / "merged"), "--no-progress"])]
    return variants_against_copy(root, inputs, variants, repeat, {
        "layers": layers, "layout": "HF-named DCP (FSDP2, 2 ranks) + PEFT adapter",
        "generate_seconds": time.monotonic() - generate_start}, per_output_gb=True)


# A DoRA adapter and two more plain ones made from a PEFT adapter dir (argv: base dir, adapter dir, out root): the
# DoRA magnitudes are the base's row norms, perturbed; the extra adapters are the first with B scaled.
ADAPTER_VARIANTS = r"""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
base, adapter, root = map(Path, sys.argv[1:4])
config = json.loads((adapter / "adapter_config.json").read_text())
tensors = load_file(adapter / "adapter_model.safetensors")
index = base / "model.safetensors.index.json"
files = json.loads(index.read_text())["weight_map"] if index.exists() else None
g = torch.Generator().manual_seed(0)
dora = dict(tensors)
for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
    module = key.removesuffix(".lora_A.weight")
    name = module.removeprefix("base_model.model.") + ".weight"
    with safe_open(base / (files[name] if files else "model.safetensors"), "pt") as f:
        norms = torch.linalg.vector_norm(f.get_tensor(name).float(), dim=1)
    dora[module + ".lora_magnitude_vector"] = norms * (1 + 0.01 * torch.randn(norms.shape, generator=g))
for out, values, changes in ((root / "dora", dora, {"use_dora": True}),
                             (root / "adapter2", {k: v * (0.5 if "lora_B" in k else 1) for k, v in tensors.items()}, {}),
                             (root / "adapter3", {k: v * (-1.3 if "lora_B" in k else 1) for k, v in tensors.items()}, {})):
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    save_file(values, out / "adapter_model.safetensors", metadata={"format": "pt"})
"""


def bench_adapter_variants(layers: int, work: Path, repeat: int, preset: str = "qwen32b") -> dict:
    """The --peft input (32B layer shapes, HF base + PEFT adapter) merged with one plain adapter, with a DoRA one,
    and with three plain ones weighted 0.5, 0.3, 0.2, alternating with a copy of the base and one adapter."""
    root = work / f"L{layers}variants"
    generate_start = time.monotonic()
    make_peft_input(root, layers, preset)
    subprocess.run([sys.executable, "-c", ADAPTER_VARIANTS, str(root / "hf_base"), str(root / "adapter"), str(root)],
                   check=True)
    inputs = [root / "hf_base", root / "adapter"]
    in_bytes = sum(dir_bytes(p) for p in inputs)
    check_free(root, in_bytes * 2)
    cmd = LORA_MERGE + ["--base", str(root / "hf_base"), "--hf-ref", str(root / "hf_base"), "--out",
                        str(root / "merged"), "--no-progress"]
    three = ["--lora", str(root / "adapter"), "--lora", str(root / "adapter2"), "--lora", str(root / "adapter3"),
             "--lora-weight", "0.5", "0.3", "0.2"]
    variants = [(f"{label}, {wlabel}", c) for label, extra in (("one adapter", ["--lora", str(root / "adapter")]),
                                                               ("DoRA", ["--lora", str(root / "dora")]),
                                                               ("3 weighted adapters", three))
                for wlabel, c in merge_variants(cmd + extra)]
    return variants_against_copy(root, inputs, variants, repeat, {
        "layers": layers, "layout": "HF base + PEFT adapter(s): plain, DoRA, 3 weighted",
        "generate_seconds": time.monotonic() - generate_start}, per_output_gb=True)


def bench_gpt_oss(layers: int, work: Path, repeat: int, experts: int = 32, megatron_ep: int | None = None) -> dict:
    """A gpt-oss-shaped MXFP4 HF base (20b's layers, or 120b's with 128 experts) + a PEFT adapter on q_proj and
    every expert (synthetic_gpt_oss_checkpoint.py), merged into bf16 and back into MXFP4 (--dtype mxfp4),
    alternating with a plain copy of both; CPU per GB of input (the two outputs differ in size). With `megatron_ep`,
    its Megatron form instead (bf16, that EP, ETP 1: each expert apart) + a Megatron LoRA on linear_qkv and every
    expert, each expert's row of the stacked HF tensors made from its own parameter (layout.ExpertSlab)."""
    root = work / (f"L{layers}gpt_oss{experts}" + ("_megatron" if megatron_ep else ""))
    drop(root)
    generate_start = time.monotonic()
    subprocess.run([sys.executable, str(HERE / "synthetic_gpt_oss_checkpoint.py"), str(root), "--layers", str(layers),
                    "--experts", str(experts)] + (["--megatron", str(megatron_ep)] if megatron_ep else []), check=True)
    if megatron_ep:
        drop(root / "adapter")
    inputs = [root / "mcore", root / "mcore_lora"] if megatron_ep else [root / "base", root / "adapter"]
    in_bytes = sum(dir_bytes(p) for p in inputs)
    check_free(root, in_bytes * 3)
    cmd = LORA_MERGE + ["--base", str(inputs[0]), "--lora", str(inputs[1]), "--hf-ref", str(root / "base"),
                        "--out", str(root / "merged"), "--no-progress"]
    variants = [(f"-> {target}, {wlabel}", c) for target in ("bfloat16", "mxfp4")
                for wlabel, c in merge_variants(cmd + ["--dtype", target])]
    source = (f"Megatron bf16 EP={megatron_ep} ETP=1 + Megatron LoRA on qkv and every expert" if megatron_ep
              else "MXFP4 HF base + PEFT adapter")
    return variants_against_copy(root, inputs, variants, repeat, {
        "layers": layers, "layout": f"gpt-oss-{'120b' if experts == 128 else '20b'} shapes ({experts} experts), {source}",
        "generate_seconds": time.monotonic() - generate_start}, per_output_gb=False)


def bench(layers: int, work: Path, skip_peft: bool, repeat: int = 1, moe_layout: str | None = None,
          deepseek_shape: list[str] | None = None, preset: str = "qwen32b", moe_family: str = "qwen3-30b") -> dict:
    root = work / ("deepseek_v3_ep8" if moe_layout == "deepseek" else f"L{layers}{moe_layout or ''}")
    drop(root)
    # Generated in a child: Linux reports a child's peak RSS as at least its parent's RSS at fork time,
    # so this process must stay small (it never imports torch).
    generate_start = time.monotonic()
    if moe_layout == "deepseek":
        layers = 2  # dense + MoE (first_k_dense_replace=1)
        subprocess.run([sys.executable, str(HERE / "synthetic_deepseek_checkpoint.py"), str(root), "--ep", "8",
                        *(["--shape", *deepseek_shape] if deepseek_shape else [])], check=True)
        skip_peft = True  # the PEFT route below is written for dense models
    elif moe_layout:
        subprocess.run([sys.executable, str(HERE / "synthetic_moe_checkpoint.py"), str(root), "--layers", str(layers),
                        "--ep", "4", "--layout", moe_layout, "--family", moe_family], check=True)
        skip_peft = True  # the PEFT route below is written for dense models
    else:
        subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(root), "--preset", preset,
                        "--layers", str(layers), "--tp", "4", "--dtype", "bfloat16"], check=True)
    generate_seconds = time.monotonic() - generate_start
    result = copy_vs_merge(root, root / "base", root / "lora", root / "hf_ref", repeat,
                           {"layers": layers, "layout": (moe_layout if moe_family == "qwen3-30b" else
                                                         f"{moe_family} {moe_layout}") if moe_layout else "dense",
                            "generate_seconds": generate_seconds},
                           no_sha256=moe_layout == "deepseek")  # where hashing is the largest stage: with and without

    if not skip_peft:
        # A model of the same shapes in HF form — setup for the PEFT route, not timed.
        subprocess.run(LORA_MERGE + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
                                     str(root / "hf_ref"), "--out", str(root / "hf_base"), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        peft = measure([sys.executable, "-c", PEFT_ROUTE, str(root / "hf_base"), str(root / "peft_out")])
        drop(root / "peft_out")
        result["peft"] = peft
        result["peft_rss_over_ours"] = peft["peak_rss_mb"] / result["ours"]["peak_rss_mb"]
    drop(root)
    return result


def bench_to_megatron(layers: int, work: Path, repeat: int, deepseek: bool, deepseek_shape: list[str],
                      preset: str = "qwen32b", in_memory: bool = True) -> dict:
    """HF model → Megatron legacy checkpoint (TP=4 for the dense shapes, EP=8 for DeepSeek-V3's) by lora-merge,
    alternating with a copy of the HF model; then the in-memory route once."""
    root = work / ("to_megatron_deepseek" if deepseek else f"to_megatron_L{layers}")
    drop(root)
    generate_start = time.monotonic()
    if deepseek:
        layers = 2
        subprocess.run([sys.executable, str(HERE / "synthetic_deepseek_checkpoint.py"), str(root), "--ep", "8",
                        *(["--shape", *deepseek_shape] if deepseek_shape else [])], check=True)
    else:
        subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(root), "--preset", preset,
                        "--layers", str(layers), "--tp", "4", "--dtype", "bfloat16"], check=True)
    subprocess.run(LORA_MERGE + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
                                 str(root / "hf_ref"), "--out", str(root / "hf"), "--no-progress", "--no-sha256"],
                   check=True, stdout=subprocess.DEVNULL)
    drop(root / "base")
    drop(root / "lora")
    generate_seconds = time.monotonic() - generate_start
    in_bytes = dir_bytes(root / "hf")
    check_free(root, in_bytes)
    layout = ["--ep", "8", "--ckpt-format", "torch_dist"] if deepseek else ["--tp", "4"]
    cmd = LORA_MERGE + ["--to", "megatron", "--base", str(root / "hf"), "--out", str(root / "merged"),
                        "--no-progress", *layout]
    variants = merge_variants(cmd)
    copy, merges, out_bytes = copy_and_merge(root, [root / "hf"], [c for _, c in variants], repeat)
    result = {"layers": layers, "layout": ("DeepSeek-V3 shapes, HF -> torch_dist (EP=8 args)" if deepseek else
                                           "32B layer shapes, HF -> TP=4"), "generate_seconds": generate_seconds,
              "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "copy": copy, "runs": {}}
    add_runs(result, variants, merges, copy, out_bytes)
    if in_memory:
        tp, ep = ("1", "8") if deepseek else ("4", "1")
        # it needs the whole model in memory, twice over: where the host has less, the OOM killer ends it
        result["in_memory"] = measure([sys.executable, "-c", IN_MEMORY_ROUTE, str(root / "hf"),
                                       str(root / "in_memory"), tp, ep], allow_failure=True)
        drop(root / "in_memory")
    drop(root)
    return result


def bench_fp8(work: Path, repeat: int, deepseek_shape: list[str]) -> dict:
    """A block-FP8 DeepSeek-V3-shaped HF base (made by lora-merge --dtype fp8 from the synthetic Megatron base)
    + the synthetic Megatron LoRA, merged into bf16 and into FP8 (--no-sha256), alternating with a copy of the
    same inputs."""
    root = work / "fp8_deepseek"
    drop(root)
    generate_start = time.monotonic()
    subprocess.run([sys.executable, str(HERE / "synthetic_deepseek_checkpoint.py"), str(root), "--ep", "8",
                    *(["--shape", *deepseek_shape] if deepseek_shape else [])], check=True)
    subprocess.run(LORA_MERGE + ["--base", str(root / "base"), "--hf-ref", str(root / "hf_ref"), "--out",
                                 str(root / "fp8_base"), "--dtype", "fp8", "--no-progress", "--no-sha256"],
                   check=True, stdout=subprocess.DEVNULL)
    drop(root / "base")
    generate_seconds = time.monotonic() - generate_start
    inputs = [root / "fp8_base", root / "lora"]
    in_bytes = sum(dir_bytes(p) for p in inputs)
    check_free(root, in_bytes * 2)
    cmd = LORA_MERGE + ["--base", str(root / "fp8_base"), "--lora", str(root / "lora"), "--hf-ref",
                        str(root / "fp8_base"), "--out", str(root / "merged"), "--no-progress", "--no-sha256"]
    variants = [(f"{label}, {wlabel}", c) for target, label in (("bfloat16", "FP8 base -> bf16"), ("fp8", "FP8 base -> fp8"))
                for wlabel, c in merge_variants(cmd + ["--dtype", target])]
    copy, merges, out_bytes = copy_and_merge(root, inputs, [c for _, c in variants], repeat)
    result = {"layers": 2, "layout": "DeepSeek-V3 shapes, block-FP8 HF base + Megatron LoRA",
              "generate_seconds": generate_seconds, "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9,
              "copy": copy, "runs": {}}
    add_runs(result, variants, merges, copy, in_bytes)
    drop(root)
    return result


def synthetic_dense(root: Path, layers: int, preset: str, tp: int = 4) -> float:
    """A fresh synthetic Megatron base + LoRA (bf16) at root (synthetic_checkpoint.py); the seconds it took."""
    drop(root)
    start = time.monotonic()
    subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(root), "--preset", preset,
                    "--layers", str(layers), "--tp", str(tp), "--dtype", "bfloat16"], check=True)
    return time.monotonic() - start


def bench_parts(layers: int, work: Path, repeat: int, counts: list[int], preset: str = "qwen32b") -> dict:
    """32B layer shapes (a Megatron base + LoRA, TP=4) merged by one process, and as N parts run as N processes
    side by side on this host (each with --workers 1) followed by `lora-merge finish`, alternating with a copy;
    500MB shards, so that each part has files of its own."""
    root = work / f"parts-L{layers}"
    generate_seconds = synthetic_dense(root, layers, preset)
    out = root / "merged"
    merge = LORA_MERGE + ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                          "--out", str(out), "--no-progress", "--max-shard-size", "500MB"]
    variants = [("one process, workers default", merge)]
    for n in counts:
        parts = " ".join(f'"$@" --part {i}/{n} --workers 1 &' for i in range(n))
        variants.append((f"{n} parts side by side + finish", ["sh", "-c", f'{parts} wait && "$0" -m lora_merge finish '
                                                             f'--out {out} -q', sys.executable, *merge]))
    in_bytes = dir_bytes(root / "base") + dir_bytes(root / "lora")
    check_free(root, in_bytes)
    copy, merges, out_bytes = copy_and_merge(root, [root / "base", root / "lora"], [cmd for _, cmd in variants], repeat)
    result = {"layers": layers, "layout": "dense, parts", "generate_seconds": generate_seconds,
              "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "copy": copy, "runs": {}}
    add_runs(result, variants, merges, copy, out_bytes)
    drop(root)
    return result


S3_PUT = "import s3fs, sys; s3fs.S3FileSystem().put(sys.argv[1], sys.argv[2], recursive=True)"
S3_GET = "import s3fs, sys; s3fs.S3FileSystem().get(sys.argv[1], sys.argv[2], recursive=True)"


def bench_object_storage(layers: int, work: Path, repeat: int, preset: str = "qwen32b") -> dict:
    """32B layer shapes (a Megatron base + LoRA, TP=8) on an S3 server on this host (moto's server mode, a process of
    its own): our merge reading s3:// and writing locally or to s3://, against the route users take today (download
    the checkpoint with s3fs, merge locally, upload the model) and against the same merge on local disk."""
    import socket

    root = work / f"s3-L{layers}"
    # TP 8: moto's server fails to complete multipart uploads of objects past ~1 GB; 200 MB shards: twenty files,
    # so that an output streamed to s3:// holds a few of them locally at a time, not all
    generate_seconds = synthetic_dense(root, layers, preset, tp=8)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        subprocess.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().mkdir('bench')"], check=True)
        for name in ("base", "lora", "hf_ref"):
            subprocess.run([sys.executable, "-c", S3_PUT, str(root / name), f"bench/in/{name}"], check=True)
        url = "s3://bench/in"
        remote_in = ["--base", f"{url}/base", "--lora", f"{url}/lora", "--hf-ref", f"{url}/hf_ref", "--no-progress",
                     "--max-shard-size", "200MB"]
        local_in = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                    "--no-progress", "--max-shard-size", "200MB"]
        dl = root / "downloaded"
        today = ["sh", "-c", f'"$0" -c "$1" bench/in "{dl}" && "$0" -m lora_merge --base "{dl}/base" --lora "{dl}/lora" '
                 f'--hf-ref "{dl}/hf_ref" --out "{root}/merged" --no-progress -q --max-shard-size 200MB && "$0" -c "$2" "{root}/merged" '
                 f'bench/today/merged', sys.executable, S3_GET, S3_PUT]
        file_in = ["--base", f"file://{root}/base", "--lora", f"file://{root}/lora", "--hf-ref", f"file://{root}/hf_ref",
                   "--no-progress", "--max-shard-size", "200MB"]
        variants = [("local disk -> local disk", LORA_MERGE + local_in + ["--out", str(root / "merged")]),
                    ("file:// (ranged reads through fsspec, no server) -> local disk",
                     LORA_MERGE + file_in + ["--out", str(root / "merged")]),
                    ("s3:// -> local disk", LORA_MERGE + remote_in + ["--out", str(root / "merged")]),
                    ("s3:// -> s3://", LORA_MERGE + remote_in + ["--out", "s3://bench/out/merged"]),
                    ("today: download, merge, upload", today)]
        clean = ["sh", "-c", f'rm -rf "{root}/merged" "{dl}"; "$0" -c "import s3fs; fs = s3fs.S3FileSystem(); '
                 f'[fs.rm(p, recursive=True) for p in (\'bench/out\', \'bench/today\') if fs.exists(p)]"',
                 sys.executable]
        runs = [[] for _ in variants]
        out_bytes = 0
        # the local disk each route holds: its staging and shadows (TMPDIR), the download, the local output
        tmp = root / "tmp"
        tmp.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(tmp)
        for _ in range(repeat):
            for i, (_, cmd) in enumerate(variants):
                subprocess.run(clean, check=True)
                runs[i].append(measure(cmd, disk_of=[tmp, dl, root / "merged"]))
                if (root / "merged").exists():
                    out_bytes = dir_bytes(root / "merged")
        subprocess.run(clean, check=True)
    finally:
        server.terminate()
        server.wait()
    in_bytes = dir_bytes(root / "base") + dir_bytes(root / "lora")
    result = {"layers": layers, "layout": "dense on S3 (moto on localhost)", "generate_seconds": generate_seconds,
              "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9, "runs": {}}
    for (label, _), r in zip(variants, runs):
        best = min(r, key=lambda m: m["seconds"])
        result["runs"][label] = best | {"peak_rss_mb": max(m["peak_rss_mb"] for m in r),
                                        "all_seconds": [m["seconds"] for m in r],
                                        "read_gb_per_s": in_bytes / 1e9 / best["seconds"],
                                        "write_gb_per_s": out_bytes / 1e9 / best["seconds"]}
    drop(root)
    return result


def print_object_storage(r: dict) -> None:
    print(f"input {r['input_gb']:.2f} GB, output {r['output_gb']:.2f} GB, generated in {r['generate_seconds']:.0f} s")
    print("| route | seconds (runs) | CPU s | peak RSS MB | peak local disk MB | input GB/s | output GB/s |")
    print("|---|---|---|---|---|---|---|")
    for label, m in r["runs"].items():
        runs = ", ".join(f"{s:.1f}" for s in m["all_seconds"])
        print(f"| {label} | {m['seconds']:.1f} ({runs}) | {m['cpu_seconds']:.1f} | {m['peak_rss_mb']:.0f} | "
              f"{m.get('peak_disk_mb', 0):.0f} | {m['read_gb_per_s']:.2f} | {m['write_gb_per_s']:.2f} |")


def print_targets(title: str, r: dict) -> None:
    print(f"generated in {r['generate_seconds']:.0f} s")
    for label, ours in r["runs"].items():
        print(f"targets ({title}, {label}): <= 1.2x copy: {'met' if ours['ratio_to_copy'] <= 1.2 else 'MISSED'} "
              f"({ours['ratio_to_copy']:.2f}x); peak RSS <= 1 GB: {'met' if ours['peak_rss_mb'] <= 1024 else 'MISSED'} "
              f"({ours['peak_rss_mb']:.0f} MB)")


def scaling(args) -> list[dict]:
    """Dense 32B, MoE (Qwen3-30B-A3B) and DeepSeek-V3 layer shapes, each merged at every --workers setting
    alternately with a copy of the same bytes: the table the README reports for a many-core host."""
    results = []
    for title, run in (
            (f"dense, DeepSeek-R1-Distill-Qwen-32B layer shapes, {args.layers[0]} layers, TP=4",
             lambda: bench(args.layers[0], args.workdir, True, args.repeat, preset=args.preset)),
            (f"MoE, Qwen3-30B-A3B layer shapes, {args.layers[-1]} layers, EP=4",
             lambda: bench(args.layers[-1], args.workdir, True, args.repeat, "sequential")),
            ("DeepSeek-V3 layer shapes" + (f" ({' '.join(args.deepseek_shape)})" if args.deepseek_shape else "")
             + ", 2 layers, EP=8, torch_dist base",
             lambda: bench(2, args.workdir, True, args.repeat, "deepseek", args.deepseek_shape))):
        r = run()
        r["title"] = title
        print_runs(title, r)
        print_targets(title, r)
        results.append(r)
        sys.stdout.flush()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--workdir", type=Path, default=Path("bench-out"))
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--repeat", type=int, default=2, help="runs of copy and merge, alternating; the fastest counts")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B layer shapes at EP=4 instead, in both expert "
                   "layouts (SequentialMLP + PEFT LoRA, GroupedMLP + MindSpeed grouped LoRA)")
    p.add_argument("--glm", action="store_true", help="GLM-4.5-Air layer shapes at EP=4 instead (layer 0 dense, then "
                   "MoE with a shared expert), GroupedMLP + MindSpeed grouped LoRA")
    p.add_argument("--deepseek", action="store_true", help="DeepSeek-V3 layer shapes at EP=8 instead (2 layers: dense, "
                   "MoE): torch_dist base + legacy per-EP-rank LoRA; --layers is ignored")
    p.add_argument("--deepseek-shape", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override a DeepSeek shape (synthetic_deepseek_checkpoint.py --shape), e.g. experts=32 for a pilot")
    p.add_argument("--peft", action="store_true", help="an HF base + a PEFT adapter as the input instead (32B layer "
                   "shapes; the adapter exported from the synthetic LoRA), against PEFT's own merge of the same two dirs")
    p.add_argument("--preset", default="qwen32b", help="dense layer shapes (synthetic_checkpoint.py --preset); "
                   "'small' for a quick check of the script")
    p.add_argument("--workers", nargs="+", default=WORKER_SETTINGS, metavar="N|default",
                   help="the --workers settings measured for every input (default: 1 default)")
    p.add_argument("--scaling", action="store_true", help="dense, MoE and DeepSeek-V3 shapes in one run, each at "
                   "every --workers setting (--layers: the first value for dense, the last for MoE; --deepseek-shape applies)")
    p.add_argument("--to-megatron", action="store_true", help="HF model -> Megatron checkpoint (32B shapes at TP=4 for "
                   "each --layers, or DeepSeek-V3 shapes at EP=8 with --deepseek), beside the in-memory route")
    p.add_argument("--skip-in-memory", action="store_true", help="--to-megatron without the in-memory route (it needs "
                   "the whole model in RAM)")
    p.add_argument("--fp8", action="store_true", help="a block-FP8 DeepSeek-V3-shaped HF base + LoRA merged into bf16 "
                   "and into FP8 (--deepseek-shape applies)")
    p.add_argument("--gpt-oss", action="store_true", help="a gpt-oss-20b-shaped MXFP4 HF base + a PEFT adapter on every "
                   "expert, merged into bf16 and into MXFP4")
    p.add_argument("--gpt-oss-experts", type=int, default=32, metavar="E", help="with --gpt-oss: experts a layer "
                   "(32: gpt-oss-20b, 128: gpt-oss-120b)")
    p.add_argument("--gpt-oss-megatron", action="store_true", help="with --gpt-oss: the Megatron form instead (bf16, "
                   "EP 1: a legacy EP file repeats the 2.3 GB embeddings) + a Megatron LoRA on qkv and every expert, merged into "
                   "bf16 and into MXFP4")
    p.add_argument("--dcp", action="store_true", help="the --peft input's base saved as FSDP2 saves it (an HF-named "
                   "torch distributed checkpoint, 2 ranks) + the PEFT adapter")
    p.add_argument("--adapter-variants", action="store_true", help="the --peft input merged with one plain adapter, "
                   "a DoRA one, and three weighted ones (32B layer shapes)")
    p.add_argument("--parts", type=int, nargs="+", metavar="N", help="32B layer shapes merged by one process and as "
                   "N parts side by side (each --workers 1) + finish, for each N")
    p.add_argument("--cold", nargs="?", const="all", choices=["all", "inputs"],
                   help="drop the page cache before every measured run, copies included (all, the default: "
                   "/proc/sys/vm/drop_caches where root may write it; inputs: only the workdir's files evicted)")
    p.add_argument("--object-storage", action="store_true", help="32B layer shapes on an S3 server on this host "
                   "(moto): s3:// in and out against download + merge + upload and against local disk")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if args.cold:
        COLD_ROOTS.append(args.workdir)
        COLD.append(args.cold)
    WORKER_SETTINGS[:] = args.workers
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        results = scaling(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    deepseek_title = "DeepSeek-V3 shapes" + (f" ({' '.join(args.deepseek_shape)})" if args.deepseek_shape else "")

    def report_one(title: str, r: dict) -> None:
        print_runs(title, r)
        print_targets(title, r)
        if args.json:
            args.json.write_text(json.dumps([r], indent=2))

    if args.object_storage:
        results = [bench_object_storage(n, args.workdir, args.repeat, args.preset) for n in args.layers]
        for r in results:
            print_object_storage(r)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if args.fp8:
        report_one(deepseek_title + ", FP8", bench_fp8(args.workdir, args.repeat, args.deepseek_shape))
        return
    if args.adapter_variants:
        for n in args.layers:
            report_one(f"32B layer shapes, {n} layers, PEFT adapter variants", bench_adapter_variants(n, args.workdir,
                                                                                                   args.repeat))
        return
    if args.parts:
        for n in args.layers:
            report_one(f"32B layer shapes, {n} layers, in parts", bench_parts(n, args.workdir, args.repeat, args.parts,
                                                                            args.preset))
        return
    if args.dcp:
        for n in args.layers:
            report_one(f"32B layer shapes, {n} layers, FSDP2 DCP base + PEFT adapter",
                       bench_dcp(n, args.workdir, args.repeat, args.preset))
        return
    if args.gpt_oss:
        for n in args.layers:
            report_one(f"gpt-oss shapes, {args.gpt_oss_experts} experts, "
                       f"{'Megatron' if args.gpt_oss_megatron else 'MXFP4'}, {n} layers",
                       bench_gpt_oss(n, args.workdir, args.repeat, args.gpt_oss_experts, 1 if args.gpt_oss_megatron else None))
        return
    if args.to_megatron:
        runs = [bench_to_megatron(2, args.workdir, args.repeat, True, args.deepseek_shape,
                                  in_memory=not args.skip_in_memory)] if args.deepseek else [
            bench_to_megatron(n, args.workdir, args.repeat, False, [], args.preset, not args.skip_in_memory)
            for n in args.layers]
        print("| input | layers | HF GB | copy s | ours s | ours / copy | ours peak RSS MB | in-memory s | "
              "in-memory peak RSS MB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            mem = r.get("in_memory", {})
            failed = f" ({mem['failed']})" if "failed" in mem else ""
            print(f"| {r['layout']} | {r['layers']} | {r['input_gb']:.2f} | {r['copy']['seconds']:.1f} | "
                  f"{r['ours']['seconds']:.1f} | {r['ratio_to_copy']:.2f} | {r['ours']['peak_rss_mb']:.0f} | "
                  f"{mem.get('seconds', float('nan')):.1f}{failed} | {mem.get('peak_rss_mb', float('nan')):.0f} |")
        for r in runs:
            print_runs(f"{r['layout']}, {r['layers']} layers", r | {"output_gb": r["output_gb"]})
            print_targets(r["layout"], r)
        if args.json:
            args.json.write_text(json.dumps(runs, indent=2))
        return
    if args.moe + args.deepseek + args.peft + args.glm > 1:
        p.error("--moe, --glm, --deepseek and --peft are separate benchmarks")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.deepseek:
        report_one(deepseek_title, bench(2, args.workdir, True, args.repeat, "deepseek", args.deepseek_shape))
        return
    if args.peft:
        layouts = ["HF base + PEFT adapter"]
        results = [bench_peft_input(n, args.workdir, args.repeat, args.preset) for n in args.layers]
    else:
        layouts = ["sequential", "grouped"] if args.moe else ["grouped"] if args.glm else [None]
        family = "glm4.5-air" if args.glm else "qwen3-30b"
        results = [bench(n, args.workdir, args.skip_peft, args.repeat, layout, preset=args.preset, moe_family=family)
                   for layout in layouts for n in args.layers]
        if args.glm:
            layouts = [f"{family} grouped"]
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
    for r in results:
        print_runs(f"{r['layout']}, {r['layers']} layers", r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
