"""CPU seconds spent in each stage of a run (merge workers, writer, disk I/O, sha256, CRC32, the thread that
plans and dispatches), for the benchmark's per-stage profile: each stage's threads add their own
`time.thread_time()` here when they end. With LORA_MERGE_STAGE_TIMES=FILE the command writes the totals
to FILE as JSON when it exits."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

_lock = threading.Lock()
_totals: dict[str, float] = defaultdict(float)
ENV = "LORA_MERGE_STAGE_TIMES"


def charge(stage: str, seconds: float) -> None:
    with _lock:
        _totals[stage] += seconds


def charge_thread(stage: str) -> None:
    """Charge the calling thread's whole CPU time to `stage` (call it as the thread ends)."""
    charge(stage, time.thread_time())


def totals() -> dict[str, float]:
    with _lock:
        return dict(_totals)


def write_if_asked() -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "w") as f:
            json.dump(totals(), f, indent=2)
