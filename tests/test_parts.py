"""A merge in parts (`--part I/N`, then `lora-merge finish`): the same bytes as one process for any N and any
order, reruns and resumes that never corrupt, and `finish` refusing what is not one complete plan."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from helpers import fixture_info, fixture_root, quiet, run_failing
from lora_merge import api, options
from lora_merge.cli import main
from lora_merge.errors import MergeError, UsageError
from lora_merge.files.parts_dir import PartsDir
from lora_merge.runs import parts as parts_module
from lora_merge.runs.parts import assign_files

SHARD = 64 << 10  # the fixtures are ~0.6-1.5 MB: ten to twenty shards


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)


def inputs(fixture: str) -> dict:
    root = fixture_root(fixture)
    given = dict(lora=root / "lora", hf_ref=root / "hf_ref")
    if fixture_info(root)["lora"] == "filtered":
        given["base"] = root / "base"
    return given


def merged(fixture: str, out: Path, **kw):
    kw.setdefault("report", out / "merge-report.json")
    return api.merge(**inputs(fixture), out=out, max_shard_size=SHARD, workers=2, warn=quiet, **kw)


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_same_output(one: Path, other: Path) -> None:
    mine, theirs = tree(one), tree(other)
    assert sorted(mine) == sorted(theirs)
    assert [name for name in mine if mine[name] != theirs[name]] == []


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each fixture merged by one process, into a directory named as the parts' outputs are."""
    made = {}

    def get(fixture: str) -> Path:
        if fixture not in made:
            out = tmp_path_factory.mktemp(f"one-{fixture}") / "merged"
            merged(fixture, out)
            made[fixture] = out
        return made[fixture]
    return get


@pytest.mark.parametrize("fixture,counts", [("tp2pp2_fp32_filtered", (1, 2, 3, 7)), ("qwen3moe_ep2", (2, 7)),
                                            ("deepseek_v3_ep2", (3,))])
def test_parts_in_any_order_give_the_one_process_bytes(fixture, counts, one_process, tmp_path):
    expected = one_process(fixture)
    assert sum(name.startswith("model-") for name in os.listdir(expected)) >= 8  # a split that means something
    for count in counts:
        out = tmp_path / str(count) / "merged"
        out.parent.mkdir()
        order = list(range(count))[::-1] if count % 2 else list(range(count))[1::2] + list(range(count))[::2]
        written = []
        for index in order:
            result = merged(fixture, out, part=f"{index}/{count}")
            assert result.part == f"{index}/{count}" and not out.exists()
            written += result.files
        assert sorted(written) == sorted(n for n in os.listdir(expected) if n.endswith(".safetensors"))
        finished = api.finish(out, rehash=count != 7)
        assert finished.parts == count
        assert_same_output(expected, out)
        assert not PartsDir(out).files.exists() and not PartsDir(out).manifests.exists()


def test_files_are_split_by_bytes_into_contiguous_balanced_parts():
    assert assign_files([10] * 10, 3) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert assign_files([10] * 4, 7) == [0, 2, 4, 6]  # more parts than files: some write none
    assert assign_files([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    for count in (1, 2, 5):
        owner = assign_files([3, 9, 1, 4, 4, 7, 2], count)
        assert owner == sorted(owner) and set(owner) <= set(range(count))


def test_the_cli_runs_parts_and_finish(one_process, tmp_path, capsys):
    fixture = "tp2pp2_fp32_filtered"
    out = tmp_path / "merged"
    root = fixture_root(fixture)
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--max-shard-size", str(SHARD), "--report", str(out / "merge-report.json"),
            "--no-progress"]
    for index in range(2):
        assert main(args + ["--part", f"{index}/2"]) == 0
        assert f"part {index}/2:" in capsys.readouterr().out
    assert main(["finish", "--out", str(out)]) == 0
    assert "checked 2 part(s)" in capsys.readouterr().out
    assert_same_output(one_process(fixture), out)


def test_two_runs_of_one_part_at_once_leave_one_correct_output(one_process, tmp_path):
    fixture = "qwen3moe_ep2"
    out = tmp_path / "merged"
    merged(fixture, out, part="0/2")
    errors = []

    def run():
        try:
            merged(fixture, out, part="1/2")
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    api.finish(out)
    assert_same_output(one_process(fixture), out)


class Killed(BaseException):
    """What a kill does to a run: it stops between two files (the test's stand-in for SIGKILL)."""


def kill_after(monkeypatch, files: int) -> None:
    placed = parts_module.PartFiles.written
    count = [0]
    lock = threading.Lock()  # (each lane's sha256 thread records its files)

    def written(self, name, sha256):
        with lock:
            if count[0] >= files:
                raise Killed
            count[0] += 1
        placed(self, name, sha256)
    monkeypatch.setattr(parts_module.PartFiles, "written", written)


def test_a_killed_part_resumes_from_its_files_and_finish_names_it_until_then(one_process, tmp_path, monkeypatch,
                                                                             capsys):
    fixture = "deepseek_v3_ep2"
    out = tmp_path / "merged"
    merged(fixture, out, part="0/2")
    with monkeypatch.context() as m:
        kill_after(m, 3)
        with pytest.raises(Killed):
            merged(fixture, out, part="1/2")
    with pytest.raises(MergeError, match=r"part 1/2 did not complete \(3 of \d+ files written\); rerun it with "
                                         r"--part 1/2 --resume"):
        api.finish(out)
    # a file the killed run completed, damaged since: written again, not kept
    manifest = PartsDir(out).own_manifest(1, 2)
    damaged = sorted(manifest["files"])[0]
    with open(PartsDir(out).files / damaged, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    result = merged(fixture, out, part="1/2", resume=True)
    assert len(result.resumed) == 2 and damaged not in result.resumed
    api.finish(out)
    assert_same_output(one_process(fixture), out)


def test_resume_without_parts_publishes_at_once(one_process, tmp_path, monkeypatch):
    fixture = "qwen3moe_ep2"
    out = tmp_path / "merged"
    with monkeypatch.context() as m:
        kill_after(m, 4)
        with pytest.raises(Killed):
            merged(fixture, out, resume=True)
    assert not out.exists()
    result = merged(fixture, out, resume=True)
    assert result.part is None and len(result.resumed) == 4
    assert "README.md" in result.files and "model.safetensors.index.json" in result.files
    assert_same_output(one_process(fixture), out)


def part_runs(fixture: str, out: Path, count: int, skip=()) -> None:
    for index in range(count):
        if index not in skip:
            merged(fixture, out, part=f"{index}/{count}")


def test_finish_refuses_a_missing_part(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 3, skip=(1,))
    with pytest.raises(MergeError, match=r"part 1/3 is missing \(no manifest\); run it with --part 1/3"):
        api.finish(out)
    assert not out.exists()


def test_finish_refuses_a_file_changed_since_its_part_wrote_it(tmp_path, capsys):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    victim = PartsDir(out).files / json.loads((PartsDir(out).manifests / "part-00001-of-00002.json").read_text())["assigned"][0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x40
    victim.write_bytes(bytes(data))
    run_failing(["finish", "--out", str(out)], capsys, f"{victim}: has other bytes than its part recorded; rerun part "
                "1/2 with --part 1/2 --resume")
    # without rehashing, a file of the same size passes (its sha256 is the one its part recorded) ...
    data[-1] ^= 0x40
    victim.write_bytes(bytes(data[:-1]))  # ... one cut short does not
    with pytest.raises(MergeError, match="has another size than its part recorded; rerun part 1/2"):
        api.finish(out, rehash=False)
    victim.unlink()
    with pytest.raises(MergeError, match="is missing; rerun part 1/2"):
        api.finish(out)
    assert not out.exists()


def test_parts_of_another_plan_or_split_are_refused(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2, skip=(1,))
    with pytest.raises(MergeError, match=r"part 0/2 differs from this run \(--part 1/2\) in the model card "
                                         r"\(--base-model-id\), --lora-alpha, the LoRA settings \(r, alpha, rsLoRA\); "
                                         r"rerun with its inputs and options, or remove"):
        merged("tp2pp2_fp32_filtered", out, part="1/2", lora_alpha=3.0)  # another LoRA scale
    with pytest.raises(MergeError, match="part 0/2 of a split into 2, this is --part 1/3"):
        merged("tp2pp2_fp32_filtered", out, part="1/3")
    manifests = PartsDir(out).manifests
    theirs = json.loads((manifests / "part-00000-of-00002.json").read_text())
    (manifests / "part-00001-of-00002.json").write_text(json.dumps({**theirs, "part": [1, 2], "plan": "0" * 64}))
    with pytest.raises(MergeError, match="part 1/2 differs from part 0/2 in .*; rerun it with the same"):
        api.finish(out)
    (manifests / "part-00001-of-00003.json").write_text(json.dumps(theirs))
    with pytest.raises(MergeError, match="parts of splits into 2 and 3"):
        api.finish(out)
    (manifests / "part-00001-of-00002.json").write_text("{not json")
    with pytest.raises(MergeError, match="part-00001-of-00002.json: not a readable part manifest"):
        api.finish(out)


def test_finish_without_parts_and_options_that_do_not_go_with_parts(tmp_path, capsys):
    with pytest.raises(MergeError, match="no parts to finish"):
        api.finish(tmp_path / "merged")
    for bad in ("2/2", "1/0", "a/b", "-1/2", "3"):
        with pytest.raises(UsageError, match="expected I/N with 0 ≤ I < N"):
            merged("tp2pp2_fp32_filtered", tmp_path / "x", part=bad)
    with pytest.raises(MergeError, match="--verify with --part 0/2"):
        merged("tp2pp2_fp32_filtered", tmp_path / "x", part="0/2", verify=True)
    with pytest.raises(MergeError, match="--no-sha256 with --part 0/2"):
        merged("tp2pp2_fp32_filtered", tmp_path / "x", part="0/2", sha256=False)
    assert not (tmp_path / "x").exists()


# --- a Megatron checkpoint in parts (--to megatron, legacy format): whole rank files --------------------------

def converted(out: Path, **kw):
    return api.to_megatron(out=out, warn=quiet, workers=2, **kw)


@pytest.mark.parametrize("source,layout,counts", [
    ("hf", dict(tp=2, pp=2), (3, 5)),
    ("qwen3moe_ep2", dict(ep=4, tp=2, etp=1, expert_layout="grouped"), (2, 3)),
])
def test_a_megatron_checkpoint_in_parts_is_the_one_process_checkpoint(source, layout, counts, one_process, tmp_path):
    if source == "hf":  # an HF model as the base: the dense fixture's merge
        given = dict(base=one_process("tp2pp2_fp32_filtered"))
    else:  # a Megatron base and its LoRA, resharded with the LoRA merged
        given = inputs(source)
    one = tmp_path / "one" / "mcore"
    one.parent.mkdir()
    converted(one, **given, **layout)
    assert len(list(one.glob("release/mp_rank_*/model_optim_rng.pt"))) >= 2
    for count in counts:
        out = tmp_path / str(count) / "mcore"
        out.parent.mkdir()
        for index in reversed(range(count)):
            result = converted(out, **given, **layout, part=f"{index}/{count}")
            assert result.part == f"{index}/{count}" and not out.exists()
        assert api.finish(out).parts == count
        assert_same_output(one, out)


def test_a_killed_megatron_part_resumes_and_resume_alone_publishes(tmp_path, monkeypatch, one_process):
    given = dict(base=one_process("tp2pp2_fp32_filtered"), tp=2, pp=2)
    one = tmp_path / "one" / "mcore"
    one.parent.mkdir()
    converted(one, **given)
    out = tmp_path / "mcore"
    with monkeypatch.context() as m:
        kill_after(m, 1)  # the part's first rank file placed, then killed
        with pytest.raises(Killed):
            converted(out, **given, resume=True)
    result = converted(out, **given, resume=True)
    assert result.part is None and len(result.resumed) == 1
    assert_same_output(one, out)


@pytest.mark.parametrize("source,layout", [("hf", dict()), ("qwen3moe_ep2", dict(ep=2))])
def test_a_torch_dist_checkpoint_in_parts_is_the_one_process_checkpoint(source, layout, tmp_path, monkeypatch,
                                                                        one_process):
    from lora_merge.writers import megatron_dist

    monkeypatch.setattr(megatron_dist, "FILE_BYTES", 64 << 10)  # several .distcp files from a small model
    given = dict(base=one_process("tp2pp2_fp32_filtered")) if source == "hf" else inputs(source)
    one = tmp_path / "one" / "dist"
    one.parent.mkdir()
    converted(one, **given, **layout, ckpt_format="torch_dist")
    assert len(list(one.glob("release/*.distcp"))) >= 4
    for count in (2, 5):
        out = tmp_path / str(count) / "dist"
        out.parent.mkdir()
        for index in reversed(range(count)):
            converted(out, **given, **layout, ckpt_format="torch_dist", part=f"{index}/{count}")
        api.finish(out)
        assert_same_output(one, out)


def test_an_interrupted_part_says_what_it_keeps_for_resume(tmp_path, monkeypatch, capsys):
    import signal

    from lora_merge import entry, interrupts

    received = []  # the signal this test sends is this test's alone
    monkeypatch.setattr(interrupts, "RECEIVED", received)
    monkeypatch.setattr(entry, "RECEIVED", received)
    root = fixture_root("tp2pp2_fp32_filtered")
    out = tmp_path / "merged"
    placed = parts_module.PartFiles.written
    count = [0]
    lock = threading.Lock()  # (each lane's sha256 thread records its files)

    def written(self, name, sha256):
        placed(self, name, sha256)
        with lock:
            count[0] += 1
            now = count[0] == 2
        if now:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(parts_module.PartFiles, "written", written)
    code = main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(out), "--max-shard-size", str(SHARD), "--no-progress", "--part", "0/2"])
    err = capsys.readouterr().err
    assert code == 143 and err.count("\n") == 1, err
    assert (f"interrupted by SIGTERM; nothing was published; {PartsDir(out).files} keeps the files completed so far: "
            "run the same command with --resume to continue") in err
    assert len(PartsDir(out).own_manifest(0, 2)["files"]) >= 2 and not out.exists()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (8 << 20) - 1, 8 << 20, (8 << 20) + 4097])
def test_a_file_hashed_without_the_page_cache_has_its_sha256(tmp_path, size):
    import hashlib

    from lora_merge.files.file_hash import sha256_of

    data = os.urandom(size)
    for directory in (tmp_path, Path("/dev/shm")):  # a disk file system, and tmpfs (O_DIRECT refused on older kernels)
        if not directory.is_dir():
            continue
        path = directory / f"lora-merge-hash-test-{os.getpid()}"
        try:
            path.write_bytes(data)
            assert sha256_of(path) == hashlib.sha256(data).hexdigest()
        finally:
            path.unlink(missing_ok=True)


# --- what the review of the parts found: each defect's class ----------------------------------------------

def test_parts_differing_in_any_lora_setting_are_refused(tmp_path, one_process):
    out = tmp_path / "merged"
    merged("tp2pp2_fp32_filtered", out, part="0/2", lora_alpha=3.0)
    with pytest.raises(MergeError, match="part 0/2 differs from this run .*--lora-alpha"):  # the card shows both as 3
        merged("tp2pp2_fp32_filtered", out, part="1/2", lora_alpha=3.000001)
    with pytest.raises(MergeError, match=r"part 0/2 differs from this run \(--part 1/2\) in --report;"):
        merged("tp2pp2_fp32_filtered", out, part="1/2", lora_alpha=3.0, report=None)  # the report is the plan's too
    mcore = tmp_path / "mcore"
    given = dict(inputs("qwen3moe_ep2"), ep=2, tp=2, etp=1)
    converted(mcore, **given, part="0/2")
    with pytest.raises(MergeError, match="part 0/2 differs from this run .*--lora-alpha"):
        converted(mcore, **given, part="1/2", lora_alpha=3.0)


def test_an_input_changed_between_parts_is_another_plan(tmp_path):
    import shutil

    root = tmp_path / "inputs"
    shutil.copytree(fixture_root("tp2pp2_fp32_filtered"), root)
    given = dict(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", max_shard_size=SHARD, warn=quiet)
    out = tmp_path / "merged"
    api.merge(**given, out=out, part="0/2")
    tracker = next(root.joinpath("lora").rglob("latest_checkpointed_iteration.txt"))
    os.utime(tracker, ns=(1, 1))  # the same bytes, written again (a LoRA trained again into the same directory)
    with pytest.raises(MergeError, match=r"part 0/2 differs from this run \(--part 1/2\) in the input files \(their "
                                         r"paths, sizes or modification times\);"):
        api.merge(**given, out=out, part="1/2")


def test_finish_refuses_a_report_it_may_not_replace_before_publishing(tmp_path):
    out = tmp_path / "merged"
    report = tmp_path / "report.json"
    for index in range(2):
        api.merge(**inputs("tp2pp2_fp32_filtered"), out=out, max_shard_size=SHARD, report=report, warn=quiet,
                  part=f"{index}/2")
    report.write_text("someone's notes")
    with pytest.raises(MergeError, match="report.json: already exists and is a file that is not a report of lora-merge"):
        api.finish(out, force=True)
    report.unlink()
    report.write_text('{"lora_merge_report": 1, "tool": "lora-merge 0.1"}')  # an earlier report of ours
    with pytest.raises(MergeError, match=r"report.json: already exists: an earlier report of lora-merge \(pass --force"):
        api.finish(out)
    assert not out.exists() and PartsDir(out).manifests.is_dir()  # nothing published, the parts kept
    api.finish(out, force=True)
    assert json.loads(report.read_text())["files"]


def test_damaged_manifests_name_the_part_to_rerun_and_a_part_rewrites_its_own(tmp_path, one_process):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    manifests = PartsDir(out).manifests
    (manifests / "part-00001-of-00002.json").write_text("{not json")
    with pytest.raises(MergeError, match=r"part-00001-of-00002.json: not a readable part manifest .*; remove it and "
                                         r"rerun part 1/2"):
        api.finish(out)
    merged("tp2pp2_fp32_filtered", out, part="1/2", resume=True)  # its own: written again
    (manifests / "part-00000-of-00002.json").write_text(json.dumps({"lora-merge part manifest": 1, "plan": "x"}))
    with pytest.raises(MergeError, match="a part manifest without its plan, files or state; remove it and rerun part 0/2"):
        merged("tp2pp2_fp32_filtered", out, part="1/2")
    (manifests / "part-00000-of-00002.json").unlink()
    merged("tp2pp2_fp32_filtered", out, part="0/2")
    api.finish(out)
    assert_same_output(one_process("tp2pp2_fp32_filtered"), out)


def test_files_not_ours_in_the_parts_directory_are_never_removed(tmp_path):
    out = tmp_path / "merged"
    staging = PartsDir(out)
    staging.files.mkdir(parents=True)
    (staging.files / "notes.txt").write_text("mine")
    staging.manifests.mkdir()  # an empty one does not make the files ours
    with pytest.raises(MergeError, match="exists with files but no part manifest"):
        merged("tp2pp2_fp32_filtered", out, part="0/2")
    (staging.files / "notes.txt").unlink()
    part_runs("tp2pp2_fp32_filtered", out, 2)
    (staging.files / "photos").mkdir()
    (staging.files / "photos" / "cat.jpg").write_text("mine")
    with pytest.raises(MergeError, match="photos/cat.jpg: in the parts' directory, but not written by lora-merge"):
        api.finish(out)
    assert (staging.files / "photos" / "cat.jpg").read_text() == "mine" and not out.exists()


def test_a_manifest_naming_files_outside_the_output_is_refused(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    path = PartsDir(out).manifests / "part-00001-of-00002.json"
    manifest = json.loads(path.read_text())
    victim = manifest["assigned"][0]
    (tmp_path / "outside.bin").write_bytes((PartsDir(out).files / victim).read_bytes())
    manifest["assigned"][0] = "../../outside.bin"
    manifest["files"]["../../outside.bin"] = manifest["files"].pop(victim)
    path.write_text(json.dumps(manifest))
    with pytest.raises(MergeError, match="the parts' files do not make up the output's"):
        api.finish(out)
    assert not out.exists()


def test_finish_says_what_the_output_directory_is(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    out.mkdir()
    (out / "mine.txt").write_text("x")
    with pytest.raises(MergeError) as err:
        api.finish(out)
    assert "not replacing it even with --force" in str(err.value) and "(pass --force" not in str(err.value)
    (out / "mine.txt").unlink()
    out.rmdir()
    out.symlink_to(tmp_path)
    with pytest.raises(MergeError, match="is a symlink; give the directory itself"):
        api.finish(out, force=True)
    out.unlink()
    api.finish(out)
    with pytest.raises(MergeError, match=r"no parts to finish: the output is there and merged.parts is not \(finished"):
        api.finish(out)


def test_parts_killed_for_real_resume_to_the_one_process_bytes(tmp_path, one_process):
    """SIGKILL, not an exception: each part is killed in a child process once its manifest records a file,
    then resumed; the published output is the one-process output."""
    import signal
    import subprocess
    import sys
    import time

    fixture = "qwen3moe_ep2"
    out = tmp_path / "merged"
    root = fixture_root(fixture)
    code = ("import sys; from lora_merge import options; options.MIN_SHARD_BYTES = 1; from lora_merge.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
            str(out), "--max-shard-size", str(SHARD), "--report", str(out / "merge-report.json"), "--no-progress",
            "-q", "--workers", "1", "--resume"]
    killed = 0
    for index in range(2):
        proc = subprocess.Popen([sys.executable, "-c", code, *args, "--part", f"{index}/2"])
        manifest = PartsDir(out).manifests / f"part-0000{index}-of-00002.json"
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if json.loads(manifest.read_text())["files"]:
                    proc.send_signal(signal.SIGKILL)
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.005)
        killed += proc.wait() == -signal.SIGKILL
    assert killed, "no part was killed mid-run: the test proved nothing"
    for index in range(2):
        assert subprocess.run([sys.executable, "-c", code, *args, "--part", f"{index}/2"]).returncode == 0
    api.finish(out)
    assert_same_output(one_process(fixture), out)


def test_a_dry_run_of_a_part_names_its_files(tmp_path, capsys):
    root = fixture_root("tp2pp2_fp32_filtered")
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
            str(tmp_path / "merged"), "--max-shard-size", str(SHARD), "--dry-run"]
    listed = []
    for index in range(3):
        assert main(args + ["--part", f"{index}/3"]) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("part:"))
        assert line.strip().startswith(f"part:   {index}/3: ")
        result = api.merge(**inputs("tp2pp2_fp32_filtered"), out=tmp_path / "merged", max_shard_size=SHARD,
                           dry_run=True, part=f"{index}/3", warn=quiet)
        listed += result.files
    written = merged("tp2pp2_fp32_filtered", tmp_path / "m", part="0/1")
    assert listed == written.files and not (tmp_path / "merged.parts").exists()



# --- what the second review found ------------------------------------------------------------------------

def test_finish_refuses_a_reference_changed_since_the_parts(tmp_path):
    import shutil

    root = tmp_path / "inputs"
    shutil.copytree(fixture_root("tp2pp2_fp32_filtered"), root)
    given = dict(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", max_shard_size=SHARD, warn=quiet)
    out = tmp_path / "merged"
    for index in range(2):
        api.merge(**given, out=out, part=f"{index}/2")
    (root / "hf_ref" / "special_tokens_map.json").write_text("{}")
    with pytest.raises(MergeError, match=r"hf_ref: changed since part 0/2 read it \(special_tokens_map.json\); the "
                                         "output would hold other reference files"):
        api.finish(out)
    (root / "hf_ref" / "special_tokens_map.json").unlink()
    api.finish(out)


def test_finish_leaves_what_is_not_a_manifest_in_the_manifests_directory(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    notes = PartsDir(out).manifests / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(MergeError, match="notes.txt: not a part manifest of lora-merge; the directory is removed once"):
        api.finish(out)
    assert notes.read_text() == "mine" and not out.exists()


def test_a_run_in_one_process_warns_of_parts_it_leaves_beside_its_output(tmp_path, monkeypatch, one_process):
    out = tmp_path / "merged"
    with monkeypatch.context() as m:
        kill_after(m, 2)
        with pytest.raises(Killed):
            merged("tp2pp2_fp32_filtered", out, resume=True)
    warnings = []
    api.merge(**inputs("tp2pp2_fp32_filtered"), out=out, max_shard_size=SHARD, report=out / "merge-report.json",
              warn=warnings.append)
    assert any("merged.parts/ and merged.manifests/ beside" in w and "neither uses nor removes" in w for w in warnings)
    assert_same_output(one_process("tp2pp2_fp32_filtered"), out)
    with pytest.raises(MergeError, match=r"part 0/1 did not complete \(2 of \d+ files written\); rerun it with --resume$"):
        api.finish(tmp_path / "merged")


def test_options_that_do_not_go_with_resume_say_resume(tmp_path):
    with pytest.raises(MergeError, match=r"--verify with --resume: verify the output once it is published"):
        merged("tp2pp2_fp32_filtered", tmp_path / "x", resume=True, verify=True)
    with pytest.raises(MergeError, match="--no-sha256 with --resume:"):
        merged("tp2pp2_fp32_filtered", tmp_path / "x", resume=True, sha256=False)


def test_inputs_named_by_relative_paths_are_the_same_plan(tmp_path, monkeypatch, one_process):
    root = fixture_root("tp2pp2_fp32_filtered")
    out = tmp_path / "merged"
    merged("tp2pp2_fp32_filtered", out, part="0/2")
    monkeypatch.chdir(root)
    api.merge(base="base", lora="lora", hf_ref="hf_ref", out=out, max_shard_size=SHARD, report=out / "merge-report.json",
              warn=quiet, part="1/2")
    api.finish(out)
    assert_same_output(one_process("tp2pp2_fp32_filtered"), out)


def test_a_dry_run_of_a_megatron_part_names_its_files(tmp_path, capsys, one_process):
    base = one_process("tp2pp2_fp32_filtered")
    listed = []
    for index in range(3):
        result = converted(tmp_path / "mcore", base=base, tp=2, pp=2, dry_run=True, part=f"{index}/3")
        listed += result.files
    one = tmp_path / "one"
    converted(one, base=base, tp=2, pp=2)
    assert sorted(listed) == sorted(str(p.relative_to(one)) for p in one.glob("release/*/model_optim_rng.pt"))
    assert main(["--to", "megatron", "--base", str(base), "--out", str(tmp_path / "mcore"), "--tp", "2", "--pp", "2",
                 "--dry-run", "--part", "0/3"]) == 0
    assert "part 0/3 would write" in capsys.readouterr().out


def test_what_finish_writes_from_part_0s_record_is_checked_before_use(tmp_path):
    out = tmp_path / "merged"
    part_runs("tp2pp2_fp32_filtered", out, 2)
    path = PartsDir(out).manifests / "part-00000-of-00002.json"
    original = json.loads(path.read_text())
    for damage in ({"reference": {**original["common"]["reference"], "dtype": "load"}}, {"card": "text"},
                   {"later": ["../elsewhere.json"]}, {"report_path": "relative.json"}, {"kind": "something else"}):
        path.write_text(json.dumps({**original, "common": {**original["common"], **damage}}))
        with pytest.raises(MergeError, match=r"part-00000-of-00002.json: says nothing valid of the whole output .*; "
                                             "remove it and rerun part 0/2"):
            api.finish(out)
    path.write_text(json.dumps(original))
    api.finish(out)
