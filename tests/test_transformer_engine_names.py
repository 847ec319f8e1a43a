"""TransformerEngine-spec legacy checkpoints, built from a real fixture by the documented renaming
(TransformerEngine does not run on CPU): the norms live inside the next linear as `layer_norm_weight`,
and every linear carries an `_extra_state` that TE pickles as an `io.BytesIO`."""

import io

import torch

from helpers import FIXTURES, copied_args, copy_fixture, rank_files, rewrite
from lora_merge.cli import main
from test_end_to_end import hf_logits

NAME = "tp2_fp32_filtered"
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def as_transformer_engine(state):
    model = {}
    for key, value in state["model"].items():
        for local, te in TE_NAMES.items():
            key = key.replace(local, te)
        if key.endswith("._extra_state"):
            value = io.BytesIO(b"fp8 metadata")
        model[key] = value
    state["model"] = model


def test_transformer_engine_names_merge_to_the_same_model(tmp_path):
    root = copy_fixture(NAME, tmp_path)
    for f in rank_files(root / "base"):
        rewrite(f, as_transformer_engine)
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    ref = torch.load(FIXTURES / NAME / "logits.pt", weights_only=True)
    assert (hf_logits(out, ref["input_ids"]) - ref["logits_lora"]).abs().max() <= 1e-4
