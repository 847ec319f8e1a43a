"""A signal that arrives once the output is being published — while the summary is printed, or while the
interpreter exits — is ignored: the command exits 0 with its output complete, never killed by the signal
(-15) nor reporting an interruption. Each case pauses the command at one moment (a hook in the child
process, not a sleep to guess at), sends the signal, then lets it go on, so the moment is exact."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import merge_args
from lora_merge.cli import main

ROOT = Path(__file__).resolve().parent.parent

# Runs the command as `lora-merge` does (lora_merge.entry.main), pausing at three moments: just after the
# output is published, while the summary is printed, and while the interpreter exits (after main returned).
# At each it creates `paused-N` and waits until the test creates `go-N`.
CHILD = textwrap.dedent("""
    import atexit, os, sys, time
    from pathlib import Path

    mark = Path(sys.argv[1])
    pauses = []

    def wait_here():
        n = len(pauses)
        pauses.append(n)
        (mark / f"paused-{n}").touch()
        deadline = time.monotonic() + 60
        while not (mark / f"go-{n}").exists() and time.monotonic() < deadline:
            time.sleep(0.005)

    from lora_merge import cli
    from lora_merge.files import staged_dir
    real_publish, real_summary = staged_dir.StagedOutput._publish, cli.print_summary

    def publish_then_wait(self):
        real_publish(self)
        wait_here()

    def wait_then_summary(console, result):
        wait_here()
        real_summary(console, result)

    staged_dir.StagedOutput._publish, cli.print_summary = publish_then_wait, wait_then_summary
    atexit.register(wait_here)

    from lora_merge.entry import main
    sys.argv = ["lora-merge"] + sys.argv[2:]
    sys.exit(main())
""")
MOMENTS = ("just after publishing", "while printing the summary", "while the interpreter exits")
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _default_handlers():
    for sig in HANDLED:  # the child must not inherit an ignored signal (CI started under nohup ignores SIGHUP)
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("signals", [(signal.SIGTERM,) * 3, (signal.SIGINT, signal.SIGHUP, signal.SIGINT)],
                         ids=["SIGTERM", "SIGINT-SIGHUP"])
def test_a_signal_after_publishing_is_ignored_until_exit(tmp_path, signals):
    out, mark = tmp_path / "merged", tmp_path / "mark"
    mark.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), *merge_args("tp2_fp32_filtered", out)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_handlers)
    for n, (moment, sig) in enumerate(zip(MOMENTS, signals)):
        deadline = time.monotonic() + 120
        while not (mark / f"paused-{n}").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (mark / f"paused-{n}").exists(), (moment, proc.communicate())
        proc.send_signal(sig)
        proc.send_signal(sig)  # a second one too (Ctrl-C pressed twice)
        time.sleep(0.1)  # were it not ignored, the signal would be handled by now
        assert proc.poll() is None, (moment, sig, proc.communicate())
        (mark / f"go-{n}").touch()
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, (proc.returncode, err)
    assert "interrupted" not in err and "error" not in err, err
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged.")] == []


def test_the_cli_called_in_process_gives_the_handlers_back(tmp_path):
    """Only the process's entry point keeps signals ignored until exit; lora_merge.cli.main (as a program
    embedding it, or these tests, call it) restores what it found."""
    before = {sig: signal.getsignal(sig) for sig in HANDLED}
    assert main(merge_args("tp2_fp32_filtered", tmp_path / "out")) == 0
    assert {sig: signal.getsignal(sig) for sig in HANDLED} == before


def test_the_python_api_never_touches_signal_handling(tmp_path):
    import lora_merge

    before = {sig: signal.getsignal(sig) for sig in HANDLED}
    args = merge_args("tp2_fp32_filtered", tmp_path / "out")
    lora_merge.merge(base=args[1], lora=args[3], hf_ref=args[5], out=args[7], warn=lambda message: None)
    assert {sig: signal.getsignal(sig) for sig in HANDLED} == before
