"""scripts/demo.py, as the README tells a newcomer to run it: the merged model matches Megatron, answers a text
prompt unlike the base, prints no loading bars, and leaves nothing behind — also when interrupted."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _start(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_demo_answers_a_prompt_and_leaves_nothing_behind(tmp_path):
    demo = _start(tmp_path)
    out, err = demo.communicate(timeout=300)
    assert demo.returncode == 0, out + err
    assert out.splitlines()[-1] == "demo: OK, the merged model is the trained model", out
    answers = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()
               if line.startswith(("  base model:", "  merged model:"))}
    assert answers["merged model"] not in ("", "''") and answers["merged model"] != answers["base model"], answers
    assert "token ids []" not in out
    # no loading bars, no library warnings; the toy model has no Hub id, which lora-merge says once
    lines = err.splitlines()
    assert len(lines) <= 1 and all("names no Hub model" in line for line in lines), err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_demo_removes_its_directory(tmp_path):
    demo = _start(tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("lora-merge-demo-*/hf_ref")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert demo.poll() is None, demo.communicate()
    demo.send_signal(signal.SIGINT)
    out, err = demo.communicate(timeout=120)
    assert demo.returncode == 130 and "demo: interrupted" in err, (demo.returncode, out, err)
    assert list(tmp_path.iterdir()) == []
