"""The command keeps freed chunks for reuse instead of mapping and zeroing fresh pages for every one."""

import subprocess
import sys

import pytest

CHURN = """
import resource, sys, torch
from lora_merge.allocator import reuse_freed_chunks
if sys.argv[1] == "tuned":
    assert reuse_freed_chunks()
def churn():
    for _ in range(10):  # a 40 MB float32 block, filled and freed: glibc's default maps it afresh each time
        torch.empty(10 << 20, dtype=torch.float32).fill_(1.0)
churn()  # the first round may grow the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], check=True, capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_chunks_are_reused_not_faulted_in_again():
    assert faults("default") > 10 * 5000  # ~10000 fresh pages a block
    assert faults("tuned") < 1000


def test_the_command_tunes_the_allocator(monkeypatch):
    from lora_merge import entry

    calls = []
    monkeypatch.setattr(entry, "reuse_freed_chunks", lambda: calls.append(True))
    monkeypatch.setattr("lora_merge.cli.main", lambda: 0)
    assert entry.main() == 0 and calls == [True]
