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
Megatron / PEFT lay shards out.  So the fp32 Qwen2-like fixtures (tp2, pp2, tp2pp2) hold the same
model and the same LoRA; their logits agree to float rounding.

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
}
STALE_SEED_OFFSET = 777  # the leftover iter_0000005 LoRA uses lora_seed + this


def padded_vocab(tp: int) -> int:
    m = MODEL["make_vocab_size_divisible_by"] * tp
    return -(-MODEL["vocab_size"] // m) * m


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


def canonical_base(torch, seed: int, qkv_bias: bool, vpad: int) -> dict:
    H, F = MODEL["hidden_size"], MODEL["ffn_hidden_size"]
    NH, NG, D = MODEL["num_attention_heads"], MODEL["num_query_groups"], MODEL["kv_channels"]
    QKV = (NH + 2 * NG) * D
    t = {}
    t["embedding.word_embeddings.weight"] = _randn(torch, seed, "emb", (vpad, H), 0.5)
    for i in range(MODEL["num_layers"]):
        p = f"decoder.layers.{i}."
        t[p + "input_layernorm.weight"] = _randn(torch, seed, p + "ln1", (H,), 0.1, 1.0)
        # global qkv, already in Megatron's group-interleaved row order [q_g | k_g | v_g] per group
        t[p + "self_attention.linear_qkv.weight"] = _randn(torch, seed, p + "qkv", (QKV, H), 0.06)
        if qkv_bias:
            t[p + "self_attention.linear_qkv.bias"] = _randn(torch, seed, p + "qkvb", (QKV,), 0.05)
        t[p + "self_attention.linear_proj.weight"] = _randn(torch, seed, p + "proj", (H, NH * D), 0.06)
        t[p + "pre_mlp_layernorm.weight"] = _randn(torch, seed, p + "ln2", (H,), 0.1, 1.0)
        # global fc1 = [gate ; up]
        t[p + "mlp.linear_fc1.weight"] = _randn(torch, seed, p + "fc1", (2 * F, H), 0.06)
        t[p + "mlp.linear_fc2.weight"] = _randn(torch, seed, p + "fc2", (H, F), 0.06)
    t["decoder.final_layernorm.weight"] = _randn(torch, seed, "lnf", (H,), 0.1, 1.0)
    t["output_layer.weight"] = _randn(torch, seed, "out", (vpad, H), 0.06)
    return t


def lora_io(module: str):
    """(in_features, out_features) of a targeted Megatron linear (global)."""
    H, F = MODEL["hidden_size"], MODEL["ffn_hidden_size"]
    NH, NG, D = MODEL["num_attention_heads"], MODEL["num_query_groups"], MODEL["kv_channels"]
    return {
        "linear_qkv": (H, (NH + 2 * NG) * D),
        "linear_proj": (NH * D, H),
        "linear_fc1": (H, 2 * F),
        "linear_fc2": (F, H),
    }[module]


def module_path(module: str) -> str:
    return ("self_attention." if module in ("linear_qkv", "linear_proj") else "mlp.") + module


def canonical_lora(torch, seed: int, targets) -> dict:
    """lora_A [r, in], lora_B [out, r] per targeted module; B's rows in W's global row order."""
    t = {}
    for i in range(MODEL["num_layers"]):
        for m in targets:
            fin, fout = lora_io(m)
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
    column = ".linear_qkv." in name or is_fc1
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


def to_local_layer(name: str, pp_rank: int, layers_per_stage: int):
    """Canonical (global layer) name -> (stage-local name) or None if not on this stage."""
    if name.startswith("decoder.layers."):
        i = int(name.split(".")[2])
        if i // layers_per_stage != pp_rank:
            return None
        rest = name.split(".", 3)[3]
        return f"decoder.layers.{i % layers_per_stage}.{rest}"
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
    return a


def make_rng_state(torch):
    import random
    import numpy as np

    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),  # stand-in: no CUDA here
        "rng_tracker_states": {},
    }]


def save_checkpoint(torch, root: Path, iteration: int, tp_rank: int, pp_rank: int, pp: int,
                    args, model_sd) -> Path:
    d = root / f"iter_{iteration:07d}" / ckpt_rank_dir(tp_rank, pp_rank, pp)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_sd,
        "rng_state": make_rng_state(torch),
        "opt_param_scheduler": {
            "max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": iteration * 2,
            "lr_decay_style": "cosine", "lr_decay_steps": LORA_ITER * 2, "min_lr": 1e-6,
            "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
        },
        "num_floating_point_operations_so_far": 0,
    }
    path = d / "model_optim_rng.pt"
    torch.save(state, path)
    return path


# --------------------------------------------------------------------------------------------
# The worker (one per rank)
# --------------------------------------------------------------------------------------------

def _patch_cuda(torch):
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


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
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
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
    qkv_bias = spec["family"] == "qwen2"
    L = MODEL["num_layers"]
    lps = L // PP
    vpad = padded_vocab(TP)

    def make_config():
        return TransformerConfig(
            num_layers=L,
            hidden_size=MODEL["hidden_size"],
            num_attention_heads=MODEL["num_attention_heads"],
            num_query_groups=MODEL["num_query_groups"],
            kv_channels=MODEL["kv_channels"],
            ffn_hidden_size=MODEL["ffn_hidden_size"],
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            layernorm_epsilon=MODEL["norm_epsilon"],
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
        )

    config = make_config()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vpad,
        max_sequence_length=MODEL["max_position_embeddings"],
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=MODEL["rotary_base"],
    )
    model.eval()

    round_bf16 = (lambda x: x.to(torch.bfloat16).to(torch.float32)) if bf16 else (lambda x: x)

    base_global = canonical_base(torch, spec["base_seed"], qkv_bias, vpad)
    base_local = {}
    for k, v in base_global.items():
        lk = to_local_layer(k, pp_rank, lps)
        if lk is not None:
            base_local[lk] = round_bf16(shard(torch, k, v, tp_rank, TP))

    def lora_local(seed):
        d = {}
        for k, v in canonical_lora(torch, seed, spec["targets"]).items():
            lk = to_local_layer(k, pp_rank, lps)
            if lk is not None:
                d[lk] = round_bf16(shard(torch, k, v, tp_rank, TP))
        return d

    def fill(values: dict):
        """Load values into the (maybe PEFT-wrapped) GPTModel; every non-extra-state key must be set."""
        sd = model.state_dict()
        new = {}
        for k, v in sd.items():
            if k.endswith("_extra_state"):
                new[k] = v
                continue
            ck = k.replace(".base_layer.", ".").replace(".default.", ".")
            assert ck in values, f"rank {rank}: no value for {k}"
            assert values[ck].shape == v.shape, f"{k}: {tuple(values[ck].shape)} vs {tuple(v.shape)}"
            new[k] = values[ck]
        model.load_state_dict(new, strict=True)

    # ---------- forward pass (manual pipeline) ----------
    S, B = MODEL["seq_length"], BATCH
    g = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, MODEL["vocab_size"], (B, S), generator=g, dtype=torch.int64)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)

    def forward():
        with torch.no_grad():
            if not first:
                recv = torch.empty(S, B, MODEL["hidden_size"], dtype=torch.float32)
                dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(recv)
            res = model(
                input_ids=input_ids if first else None,
                position_ids=position_ids,
                attention_mask=mask,
                runtime_gather_output=True,
            )
            if not last:
                dist.send(res.contiguous().float(), dst=ps.get_pipeline_model_parallel_next_rank())
                return None
            assert res.shape == (B, S, vpad), res.shape
            return res[..., : MODEL["vocab_size"]].float().contiguous()

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

    log = []

    # ---------- base ----------
    fill(base_local)
    logits_base = forward()
    base_sd = cast_sd(model.state_dict_for_save_checkpoint())
    check_replicated(base_sd)
    base_root = out / "base"
    args = make_args(torch, spec, BASE_ITER, world, lora=False, lora_filter=False,
                     load=f"/data/ckpt/{name}/hf-converted", save=f"/data/ckpt/{name}/base")
    save_checkpoint(torch, base_root, BASE_ITER, tp_rank, pp_rank, PP, args, base_sd)
    if rank == 0:
        log.append(f"base keys at tp{tp_rank} pp{pp_rank}: {len(base_sd)}")

    # ---------- PEFT wrap, as MindSpeed-LLM's model_provider_func_wrapper does ----------
    lora_cfg = LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        target_modules=list(spec["targets"]),
        lora_dropout=0.0,
        bias="none",
        megatron_config=make_config(),
        megatron_core="megatron.core",
    )
    peft_model = get_peft_model(model, lora_cfg)
    assert peft_model.base_model.model is model
    peft_model.eval()

    # what PEFT 0.7.1 really built on megatron-core 0.16.1
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    layout = {}
    for mname, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            short = mname.split(".")[-1]
            A, Bm = mod.lora_A["default"], mod.lora_B["default"]
            base_is_row = isinstance(mod.base_layer, RowParallelLinear)
            info = dict(
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
            fin, fout = lora_io(short)
            if base_is_row:
                assert isinstance(A, RowParallelLinear) and isinstance(Bm, torch.nn.Linear), info
                assert info["A_shape"] == (LORA_R, fin // TP) and info["A_partition_dim"] == 1, info
                assert info["B_shape"] == (fout, LORA_R), info
            else:
                assert isinstance(mod.base_layer, ColumnParallelLinear)
                assert isinstance(A, torch.nn.Linear) and isinstance(Bm, ColumnParallelLinear), info
                assert info["A_shape"] == (LORA_R, fin), info
                assert info["B_shape"] == (fout // TP, LORA_R) and info["B_partition_dim"] == 0, info
            assert info["scaling"] == LORA_ALPHA / LORA_R
            layout.setdefault(short, info)

    lora_vals = lora_local(spec["lora_seed"])
    stale_vals = lora_local(spec["lora_seed"] + STALE_SEED_OFFSET)

    lora_root = out / "lora"
    filtered = spec["lora"] == "filtered"

    def lora_sd():
        sd = cast_sd(model.state_dict_for_save_checkpoint())
        if filtered:
            sd = type(sd)((k, v) for k, v in sd.items() if "lora" in k)  # --lora-ckpt-filter
        return sd

    # leftover, older LoRA checkpoint with other values (the tracker file will not point to it)
    fill({**base_local, **stale_vals})
    args = make_args(torch, spec, STALE_LORA_ITER, world, lora=True, lora_filter=filtered,
                     load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
    save_checkpoint(torch, lora_root, STALE_LORA_ITER, tp_rank, pp_rank, PP, args, lora_sd())
    logits_stale = forward()

    fill({**base_local, **lora_vals})
    logits_lora = forward()
    sd = lora_sd()
    # PEFT-replicated parts (column lora_A, row lora_B) must be equal across TP ranks
    if TP > 1:
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
    save_checkpoint(torch, lora_root, LORA_ITER, tp_rank, pp_rank, PP, args, sd)

    # optional: the same forward in real bf16 (for information only)
    bf16_diff = None
    if bf16:
        model.bfloat16()
        peft_model.bfloat16()
        # pipeline send/recv buffers are fp32 in forward(); cast the received tensor on use
        with torch.no_grad():
            if not first:
                recv = torch.empty(S, B, MODEL["hidden_size"], dtype=torch.float32)
                dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(recv.to(torch.bfloat16))
            res = model(input_ids=input_ids if first else None, position_ids=position_ids,
                        attention_mask=mask, runtime_gather_output=True)
            if not last:
                dist.send(res.float().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            else:
                bf16_diff = (res[..., : MODEL["vocab_size"]].float() - logits_lora).abs().max().item()

    if last and tp_rank == 0:
        assert logits_lora.shape == (B, S, MODEL["vocab_size"])
        torch.save(
            {
                "input_ids": input_ids.clone(),
                "logits_lora": logits_lora.clone(),
                "logits_base": logits_base.clone(),
            },
            out / "logits.pt",
        )
        summary = dict(
            layout=layout,
            lora_vs_base_max_abs=(logits_lora - logits_base).abs().max().item(),
            stale_vs_lora_max_abs=(logits_stale - logits_lora).abs().max().item(),
            real_bf16_forward_vs_fp32_max_abs=bf16_diff,
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
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

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

    common = dict(
        vocab_size=V,
        hidden_size=MODEL["hidden_size"],
        intermediate_size=MODEL["ffn_hidden_size"],
        num_hidden_layers=MODEL["num_layers"],
        num_attention_heads=MODEL["num_attention_heads"],
        num_key_value_heads=MODEL["num_query_groups"],
        max_position_embeddings=MODEL["max_position_embeddings"],
        rope_theta=float(MODEL["rotary_base"]),
        rms_norm_eps=MODEL["norm_epsilon"],
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=bos,
        eos_token_id=eos,
        dtype=spec["dtype"],
    )
    if spec["family"] == "qwen2":
        cfg = Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    else:
        cfg = LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False,
                          head_dim=MODEL["kv_channels"], **common)
    cfg.save_pretrained(str(d))
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False, max_new_tokens=8).save_pretrained(str(d))
    for f in d.iterdir():
        assert not f.name.endswith((".safetensors", ".bin")), f


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

    import torch
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
            description=desc,
        )
        (d / "fixture.json").write_text(json.dumps(fx, indent=2) + "\n")
        print(f"[{name}] done: lora-vs-base max|dlogit| {summary['lora_vs_base_max_abs']:.4f}, "
              f"stale-vs-lora {summary['stale_vs_lora_max_abs']:.4f}", flush=True)
        print(f"[{name}] PEFT layout: " + json.dumps(summary["layout"], default=str), flush=True)


if __name__ == "__main__":
    main()
