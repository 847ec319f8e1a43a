"""lora_merge.writers.megatron_dist: small models' tensors written with known random values through the
writer (the bytes scattered into its regions as the merge does, out of order), then read back
(a) by the project's own torch_dist reader, bit for bit, every archive's CRC32 checked;
(b) by the real megatron-core 0.16.1: `dist_checkpointing.load(model.sharded_state_dict(), dir)` into
    GPTModels at TP=1 (EP=2 for the MoE models) and at TP=2, then `load_state_dict(strict=True)`, every
    parameter compared with its slice of the value written; and the layout held against Megatron's own
    `dist_checkpointing.save` of the same model (same keys, global shapes, chunk grid but fc1's two halves);
(c) by torch.distributed.checkpoint's own FileSystemReader and load, without a process group.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import importlib.util
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_dist_worker as meg  # noqa: E402  (the model table; Megatron is imported in its subprocess only)

from lora_merge.errors import MergeError  # noqa: E402
from lora_merge.writers.megatron_dist import (CONTENT_METADATA, DistCheckpointWriter, DistModelFacts,  # noqa: E402
                                              DistTensor)

DTYPES = {"dense_tied_qknorm": torch.bfloat16}  # the others float32; router and expert bias float32 always
ITERATION = 7
# the reader presents norms under TransformerEngine's names (what torch_dist stores for the local spec)
READER_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                  "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def facts(name: str) -> DistModelFacts:
    return DistModelFacts.from_args(make_args(name))


def make_args(name: str) -> argparse.Namespace:
    s = meg.MODELS[name]
    moe = s.get("moe") or {}
    return argparse.Namespace(
        num_layers=s["layers"], hidden_size=meg.H, num_attention_heads=s["heads"], tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, num_experts=moe.get("experts"),
        moe_layer_freq=moe.get("freq", 1), multi_latent_attention="mla" in s, transformer_impl="local",
        untie_embeddings_and_output_weights=not s["tied"], padded_vocab_size=meg.VOCAB, ckpt_format="torch_dist",
        no_save_optim=True, no_save_rng=True, iteration=ITERATION)


def tensor_dtype(model: str, name: str) -> torch.dtype:
    if name.endswith(("mlp.router.weight", "mlp.router.expert_bias")):
        return torch.float32
    return DTYPES.get(model, torch.float32)


def values_of(model: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in meg.canonical_tensors(model):
        g = torch.Generator().manual_seed(zlib.crc32(f"{model}:{name}".encode()))
        out[name] = torch.randn(shape, generator=g).to(tensor_dtype(model, name))
    return out


def scatter(writer: DistCheckpointWriter, name: str, value: torch.Tensor) -> None:
    """What the merge does: rows of the tensor written into its region piece by piece, the last piece first."""
    fd, offset = writer.region(name)
    data = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    row = len(data) // value.shape[0] if value.dim() else len(data)
    pieces = [(i, data[i:i + 3 * row]) for i in range(0, len(data), 3 * row)]
    for start, piece in reversed(pieces):
        assert os.pwrite(fd, piece, offset + start) == len(piece)


def write_model(model: str, iter_dir: Path, file_bytes: int | None = None) -> dict[str, torch.Tensor]:
    values = values_of(model)
    tensors = [DistTensor(n, tuple(v.shape), v.dtype) for n, v in values.items()]
    common = {"args": make_args(model), "checkpoint_version": 3.0, "iteration": ITERATION}
    kw = {} if file_bytes is None else {"file_bytes": file_bytes}
    writer = DistCheckpointWriter(iter_dir, tensors, common, facts(model), **kw)
    for i, (name, value) in enumerate(reversed(list(values.items()))):
        scatter(writer, name, value)
        if i % 2:
            writer.done(name)  # the others' CRC32s are taken by finish()
    writer.finish()
    return values


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = {}
    for model in meg.MODELS:
        ckpt = root / model
        ckpt.mkdir()
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        # small files for the stacked dense model: several .distcp files
        values = write_model(model, ckpt / f"iter_{ITERATION:07d}", 20_000 if model == "dense_bias" else None)
        torch.save(values, root / f"{model}.values.pt")
        out[model] = (ckpt, values)
    return root, out


# --- the writer's own files ----------------------------------------------------------------------------

def test_files_written(written):
    _, models = written
    it = models["dense_bias"][0] / f"iter_{ITERATION:07d}"
    names = sorted(os.listdir(it))
    assert names[:3] == [".metadata", "__0_0.distcp", "__0_1.distcp"] and names[-2:] == ["common.pt", "metadata.json"]
    assert json.loads((it / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    common = torch.load(it / "common.pt", weights_only=False)
    assert common["content_metadata"] == CONTENT_METADATA and common["checkpoint_version"] == 3.0
    assert common["iteration"] == ITERATION and common["args"].num_layers == 2


# --- (a) the project's reader ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", list(meg.MODELS))
def test_project_reader_reads_every_tensor_bit_for_bit(written, model):
    from lora_merge.readers.checkpoint import joined_ref
    from lora_merge.readers.torch_dist import read_torch_dist

    ckpt_dir, values = written[1][model]
    ckpt = read_torch_dist(ckpt_dir)
    seen = set()
    for name, pieces in ckpt.params.items():
        layer = name.split(".", 3)
        canonical = name
        if name.startswith("decoder.layers.") and layer[3] in READER_ALIASES:
            canonical = ".".join(layer[:3] + [READER_ALIASES[layer[3]]])
        ref = joined_ref(list(pieces.refs), pieces.dim)
        got = ref.load()
        want = values[canonical]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        for piece in pieces.refs:
            for record in piece.records():
                record.check_crc()
        seen.add(canonical)
    assert seen == set(values)
    assert not ckpt.lora and ckpt.skipped["_extra_state"] > 0


# --- (c) torch.distributed.checkpoint's own reader -------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model", list(meg.MODELS))
def test_torch_dcp_reads_it_without_megatron(written, model):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    ckpt_dir, values = written[1][model]
    it = ckpt_dir / f"iter_{ITERATION:07d}"
    meta = FileSystemReader(str(it)).read_metadata()
    state = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.full(tuple(md.size), float("nan"), dtype=md.properties.dtype)
        else:
            assert isinstance(md, BytesStorageMetadata) and "._extra_state/shard_" in key
            state[key] = io.BytesIO()
    dcp.load(state, storage_reader=FileSystemReader(str(it)), no_dist=True)
    for key, value in state.items():
        if isinstance(value, io.BytesIO):
            value.seek(0)
            assert torch.load(value, weights_only=True) == [None]
    f = facts(model)
    for name, want in values.items():
        key, index = name, ()
        if name.startswith("decoder.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest in ("input_layernorm.weight", "pre_mlp_layernorm.weight") and not f.multi_latent_attention:
                rest = {v: k for k, v in READER_ALIASES.items()}[rest]
            if rest.startswith("mlp.experts."):
                _, _, e, rest = rest.split(".", 3)
                rest, index = f"mlp.experts.experts.{rest}", (int(e),)
            key = f"decoder.layers.{rest}" if not f.per_layer_keys else f"decoder.layers.{layer}.{rest}"
            index = index if f.per_layer_keys else (int(layer), *index)
        got = state[key][index] if index else state[key]
        assert torch.equal(got, want), name


# --- (b) the real Megatron ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_job(written, tmp_path_factory):
    # test dependencies (pyproject's test extra): required, and looked up without importing megatron into this
    # process (importing it widens torch's weights_only allow-list for every later test)
    for module in ("megatron.core", "psutil"):  # psutil: dist_checkpointing.save's helper process
        assert importlib.util.find_spec(module) is not None, f"{module} is not installed (pip install -e '.[test]')"
    root, models = written
    out = tmp_path_factory.mktemp("megatron")
    own = {m: str(out / f"megatron_{m}") for m in models}
    for d in own.values():
        os.mkdir(d)
    ours = {m: str(ckpt / f"iter_{ITERATION:07d}") for m, (ckpt, _) in models.items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {"port": port, "out": str(out), "values": {m: str(root / f"{m}.values.pt") for m in models},
           "steps": [{"mode": "save", "tp": 1, "ep": 1, "models": own},
                     {"mode": "load", "tp": 1, "ep": 2, "models": ours},
                     {"mode": "load", "tp": 2, "ep": 1, "models": ours}]}
    (out / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(HERE / "megatron_dist_worker.py"), str(out / "job.json")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return own, ours, reports, models


@pytest.mark.parametrize("layout", ["tp1 ep2", "tp2 ep1"])
@pytest.mark.parametrize("model", list(meg.MODELS))
def test_megatron_loads_every_parameter(megatron_job, model, layout):
    """Every GPTModel parameter (on some rank) was loaded from the checkpoint and equals its slice of the
    value written; the worker checked each one, and together they cover every tensor written."""
    _, _, reports, models = megatron_job
    checked = set()
    for report in reports:
        checked |= set(report[f"{model} {layout}"])
    assert checked == set(models[model][1])


def _layout(it_dir: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(it_dir).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = (tuple(md.size), md.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        else:
            out[key] = "bytes"
    return out


def _joined_halves(chunks):
    """Megatron's swiglu factory saves fc1 as a gate chunk and an up chunk; as one chunk, they are one."""
    joined, rest = [], list(chunks)
    while rest:
        off, size = rest.pop(0)
        other = next((c for c in rest if c[0][:-2] == off[:-2] and c[0][-2] == off[-2] + size[-2]
                      and c[1][:-2] == size[:-2] and c[1][-1] == size[-1]), None)
        if other is not None:
            rest.remove(other)
            size = (*size[:-2], size[-2] + other[1][-2], size[-1])
        joined.append((off, size))
    return sorted(joined)


@pytest.mark.parametrize("model", list(meg.MODELS))
def test_layout_is_megatrons_own(megatron_job, model):
    """Same keys (_extra_state entries included), global shapes and chunks as Megatron's own TP=1 save, fc1's
    gate and up chunks being one chunk here."""
    own, ours, _, _ = megatron_job
    theirs, mine = _layout(own[model]), _layout(ours[model])
    assert sorted(mine) == sorted(theirs)
    for key, entry in theirs.items():
        if entry == "bytes":
            assert mine[key] == "bytes", key
            continue
        shape, dtype, chunks = entry
        assert mine[key][0] == shape, key
        if DTYPES.get(model, torch.float32) == torch.float32:
            assert mine[key][1] == dtype, key
        want = _joined_halves(chunks) if "linear_fc1.weight" in key else chunks
        assert mine[key][2] == want, key


# --- refusals and cleanup ------------------------------------------------------------------------------

def _tensors(model: str):
    return [DistTensor(n, s, torch.float32) for n, s in meg.canonical_tensors(model)]


def test_refuses_inconsistent_inputs(tmp_path):
    common = {"args": make_args("moe_first_dense")}
    tensors = _tensors("moe_first_dense")
    with pytest.raises(MergeError, match="stacked layer keys: layer 1 differs from layer 0"):
        DistCheckpointWriter(tmp_path / "a", tensors, common, DistModelFacts(3, frozenset({1, 2}), 4))
    with pytest.raises(MergeError, match="layer 0 is dense"):
        DistCheckpointWriter(tmp_path / "b", [DistTensor("decoder.layers.0.mlp.router.weight", (4, 32), torch.float32)],
                             common, DistModelFacts(3, frozenset({1, 2}), 4, True))
    missing = [t for t in tensors if t.name != "decoder.layers.2.mlp.experts.3.linear_fc2.weight"]
    with pytest.raises(MergeError, match=r"layer 2 has no linear_fc2.weight for experts \[3\]"):
        DistCheckpointWriter(tmp_path / "c", missing, common, facts("moe_first_dense"))
    no_experts = [t for t in tensors if not t.name.startswith("decoder.layers.2.mlp.experts.")]
    with pytest.raises(MergeError, match="MoE layer 2 has experts' nothing"):
        DistCheckpointWriter(tmp_path / "c", no_experts, common, facts("moe_first_dense"))
    with pytest.raises(MergeError, match="is multi-latent attention, but"):
        DistCheckpointWriter(tmp_path / "c", _tensors("mla_moe"), common,
                             DistModelFacts(2, frozenset({1}), 4, True, multi_latent_attention=False))
    dense = _tensors("dense_bias")
    with pytest.raises(MergeError, match="no tensors of layer 2"):
        DistCheckpointWriter(tmp_path / "d", dense, {}, DistModelFacts(3))
    twice = dense + [DistTensor("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (32,), torch.float32)]
    with pytest.raises(MergeError, match="given twice"):
        DistCheckpointWriter(tmp_path / "e", twice, {}, DistModelFacts(2))
    with pytest.raises(MergeError, match="transformer_impl 'inference_optimized': expected one of local, "
                                         "transformer_engine"):
        DistCheckpointWriter(tmp_path / "f", dense, {}, DistModelFacts(2, transformer_impl="inference_optimized"))
    with pytest.raises(MergeError, match="another key layout"):
        DistCheckpointWriter(tmp_path / "g", dense, {"content_metadata": {"singleton_local_shards": True}},
                             DistModelFacts(2))
    assert not any(tmp_path.iterdir())  # nothing created by a refused plan


def test_abort_removes_what_it_created(tmp_path):
    it = tmp_path / "iter_0000001"
    writer = DistCheckpointWriter(it, _tensors("dense_bias"), {}, DistModelFacts(2))
    assert (it / "__0_0.distcp").is_file()
    writer.abort()
    assert not it.exists()
    it.mkdir()
    (it / "mine").write_text("x")
    writer = DistCheckpointWriter(it, _tensors("dense_bias"), {}, DistModelFacts(2))
    writer.abort()
    assert os.listdir(it) == ["mine"]


def test_never_overwrites(tmp_path):
    it = tmp_path / "iter_0000001"
    it.mkdir()
    (it / "__0_0.distcp").write_bytes(b"not ours")
    with pytest.raises(FileExistsError):
        DistCheckpointWriter(it, _tensors("dense_bias"), {}, DistModelFacts(2))
    assert sorted(os.listdir(it)) == ["__0_0.distcp"] and (it / "__0_0.distcp").read_bytes() == b"not ours"


def test_facts_from_megatron_args():
    ns = argparse.Namespace
    assert DistModelFacts.from_args(ns(num_layers=4)) == DistModelFacts(4)
    assert DistModelFacts.from_args(ns(num_layers=4, num_experts=8, moe_layer_freq=1)) == \
        DistModelFacts(4, frozenset(range(4)), 8, False)
    assert DistModelFacts.from_args(ns(num_layers=4, num_experts=8, moe_layer_freq=2)) == \
        DistModelFacts(4, frozenset({0, 2}), 8, True)
    assert DistModelFacts.from_args(ns(num_layers=3, num_experts=8, moe_layer_freq=[0, 1, 1],
                                       multi_latent_attention=True)) == DistModelFacts(3, frozenset({1, 2}), 8, True, True)
    with pytest.raises(MergeError, match="moe_layer_freq"):
        DistModelFacts.from_args(ns(num_layers=3, num_experts=8, moe_layer_freq=[0, 1]))
