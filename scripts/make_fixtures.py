#!/usr/bin/env python
"""Generate the committed test fixtures with the REAL megatron-core and PEFT 0.7.1.

    python scripts/make_fixtures.py --out tests/fixtures

What it does, per fixture (see FIXTURES below):

* spawns TP*PP ranks (torch.multiprocessing, gloo, CPU), builds a Megatron-Core ``GPTModel`` with
  ``get_gpt_layer_local_spec`` (RMSNorm, rope, swiglu, GQA, optional qkv bias), fills every
  parameter with seeded random values, runs the base forward pass, and saves the base checkpoint
  (legacy ``torch`` format, as ``megatron.training.checkpointing.save_checkpoint`` writes it);
* wraps the model with PEFT 0.7.1 exactly as MindSpeed-LLM does (``LoraConfig(...,
  megatron_config=<TransformerConfig>, megatron_core="megatron.core")`` + ``get_peft_model``),
  fills lora_A / lora_B with seeded random values, runs the LoRA forward pass, and saves the LoRA
  checkpoint at iteration 10 (filtered like ``--lora-ckpt-filter`` or unfiltered) plus a leftover
  iteration 5 holding different LoRA values;
* writes ``logits.pt`` (real Megatron logits, gathered over TP, passed by hand over PP, trimmed to
  the real vocabulary), ``hf_ref/`` (config, generation config, tiny tokenizer, chat template; no
  weights) and ``fixture.json``.

All values come from a canonical, TP/PP-independent set of *global* tensors (Megatron TP=1
layout), generated per tensor from a seed, and each rank's shard is sliced from them the way
Megatron / PEFT lay shards out.  So the fp32 Qwen2-like 4-layer fixtures (tp2, pp2, tp2pp2,
dist_*, vpp2, uneven) hold the same model and the same LoRA; their logits agree to float rounding.

Variants (see the FIXTURES specs): ``base_format="torch_dist"`` saves the base with
``megatron.core.dist_checkpointing.save`` as Megatron-LM's training loop does (optionally with the
``singleton_local_shards`` sharded-state-dict metadata); ``vpp`` builds that many model chunks per
pipeline rank (saved as ``model0``, ``model1``, ...; forward run chunk by chunk in the interleaved
order); ``first_stage_layers`` sets ``num_layers_in_first_pipeline_stage`` (uneven split);
``tied`` shares the embedding and output weights (the last stage keeps its own copy, synchronised
by Megatron's embedding-group all-reduce); family ``qwen3`` adds q/k layernorms and a head_dim
with heads*head_dim != hidden.

Regenerate only some fixtures with ``--only NAME ...`` (the others keep their bytes; the script is
deterministic, so regenerating an existing fixture reproduces it byte for byte).

PEFT 0.7.1 must be installed apart (PEFT >= 0.8's Megatron path is broken or different):
    pip install --no-deps --target .fixture-deps peft==0.7.1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------
# Model / fixture definitions
# --------------------------------------------------------------------------------------------

MODEL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=8,
    ffn_hidden_size=96,
    vocab_size=250,
    make_vocab_size_divisible_by=64,
    seq_length=16,
    max_position_embeddings=32,
    rotary_base=10000,
    norm_epsilon=1e-6,
)
BATCH = 2
LORA_R = 4
LORA_ALPHA = 12
ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
BASE_ITER = 1
LORA_ITER = 10
STALE_LORA_ITER = 5
INPUT_SEED = 1234

# seeds: the Qwen2-like fixtures share one base model and one LoRA; llama has its own.
FIXTURES = {
    "tp2_fp32_filtered": dict(
        tp=2, pp=1, dtype="float32", lora="filtered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000,
    ),
    "pp2_fp32_unfiltered": dict(
        tp=1, pp=2, dtype="float32", lora="unfiltered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000,
    ),
    "tp2pp2_fp32_filtered": dict(
        tp=2, pp=2, dtype="float32", lora="filtered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000,
    ),
    "tp2pp2_bf16_unfiltered": dict(
        tp=2, pp=2, dtype="bfloat16", lora="unfiltered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000,
    ),
    "tp2_llama_fp32_partial": dict(
        tp=2, pp=1, dtype="float32", lora="filtered", family="llama",
        targets=["linear_qkv", "linear_fc2"], base_seed=3000, lora_seed=4000,
    ),
    # ---- second generation: torch_dist bases, VPP, uneven PP, tied embeddings, Qwen3 ----
    "dist_tp2pp2_fp32": dict(
        tp=2, pp=2, dtype="float32", lora="filtered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000, gen=2, base_format="torch_dist",
    ),
    "dist_singleton_tp2_fp32": dict(
        tp=2, pp=1, dtype="float32", lora="filtered", family="qwen2", targets=ALL_TARGETS,
        base_seed=1000, lora_seed=2000, gen=2, base_format="torch_dist", singleton=True,
    ),
    "vpp2_fp32_filtered": dict(
        tp=1, pp=2, vpp=2, dtype="float32", lora="filtered", family="qwen2",
        targets=ALL_TARGETS, base_seed=1000, lora_seed=2000, gen=2,
    ),
    "uneven_pp2_fp32": dict(
        tp=1, pp=2, first_stage_layers=1, dtype="float32", lora="filtered", family="qwen2",
        targets=ALL_TARGETS, base_seed=1000, lora_seed=2000, gen=2,
    ),
    "tied_pp2_llama_fp32": dict(
        tp=1, pp=2, tied=True, dtype="float32", lora="unfiltered", family="llama",
        targets=ALL_TARGETS, base_seed=5000, lora_seed=6000, gen=2,
    ),
    "qwen3_tp2_fp32": dict(
        tp=2, pp=1, kv_channels=16, dtype="float32", lora="filtered", family="qwen3",
        targets=ALL_TARGETS, base_seed=7000, lora_seed=8000, gen=2,
    ),
}
STALE_SEED_OFFSET = 777  # the leftover iter_0000005 LoRA uses lora_seed + this


def padded_vocab(tp: int) -> int:
    m = MODEL["make_vocab_size_divisible_by"] * tp
    return -(-MODEL["vocab_size"] // m) * m


def dims(spec: dict) -> dict:
    """MODEL with the spec's overrides (num_layers, kv_channels)."""
    d = dict(MODEL)
    for k in ("num_layers", "kv_channels"):
        if k in spec:
            d[k] = spec[k]
    return d


def has_qkv_bias(spec: dict) -> bool:
    return spec["family"] == "qwen2"


def layer_layout(spec: dict) -> dict:
    """{(pp_rank, vp_stage): [global layer indices]} -- layers are handed out in chunk order
    (for v in VPP: for p in PP), each stage getting its count (first stage maybe uneven)."""
    L, PP, VPP = dims(spec)["num_layers"], spec["pp"], spec.get("vpp") or 1
    first = spec.get("first_stage_layers")
    if first is None:
        counts = [L // PP] * PP
    else:
        counts = [first] + [(L - first) // (PP - 1)] * (PP - 1)
    assert sum(counts) == L and all(c % VPP == 0 for c in counts), counts
    out, nxt = {}, 0
    for v in range(VPP):
        for p in range(PP):
            n = counts[p] // VPP
            out[(p, v)] = list(range(nxt, nxt + n))
            nxt += n
    return out


def ckpt_rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    if pp == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


# --------------------------------------------------------------------------------------------
# Canonical global tensors (Megatron TP=1 layout, global layer indices)
# --------------------------------------------------------------------------------------------

def _randn(torch, seed: int, name: str, shape, std: float, mean: float = 0.0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean


def canonical_base(torch, seed: int, qkv_bias: bool, vpad: int, dm: dict = MODEL,
                   qk_norm: bool = False, tied: bool = False) -> dict:
    H, F = dm["hidden_size"], dm["ffn_hidden_size"]
    NH, NG, D = dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    QKV = (NH + 2 * NG) * D
    t = {}
    # (tied: the embedding is the output layer too; a smaller scale keeps the logits moderate)
    t["embedding.word_embeddings.weight"] = _randn(torch, seed, "emb", (vpad, H), 0.1 if tied else 0.5)
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}."
        t[p + "input_layernorm.weight"] = _randn(torch, seed, p + "ln1", (H,), 0.1, 1.0)
        # global qkv, already in Megatron's group-interleaved row order [q_g | k_g | v_g] per group
        t[p + "self_attention.linear_qkv.weight"] = _randn(torch, seed, p + "qkv", (QKV, H), 0.06)
        if qkv_bias:
            t[p + "self_attention.linear_qkv.bias"] = _randn(torch, seed, p + "qkvb", (QKV,), 0.05)
        if qk_norm:  # Qwen3: RMSNorm over head_dim on q and k
            t[p + "self_attention.q_layernorm.weight"] = _randn(torch, seed, p + "qln", (D,), 0.1, 1.0)
            t[p + "self_attention.k_layernorm.weight"] = _randn(torch, seed, p + "kln", (D,), 0.1, 1.0)
        t[p + "self_attention.linear_proj.weight"] = _randn(torch, seed, p + "proj", (H, NH * D), 0.06)
        t[p + "pre_mlp_layernorm.weight"] = _randn(torch, seed, p + "ln2", (H,), 0.1, 1.0)
        # global fc1 = [gate ; up]
        t[p + "mlp.linear_fc1.weight"] = _randn(torch, seed, p + "fc1", (2 * F, H), 0.06)
        t[p + "mlp.linear_fc2.weight"] = _randn(torch, seed, p + "fc2", (H, F), 0.06)
    t["decoder.final_layernorm.weight"] = _randn(torch, seed, "lnf", (H,), 0.1, 1.0)
    if not tied:
        t["output_layer.weight"] = _randn(torch, seed, "out", (vpad, H), 0.06)
    return t


def lora_io(module: str, dm: dict = MODEL):
    """(in_features, out_features) of a targeted Megatron linear (global)."""
    H, F = dm["hidden_size"], dm["ffn_hidden_size"]
    NH, NG, D = dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    return {
        "linear_qkv": (H, (NH + 2 * NG) * D),
        "linear_proj": (NH * D, H),
        "linear_fc1": (H, 2 * F),
        "linear_fc2": (F, H),
    }[module]


def module_path(module: str) -> str:
    return ("self_attention." if module in ("linear_qkv", "linear_proj") else "mlp.") + module


def canonical_lora(torch, seed: int, targets, dm: dict = MODEL) -> dict:
    """lora_A [r, in], lora_B [out, r] per targeted module; B's rows in W's global row order."""
    t = {}
    for i in range(dm["num_layers"]):
        for m in targets:
            fin, fout = lora_io(m, dm)
            p = f"decoder.layers.{i}.{module_path(m)}."
            t[p + "lora_A.weight"] = _randn(torch, seed, p + "A", (LORA_R, fin), 0.1)
            t[p + "lora_B.weight"] = _randn(torch, seed, p + "B", (fout, LORA_R), 0.1)
    return t


def shard(torch, name: str, x, tp_rank: int, tp: int):
    """Slice rank tp_rank's shard of a canonical global tensor, as Megatron / PEFT lay it out."""
    if tp == 1:
        return x.clone()
    col0 = lambda: x.chunk(tp, dim=0)[tp_rank].clone()  # noqa: E731
    col1 = lambda: x.chunk(tp, dim=1)[tp_rank].clone()  # noqa: E731
    if name.endswith("layernorm.weight"):
        return x.clone()  # replicated
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return col0()  # vocab parallel
    is_fc1 = ".linear_fc1." in name
    if is_fc1 and (name.endswith("linear_fc1.weight") or name.endswith("lora_B.weight")):
        # swiglu: every rank holds [gate shard ; up shard]
        gate, up = x.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]]).clone()
    # MLA: Megatron-Core's local spec builds the down-projections as ColumnParallelLinear too (their output
    # is gathered before q_layernorm / kv_layernorm); TransformerEngine's spec duplicates them instead
    mla_column = (".linear_q_down_proj.", ".linear_kv_down_proj.", ".linear_q_up_proj.", ".linear_kv_up_proj.",
                  ".linear_q_proj.")
    column = ".linear_qkv." in name or is_fc1 or any(m in name for m in mla_column)
    row = ".linear_proj." in name or ".linear_fc2." in name
    if name.endswith("lora_A.weight"):
        return col1() if row else x.clone()  # row: sharded on dim 1; column: replicated
    if name.endswith("lora_B.weight"):
        return col0() if column else x.clone()  # column: sharded on dim 0; row: replicated
    if column:
        return col0()  # weight and bias, group-interleaved qkv is contiguous per rank
    if row:
        return col1()
    raise KeyError(name)


def to_local_layer(name: str, chunk_layers: list, first: bool, last: bool):
    """Canonical (global layer) name -> chunk-local name, or None if not in this model chunk
    (chunk_layers: the chunk's global layer indices; first / last: pre_process / post_process)."""
    if name.startswith("decoder.layers."):
        i = int(name.split(".")[2])
        if i not in chunk_layers:
            return None
        rest = name.split(".", 3)[3]
        return f"decoder.layers.{chunk_layers.index(i)}.{rest}"
    if name.startswith("embedding."):
        return name if first else None
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return name if last else None
    return name


# --------------------------------------------------------------------------------------------
# Checkpoint pieces that mimic megatron.training
# --------------------------------------------------------------------------------------------

def make_args(torch, spec: dict, iteration: int, world_size: int, lora: bool, lora_filter: bool,
              load: str, save: str):
    from argparse import Namespace
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    bf16 = spec["dtype"] == "bfloat16"
    qkv_bias = spec["family"] == "qwen2"
    a = Namespace(
        # parallelism
        tensor_model_parallel_size=spec["tp"],
        pipeline_model_parallel_size=spec["pp"],
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        world_size=world_size,
        data_parallel_size=1,
        rank=0,
        # model
        num_layers=MODEL["num_layers"],
        hidden_size=MODEL["hidden_size"],
        ffn_hidden_size=MODEL["ffn_hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=MODEL["num_query_groups"],
        kv_channels=MODEL["kv_channels"],
        padded_vocab_size=padded_vocab(spec["tp"]),
        make_vocab_size_divisible_by=MODEL["make_vocab_size_divisible_by"],
        add_qkv_bias=qkv_bias,
        add_bias_linear=False,
        add_dense_bias=False,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        normalization="RMSNorm",
        norm_epsilon=MODEL["norm_epsilon"],
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=MODEL["rotary_base"],
        rotary_percent=1.0,
        rotary_interleaved=False,
        rope_scaling_type=None,
        seq_length=MODEL["seq_length"],
        max_position_embeddings=MODEL["max_position_embeddings"],
        qk_layernorm=False,
        num_experts=None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        fp16=False,
        model_type=ModelType.encoder_or_decoder,
        attention_backend=AttnBackend.auto,
        transformer_impl="local",
        use_mcore_models=True,
        use_legacy_models=False,
        spec=None,
        # MindSpeed layer knobs
        noop_layers=None,
        num_layer_list=None,
        # checkpointing
        ckpt_format="torch",
        use_dist_ckpt=False,
        load=load,
        save=save,
        finetune=lora,
        no_load_optim=True,
        no_load_rng=True,
        no_save_optim=True,
        # tokenizer / training
        tokenizer_type="PretrainedFromHF",
        tokenizer_name_or_path="/data/models/tiny-hf",
        micro_batch_size=1,
        global_batch_size=2,
        train_iters=LORA_ITER,
        lr=1e-4,
        min_lr=1e-6,
        iteration=iteration,
        # LoRA (MindSpeed defaults when not fine-tuning with LoRA: r=16, alpha=32, no targets)
        lora_r=LORA_R if lora else 16,
        lora_alpha=LORA_ALPHA if lora else 32,
        lora_target_modules=list(spec["targets"]) if lora else [],
        lora_ckpt_filter=bool(lora_filter),
        lora_load=None,
        lora_fusion=False,
        lora_register_forward_hook=["word_embeddings", "input_layernorm"],
    )
    if spec.get("gen", 1) >= 2:
        # second-generation fixtures: the fields that vary, plus a few more Megatron-LM 0.16.1
        # training args (names as in megatron/training/arguments.py).  First-generation fixtures
        # keep their exact args (and bytes).
        dm = dims(spec)
        vpp = spec.get("vpp")
        dist_base = spec.get("base_format", "torch") == "torch_dist"
        fmt = "torch_dist" if (dist_base and not lora) else "torch"
        a.num_layers = dm["num_layers"]
        a.kv_channels = dm["kv_channels"]
        a.add_qkv_bias = has_qkv_bias(spec)
        a.untie_embeddings_and_output_weights = not spec.get("tied", False)
        a.qk_layernorm = spec["family"] == "qwen3"
        a.virtual_pipeline_model_parallel_size = vpp
        a.num_layers_per_virtual_pipeline_stage = (dm["num_layers"] // spec["pp"] // vpp) if vpp else None
        a.ckpt_format = fmt
        a.use_dist_ckpt = fmt != "torch"
        a.num_virtual_stages_per_pipeline_rank = None
        a.decoder_first_pipeline_num_layers = spec.get("first_stage_layers")
        a.decoder_last_pipeline_num_layers = None
        a.pipeline_model_parallel_layout = None
        a.account_for_embedding_in_pipeline_split = False
        a.account_for_loss_in_pipeline_split = False
        a.overlap_p2p_comm = vpp is not None
        a.use_distributed_optimizer = False
        a.auto_detect_ckpt_format = dist_base and lora  # the LoRA run loads a torch_dist base, saves legacy
        a.ckpt_fully_parallel_save = True
        a.ckpt_assume_constant_structure = False
        a.async_save = False
        a.no_save_rng = False
    return a


def make_rng_state(torch, gen: int = 1):
    import random
    import numpy as np

    if gen >= 2:
        # as on a GPU: torch.cuda.get_rng_state() and the tracker states are 16-byte Philox states
        g = torch.Generator().manual_seed(99)
        philox = lambda: torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8)  # noqa: E731
        return [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": philox(),
            "rng_tracker_states": {"model-parallel-rng": philox()},
        }]
    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),  # stand-in: no CUDA here
        "rng_tracker_states": {},
    }]


def save_checkpoint(torch, root: Path, iteration: int, tp_rank: int, pp_rank: int, pp: int,
                    args, model_sd, gen: int = 1) -> Path:
    """Legacy checkpoint; model_sd is one state dict, or a list of them (VPP: model0, model1, ...)."""
    d = root / f"iter_{iteration:07d}" / ckpt_rank_dir(tp_rank, pp_rank, pp)
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(model_sd, list):
        models = {f"model{v}": sd for v, sd in enumerate(model_sd)} if len(model_sd) > 1 else {"model": model_sd[0]}
    else:
        models = {"model": model_sd}
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        **models,
        "rng_state": make_rng_state(torch, gen),
        "opt_param_scheduler": {
            "max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": iteration * 2,
            "lr_decay_style": "cosine", "lr_decay_steps": LORA_ITER * 2, "min_lr": 1e-6,
            "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
        },
        "num_floating_point_operations_so_far": 0,
    }
    if gen >= 2:
        # Megatron's generate_state_dict saves opt_param_scheduler only without --no-save-optim
        # (args.no_save_optim is True here), and puts rng_state after it
        assert args.no_save_optim
        del state["opt_param_scheduler"]
    path = d / "model_optim_rng.pt"
    torch.save(state, path)
    return path


# --------------------------------------------------------------------------------------------
# The worker (one per rank)
# --------------------------------------------------------------------------------------------

def _patch_cuda(torch):
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # LanguageModule.setup_embeddings_and_output_layer does `weight.data = weight.data.cuda()`
    # before the embedding-group all-reduce (tied embeddings with PP > 1)
    torch.Tensor.cuda = lambda self, *a, **k: self


def save_dist_checkpoint(torch, root: Path, iteration: int, args, model, singleton: bool, rng_state):
    """torch_dist checkpoint as megatron.training.checkpointing.save_checkpoint (0.16.1) writes it:
    generate_state_dict(...) with model.sharded_state_dict(metadata=_build_sharded_state_dict_metadata
    (args)), rng_state as a ShardedObject, then dist_checkpointing.save(..., content_metadata=...)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    d = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = {
        # Megatron-LM 0.16.1 _build_sharded_state_dict_metadata (no distributed optimizer): it
        # hard-codes singleton_local_shards=False; the singleton fixture sets it to True here.
        "singleton_local_shards": singleton,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(metadata=metadata),
        "rng_state": ShardedObject(
            "rng_state", rng_state,
            (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        "num_floating_point_operations_so_far": 0,
    }
    # .metadata's storage_meta records the save directory and a random uuid4 save_id; pin both
    # (the directory as args.save would name it on the training cluster) so regenerating the
    # fixture reproduces its bytes and no local path ends up in it.
    import uuid

    import torch.distributed.checkpoint.filesystem as dcp_fs
    from torch.distributed.checkpoint.metadata import StorageMeta

    # The write threads (2 per rank) also finish in any order, which only permutes the
    # storage_data dict of .metadata: sort every rank's results by (file, offset).
    ckpt_id = f"{args.save}/iter_{iteration:07d}"
    saved = dcp_fs._generate_uuid, dcp_fs.FileSystemWriter.storage_meta, dcp_fs.FileSystemWriter.finish
    orig_finish = dcp_fs.FileSystemWriter.finish

    def finish(self, md, results):
        key = lambda wr: (wr.storage_data.relative_path, wr.storage_data.offset)  # noqa: E731
        return orig_finish(self, md, [sorted(r, key=key) for r in results])

    dcp_fs._generate_uuid = lambda: str(uuid.uuid5(uuid.NAMESPACE_URL, "lora-merge-fixture:" + ckpt_id))
    dcp_fs.FileSystemWriter.storage_meta = lambda self: StorageMeta(checkpoint_id=ckpt_id, save_id=self.save_id)
    dcp_fs.FileSystemWriter.finish = finish
    try:
        dist_checkpointing.save(
            state, str(d), get_default_save_sharded_strategy("torch_dist"),
            validate_access_integrity=True,
            content_metadata=_clean_metadata_for_serialization(metadata),
        )
    finally:
        dcp_fs._generate_uuid, dcp_fs.FileSystemWriter.storage_meta, dcp_fs.FileSystemWriter.finish = saved
    # read it back through Megatron and compare with the live parameters
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, str(d))
    live = model.state_dict()
    n = 0
    for k, v in loaded["model"].items():
        if torch.is_tensor(v) and not k.endswith("_extra_state"):
            assert torch.equal(v, live[k]), k
            n += 1
    assert n == sum(1 for k in live if not k.endswith("_extra_state")), (n, len(live))
    return d


def worker(rank: int, world: int, name: str, spec: dict, out_dir: str, port: int, peft_dir: str):
    if peft_dir not in sys.path:
        sys.path.insert(0, peft_dir)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _patch_cuda(torch)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import peft
    from peft import LoraConfig, get_peft_model

    assert peft.__version__ == "0.7.1", f"need PEFT 0.7.1, got {peft.__version__} ({peft.__file__})"

    TP, PP = spec["tp"], spec["pp"]
    VPP = spec.get("vpp")  # None or >= 2
    NCH = VPP or 1  # model chunks on this rank
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                                 virtual_pipeline_model_parallel_size=VPP)
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    torch.manual_seed(1)  # instead of model_parallel_cuda_manual_seed (needs CUDA)
    import random

    import numpy as np

    random.seed(1)  # the rng_state saved in the checkpoints must be deterministic too
    np.random.seed(1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    out = Path(out_dir) / name
    bf16 = spec["dtype"] == "bfloat16"
    qkv_bias = has_qkv_bias(spec)
    qk_norm = spec["family"] == "qwen3"
    tied = spec.get("tied", False)
    dist_base = spec.get("base_format", "torch") == "torch_dist"
    dm = dims(spec)
    GEN = spec.get("gen", 1)
    L = dm["num_layers"]
    layout = layer_layout(spec)
    vpad = padded_vocab(TP)

    def make_config():
        kw = {}
        if VPP:
            kw["virtual_pipeline_model_parallel_size"] = VPP
        if spec.get("first_stage_layers") is not None:
            kw["num_layers_in_first_pipeline_stage"] = spec["first_stage_layers"]
        if qk_norm:
            kw["qk_layernorm"] = True
        return TransformerConfig(
            num_layers=L,
            hidden_size=dm["hidden_size"],
            num_attention_heads=dm["num_attention_heads"],
            num_query_groups=dm["num_query_groups"],
            kv_channels=dm["kv_channels"],
            ffn_hidden_size=dm["ffn_hidden_size"],
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            layernorm_epsilon=dm["norm_epsilon"],
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=TP,
            pipeline_model_parallel_size=PP,
            use_cpu_initialization=True,
            # the forward pass runs in fp32; bf16 checkpoints are cast afterwards (Float16Module)
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            **kw,
        )

    config = make_config()
    # as megatron.training.get_model: one chunk per virtual stage, pre/post_process per chunk
    chunks, chunk_first, chunk_last = [], [], []
    for v in range(NCH):
        vp = v if VPP else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        kw = {"vp_stage": vp} if VPP else {}
        m = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
            if qk_norm else get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=vpad,
            max_sequence_length=dm["max_position_embeddings"],
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=dm["rotary_base"],
            **kw,
        )
        m.eval()
        # Megatron's own layer numbering must match our layout
        got = [layer.layer_number - 1 for layer in m.decoder.layers]
        assert got == layout[(pp_rank, v)], (pp_rank, v, got, layout[(pp_rank, v)])
        chunks.append(m)
        chunk_first.append(pre)
        chunk_last.append(post)
    model = chunks[0]

    round_bf16 = (lambda x: x.to(torch.bfloat16).to(torch.float32)) if bf16 else (lambda x: x)

    base_global = canonical_base(torch, spec["base_seed"], qkv_bias, vpad, dm, qk_norm=qk_norm, tied=tied)

    def localize(global_vals: dict) -> list:
        res = []
        for v in range(NCH):
            d = {}
            for k, x in global_vals.items():
                lk = to_local_layer(k, layout[(pp_rank, v)], chunk_first[v], chunk_last[v])
                if lk is not None:
                    d[lk] = round_bf16(shard(torch, k, x, tp_rank, TP))
            res.append(d)
        return res

    base_local = localize(base_global)
    if tied and PP > 1 and chunk_last[-1] and not chunk_first[-1]:
        # the last stage's own copy of the embedding: Megatron zeroes it and all-reduces it with
        # the first stage's embedding over the embedding group (setup_embeddings_and_output_layer)
        base_local[-1]["output_layer.weight"] = torch.zeros(vpad // TP, dm["hidden_size"])

    def lora_local(seed):
        return localize(canonical_lora(torch, seed, spec["targets"], dm))

    def fill(values: list):
        """Load values into the (maybe PEFT-wrapped) GPTModel chunks; every non-extra-state key must be set."""
        for v, m in enumerate(chunks):
            sd = m.state_dict()
            new = {}
            for k, x in sd.items():
                if k.endswith("_extra_state"):
                    new[k] = x
                    continue
                ck = k.replace(".base_layer.", ".").replace(".default.", ".")
                assert ck in values[v], f"rank {rank} chunk {v}: no value for {k}"
                assert values[v][ck].shape == x.shape, f"{k}: {tuple(values[v][ck].shape)} vs {tuple(x.shape)}"
                new[k] = values[v][ck]
            m.load_state_dict(new, strict=True)
        if tied and PP > 1:
            for m in chunks:
                m.setup_embeddings_and_output_layer()  # collective over the embedding group
            if chunk_last[-1]:
                emb = shard(torch, "embedding.word_embeddings.weight",
                            base_global["embedding.word_embeddings.weight"], tp_rank, TP)
                assert torch.equal(chunks[-1].output_layer.weight.detach(), emb)

    # ---------- forward pass (manual pipeline) ----------
    S, B = dm["seq_length"], BATCH
    g = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, dm["vocab_size"], (B, S), generator=g, dtype=torch.int64)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)

    def forward():
        """Chunks run in the interleaved order: (v=0: pp0, pp1, ...), (v=1: pp0, pp1, ...), ...;
        activations go to the next pipeline rank (ring: the last rank's chunk v feeds pp0's v+1)."""
        res = None
        with torch.no_grad():
            for v, m in enumerate(chunks):
                if not chunk_first[v]:
                    recv = torch.empty(S, B, dm["hidden_size"], dtype=torch.float32)
                    dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                    m.set_input_tensor(recv)
                res = m(
                    input_ids=input_ids if chunk_first[v] else None,
                    position_ids=position_ids,
                    attention_mask=mask,
                    runtime_gather_output=True,
                )
                if not chunk_last[v]:
                    dist.send(res.contiguous().float(), dst=ps.get_pipeline_model_parallel_next_rank())
                    res = None
        if res is None:
            return None
        assert res.shape == (B, S, vpad), res.shape
        return res[..., : dm["vocab_size"]].float().contiguous()

    def check_replicated(sd: dict):
        """Replicated tensors must be bitwise equal across TP ranks."""
        if TP == 1:
            return
        for k, v in sd.items():
            if v is None:
                continue
            if not (k.endswith("layernorm.weight") or k.endswith("layernorm.bias")):
                # PEFT replicated parts are checked further below
                continue
            gathered = [torch.empty_like(v) for _ in range(TP)]
            dist.all_gather(gathered, v.contiguous(), group=ps.get_tensor_model_parallel_group())
            assert all(torch.equal(gathered[0], x) for x in gathered), k

    def cast_sd(sd):
        # Megatron's Float16Module does module.bfloat16(): every floating tensor, norms included
        if not bf16:
            return sd
        return type(sd)((k, v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
                        for k, v in sd.items())

    def chunk_sds():
        sds = [cast_sd(m.state_dict_for_save_checkpoint()) for m in chunks]
        return sds[0] if not VPP else sds

    log = []
    info = {}

    # ---------- base ----------
    fill(base_local)
    logits_base = forward()
    base_sd = chunk_sds()
    for sd in (base_sd if VPP else [base_sd]):
        check_replicated(sd)
    base_root = out / "base"
    args = make_args(torch, spec, BASE_ITER, world, lora=False, lora_filter=False,
                     load=f"/data/ckpt/{name}/hf-converted", save=f"/data/ckpt/{name}/base")
    if dist_base:
        save_dist_checkpoint(torch, base_root, BASE_ITER, args, model, spec.get("singleton", False),
                             make_rng_state(torch, GEN))
    else:
        save_checkpoint(torch, base_root, BASE_ITER, tp_rank, pp_rank, PP, args, base_sd, GEN)
    if tied and chunk_last[-1]:
        sd = base_sd[-1] if VPP else base_sd
        info["tied_last_stage_has_output_layer"] = "output_layer.weight" in sd
        if "output_layer.weight" in sd:
            emb = shard(torch, "embedding.word_embeddings.weight",
                        base_global["embedding.word_embeddings.weight"], tp_rank, TP)
            info["tied_output_layer_equals_embedding"] = bool(torch.equal(sd["output_layer.weight"], emb))
    if rank == 0:
        log.append(f"base keys at tp{tp_rank} pp{pp_rank}: {len(base_sd)}")

    # ---------- PEFT wrap, as MindSpeed-LLM's model_provider_func_wrapper does (per model chunk) ----------
    def lora_config():
        return LoraConfig(
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            target_modules=list(spec["targets"]),
            lora_dropout=0.0,
            bias="none",
            megatron_config=make_config(),
            megatron_core="megatron.core",
        )

    peft_models = []
    for m in chunks:
        pm = get_peft_model(m, lora_config())
        assert pm.base_model.model is m
        pm.eval()
        peft_models.append(pm)
    peft_model = peft_models[0]

    # what PEFT 0.7.1 really built on megatron-core 0.16.1
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    layout_info = {}
    for mname, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            short = mname.split(".")[-1]
            A, Bm = mod.lora_A["default"], mod.lora_B["default"]
            base_is_row = isinstance(mod.base_layer, RowParallelLinear)
            li = dict(
                base=type(mod.base_layer).__name__,
                A=type(A).__name__, A_shape=tuple(A.weight.shape),
                A_partition_dim=getattr(A.weight, "partition_dim", None),
                A_tp=getattr(A.weight, "tensor_model_parallel", False),
                B=type(Bm).__name__, B_shape=tuple(Bm.weight.shape),
                B_partition_dim=getattr(Bm.weight, "partition_dim", None),
                B_tp=getattr(Bm.weight, "tensor_model_parallel", False),
                scaling=mod.scaling["default"],
                lora_B_init_zero=bool((Bm.weight == 0).all()),
            )
            fin, fout = lora_io(short, dm)
            if base_is_row:
                assert isinstance(A, RowParallelLinear) and isinstance(Bm, torch.nn.Linear), li
                assert li["A_shape"] == (LORA_R, fin // TP) and li["A_partition_dim"] == 1, li
                assert li["B_shape"] == (fout, LORA_R), li
            else:
                assert isinstance(mod.base_layer, ColumnParallelLinear)
                assert isinstance(A, torch.nn.Linear) and isinstance(Bm, ColumnParallelLinear), li
                assert li["A_shape"] == (LORA_R, fin), li
                assert li["B_shape"] == (fout // TP, LORA_R) and li["B_partition_dim"] == 0, li
            assert li["scaling"] == LORA_ALPHA / LORA_R
            layout_info.setdefault(short, li)

    lora_vals = lora_local(spec["lora_seed"])
    stale_vals = lora_local(spec["lora_seed"] + STALE_SEED_OFFSET)

    lora_root = out / "lora"
    filtered = spec["lora"] == "filtered"

    def merge(a: list, b: list) -> list:
        return [{**x, **y} for x, y in zip(a, b)]

    def lora_sd():
        sds = []
        for m in chunks:
            sd = cast_sd(m.state_dict_for_save_checkpoint())
            if filtered:
                sd = type(sd)((k, v) for k, v in sd.items() if "lora" in k)  # --lora-ckpt-filter
            sds.append(sd)
        return sds[0] if not VPP else sds

    # leftover, older LoRA checkpoint with other values (the tracker file will not point to it)
    fill(merge(base_local, stale_vals))
    args = make_args(torch, spec, STALE_LORA_ITER, world, lora=True, lora_filter=filtered,
                     load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
    save_checkpoint(torch, lora_root, STALE_LORA_ITER, tp_rank, pp_rank, PP, args, lora_sd(), GEN)
    logits_stale = forward()

    fill(merge(base_local, lora_vals))
    logits_lora = forward()
    sd_all = lora_sd()
    # PEFT-replicated parts (column lora_A, row lora_B) must be equal across TP ranks
    if TP > 1:
        for sd in (sd_all if VPP else [sd_all]):
            for k, v in sd.items():
                if v is None:
                    continue
                rep = (("linear_qkv" in k or "linear_fc1" in k) and ".lora_A." in k) or (
                    ("linear_proj" in k or "linear_fc2" in k) and ".lora_B." in k
                ) or k.endswith("layernorm.weight")
                if rep:
                    gathered = [torch.empty_like(v) for _ in range(TP)]
                    dist.all_gather(gathered, v.contiguous(), group=ps.get_tensor_model_parallel_group())
                    assert all(torch.equal(gathered[0], x) for x in gathered), k
    args = make_args(torch, spec, LORA_ITER, world, lora=True, lora_filter=filtered,
                     load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
    save_checkpoint(torch, lora_root, LORA_ITER, tp_rank, pp_rank, PP, args, sd_all, GEN)

    # optional: the same forward in real bf16 (for information only)
    bf16_diff = None
    if bf16:
        assert not VPP
        model.bfloat16()
        peft_model.bfloat16()
        # pipeline send/recv buffers are fp32 in forward(); cast the received tensor on use
        with torch.no_grad():
            if not first:
                recv = torch.empty(S, B, dm["hidden_size"], dtype=torch.float32)
                dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(recv.to(torch.bfloat16))
            res = model(input_ids=input_ids if first else None, position_ids=position_ids,
                        attention_mask=mask, runtime_gather_output=True)
            if not last:
                dist.send(res.float().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            else:
                bf16_diff = (res[..., : dm["vocab_size"]].float() - logits_lora).abs().max().item()

    if last and tp_rank == 0:
        assert logits_lora.shape == (B, S, dm["vocab_size"])
        torch.save(
            {
                "input_ids": input_ids.clone(),
                "logits_lora": logits_lora.clone(),
                "logits_base": logits_base.clone(),
            },
            out / "logits.pt",
        )
        summary = dict(
            layout=layout_info,
            lora_vs_base_max_abs=(logits_lora - logits_base).abs().max().item(),
            stale_vs_lora_max_abs=(logits_stale - logits_lora).abs().max().item(),
            real_bf16_forward_vs_fp32_max_abs=bf16_diff,
            **info,
        )
        (out / ".summary.json").write_text(json.dumps(summary, indent=1, default=str))

    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Main process: hf_ref, fixture.json, tracker files
# --------------------------------------------------------------------------------------------

def write_hf_ref(spec: dict, d: Path):
    import warnings

    warnings.filterwarnings("ignore")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

    d.mkdir(parents=True, exist_ok=True)
    V = MODEL["vocab_size"]
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(V - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    assert len(vocab) == V
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    eos = vocab["<|im_end|>"]
    bos = vocab["<|endoftext|>"]
    chat_template = (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MODEL["max_position_embeddings"],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(d))
    if not (d / "chat_template.jinja").exists():
        (d / "chat_template.jinja").write_text(chat_template)

    dm = dims(spec)
    common = dict(
        vocab_size=V,
        hidden_size=MODEL["hidden_size"],
        intermediate_size=MODEL["ffn_hidden_size"],
        num_hidden_layers=dm["num_layers"],
        num_attention_heads=MODEL["num_attention_heads"],
        num_key_value_heads=MODEL["num_query_groups"],
        max_position_embeddings=MODEL["max_position_embeddings"],
        rope_theta=float(MODEL["rotary_base"]),
        rms_norm_eps=MODEL["norm_epsilon"],
        tie_word_embeddings=bool(spec.get("tied", False)),
        hidden_act="silu",
        bos_token_id=bos,
        eos_token_id=eos,
        dtype=spec["dtype"],
    )
    if spec["family"] == "qwen2":
        cfg = Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    elif spec["family"] == "qwen3":
        cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], attention_bias=False,
                          head_dim=dm["kv_channels"], **common)
    else:
        cfg = LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False,
                          head_dim=dm["kv_channels"], **common)
    cfg.save_pretrained(str(d))
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False, max_new_tokens=8).save_pretrained(str(d))
    for f in d.iterdir():
        assert not f.name.endswith((".safetensors", ".bin")), f


def describe_gen2(name: str, spec: dict, summary: dict):
    """(description, extra fixture.json fields) of a second-generation fixture."""
    dm = dims(spec)
    TP, PP, VPP = spec["tp"], spec["pp"], spec.get("vpp")
    fam = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[spec["family"]]
    dist_base = spec.get("base_format", "torch") == "torch_dist"
    lay = layer_layout(spec)
    extra = dict(
        num_layers=dm["num_layers"],
        kv_channels=dm["kv_channels"],
        vpp=VPP,
        base_format=spec.get("base_format", "torch"),
        lora_format="torch",
        singleton_local_shards=bool(spec.get("singleton", False)),
        tied_embeddings=bool(spec.get("tied", False)),
        qk_layernorm=spec["family"] == "qwen3",
        qkv_bias=has_qkv_bias(spec),
        layer_layout=[dict(pp_rank=p, vp_stage=v, global_layers=lay[(p, v)]) for (p, v) in sorted(lay)],
    )
    parts = [
        f"{fam}-like Megatron-Core GPTModel (local spec), TP={TP} PP={PP}"
        + (f" VPP={VPP}" if VPP else "") + f", {spec['dtype']} checkpoint; {dm['num_layers']} layers, "
        f"hidden {dm['hidden_size']}, heads {dm['num_attention_heads']}, query groups "
        f"{dm['num_query_groups']}, head_dim (kv_channels) {dm['kv_channels']}, ffn {dm['ffn_hidden_size']}, "
        f"vocab {dm['vocab_size']} (padded {padded_vocab(TP)})"
        + (", qkv bias" if has_qkv_bias(spec) else ", no qkv bias")
        + (", q/k layernorm (RMSNorm over head_dim; heads*head_dim = "
           f"{dm['num_attention_heads'] * dm['kv_channels']} != hidden)" if spec["family"] == "qwen3" else "")
        + "."
    ]
    if dist_base:
        parts.append(
            f"base/ = torch_dist base checkpoint (iter {BASE_ITER}) written by megatron-core 0.16.1 "
            "dist_checkpointing.save as Megatron-LM's save_checkpoint does (metadata.json, .metadata, "
            "__R_K.distcp, common.pt holding args / iteration / checkpoint_version / "
            "num_floating_point_operations_so_far / content_metadata; rng_state as a per-rank "
            "ShardedObject); global tensors, "
            + ("singleton_local_shards=True: per-layer keys decoder.layers.{i}.*, swiglu fc1 split into "
               "mlp.linear_fc1.weight_w (gate) and mlp.linear_fc1.weight_v (up)"
               if spec.get("singleton") else
               "stacked layers: decoder.layers.* with a leading [num_layers] dim, fc1 as [all gate ; all up]")
            + "; norms under the TransformerEngine names (self_attention.linear_qkv.layer_norm_weight, "
            "mlp.linear_fc1.layer_norm_weight)."
        )
    else:
        parts.append(f"base/ = legacy base checkpoint (iter {BASE_ITER}).")
    if VPP:
        parts.append(
            f"Virtual pipeline: every mp_rank_TT_PPP file holds model0..model{VPP - 1} (one model chunk "
            f"per virtual stage, chunk-local layer indices); chunk v on pipeline rank p holds global "
            f"layers v*{dm['num_layers'] // VPP} + p*{dm['num_layers'] // (PP * VPP)} + local "
            "(see layer_layout); embedding only in pp0's model0, final norm and output layer only in "
            f"the last rank's model{VPP - 1}.")
    if spec.get("first_stage_layers") is not None:
        n0 = len(lay[(0, 0)])
        parts.append(
            f"Uneven pipeline split: num_layers_in_first_pipeline_stage={n0} (args."
            f"decoder_first_pipeline_num_layers={n0}), so pp0 holds global layer 0..{n0 - 1} and pp1 "
            f"holds {dm['num_layers'] - n0} layers (local 0..{dm['num_layers'] - n0 - 1} = global "
            f"{n0}..{dm['num_layers'] - 1}).")
    if spec.get("tied"):
        parts.append(
            "Tied embeddings (share_embeddings_and_output_weights=True; args.untie_embeddings_and_output_"
            "weights=False; HF tie_word_embeddings=true): the last pipeline stage holds its own "
            "output_layer.weight copy of the embedding "
            f"(present: {summary.get('tied_last_stage_has_output_layer')}, bitwise equal to the "
            f"embedding: {summary.get('tied_output_layer_equals_embedding')}), synchronised by "
            "Megatron's embedding-group all-reduce; the HF model has no lm_head.weight of its own.")
    parts.append(
        f"lora/ = PEFT 0.7.1 LoRA checkpoint, legacy format ({spec['lora']}) at iter {LORA_ITER} per "
        f"latest_checkpointed_iteration.txt, plus a stale iter_{STALE_LORA_ITER:07d} with other LoRA "
        "values that must be ignored. logits.pt = real Megatron forward (logits_lora with LoRA active, "
        "logits_base without), gathered over TP, passed by hand over PP"
        + (" in the interleaved chunk order" if VPP else "") + ", trimmed to vocab.")
    if spec["family"] == "qwen2" and dm["num_layers"] == MODEL["num_layers"]:
        parts.append("Same underlying base model and LoRA as the other 4-layer Qwen2-like fixtures, so "
                     "the logits agree with theirs to rounding.")
    elif spec["family"] == "qwen2":
        parts.append(f"Layers 0..{MODEL['num_layers'] - 1} hold the same values as the 4-layer Qwen2-like "
                     "fixtures' layers (values are seeded per tensor name); the logits differ.")
    return " ".join(parts), extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "tests" / "fixtures"))
    ap.add_argument("--peft-dir", default=str(REPO_ROOT / ".fixture-deps"),
                    help="directory holding PEFT 0.7.1 (pip install --no-deps --target DIR peft==0.7.1)")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)build; default all")
    opts = ap.parse_args()

    peft_dir = str(Path(opts.peft_dir).resolve())
    init = Path(peft_dir) / "peft" / "__init__.py"
    if not init.is_file():
        sys.exit(f"error: PEFT 0.7.1 not found in {peft_dir}.\n"
                 f"Install it apart with:  pip install --no-deps --target {peft_dir} peft==0.7.1")
    if '__version__ = "0.7.1"' not in init.read_text():
        sys.exit(f"error: {init} is not PEFT 0.7.1; reinstall with "
                 f"pip install --no-deps --target {peft_dir} --upgrade peft==0.7.1")
    sys.path.insert(0, peft_dir)
    os.environ["PYTHONPATH"] = peft_dir + os.pathsep + os.environ.get("PYTHONPATH", "")

    import torch.multiprocessing as mp

    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = opts.only or list(FIXTURES)
    for name in names:
        spec = FIXTURES[name]
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        world = spec["tp"] * spec["pp"]
        print(f"[{name}] spawning {world} ranks (TP={spec['tp']}, PP={spec['pp']}, {spec['dtype']})", flush=True)
        mp.spawn(worker, args=(world, name, spec, str(out), free_port(), peft_dir), nprocs=world, join=True)

        (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
        (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
        write_hf_ref(spec, d / "hf_ref")
        summary = json.loads((d / ".summary.json").read_text())
        (d / ".summary.json").unlink()
        desc = (
            f"{'Qwen2' if spec['family'] == 'qwen2' else 'Llama'}-like Megatron-Core GPTModel (local spec), "
            f"TP={spec['tp']} PP={spec['pp']}, {spec['dtype']} checkpoint; {MODEL['num_layers']} layers, "
            f"hidden {MODEL['hidden_size']}, heads {MODEL['num_attention_heads']}, query groups "
            f"{MODEL['num_query_groups']}, ffn {MODEL['ffn_hidden_size']}, vocab {MODEL['vocab_size']} "
            f"(padded {padded_vocab(spec['tp'])}). base/ = base checkpoint (iter {BASE_ITER}); lora/ = "
            f"PEFT 0.7.1 LoRA checkpoint ({spec['lora']}) at iter {LORA_ITER} per "
            f"latest_checkpointed_iteration.txt, plus a stale iter_{STALE_LORA_ITER:07d} with other "
            f"LoRA values that must be ignored. logits.pt = real Megatron forward (logits_lora with "
            f"LoRA active, logits_base without), gathered over TP, trimmed to vocab."
        )
        if spec["dtype"] == "bfloat16":
            desc += (" The checkpoint tensors are bf16 (model cast like Float16Module, norms included); "
                     "the logits come from a float32 forward of a model holding exactly the stored "
                     "bf16 values, so they are the exact function of the stored weights (a real bf16 "
                     f"forward differs by up to {summary['real_bf16_forward_vs_fp32_max_abs']:.3g}).")
        if spec["family"] == "qwen2":
            desc += (" All Qwen2-like fixtures hold the same underlying base model and LoRA "
                     "(bf16-rounded in the bf16 one), so their logits agree to rounding.")
        extra = {}
        if spec.get("gen", 1) >= 2:
            desc, extra = describe_gen2(name, spec, summary)
        fx = dict(
            tp=spec["tp"],
            pp=spec["pp"],
            dtype=spec["dtype"],
            lora=spec["lora"],
            r=LORA_R,
            alpha=LORA_ALPHA,
            targets=list(spec["targets"]),
            model_type=spec["family"],
            vocab_size=MODEL["vocab_size"],
            padded_vocab_size=padded_vocab(spec["tp"]),
            base_iteration=BASE_ITER,
            lora_iteration=LORA_ITER,
            stale_lora_iteration=STALE_LORA_ITER,
            logits_computed_in="float32" + (" on bf16-rounded weights" if spec["dtype"] == "bfloat16" else ""),
            **extra,
            description=desc,
        )
        (d / "fixture.json").write_text(json.dumps(fx, indent=2) + "\n")
        print(f"[{name}] done: lora-vs-base max|dlogit| {summary['lora_vs_base_max_abs']:.4f}, "
              f"stale-vs-lora {summary['stale_vs_lora_max_abs']:.4f}", flush=True)
        print(f"[{name}] PEFT layout: " + json.dumps(summary["layout"], default=str), flush=True)
        for k in ("tied_last_stage_has_output_layer", "tied_output_layer_equals_embedding"):
            if k in summary:
                print(f"[{name}] {k}: {summary[k]}", flush=True)


if __name__ == "__main__":
    main()
