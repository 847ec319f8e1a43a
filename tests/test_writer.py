"""The streaming writer's files, read back by the safetensors library and by transformers' conventions."""

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open

from lora_merge.files import output_file
from lora_merge.files.output_file import OutputFile
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


def through_the_page_cache(monkeypatch, refusal: int = errno.EINVAL):
    """Make every OutputFile refuse O_DIRECT at open (with `refusal`), with small buffers, as on tmpfs."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & output_file.O_DIRECT:
            raise OSError(refusal, os.strerror(refusal))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(output_file, "BUFFER_BYTES", 4096)


def test_bounded_writeback_writes_the_same_bytes_and_syncs_every_window(tmp_path, monkeypatch):
    """Through the page cache, writeback is handed to the disk window by window (kicked, then waited for
    and dropped from the page cache); the files read back exactly and the closing fsync still runs."""
    data = many_tensors()
    calls, syncs = [], []
    real = output_file._sync_file_range()
    if real is None:
        pytest.skip("no sync_file_range on this platform")

    def spy(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        real(fd, offset, nbytes, flags)
    through_the_page_cache(monkeypatch)
    monkeypatch.setattr(output_file.BoundedWriteback, "WINDOW", 16 << 10)
    monkeypatch.setattr(output_file, "_sync_file_range", lambda: spy)
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    (tmp_path / "a").mkdir()
    files = write_all(tmp_path / "a", data, max_bytes=300_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(syncs) == len(shards) > 1
    kicks = [c for c in calls if c[2] == 2]
    waits = [c for c in calls if c[2] == 7]
    assert len(kicks) > 2 * len(shards) and len(waits) >= len(kicks) - len(shards)
    for offset, nbytes, _ in calls:
        assert offset >= 0 and nbytes > 0

    monkeypatch.setattr(output_file, "_sync_file_range", lambda: None)
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
    def failing(fd, offset, nbytes, flags):
        failing.calls += 1
        raise OSError(22, "sync_file_range: Invalid argument")
    failing.calls = 0
    through_the_page_cache(monkeypatch)
    monkeypatch.setattr(output_file.BoundedWriteback, "WINDOW", 16 << 10)
    monkeypatch.setattr(output_file, "_sync_file_range", lambda: failing)
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


# OutputFile: O_DIRECT where the file system allows it, the page cache where it does not; the same bytes.

SIZES = [1, 4095, 4096, 4097, 8192, 8193, 3 * 8192 + 5]


def pieces(total: int, seed: int) -> list[bytes]:
    """`total` random bytes in pieces of uneven sizes, crossing buffer and block boundaries."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g).numpy().tobytes()
    cuts = sorted(set(torch.randint(0, total + 1, (6,), generator=g).tolist()) | {0, total})
    return [data[a:b] for a, b in zip(cuts, cuts[1:])]


def fd_flags(f: OutputFile) -> int:
    for line in open(f"/proc/self/fdinfo/{f._fd}"):
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError("no flags in fdinfo")


def direct_allowed(directory) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | output_file.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("total", SIZES)
def test_output_file_writes_exact_bytes_and_length(tmp_path, total):
    parts = pieces(total, total)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    if output_file.O_DIRECT and direct_allowed(tmp_path):
        assert f.direct and fd_flags(f) & output_file.O_DIRECT
    for part in parts:
        f.write(part)
    assert f.size == total
    f.close()
    assert (tmp_path / "out.bin").read_bytes() == b"".join(parts)


@pytest.mark.parametrize("total", [4097, 3 * 8192 + 5])
def test_output_file_falls_back_to_the_page_cache_where_o_direct_is_refused_at_open(tmp_path, monkeypatch, total):
    through_the_page_cache(monkeypatch)
    parts = pieces(total, 1)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    assert not f.direct
    for part in parts:
        f.write(part)
    f.close()
    assert (tmp_path / "out.bin").read_bytes() == b"".join(parts)


@pytest.mark.skipif(not output_file.O_DIRECT, reason="no O_DIRECT here")
@pytest.mark.parametrize("total", [100, 3 * 8192 + 5])
def test_output_file_falls_back_where_the_first_direct_write_is_refused(tmp_path, monkeypatch, total):
    if not direct_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT at open")
    real_write, refused = os.write, []

    def refusing_write(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing_write)
    parts = pieces(total, 2)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    for part in parts:
        f.write(part)
    f.close()
    assert refused and not f.direct
    assert (tmp_path / "out.bin").read_bytes() == b"".join(parts)


@pytest.mark.skipif(not output_file.O_DIRECT, reason="no O_DIRECT here")
@pytest.mark.skipif(not output_file.O_DIRECT, reason="no O_DIRECT here")
@pytest.mark.parametrize("refused_call", [2, 4])  # a full buffer mid-file; the padded last block
def test_output_file_goes_on_through_the_page_cache_where_a_later_direct_write_is_refused(tmp_path, monkeypatch,
                                                                                        refused_call):
    if not direct_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT at open")
    real_write, calls = os.write, []

    def refusing(fd, data):
        calls.append(len(data))
        if len(calls) == refused_call:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing)
    parts = pieces(3 * 8192 + 5, 3)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    for part in parts:
        f.write(part)
    f.close()
    assert len(calls) > refused_call and not f.direct
    assert (tmp_path / "out.bin").read_bytes() == b"".join(parts)


def test_output_file_falls_back_where_o_direct_is_not_supported_at_open(tmp_path, monkeypatch):
    through_the_page_cache(monkeypatch, errno.EOPNOTSUPP)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    f.write(b"abc" * 5000)
    f.close()
    assert not f.direct and (tmp_path / "out.bin").read_bytes() == b"abc" * 5000


def test_output_file_refuses_use_after_close_or_abort_and_frees_what_it_opened(tmp_path, monkeypatch):
    f = OutputFile(tmp_path / "a.bin", buffer_bytes=8192)
    f.write(b"x")
    f.close()
    with pytest.raises(ValueError, match="after it was closed"):
        f.close()
    g = OutputFile(tmp_path / "b.bin", buffer_bytes=8192)
    g.abort()
    with pytest.raises(ValueError, match="after it was closed"):
        g.write(b"y" * 3 * 8192)  # an aborted file: raised, not a wait for buffers that never come back

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    calls = []

    def no_memory(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_mmap(*args)
    real_mmap = output_file.mmap.mmap
    monkeypatch.setattr(output_file.mmap, "mmap", no_memory)
    with pytest.raises(OSError):
        OutputFile(tmp_path / "c.bin", buffer_bytes=8192)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # the file's descriptor closed again


def test_zero_byte_tensors_are_planned_written_and_read_back(tmp_path):
    data = {"big.weight": torch.ones(40, 10), "empty.bias": torch.zeros(0, 3), "after.weight": torch.ones(2, 2)}
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in data.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=100)  # big alone; empty starts the next
    for name, t in data.items():
        if t.numel():  # the merge yields no rows for an empty tensor
            writer.write(name, t)
    files = writer.finish()
    seen = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(tmp_path / name, framework="pt") as f:
                seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert seen.keys() == data.keys() and all(torch.equal(seen[k], v) for k, v in data.items())

    only_empty_last = {"big.weight": torch.ones(40, 10), "empty.bias": torch.zeros(0, 3)}
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in only_empty_last.items()]
    (tmp_path / "b").mkdir()
    writer = ShardedSafetensorsWriter(tmp_path / "b", plan, max_shard_bytes=100)
    writer.write("big.weight", only_empty_last["big.weight"])
    files = writer.finish()
    assert len([f for f in files if f.endswith(".safetensors")]) == 2
    for name in files:  # every listed shard exists and reads
        assert (tmp_path / "b" / name).is_file()
    with safe_open(tmp_path / "b" / files[1], framework="pt") as f:
        assert list(f.keys()) == ["empty.bias"] and f.get_tensor("empty.bias").shape == (0, 3)

    unfinished = ShardedSafetensorsWriter(tmp_path / "b", plan, max_shard_bytes=100)
    with pytest.raises(RuntimeError, match="only 0 of 2"):
        unfinished.finish()
    unfinished.abort()


def test_a_failed_write_on_the_io_thread_is_raised_to_the_writer_not_waited_for(tmp_path, monkeypatch):
    """Every buffer but one may be queued when a write fails: the next write must raise that failure
    (ENOSPC here) instead of waiting for a free buffer forever, and abort must still clean up."""
    import threading

    real_write, calls = os.write, []

    def disk_full_at_the_second(fd, data):
        calls.append(len(data))
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full_at_the_second)
    f = OutputFile(tmp_path / "out.bin", buffer_bytes=8192)
    raised = []

    def fill():
        try:
            for _ in range(4 * output_file.BUFFERS):
                f.write(b"y" * 8192)
            f.close()
        except OSError as exc:
            raised.append(exc)
    writer = threading.Thread(target=fill, daemon=True)
    writer.start()
    writer.join(timeout=30)
    assert not writer.is_alive(), "the writer waits for a buffer that never comes back"
    assert raised and raised[0].errno == errno.ENOSPC
    f.abort()


def test_stopping_the_background_writer_waits_for_the_write_in_progress_and_drops_its_error():
    """A run interrupted while waiting for the writer thread must not close the files under a write in
    progress: stop() returns only once the thread has ended, and a write's error is not raised over the
    run's own."""
    import time

    from lora_merge.writers.background import BackgroundWriter

    done = []

    def slow(name, tensor, then):
        time.sleep(0.1)
        done.append(name)
        if name == "c":
            raise OSError(errno.EIO, "Input/output error")

    writer = BackgroundWriter(slow)
    for name in "abc":
        writer.write(name, None)
    writer.stop()
    assert done == ["a", "b", "c"] and not writer._worker._thread.is_alive()
    writer.stop()  # again: nothing left to wait for
