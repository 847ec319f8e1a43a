"""An output at a URL written as parts are, against a real S3-protocol server on localhost (moto's server mode):
each file uploaded as soon as it is complete, `--part I/N` and `finish` at a URL, `--resume` after a kill, URL
inputs recognised across runs by their URL, size and ETag, and an input replaced during a run refused before
anything is published. Each output is compared byte for byte with a one-process local run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, downloaded, files, out_dir, quiet, run_failing, upload
from lora_merge import api, options
from lora_merge.cli import main
from lora_merge.files import remote
from lora_merge.files.parts_dir import PartsDir
from lora_merge.writers.safetensors_stream import ShardLanes

FIXTURE = FIXTURES / "tp2_fp32_filtered"
SHARD = 96 << 10  # the fixture's ~0.7 MB model: eight shards


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)


def local_inputs(root: Path = FIXTURE) -> dict:
    return dict(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref")


def url_inputs(url: str) -> dict:
    return dict(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref")


def one_process(tmp_path: Path, where: str = "local", name: str = "merged") -> dict[str, bytes]:
    out = out_dir(tmp_path, where, name)
    api.merge(**local_inputs(), out=out, max_shard_size=SHARD, warn=quiet)
    return files(out)


def objects(s3, key: str) -> list[str]:
    s3.invalidate_cache()
    return sorted(p.split(f"models/{key}/", 1)[1] for p in s3.find(f"models/{key}"))


def recorded(s3, key: str) -> int:
    """How many files the manifest of a one-process run at `key` records as uploaded."""
    try:
        return len(json.loads(s3.cat_file(f"models/{key}.manifests/part-00000-of-00001.json"))["files"])
    except FileNotFoundError:
        return 0


def test_parts_from_urls_to_a_url_in_any_order_then_finish_give_the_one_process_bytes(s3, tmp_path, capsys):
    url = upload(s3, FIXTURE, "pin")
    out = "s3://models/pout/merged"
    written = set()
    for index in (2, 0, 1, 2):  # any order, one part run twice
        result = api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part=f"{index}/3", warn=quiet)
        assert result.part == f"{index}/3" and result.out == out
        written |= set(result.files)
    assert len(written) >= 6
    # the parts' files are there, nothing that says the model is complete
    assert set(objects(s3, "pout/merged")) == written
    assert objects(s3, "pout/merged.manifests") == [f"part-0000{i}-of-00003.json" for i in range(3)]
    assert main(["finish", "--out", out]) == 0
    assert f"published {out}" in capsys.readouterr().out
    assert not s3.exists("models/pout/merged.manifests")
    assert downloaded(s3, out, tmp_path / "got") == one_process(tmp_path)
    # finished: nothing left to finish, said by URL
    run_failing(["finish", "--out", out], capsys, f"{out}: holds objects but no part manifests", "finished already?")


def test_a_megatron_checkpoint_in_parts_to_a_url(s3, tmp_path):
    fixture = FIXTURES / "dist_tp2pp2_fp32"
    local = out_dir(tmp_path, "local", "mg")
    api.to_megatron(**local_inputs(fixture), out=local, tp=2, pp=2, warn=quiet)
    out = "s3://models/mgparts/mg"
    for index in (1, 0):
        api.to_megatron(**local_inputs(fixture), out=out, tp=2, pp=2, part=f"{index}/2", warn=quiet)
    assert "latest_checkpointed_iteration.txt" not in objects(s3, "mgparts/mg")  # written by finish, last
    result = api.finish(out)
    assert result.out == out and result.parts == 2
    assert downloaded(s3, out, tmp_path / "got") == files(local)


def test_finish_at_a_url_refuses_a_missing_part_a_replaced_object_and_another_plan(s3, tmp_path):
    url = upload(s3, FIXTURE, "fin")
    out = "s3://models/fin-out/merged"
    api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="0/2", warn=quiet)
    with pytest.raises(api.MergeError, match=rf"^{out}: part 1/2 is missing \(no manifest\); run it with --part 1/2$"):
        api.finish(out)
    with pytest.raises(api.MergeError, match=rf"{out}.manifests/part-00000-of-00002.json: part 0/2 differs from this "
                                             r"run \(--part 1/2\) in .*--lora-alpha"):
        api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="1/2", lora_alpha=3.0, warn=quiet)
    second = api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="1/2", warn=quiet)
    # an object replaced by other bytes of the same size: its ETag differs
    name = second.files[0]
    data = bytearray(s3.cat_file(f"models/fin-out/merged/{name}"))
    data[-1] ^= 1
    s3.pipe_file(f"models/fin-out/merged/{name}", bytes(data))
    for rehash, what in ((True, "has other bytes"), (False, "has another size or ETag")):
        with pytest.raises(api.MergeError, match=rf"^{out}/{name}: {what} than its part recorded; rerun part 1/2 with "
                                                 r"--part 1/2 --resume$"):
            api.finish(out, rehash=rehash)
    assert not s3.exists("models/fin-out/merged/README.md")
    resumed = api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="1/2", resume=True, warn=quiet)
    assert resumed.resumed == sorted(set(second.files) - {name})  # the others read back: their sha256 holds
    api.finish(out)
    assert downloaded(s3, out, tmp_path / "got") == one_process(tmp_path)


def test_a_killed_run_to_a_url_is_continued_with_resume(s3, tmp_path, capsys, monkeypatch):
    """Killed (SIGKILL: nothing is cleaned up) once some files are up: the objects stay, without an index or card;
    a plain rerun is refused and says --resume; --resume keeps what its manifest records and the object still
    holds, and gives the one-process bytes."""
    out = "s3://models/killed/merged"
    args = ["--base", str(FIXTURE / "base"), "--lora", str(FIXTURE / "lora"), "--hf-ref", str(FIXTURE / "hf_ref"),
            "--out", out, "--max-shard-size", str(SHARD), "--no-progress"]
    code = ("import sys, time; from lora_merge import options; options.MIN_SHARD_BYTES = 1\n"
            "from lora_merge.files import remote; upload = remote._upload\n"
            "def slow(*a, **k):\n    time.sleep(0.4); upload(*a, **k)\n"
            "remote._upload = slow\n"
            "from lora_merge.entry import main; sys.exit(main())")
    local = tmp_path / "tmp"
    local.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(local)})
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and recorded(s3, "killed/merged") < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = objects(s3, "killed/merged")
    assert len(left) >= 2 and "model.safetensors.index.json" not in left and "README.md" not in left
    assert [p.name[:len(remote.ROOT_PREFIX)] for p in local.iterdir()] == [remote.ROOT_PREFIX]  # what it left
    monkeypatch.setattr(tempfile, "tempdir", str(local))
    run_failing(args, capsys, f"{out}: already holds objects", "pass --resume to continue")
    assert not list(local.iterdir())  # the killed run's local directory (fetched ranges, files not uploaded) removed
    assert main([*args, "--resume"]) == 0
    assert "kept from an earlier run" in capsys.readouterr().out
    assert not s3.exists("models/killed/merged.manifests")
    assert downloaded(s3, out, tmp_path / "got") == one_process(tmp_path)


def test_files_go_up_as_they_complete_so_the_local_disk_holds_a_few(s3, tmp_path, monkeypatch):
    """At most LOCAL_FILES complete files (those uploading and one waiting) are held locally (the writer waits
    beyond): here one upload at a time, each slowed, so the writer outruns it."""
    monkeypatch.setattr(remote, "UPLOADS", 1)
    monkeypatch.setattr(remote, "LOCAL_FILES", 2)
    upload_file = remote._upload
    monkeypatch.setattr(remote, "_upload", lambda *a, **k: (time.sleep(0.1), upload_file(*a, **k))[1])
    waiting = []
    place = PartsDir.place

    def placing(self, name):
        place(self, name)
        waiting.append(len([p for p in self.files.rglob("*.safetensors") if p.is_file()]))

    monkeypatch.setattr(PartsDir, "place", placing)
    lanes = []
    real = ShardLanes.__init__
    monkeypatch.setattr(ShardLanes, "__init__", lambda self, writer, of: (lanes.append(max(of) + 1),
                                                                           real(self, writer, of))[1])
    out = "s3://models/stream/merged"
    result = api.merge(**local_inputs(), out=out, max_shard_size=SHARD, workers=2, warn=quiet)
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(waiting) == len(shards) >= 6
    assert lanes == [2]  # two files written at once
    assert max(waiting) <= remote.LOCAL_FILES + 2  # uploading or waiting, and each lane's one just placed
    assert downloaded(s3, out, tmp_path / "got") == one_process(tmp_path)


@pytest.mark.parametrize("to_url", [True, False])
def test_an_input_object_replaced_during_the_run_is_refused_before_publishing(s3, tmp_path, monkeypatch, to_url):
    """Ranged reads are not pinned to an object's version: the inputs are listed again before anything is
    published, and an object whose size or ETag changed stops the run."""
    key = f"changed-{to_url}"
    url = upload(s3, FIXTURE, key)
    lora_file = next(n for n in objects(s3, f"{key}/lora") if n.endswith(".pt"))
    from lora_merge.runs import to_hf

    build_plan = to_hf.build_plan

    def replacing(*args, **kwargs):  # once the headers are read: another training run writes the file again
        data = bytearray(s3.cat_file(f"models/{key}/lora/{lora_file}"))
        data[len(data) // 2] ^= 1
        s3.pipe_file(f"models/{key}/lora/{lora_file}", bytes(data))
        return build_plan(*args, **kwargs)

    monkeypatch.setattr(to_hf, "build_plan", replacing)
    out = f"s3://models/{key}-out/merged" if to_url else out_dir(tmp_path, "o", "merged")
    with pytest.raises(api.MergeError, match=rf"{url}/lora/{lora_file}: was written again \(its size or ETag "
                                             r"differs\) while this run read it; nothing was published"):
        api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, warn=quiet)
    if to_url:
        assert not s3.exists(f"models/{key}-out")
    else:
        assert not out.exists() and list(out.parent.iterdir()) == []


def test_url_inputs_are_one_plan_across_part_runs_until_an_object_changes(s3, tmp_path):
    """Each run fetches the inputs into a shadow of its own; parts agree by URL, size and ETag."""
    url = upload(s3, FIXTURE, "agree")
    out = out_dir(tmp_path, "o", "merged")
    api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="0/3", warn=quiet)
    api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="2/3", warn=quiet)
    config = "models/agree/hf_ref/config.json"
    s3.pipe_file(config, s3.cat_file(config) + b"\n")
    with pytest.raises(api.MergeError, match=r"part 0/3 differs from this run \(--part 1/3\) in .*the input files"):
        api.merge(**url_inputs(url), out=out, max_shard_size=SHARD, part="1/3", warn=quiet)


def test_an_output_url_that_cannot_be_written_is_named_before_the_run(s3, tmp_path, monkeypatch):
    from lora_merge.runs import to_hf

    monkeypatch.setattr(to_hf, "build_plan", lambda *a, **k: pytest.fail("the run began"))
    with pytest.raises(api.MergeError, match=r"^s3://no-such-bucket/m/merged.manifests: cannot be written "
                                             r"\(.*\); the output's parts are recorded there$"):
        api.merge(**local_inputs(), out="s3://no-such-bucket/m/merged", warn=quiet)
    assert "no-such-bucket" not in s3.ls("")  # a typo in the URL is not a new bucket


def test_two_runs_to_one_url_at_once_never_leave_a_broken_model(tmp_path, monkeypatch):
    """Both find the prefix empty before either writes. The first publishes; the second, whose uploads carry on
    after that (the same names, the same bytes), then fails. It must not remove the first's files, and neither
    publishes over the other: what is there is the one-process bytes, or no index and card at all."""
    import fsspec

    barrier = threading.Barrier(2, timeout=60)
    output_parts = remote.RemoteRun.output_parts
    mirrors = {}

    def both_find_it_empty(self, *args, **kwargs):
        local = output_parts(self, *args, **kwargs)
        mirrors[threading.current_thread()] = self.mirror
        barrier.wait()
        return local

    monkeypatch.setattr(remote.RemoteRun, "output_parts", both_find_it_empty)
    first_done, outcome = threading.Event(), {}
    submit = remote.RemoteOutput.submit
    submitted = []

    lock = threading.Lock()

    def second_goes_on_then_fails(self, path, name, done):
        if self is mirrors.get(threading.main_thread()):
            first_done.wait(60)  # the first has published by now
            with lock:  # (each lane's sha256 thread hands in its files)
                submitted.append(name)
                failing = len(submitted) >= 4
            if failing:  # three uploaded over the first's objects; another lane may hand in one more meanwhile
                self.wait()
                raise api.MergeError("stopped")
        return submit(self, path, name, done)

    monkeypatch.setattr(remote.RemoteOutput, "submit", second_goes_on_then_fails)

    def first():
        try:
            api.merge(**local_inputs(), out="memory://dup/merged", max_shard_size=SHARD, warn=quiet)
            outcome["first"] = "published"
        except api.MergeError as exc:
            outcome["first"] = str(exc)
        first_done.set()

    thread = threading.Thread(target=first)
    thread.start()
    with pytest.raises(api.MergeError, match="stopped"):
        api.merge(**local_inputs(), out="memory://dup/merged", max_shard_size=SHARD, warn=quiet)
    thread.join()
    assert len(submitted) >= 4
    mem = fsspec.filesystem("memory")
    if mem.exists("/dup/merged/README.md"):
        got = {p.split("/dup/merged/", 1)[1]: mem.cat_file(p) for p in mem.find("/dup/merged")}
        assert got == one_process(tmp_path), outcome
    else:
        assert not mem.exists("/dup/merged/model.safetensors.index.json"), outcome


def test_a_failure_after_publishing_leaves_the_published_model(tmp_path, monkeypatch):
    """A report beside the output that cannot be published after the model was: the error says so, and the
    model at the URL stays (as a local output does)."""
    import fsspec

    from lora_merge.files.staged_dir import SideFile

    def failing(self, force):
        raise api.MergeError(f"{self.final}: appeared while this run was writing")

    monkeypatch.setattr(SideFile, "publish", failing)
    with pytest.raises(api.MergeError, match="appeared while this run was writing") as caught:
        api.merge(**local_inputs(), out="memory://late/merged", max_shard_size=SHARD, warn=quiet,
                  report=tmp_path / "report.json")
    assert "removed" not in str(caught.value)
    mem = fsspec.filesystem("memory")
    got = {p.split("/late/merged/", 1)[1]: mem.cat_file(p) for p in mem.find("/late/merged")}
    assert got == one_process(tmp_path)


def test_a_write_check_left_by_a_killed_run_and_messages_name_the_url(tmp_path, capsys):
    """A run checks the output URL by writing a temporary object; one a killed run left there is skipped by the
    parts and by finish. Messages say where the files are: under the URL, not in a local OUT.parts."""
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/left/merged.manifests/.write-check.host-1-abcd.tmp", b"lora-merge")
    out = "memory://left/merged"
    api.merge(**local_inputs(), out=out, max_shard_size=SHARD, part="0/2", warn=quiet)
    with pytest.raises(api.MergeError, match=rf"part 0/2 of a split into 2, this is --part 1/3; finish or remove {out} "
                                             rf"and {out}.manifests before splitting differently"):
        api.merge(**local_inputs(), out=out, max_shard_size=SHARD, part="1/3", warn=quiet)
    api.merge(**local_inputs(), out=out, max_shard_size=SHARD, part="1/2", warn=quiet)
    api.finish(out)
    got = {p.split("/left/merged/", 1)[1]: mem.cat_file(p) for p in mem.find("/left/merged")}
    assert got == one_process(tmp_path)


def test_a_dry_run_writes_nothing_at_the_url(tmp_path):
    target = tmp_path / "store"
    for flags in ({}, {"part": "0/2"}, {"resume": True}):
        api.merge(**local_inputs(), out=f"file://{target}/merged", dry_run=True, warn=quiet, **flags)
    assert not target.exists()


def test_abandoned_local_directories_of_killed_url_runs_are_removed(tmp_path, monkeypatch):
    """A run with URLs keeps fetched ranges and files not yet uploaded under TMPDIR; a killed one's directory is
    removed by the next run there, one whose run is alive (its lock held) is not."""
    import fcntl

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    abandoned, alive = tmp_path / f"{remote.ROOT_PREFIX}old", tmp_path / f"{remote.ROOT_PREFIX}alive"
    for root in (abandoned, alive):
        root.mkdir()
        (root / "1").mkdir()
        (root / "1" / "model.safetensors").write_bytes(b"x" * 1000)
        (root / remote.ROOT_LOCK).write_bytes(b"")
    held = os.open(alive / remote.ROOT_LOCK, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with remote.RemoteRun() as run:
            assert not abandoned.exists() and alive.exists() and run.root.is_dir()
        assert not run.root.exists()
    finally:
        os.close(held)


def test_a_failed_manifest_write_still_removes_everything_the_run_uploaded(monkeypatch):
    """The manifest at the URL is then an older one of this run's: still its own, so the run removes what it
    uploaded (and on a local file system leaves no temporary file)."""
    import fsspec

    put = remote._put_bytes
    writes = []

    def failing(fs, rpath, data):
        if rpath.endswith(".json"):
            writes.append(rpath)
            if len(writes) == 4:
                raise OSError("connection reset")
        return put(fs, rpath, data)

    monkeypatch.setattr(remote, "_put_bytes", failing)
    with pytest.raises(api.MergeError, match="connection reset.*the objects uploaded were removed"):
        api.merge(**local_inputs(), out="memory://mput/merged", max_shard_size=SHARD, warn=quiet)
    assert not fsspec.filesystem("memory").find("/mput")


def test_on_a_local_file_system_a_failed_write_leaves_no_temporary_file_and_a_killed_ones_is_removed(tmp_path,
                                                                                                       monkeypatch):
    import fsspec

    fs = fsspec.filesystem("file")
    pipe = type(fs).pipe_file

    def short(self, path, value, *args, **kwargs):
        pipe(self, path, value[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(fs), "pipe_file", short)
    with pytest.raises(OSError, match="No space"):
        remote._put_bytes(fs, f"{tmp_path}/m/part.json", b"{}" * 10)
    assert not list((tmp_path / "m").iterdir())
    monkeypatch.undo()
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)
    # what a run killed mid-upload leaves: a temporary file under the output; finish removes it
    out = f"file://{tmp_path}/store/merged"
    api.merge(**local_inputs(), out=out, max_shard_size=SHARD, part="0/2", warn=quiet)
    left = tmp_path / "store" / "merged" / ".model-00008-of-00008.safetensors.host-123-abcd1234.tmp"
    left.write_bytes(b"partial")
    api.merge(**local_inputs(), out=out, max_shard_size=SHARD, part="1/2", warn=quiet)
    api.finish(out)
    assert not left.exists()
    assert files(tmp_path / "store" / "merged") == one_process(tmp_path)


def test_a_write_check_left_by_a_killed_run_does_not_block_a_new_run():
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/probe/merged.manifests/.write-check.host-1-abcd.tmp", b"lora-merge")
    api.merge(**local_inputs(), out="memory://probe/merged", max_shard_size=SHARD, warn=quiet)
    assert mem.exists("/probe/merged/README.md")


@pytest.mark.parametrize("fixture", ["qwen3moe_dist_ep2", "deepseek_v3_mtp_tp2etp1_ep2"])
def test_moe_and_deepseek_from_urls_in_parts_to_a_url(tmp_path, fixture):
    """The same for an MoE (torch_dist) and a DeepSeek-V3 (MLA, MTP, EP) fixture, inputs and output at URLs:
    seven parts, run in reverse order, then finish give the one-process local bytes."""
    import fsspec

    from helpers import fixture_info, fixture_root

    root = fixture_root(fixture)
    given = dict(lora=root / "lora", hf_ref=root / "hf_ref")
    if fixture_info(root)["lora"] == "filtered":
        given["base"] = root / "base"
    mem = fsspec.filesystem("memory")
    mem.put(str(root), f"/in-{fixture}", recursive=True)
    urls = {k: f"memory://in-{fixture}/{v.name}" for k, v in given.items()}
    local = out_dir(tmp_path, "local", "merged")
    api.merge(**given, out=local, max_shard_size=SHARD, warn=quiet)
    out = f"memory://out-{fixture}/merged"
    for index in reversed(range(7)):
        api.merge(**urls, out=out, max_shard_size=SHARD, part=f"{index}/7", warn=quiet)
    api.finish(out)
    got = {p.split(f"/out-{fixture}/merged/", 1)[1]: mem.cat_file(p) for p in mem.find(f"/out-{fixture}/merged")}
    assert got == files(local)


def test_where_locks_are_per_process_a_run_never_removes_another_threads_directory(tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, which belong to the process: another open of a lock file in the same
    process takes it. A run must still not take the directory of a live run in another thread for abandoned."""
    import fcntl

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    flock = fcntl.flock
    held: set[int] = set()

    def per_process(fd, op):  # as POSIX locks behave: this process always gets them
        if op & fcntl.LOCK_UN:
            held.discard(os.fstat(fd).st_ino)
        else:
            held.add(os.fstat(fd).st_ino)

    monkeypatch.setattr(fcntl, "flock", per_process)
    with remote.RemoteRun() as first:
        with remote.RemoteRun() as second:
            assert first.root.is_dir() and second.root.is_dir()
    monkeypatch.setattr(fcntl, "flock", flock)
