"""The streaming writer's files, read back by the safetensors library and by transformers' conventions."""

import json

import torch
from safetensors import safe_open

from lora_merge.writers.safetensors_stream import PlannedTensor, ShardedSafetensorsWriter


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(11, 13, generator=g).to(torch.bfloat16),
        "d.weight": torch.randn(2, 2, generator=g).to(torch.bfloat16),
    }


def write_all(tmp_path, data, max_bytes):
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in data.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_bytes)
    for n, t in data.items():
        writer.write(n, t)
    return writer.finish()


def test_sharded_output_reads_back_exactly(tmp_path):
    data = tensors()
    files = write_all(tmp_path, data, max_bytes=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(files) == set(shards) | {"model.safetensors.index.json"}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in data.values())
    seen = {}
    for shard in shards:
        with safe_open(tmp_path / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                seen[name] = f.get_tensor(name)
    assert seen.keys() == data.keys()
    for name, t in data.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t)


def test_single_shard_is_model_safetensors(tmp_path):
    data = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert write_all(tmp_path, data, max_bytes=10**9) == ["model.safetensors"]
    raw = (tmp_path / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0  # data section aligned
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("x"), data["x"])


def test_writer_refuses_out_of_plan_tensor(tmp_path):
    import pytest

    writer = ShardedSafetensorsWriter(tmp_path, [PlannedTensor("x", (2,), torch.float32)], 100)
    with pytest.raises(RuntimeError, match="plan expects x"):
        writer.write("x", torch.zeros(3))
    with pytest.raises(RuntimeError, match="only 0 of 1"):
        writer.finish()


def many_tensors(count=40):
    g = torch.Generator().manual_seed(1)
    return {f"t{i}.weight": torch.randn(64, 33 + i, generator=g) for i in range(count)}


def test_bounded_writeback_writes_the_same_bytes_and_syncs_every_window(tmp_path, monkeypatch):
    """Writeback is handed to the disk window by window (kicked, then waited for and dropped from the
    page cache); the files read back exactly and the closing fsync still runs."""
    from lora_merge.writers import safetensors_stream

    data = many_tensors()
    calls, syncs = [], []
    real = safetensors_stream._sync_file_range()
    if real is None:
        import pytest
        pytest.skip("no sync_file_range on this platform")

    def spy(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        real(fd, offset, nbytes, flags)
    monkeypatch.setattr(safetensors_stream.BoundedWriteback, "WINDOW", 16 << 10)
    monkeypatch.setattr(safetensors_stream, "_sync_file_range", lambda: spy)
    real_fsync = safetensors_stream.os.fsync
    monkeypatch.setattr(safetensors_stream.os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    (tmp_path / "a").mkdir()
    files = write_all(tmp_path / "a", data, max_bytes=300_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(syncs) == len(shards) > 1
    kicks = [c for c in calls if c[2] == 2]
    waits = [c for c in calls if c[2] == 7]
    assert len(kicks) > 2 * len(shards) and len(waits) >= len(kicks) - len(shards)
    for offset, nbytes, _ in calls:
        assert offset > 0 and nbytes > 0

    monkeypatch.setattr(safetensors_stream, "_sync_file_range", lambda: None)
    (tmp_path / "b").mkdir()
    assert write_all(tmp_path / "b", data, max_bytes=300_000) == files
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    seen = {}
    for name in shards:
        with safe_open(tmp_path / "a" / name, framework="pt") as f:
            seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert seen.keys() == data.keys() and all(torch.equal(seen[k], v) for k, v in data.items())


def test_writeback_failure_falls_back_to_fsync_alone(tmp_path, monkeypatch):
    from lora_merge.writers import safetensors_stream

    def failing(fd, offset, nbytes, flags):
        failing.calls += 1
        raise OSError(22, "sync_file_range: Invalid argument")
    failing.calls = 0
    monkeypatch.setattr(safetensors_stream.BoundedWriteback, "WINDOW", 16 << 10)
    monkeypatch.setattr(safetensors_stream, "_sync_file_range", lambda: failing)
    data = many_tensors()
    write_all(tmp_path, data, max_bytes=10**9)
    assert failing.calls == 1  # tried once, then left to the closing fsync
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in data.items())


def test_hashes_on_their_own_thread_equal_the_files_and_callbacks_follow_hashing(tmp_path):
    """sha256 runs as a stage behind the writes: every digest equals hashlib's of the file read back,
    and each piece's `then` runs after its bytes were hashed, in order."""
    import hashlib

    data = many_tensors()
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in data.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, 40_000, hash_files=True)
    done = []
    for n, t in data.items():
        for rows in t.split(16):
            writer.write(n, rows, then=lambda n=n, r=rows: done.append((n, r.shape[0])))
    files = writer.finish()
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and writer.sha256.keys() == set(shards)
    for shard in shards:
        assert writer.sha256[shard] == hashlib.sha256((tmp_path / shard).read_bytes()).hexdigest()
    assert done == [(n, r.shape[0]) for n, t in data.items() for r in t.split(16)]


def test_a_hashing_failure_reaches_the_writer_and_abort_ends_the_thread(tmp_path, monkeypatch):
    import threading

    import pytest

    data = many_tensors(8)
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in data.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, 10**9, hash_files=True)

    def broken():
        raise MemoryError("hash state lost")

    with pytest.raises(MemoryError, match="hash state lost"):
        for i, (n, t) in enumerate(data.items()):
            writer.write(n, t, then=broken if i == 0 else None)
        writer.finish()
    writer.abort()
    assert not [t for t in threading.enumerate() if t.name == "lora-merge-sha256"]
