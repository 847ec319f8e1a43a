"""Several output files written at once (runs/lanes.py, writers/safetensors_stream.ShardLanes): where a plan
may be cut into lanes, the same bytes for any number of lanes (dense, MoE, DeepSeek MLA, an HF base with a PEFT
adapter, a multimodal release's own names), and a failure in any lane leaving nothing behind."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import lora_merge
from helpers import copied_args, copy_fixture, fixture_root, rank_files, set_value
from lora_merge import merge_pipeline, options
from lora_merge.cli import main
from lora_merge.runs.lanes import split_into_lanes
from lora_merge.writers import safetensors_stream


def _plan(*task_files, quantized=None):
    """A plan whose task i writes one tensor into each file of task_files[i]."""
    tasks = [SimpleNamespace(outputs=[SimpleNamespace(name=f"t{i}.f{f}") for f in files])
             for i, files in enumerate(task_files)]
    file_of = {o.name: int(o.name.rsplit(".f", 1)[1]) for t in tasks for o in t.outputs}
    return SimpleNamespace(tasks=tasks, quantized=quantized or {}, mxfp4={}), file_of


def test_lanes_are_cut_only_where_no_task_writes_on_both_sides():
    plan, file_of = _plan([0], [0, 1], [1], [2], [3])  # task 1 straddles files 0 and 1
    two = split_into_lanes(plan, file_of, [1, 1, 1, 1], 2)
    assert two.lane_of_file == [0, 0, 1, 1]
    assert two.tasks == [plan.tasks[:3], plan.tasks[3:]]
    # four wanted: the boundary before file 1 cannot be used, so three
    three = split_into_lanes(plan, file_of, [1, 1, 1, 1], 4)
    assert three.lane_of_file == [0, 0, 1, 2]
    assert [len(t) for t in three.tasks] == [3, 1, 1]


def test_lanes_are_about_equal_in_bytes():
    plan, file_of = _plan(*([f] for f in range(6)))
    assert split_into_lanes(plan, file_of, [5] * 6, 3).lane_of_file == [0, 0, 1, 1, 2, 2]
    assert split_into_lanes(plan, file_of, [9, 1, 1, 1, 1, 1], 2).lane_of_file == [0, 1, 1, 1, 1, 1]
    assert split_into_lanes(plan, file_of, [1] * 6, 9).lane_of_file == [0, 1, 1, 2, 3, 3]  # at most MAX_LANES (4)


def test_one_lane_where_the_plan_cannot_be_cut():
    plan, file_of = _plan([0], [0, 1], [1, 2])
    assert split_into_lanes(plan, file_of, [1, 1, 1], 3) is None  # every boundary straddled
    plan, file_of = _plan([0], [1])
    assert split_into_lanes(plan, file_of, [1, 1], 1) is None  # one lane asked for
    plan, file_of = _plan([0], [1], quantized={"t0.f0": (128, 128)})
    assert split_into_lanes(plan, file_of, [1, 1], 2) is None  # FP8 scales are written beside their weights
    plan, file_of = _plan([1], [0])
    assert split_into_lanes(plan, file_of, [1, 1], 2) is None  # not in file order
    plan, file_of = _plan([0], [0])
    assert split_into_lanes(plan, file_of, [1], 2) is None  # one file


def _digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.is_file() and p.name != "README.md"}  # the card names the output directory


def _card_hashes(out: Path) -> str:
    return "\n".join(line for line in (out / "README.md").read_text().splitlines() if "sha256" in line.lower())


@pytest.fixture
def lanes_used(monkeypatch):
    """How many lanes each run wrote at once."""
    used = []
    real = safetensors_stream.ShardLanes.__init__

    def spy(self, writer, lane_of_file):
        used.append(max(lane_of_file) + 1)
        real(self, writer, lane_of_file)
    monkeypatch.setattr(safetensors_stream.ShardLanes, "__init__", spy)
    return used


def _hf_base_and_adapter(base_model, tmp_path):
    root = fixture_root("tp2pp2_fp32_filtered")
    adapter = tmp_path / "adapter"
    lora_merge.export_adapter(lora=root / "lora", hf_ref=root / "hf_ref", out=adapter, warn=lambda m: None)
    return base_model("tp2pp2_fp32_filtered"), adapter, root / "hf_ref"


@pytest.mark.parametrize("fixture", ["tp2pp2_bf16_unfiltered", "qwen3moe_grouped_ep2", "deepseek_v3_tp2etp1_ep2",
                                     "hf+peft"])
def test_every_lane_count_writes_the_same_bytes(fixture, tmp_path, monkeypatch, lanes_used, base_model):
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 4096)  # pieces small enough to interleave
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)  # shards small enough for these tiny models to fill several
    if fixture == "hf+peft":
        base, lora, hf_ref = _hf_base_and_adapter(base_model, tmp_path)
    else:
        root = fixture_root(fixture)
        base = root / "base" if (root / "base").exists() else None
        lora, hf_ref = root / "lora", root / "hf_ref"
    outputs, cards = {}, {}
    for workers in (1, 2, 3, 4):
        out = tmp_path / f"w{workers}"
        lora_merge.merge(base=base, lora=lora, hf_ref=hf_ref, out=out, workers=workers, max_shard_size="40KB",
                         warn=lambda m: None)
        outputs[workers], cards[workers] = _digests(out), _card_hashes(out)
    assert sum(name.endswith(".safetensors") for name in outputs[1]) >= 4
    assert lanes_used and min(lanes_used) >= 2 and max(lanes_used) >= 3  # (one worker: one lane)
    assert outputs[1] == outputs[2] == outputs[3] == outputs[4]
    assert cards[1] == cards[2] == cards[3] == cards[4] and cards[1]  # every file's sha256, as hashed while written


def test_a_multimodal_release_is_written_in_lanes_under_its_own_names(tmp_path, lanes_used):
    """A Gemma 3 release (its language model under `language_model.model.*`, a vision tower) with a PEFT adapter on
    both: in lanes, as PEFT's merge_and_unload merges it, and the bytes of a one-lane run."""
    from peft import LoraConfig
    from transformers import Gemma3Config

    from helpers import assert_merges_as_peft, random_hf_model
    from test_multimodal import VISION, _image_text_to_text

    base = random_hf_model(Gemma3Config(
        text_config=dict(vocab_size=12000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         sliding_window=8),
        vision_config=VISION, mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7,
        architectures=["Gemma3ForConditionalGeneration"]), tmp_path / "base", auto=_image_text_to_text())
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "out_proj", "fc1", "down_proj"])
    assert_merges_as_peft(base, lora, 3, tmp_path, auto=_image_text_to_text(), workers=3, max_shard_size="1MB")
    assert lanes_used and lanes_used[0] >= 2
    one = tmp_path / "one-lane"
    lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=base, out=one, dtype="float32", workers=1,
                     max_shard_size="1MB", warn=lambda m: None)
    assert _digests(one) == _digests(tmp_path / "out") and len(lanes_used) == 1


def test_a_failure_in_a_later_lane_stops_the_run_and_publishes_nothing(tmp_path, capsys, monkeypatch, lanes_used):
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    set_value(rank_files(root / "base")[1], "decoder.layers.3.mlp.linear_fc2.weight", (5, 1), float("inf"))
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--workers", "4", "--max-shard-size", "40KB", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.3.mlp.down_proj.weight" in err and "non-finite" in err
    assert lanes_used and lanes_used[0] >= 2
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    assert not [t for t in threading.enumerate() if t.name.startswith(("lora-merge-merge", "lora-merge-sha256",
                                                                       "lora-merge-io"))]


def test_a_lane_holding_only_an_empty_tensor_still_writes_its_file(tmp_path):
    """A shard may hold nothing but a zero-byte tensor; the lane that has only it writes it all the same."""
    import json

    import torch

    from lora_merge.writers.safetensors_stream import PlannedTensor, ShardedSafetensorsWriter, ShardLanes

    data = {"a.weight": torch.ones(10, 10), "e.bias": torch.zeros(0, 3), "b.weight": torch.ones(10, 10),
            "c.weight": torch.ones(10, 10)}
    planned = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in data.items()]
    outputs = {}
    for lanes in (False, True):
        out = tmp_path / f"lanes{lanes}"
        out.mkdir()
        writer = ShardedSafetensorsWriter(out, planned, max_shard_bytes=100, hash_files=True)
        assert [[t.name for t in shard] for shard in writer.shards] == [["a.weight"], ["e.bias"], ["b.weight"],
                                                                         ["c.weight"]]
        sink = ShardLanes(writer, [0, 1, 2, 3]) if lanes else writer
        sink.start(out)
        for name, tensor in data.items():
            if tensor.numel():  # the merge yields no rows for an empty tensor
                sink.write(name, tensor)
        files = sink.finish()
        assert all((out / f).is_file() for f in files)
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["e.bias"] == \
            "model-00002-of-00004.safetensors"
        outputs[lanes] = (_digests(out), writer.sha256)
    assert outputs[True] == outputs[False]


def test_parts_and_resumed_runs_write_in_lanes_the_one_process_bytes(tmp_path, monkeypatch, lanes_used):
    """A part's files (and a --resume run's, part 0/1) are written in lanes too, balanced over the files that
    run writes: the bytes of a one-process, one-lane run, the part manifests' sha256 as the card's."""
    monkeypatch.setattr(merge_pipeline, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)
    writing = []  # how many files each lane of each run writes
    real_finish = safetensors_stream.ShardLanes.finish

    def finish(self):
        writing.append([len(lane.part.files) for lane in self.lanes])
        return real_finish(self)
    monkeypatch.setattr(safetensors_stream.ShardLanes, "finish", finish)
    root = fixture_root("tp2pp2_fp32_filtered")
    given = dict(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", max_shard_size="40KB",
                 warn=lambda m: None)
    for where in ("one", "parts", "resumed"):
        (tmp_path / where).mkdir()
    one = tmp_path / "one" / "merged"  # (the card names the output directory: the same name everywhere)
    lora_merge.merge(out=one, workers=1, **given)
    assert not lanes_used
    parts = tmp_path / "parts" / "merged"
    for index in (1, 0):
        lora_merge.merge(out=parts, workers=3, part=f"{index}/2", **given)
    assert len(lanes_used) == 2 and min(lanes_used) >= 2
    lora_merge.finish(parts)
    resumed = tmp_path / "resumed" / "merged"
    lora_merge.merge(out=resumed, workers=4, resume=True, **given)
    assert len(lanes_used) == 3 and lanes_used[-1] >= 3
    assert len(writing) == 3 and all(min(files) >= 1 for files in writing), writing  # no lane idle
    for out in (parts, resumed):
        assert _digests(out) == _digests(one)
        assert _card_hashes(out) == _card_hashes(one)
