"""Reading inputs ahead (files/prefetch.py): the byte ranges each reader's tensors come from, which files of an
input dir are read while the process starts, and the readers' bounds (lead, budget, stop, files that are not
regular). Reading ahead never changes an output: every merge test runs with it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_merge import cli, merge_pipeline
from lora_merge.files import prefetch
from lora_merge.readers.checkpoint import joined_ref
from lora_merge.readers.detect import open_checkpoint
from lora_merge.readers.safetensors_file import tensor_refs
from helpers import FIXTURES, fixture_root, merge_args


def _bytes_at(span) -> bytes:
    file, start, nbytes = span
    with open(file.path, "rb") as f:
        f.seek(start)
        return f.read(nbytes)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("fixture", ["tp2pp2_fp32_filtered", "dist_tp2pp2_fp32"])
def test_spans_of_megatron_tensors_hold_their_bytes(fixture):
    """Every tensor's byte spans, read from the file, are its bytes (a legacy archive's members), or the torch.save
    archive that holds them and little else (a torch_dist chunk, known from the metadata before it is opened)."""
    ckpt = open_checkpoint(FIXTURES / fixture / "base")
    refs = [ref for pieces in ckpt.params.values() for ref in pieces]
    assert refs
    for ref in refs:
        spans = ref.byte_spans()
        assert spans, ref.where
        read, tensor = b"".join(_bytes_at(s) for s in spans), _tensor_bytes(ref.load())
        if ckpt.format == "legacy":
            assert read == tensor, ref.where
        else:
            assert len(spans) == 1 and read.startswith(b"PK\x03\x04") and tensor in read, ref.where
            assert len(read) < len(tensor) + 4096, ref.where


def test_spans_of_safetensors_tensors_and_of_joined_refs(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 5)}
    save_file(tensors, str(path))
    refs = tensor_refs(path, "a test file")
    for name, tensor in tensors.items():
        (span,) = refs[name].byte_spans()
        assert _bytes_at(span) == _tensor_bytes(tensor)
    joined = joined_ref([refs["a"], refs["c"]], 0)
    assert b"".join(_bytes_at(s) for s in joined.byte_spans()) == _tensor_bytes(torch.cat([tensors["a"], tensors["c"]]))


def _touch(path, nbytes=10):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * nbytes)
    return str(path)


def test_input_files_are_those_the_readers_read(tmp_path):
    legacy = fixture_root("tp2pp2_fp32_filtered") / "base"
    assert prefetch.input_files(legacy) == [str(p) for p in sorted((legacy / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"))]
    dist = FIXTURES / "dist_tp2pp2_fp32" / "base"
    assert prefetch.input_files(dist) == [str(p) for p in sorted((dist / "iter_0000001").glob("*.distcp"))]

    # a legacy rank's distributed-optimizer file is not read
    rank = tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00"
    model = _touch(rank / "model_optim_rng.pt")
    _touch(rank / "distrib_optim.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    _touch(tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")  # not the tracked iteration
    assert prefetch.input_files(tmp_path / "ckpt") == [model]

    # an HF model: the files its index lists, not another weight file beside them
    hf = tmp_path / "hf"
    listed = [_touch(hf / "model-00001-of-00002.safetensors"), _touch(hf / "model-00002-of-00002.safetensors")]
    _touch(hf / "consolidated.safetensors")
    (hf / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}')
    assert prefetch.input_files(hf) == listed
    single = tmp_path / "single"
    assert prefetch.input_files(single) == []
    assert prefetch.input_files(single.parent / "hf" / "model.safetensors.index.json") == []  # a file, not a dir

    # a PEFT adapter: its weights file (safetensors first, as the reader takes it)
    adapter = tmp_path / "adapter"
    (adapter).mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    _touch(adapter / "adapter_model.bin")
    weights = _touch(adapter / "adapter_model.safetensors")
    assert prefetch.input_files(adapter) == [weights]

    assert prefetch.input_files("s3://bucket/model") == []
    assert prefetch.input_files(None) == []
    assert prefetch.input_files(tmp_path / "missing") == []


def test_early_reads_take_files_round_robin_up_to_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK_BYTES", 100)
    files = [_touch(tmp_path / f"f{i}", size) for i, size in enumerate((250, 40, 1000))]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened without blocking, and not read
    reads = prefetch.EarlyReads([str(fifo), str(tmp_path / "missing"), *files], budget=600).start()
    reads._thread.join(timeout=30)
    assert not reads._thread.is_alive()
    # chunk by chunk in turn: f0 100, f1 40 (its end), f2 100, f0 100, f2 100, f0 50 (its end), f2 ...
    assert reads.stop() == {files[0]: 250, files[1]: 40, files[2]: 310}


def test_early_reads_stop_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK_BYTES", 4096)
    big = _touch(tmp_path / "big", 64 << 20)
    reads = prefetch.EarlyReads([big], budget=1 << 40).start()
    read = reads.stop()
    assert not reads._thread.is_alive()
    assert read.get(big, 0) <= 64 << 20


class _File:
    def __init__(self, path, in_memory=False):
        self.path, self.in_memory = path, in_memory


class _Ref:
    def __init__(self, *spans):
        self.spans = spans

    def byte_spans(self):
        return self.spans


def test_prefetcher_reads_ahead_in_plan_order_within_its_lead(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK_BYTES", 64)
    path = _touch(tmp_path / "input", 1000)
    f = _File(path)
    read, cond = [], threading.Condition()
    real = os.preadv

    def preadv(fd, buffers, offset):
        got = real(fd, buffers, offset)
        with cond:
            read.append((offset, got))
            cond.notify_all()
        return got
    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    jobs = [(0, [_Ref((f, 0, 100))]), (100, [_Ref((f, 100, 100), (f, 0, 100))]), (400, [_Ref((f, 500, 200))])]
    fetcher = prefetch.Prefetcher(iter(jobs), read_early={path: 150}, lead=300)
    with cond:  # jobs due within the lead: [0, 100) was read early, [100, 150) too, then [150, 200)
        assert cond.wait_for(lambda: sum(n for _, n in read) >= 50, timeout=30)
    assert read == [(150, 50)]
    fetcher.advance(100)  # the third job (due at 400) is now within the lead
    with cond:
        assert cond.wait_for(lambda: sum(n for _, n in read) >= 250, timeout=30)
    fetcher.stop()
    assert read == [(150, 50), (500, 64), (564, 64), (628, 64), (692, 8)]


def test_prefetcher_fetches_shadow_files_and_skips_in_memory_ones(tmp_path, monkeypatch):
    from lora_merge.files import remote

    shadow, memory = _touch(tmp_path / "shadow", 100), _touch(tmp_path / "memory", 100)
    fetched = []
    monkeypatch.setattr(remote, "is_shadow", lambda p: str(p) == shadow)
    monkeypatch.setattr(remote, "ensure", lambda p, start, n, ahead=False: fetched.append((p, start, n, ahead)))
    monkeypatch.setattr(prefetch.os, "preadv", lambda *a: pytest.fail("read a file it should not"))
    fetcher = prefetch.Prefetcher(iter([(0, [_Ref((_File(shadow), 10, 20), (_File(memory, True), 0, 100))])]))
    fetcher._thread.join(timeout=30)
    fetcher.stop()
    assert fetched == [(shadow, 10, 20, True)]  # (ahead: not a range handed back)


def test_a_merge_reads_its_inputs_early_and_stops_before_merging(tmp_path, monkeypatch):
    started, handed = [], []
    real_start = prefetch.EarlyReads.start

    def start(self):
        started.append(list(self._files))
        return real_start(self)

    class Prefetcher(prefetch.Prefetcher):
        def __init__(self, jobs, read_early=None, **kw):
            handed.append((dict(read_early), list(prefetch._EARLY)))
            super().__init__(jobs, read_early, **kw)

    monkeypatch.setattr(prefetch.EarlyReads, "start", start)
    monkeypatch.setattr(merge_pipeline, "Prefetcher", Prefetcher)
    fixture = "tp2pp2_fp32_filtered"
    assert cli.main([*merge_args(fixture, tmp_path / "out"), "-q"]) == 0
    root = fixture_root(fixture)
    assert started == [prefetch.input_files(root / "lora") + prefetch.input_files(root / "base")]
    ((read_early, still_running),) = handed
    assert still_running == [] and set(read_early) <= set(started[0])
    assert prefetch._EARLY == []

    started.clear()
    assert cli.main([*merge_args(fixture, tmp_path / "dry"), "--dry-run", "-q"]) == 0
    assert cli.main([*merge_args(fixture, tmp_path / "part"), "--part", "0/2", "-q"]) == 0
    assert started == []  # a dry run reads nothing; a part reads only its own share


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_readers_keep_few_files_open_whatever_the_number_of_input_files(tmp_path, monkeypatch):
    """A checkpoint may have more files than the process may open (ulimit -n 1024; TP×PP×EP rank files)."""
    monkeypatch.setattr(prefetch, "CHUNK_BYTES", 64)
    files = [_touch(tmp_path / f"f{i:03d}", 100) for i in range(300)]
    before = _open_fds()
    seen = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        seen.append(_open_fds())
        return real(fd, buffers, offset)
    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    reads = prefetch.EarlyReads(files, budget=1 << 30).start()
    reads._thread.join(timeout=60)
    assert reads.stop() == dict.fromkeys(files, 100)  # every file read whole
    jobs = [(0, [_Ref(*((_File(f), 0, 100) for f in files))])]
    fetcher = prefetch.Prefetcher(iter(jobs))
    fetcher._thread.join(timeout=60)
    fetcher.stop()
    assert seen and max(seen) <= before + prefetch.OPEN_FILES + 2  # (+ the listing's own descriptor)
    assert _open_fds() == before


def test_files_that_cannot_be_found_early_are_left_to_the_readers(tmp_path, capsys):
    """A damaged index is the reader's to name in one line: finding the files to read early says nothing."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    for bad in ('{"weight_map": {"a": ["x"]}}', '{"weight_map": {"a": 3}}', "[" * 100000):
        (base / "model.safetensors.index.json").write_text(bad)
        prefetch.start_early_reads([base], [])
        assert prefetch.stop_early_reads() == {}


def test_a_shadow_file_is_fetched_a_few_ranges_at_a_time_and_a_stop_waits_for_those_only(tmp_path, monkeypatch):
    from lora_merge.files import remote

    shadow = _touch(tmp_path / "shadow", 10)
    monkeypatch.setattr(remote, "FETCH_BYTES", 100)
    monkeypatch.setattr(remote, "FETCH_THREADS", 2)
    calls, gate = [], threading.Event()

    def ensure(path, start, nbytes, ahead=False):
        calls.append((start, nbytes))
        gate.wait(timeout=30)
    monkeypatch.setattr(remote, "is_shadow", lambda p: str(p) == shadow)
    monkeypatch.setattr(remote, "ensure", ensure)
    fetcher = prefetch.Prefetcher(iter([(0, [_Ref((_File(shadow), 50, 1000))])]))
    while not calls:
        threading.Event().wait(0.01)
    stopper = threading.Thread(target=fetcher.stop)
    stopper.start()
    gate.set()
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert calls == [(50, 200)]  # the first two GETs' worth; the other 800 bytes not asked for after the stop


def test_an_fp8_weights_spans_are_its_bytes_and_its_scales(tmp_path):
    from lora_merge.readers.hf_model import read_hf_model
    from test_fp8 import fp8_release, hf_base

    fp8, _ = fp8_release(hf_base(FIXTURES / "tp2_fp32_filtered", tmp_path / "hf"), tmp_path / "release")
    model = read_hf_model(fp8)
    quantized = [ref for ref in model.tensors.values() if hasattr(ref, "scale")]
    assert quantized
    for ref in quantized:
        spans = ref.byte_spans()
        assert len(spans) == 2 and spans[1] == ref.scale.byte_spans()[0]
        assert {Path(s[0].path).name for s in spans} == {"model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"}


def test_url_inputs_keep_no_descriptor_per_object(tmp_path):
    """A URL input's data objects are sparse shadow files fetched by ranges: none is held open between fetches,
    so a model of more objects than the process may open still runs; a failure names the URL, not the shadow."""
    import fsspec

    from lora_merge.files import remote

    mem = fsspec.filesystem("memory")
    for i in range(60):
        mem.pipe(f"/many/m/model-{i:05d}.safetensors", b"x" * 5000)
    before = _open_fds()
    with remote.RemoteRun() as run:
        shadow = run.input("memory://many/m")
        assert _open_fds() < before + 10
        for i in range(60):
            remote.ensure(shadow / f"model-{i:05d}.safetensors", 100, 200)
        assert _open_fds() < before + 10
        assert (shadow / "model-00007.safetensors").read_bytes()[100:300] == b"x" * 200
        assert run.names[str(shadow)] == "memory://many/m"


def _cgroup(tmp_path, membership: str, files: dict) -> tuple:
    root = tmp_path / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    return root, tmp_path / "cgroup"


GIB = 1 << 30


@pytest.mark.parametrize("membership, files, room", [
    # v2 in its own namespace (a container): the limit at the mount point, page cache partly reclaimable
    ("0::/\n", {"memory.max": f"{4 * GIB}", "memory.current": f"{3 * GIB}",
                "memory.stat": f"anon 1\ninactive_file {2 * GIB}\n"}, 3 * GIB),
    # Docker on cgroup v1: /proc says /docker/ID, the container's own cgroup is mounted at the mount point
    ("12:memory:/docker/abc\n0::/\n", {"memory/memory.limit_in_bytes": f"{2 * GIB}",
                                       "memory/memory.usage_in_bytes": f"{GIB}",
                                       "memory/memory.stat": "total_inactive_file 0\n"}, GIB),
    # a limit on a parent (a Slurm job, a systemd slice); the process's own cgroup says max
    ("0::/job_1/step_0\n", {"job_1/memory.max": f"{8 * GIB}", "job_1/memory.current": f"{5 * GIB}",
                            "job_1/memory.stat": "", "job_1/step_0/memory.max": "max",
                            "job_1/step_0/memory.current": "0"}, 3 * GIB),
    # no limit anywhere; v1's "no limit" is a huge number; lines that are not cgroup lines are skipped
    ("garbage\n4:memory:/x\n", {"memory/x/memory.limit_in_bytes": "9223372036854771712",
                                "memory/x/memory.usage_in_bytes": "1"}, None),
])
def test_the_early_read_budget_heeds_a_memory_cgroup_wherever_its_limit_is(tmp_path, membership, files, room):
    root, proc = _cgroup(tmp_path, membership, files)
    assert prefetch._cgroup_room(root, proc) == room
