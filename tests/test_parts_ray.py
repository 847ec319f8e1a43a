"""docs/parts.md's Ray example, run as written on a local Ray cluster: the parts as Ray tasks in worker
processes, then finish; the output is the one-process output byte for byte."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import fixture_root, quiet
from lora_merge import api
from test_parts import assert_same_output

ray = pytest.importorskip("ray")

DOC = Path(__file__).parents[1] / "docs" / "parts.md"


def documented_ray_example() -> str:
    text = DOC.read_text()
    section = text[text.index("## Ray"):]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_documented_ray_example_merges_in_parts(tmp_path):
    fixture = fixture_root("mixtral_ep2")
    given = dict(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref")
    one = tmp_path / "one" / "merged"
    one.parent.mkdir()
    api.merge(**given, out=one, max_shard_size="1MB", warn=quiet)
    assert len(list(one.glob("model-*.safetensors"))) >= 2
    out = tmp_path / "merged"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        scope = {"BASE": str(given["base"]), "LORA": str(given["lora"]), "HF_REF": str(given["hf_ref"]),
                 "OUT": str(out), "PARTS": 2, "MAX_SHARD_SIZE": "1MB"}
        exec(compile(documented_ray_example(), str(DOC), "exec"), scope)
    finally:
        ray.shutdown()
    assert sorted(f for files in scope["files"] for f in files) == sorted(p.name for p in one.glob("model-*"))
    assert scope["finished"].parts == 2
    assert_same_output(one, out)
