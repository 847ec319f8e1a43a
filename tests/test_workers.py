"""Pieces merged on a pool of workers: the output is the same bytes whatever the worker count, a failure
in any worker stops the run cleanly, and the ordered pool delivers in submission order."""

import hashlib
import math
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import FIXTURES, copied_args, copy_fixture, rank_files, set_value
from lora_merge import merge_pipeline
from lora_merge.cli import main
from lora_merge.errors import MergeError
from lora_merge.merge_pipeline import OrderedPool

MOE = Path(__file__).parent / "fixtures_moe"


def digests(out: Path) -> dict:
    """Every file's digest but the card's, which names the output directory."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.is_file() and p.name != "README.md"}


@pytest.mark.parametrize("root", [FIXTURES / "tp2pp2_bf16_unfiltered", MOE / "qwen3moe_ep2"])
def test_every_worker_count_writes_the_same_bytes(root, tmp_path, monkeypatch):
    # small pieces, so that even these tiny tensors are split and the workers really interleave
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 4096)
    outputs = {}
    for workers in (1, 2, 5):
        out = tmp_path / f"w{workers}"
        base = root / "base" if (root / "base").exists() else None
        lora_merge.merge(base=base, lora=root / "lora", hf_ref=root / "hf_ref", out=out, workers=workers,
                         max_shard_size="1MB")
        outputs[workers] = digests(out)
    assert any(name.endswith(".safetensors") for name in outputs[1]) and outputs[1] == outputs[2] == outputs[5]


def test_a_failing_worker_stops_the_run_and_publishes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 1024)
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.3.mlp.linear_fc2.weight"

    set_value(rank_files(root / "base")[1], key, (5, 1), float("inf"))
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--workers", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.3.mlp.down_proj.weight" in err and "non-finite" in err
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    assert not [t for t in threading.enumerate() if t.name.startswith("lora-merge-merge")]


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", 257])
def test_worker_count_is_checked(value, tmp_path):
    root = FIXTURES / "tp2_fp32_filtered"
    with pytest.raises(MergeError, match="workers="):
        lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "o",
                         workers=value)


@pytest.mark.parametrize("text", ["0", "-3", "two", "100000"])
def test_worker_option_is_checked(text, tmp_path, capsys):
    root = FIXTURES / "tp2_fp32_filtered"
    with pytest.raises(SystemExit) as exc:
        main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
              "--out", str(tmp_path / "o"), "--workers", text])
    assert exc.value.code == 2 and "--workers" in capsys.readouterr().err


def test_ordered_pool_delivers_in_submission_order():
    rng = random.Random(0)
    delivered = []
    pool = OrderedPool(4)
    try:
        for i in range(60):
            delay = rng.random() / 500
            pool.submit(lambda i=i, delay=delay: (time.sleep(delay), i)[1], delivered.append)
            if i % 7 == 0:
                pool.submit_in_order(lambda i=i: delivered.append(f"marker {i}"))
        pool.drain()
    finally:
        pool.stop()
    numbers = [d for d in delivered if isinstance(d, int)]
    assert numbers == list(range(60))
    assert delivered.index("marker 14") == delivered.index(14) + 1


def test_ordered_pool_raises_a_failure_at_its_turn_and_stops_cleanly():
    started = threading.Event()
    release = threading.Event()
    finished = []

    def slow():
        started.set()
        release.wait(5)
        finished.append(True)
        return "slow"

    def broken():
        raise ValueError("piece failed")

    delivered = []
    pool = OrderedPool(2)
    pool.submit(lambda: "first", delivered.append)
    pool.submit(broken, delivered.append)
    pool.submit(slow, delivered.append)
    started.wait(5)
    with pytest.raises(ValueError, match="piece failed"):
        pool.drain()
    assert delivered == ["first"]
    threading.Timer(0.05, release.set).start()
    pool.stop()  # waits for the running job: nothing touches the inputs after the run
    assert finished == [True]


def test_merging_leaves_torch_threads_as_they_were(tmp_path):
    root = FIXTURES / "tp2_fp32_filtered"
    threads = torch.get_num_threads()
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "o", workers=3)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("root", [FIXTURES / "tp2_fp32_filtered", MOE / "qwen3moe_ep2"])
def test_pieces_of_other_sizes_merge_to_the_same_bits(root, tmp_path, monkeypatch):
    """Piece sizes shrink as workers grow, and addmm_'s bits depend on how many rows one call covers: LoRA
    pieces are cut at whole merge blocks, so every row is merged in the same block at any worker count."""
    from lora_merge import lora

    monkeypatch.setattr(lora, "MERGE_BLOCK_BYTES", 4 * 64 * 3)  # 3 rows of 64 columns per addmm_ block
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 4 * 64 * 40)
    monkeypatch.setattr(merge_pipeline, "MIN_CHUNK_BYTES", 4 * 64 * 2)
    monkeypatch.setattr(merge_pipeline, "IN_FLIGHT_BYTES", 4 * 64 * 48)
    sizes = {w: merge_pipeline.chunk_bytes(w) for w in (1, 3, 6, 8)}
    assert len(set(sizes.values())) == 4, sizes  # the piece size really differs between these runs
    outputs = {}
    for workers in sizes:
        out = tmp_path / f"w{workers}"
        base = root / "base" if (root / "base").exists() else None
        lora_merge.merge(base=base, lora=root / "lora", hf_ref=root / "hf_ref", out=out, workers=workers)
        outputs[workers] = digests(out)
    assert outputs[1] == outputs[3] == outputs[6] == outputs[8]


def test_overlapping_runs_give_torch_its_thread_count_back(tmp_path):
    root = FIXTURES / "tp2_fp32_filtered"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        errors = []

        def run(i):
            try:
                lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref",
                                 out=tmp_path / f"o{i}", workers=2)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        runners = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in runners:
            t.start()
            time.sleep(0.05)
        for t in runners:
            t.join()
        assert not errors and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_an_interrupt_while_stopping_still_waits_for_the_workers():
    """A second Ctrl-C arriving while the pool waits for its running jobs must not leave one running (it
    could touch a checkpoint mapping after the run is over): the wait goes on, then the interrupt is raised."""
    release = threading.Event()
    finished = []

    def slow():
        release.wait(5)
        finished.append(True)

    pool = OrderedPool(2)
    pool.submit(slow, lambda result: None)
    real_shutdown = pool._executor.shutdown
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            threading.Timer(0.05, release.set).start()
            raise KeyboardInterrupt  # as if the signal arrived while joining
        return real_shutdown(*args, **kwargs)

    pool._executor.shutdown = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        pool.stop()
    assert finished == [True] and len(calls) == 2


@pytest.mark.parametrize("files,quota", [
    ({"cpu.max": "200000 100000\n"}, 2.0),                       # cgroup v2: 2 CPUs
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),                         # no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_the_default_worker_count_follows_the_cgroup_cpu_quota(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert merge_pipeline.cgroup_cpu_quota(tmp_path) == quota
    cores = merge_pipeline.available_cores(tmp_path)
    assert 1 <= cores <= (math.ceil(quota) if quota else cores)
    if quota:
        assert cores == min(math.ceil(quota), merge_pipeline.available_cores(tmp_path / "none"))
