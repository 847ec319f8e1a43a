"""Runs with the same --out (threads of one process, processes, processes in other PID namespaces with the
same hostname) never remove each other's staging directories or report temp files: one is abandoned only
when the lock its run holds can be taken, i.e. its run is gone. Exactly one run publishes; the others get
the documented one-line error, never a raw FileNotFoundError."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from helpers import FIXTURES
from lora_merge.errors import MergeError

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = FIXTURES / "tp2_fp32_filtered"


def staging_dirs(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_live_runs_staging_dir_survives_cleanup_by_this_thread_and_others(tmp_path):
    from lora_merge.files.staged_dir import StagedOutput, remove_abandoned_staging
    from lora_merge.files.targets import InputPaths

    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with StagedOutput(out, False, InputPaths()) as stage:
            (stage.dir / "model.safetensors").write_bytes(b"half")
            remove_abandoned_staging(out, InputPaths())  # same pid: once taken for a killed earlier process's
            worker = threading.Thread(target=remove_abandoned_staging, args=(out, InputPaths()))
            worker.start()
            worker.join()
            assert (stage.dir / "model.safetensors").read_bytes() == b"half"
            raise RuntimeError("the run fails: its own staging dir goes")
    assert staging_dirs(tmp_path, "out") == []


def test_a_report_temp_file_of_a_live_run_survives_cleanup(tmp_path):
    from lora_merge.files.staged_dir import SideFile, _prefix, remove_abandoned_side_files
    from lora_merge.files.targets import InputPaths

    report = tmp_path / "report.json"
    side = SideFile(report)
    side.write("{}")
    remove_abandoned_side_files(report, InputPaths())
    assert side.tmp.read_text() == "{}"
    side.discard()
    # What a killed run leaves: the file, locked by nobody.
    left = tmp_path / f"{_prefix('report.json')}{_dead_pid()}-abcd"
    left.write_text("{}")
    remove_abandoned_side_files(report, InputPaths())
    assert not left.exists()


def test_three_threads_merging_to_one_out(tmp_path, monkeypatch):
    """All three stage their output at the same time (a barrier holds each until the others have staged
    theirs); one publishes, the others say so in one line."""
    import lora_merge
    from lora_merge.runs import stream

    out = tmp_path / "merged"
    everyone_staged = threading.Barrier(3, timeout=60)
    real_execute = stream.execute

    def execute_once_all_staged(*args, **kwargs):
        everyone_staged.wait()
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(stream, "execute", execute_once_all_staged)
    results = []

    def merge():
        try:
            lora_merge.merge(base=FIXTURE / "base", lora=FIXTURE / "lora", hf_ref=FIXTURE / "hf_ref", out=out,
                             warn=lambda message: None)
            results.append("published")
        except MergeError as exc:
            results.append(str(exc))
        except BaseException as exc:  # noqa: BLE001 — what this test is about: no raw error escapes
            results.append(f"RAW {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=merge) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results).count("published") == 1, results
    for message in results:
        if message != "published":
            assert message == (f"{out}: appeared while this run was writing (another run with the same --out?); "
                               "it was left as it is and this run's output discarded"), results
    assert (out / "model.safetensors").is_file()
    assert staging_dirs(tmp_path, "merged") == []


# A process staging an output, as a run in another PID namespace on this host looks from here: its staging
# dir is renamed to carry a pid that does not exist in ours. It holds the dir until told to go on.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from lora_merge.files.staged_dir import StagedOutput
    from lora_merge.files.targets import InputPaths

    out, dead_pid, mark = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    with StagedOutput(out, False, InputPaths()) as stage:
        (stage.dir / "model.safetensors").write_bytes(b"live")
        disguised = stage.dir.with_name(stage.dir.name.replace(f"-{os.getpid()}-", f"-{dead_pid}-"))
        os.rename(stage.dir, disguised)
        stage.dir = disguised
        (mark / "staged").write_text(str(disguised))
        while not (mark / "go").exists():
            time.sleep(0.01)
        raise SystemExit(3)  # fails: removes its own staging dir
""")


def test_a_live_run_in_another_pid_namespace_keeps_its_staging_dir(tmp_path):
    from lora_merge.files.staged_dir import remove_abandoned_staging
    from lora_merge.files.targets import InputPaths

    out, mark = tmp_path / "merged", tmp_path / "mark"
    mark.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for ending in ("finishes", "is killed"):
        for f in mark.iterdir():
            f.unlink()
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(_dead_pid()), str(mark)], env=env)
        deadline = time.monotonic() + 60
        while not (mark / "staged").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        held = Path((mark / "staged").read_text())
        remove_abandoned_staging(out, InputPaths())  # its pid is dead here, but its run is alive
        assert (held / "model.safetensors").read_bytes() == b"live"
        if ending == "finishes":
            (mark / "go").touch()
            assert proc.wait(60) == 3
            assert not held.exists()
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
            assert held.exists()  # a killed run leaves it: the next run's cleanup takes it
            remove_abandoned_staging(out, InputPaths())
            assert not held.exists()
    assert staging_dirs(tmp_path, "merged") == []


def test_a_staging_dir_without_a_lock_is_left_alone(tmp_path):
    """An earlier version's staging dir, or one whose run has only just created it, cannot be proven
    abandoned: it is never removed (its pid proves nothing)."""
    from lora_merge.files.staged_dir import _host, remove_abandoned_staging
    from lora_merge.files.targets import InputPaths

    unproven = tmp_path / f".out.partial-{_host()}-{_dead_pid()}-abcd"
    unproven.mkdir()
    (unproven / "model.safetensors").write_bytes(b"?")
    remove_abandoned_staging(tmp_path / "out", InputPaths())
    assert (unproven / "model.safetensors").exists()
