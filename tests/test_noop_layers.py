"""MindSpeed noop layers, built by the documented rules from a real fixture (megatron-core cannot make them).

MindSpeed's `--noop-layers` counts the noop layers in `num_layers`; they stay in each stage's module list
(so they take local indices) but hold no parameters. We rewrite the real TP=2 x PP=2 fixture as a 6-layer
run with noop layers 1 and 4: stage 0 holds globals 0,1,2 (local 1 is noop), stage 1 globals 3,4,5 (local
1 is noop). The real layers are the same four, so the merged model must still compute the Megatron logits.
"""

import re

import torch

from helpers import FIXTURES, copied_args, copy_fixture, rank_files, rewrite
from lora_merge.cli import main
from test_end_to_end import hf_logits

NAME = "tp2pp2_fp32_filtered"


def as_noop_run(state):
    state["args"].num_layers = 6
    state["args"].noop_layers = {1, 4}
    model = state["model"]
    renamed = {}
    for key, value in model.items():
        # local layer 1 moves to local 2: local 1 is now the noop layer
        renamed[re.sub(r"^decoder\.layers\.1\.", "decoder.layers.2.", key)] = value
    state["model"] = renamed


def test_noop_layers_are_skipped_in_numbering(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    for ckpt in ("base", "lora"):
        for f in rank_files(root / ckpt):
            rewrite(f, as_noop_run)
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    ref = torch.load(FIXTURES / NAME / "logits.pt", weights_only=True)
    assert (hf_logits(out, ref["input_ids"]) - ref["logits_lora"]).abs().max() <= 1e-4

    assert main(["inspect", str(root / "base")]) == 0
    assert "noop_layers={1, 4}" in capsys.readouterr().out
