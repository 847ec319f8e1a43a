"""The torch_dist reader against torch.distributed.checkpoint itself: what DCP saves, we read back
bit-identically, per layer, without a process group; a crafted .metadata never runs code."""

import argparse
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lora_merge.errors import MergeError
from lora_merge.readers.detect import open_checkpoint
from lora_merge.readers.torch_dist import read_metadata


@pytest.fixture()
def saved(tmp_path):
    it = tmp_path / "ckpt" / "iter_0000007"
    it.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    g = torch.Generator().manual_seed(0)
    state = {
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(3, 8, 12, generator=g),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(3, 8, generator=g).to(torch.bfloat16),
        "embedding.word_embeddings.weight": torch.randn(20, 8, generator=g)[::1, :],
        "decoder.layers.self_attention.linear_proj._extra_state": torch.zeros(3, 2, dtype=torch.uint8),
    }
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(it)), no_dist=True)
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_layers=3)
    torch.save({"args": args, "iteration": 7}, it / "common.pt")
    return tmp_path / "ckpt", state


def test_reads_what_dcp_saved_layer_by_layer(saved):
    root, state = saved
    ckpt = open_checkpoint(root)
    assert ckpt.format == "torch_dist" and ckpt.iteration == "7" and ckpt.tp == 1
    assert "TP=2" in ckpt.note
    for layer in range(3):
        ref = ckpt.params[f"decoder.layers.{layer}.mlp.linear_fc2.weight"][0]
        assert ref.shape == (8, 12) and ref.mapped
        assert torch.equal(ref.load(), state["decoder.layers.mlp.linear_fc2.weight"][layer])
        norm = ckpt.params[f"decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight"][0].load()
        assert norm.dtype == torch.bfloat16
        assert torch.equal(norm, state["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][layer])
    emb = ckpt.params["embedding.word_embeddings.weight"][0].load()
    assert torch.equal(emb, state["embedding.word_embeddings.weight"])
    assert not any("_extra_state" in name for name in ckpt.params)
    assert ckpt.skipped["_extra_state"] == 1


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_without_running(saved, tmp_path):
    root, _ = saved
    marker = tmp_path / "pwned"
    meta = root / "iter_0000007" / ".metadata"
    meta.write_bytes(pickle.dumps({"state_dict_metadata": _Payload(marker)}))
    with pytest.raises(MergeError, match="refusing to load.*system"):
        read_metadata(meta)
    assert not marker.exists()


def test_truncated_distcp_is_a_clear_error(saved):
    root, _ = saved
    distcp = next((root / "iter_0000007").glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(MergeError, match="past the end of the file"):
        open_checkpoint(root)

