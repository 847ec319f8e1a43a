"""The fixture-making library: one outline for every family of committed test fixtures.

A fixture is made by the REAL megatron-core 0.16.1 and PEFT 0.7.1 on CPU (gloo), as MindSpeed-LLM calls
them. For each fixture of a family (dense.py, moe.py, deepseek.py: each holds only what differs):

* ``worker``: spawns the fixture's ranks (torch.multiprocessing, gloo, CPU); every rank initialises
  Megatron's model parallelism (TP, PP with VPP or an uneven split, EP, ETP), seeds every generator, builds
  the family's Megatron-Core ``GPTModel`` (one chunk per virtual pipeline stage, as
  ``megatron.training.get_model`` does) and fills every parameter with seeded values sliced from
  canonical, parallelism-independent GLOBAL tensors (Megatron TP=1 layout) the way Megatron / PEFT lay
  shards out (expert e of EP rank p: local expert ``e - p * E_local``);
* runs the base forward pass (activations passed by hand over the pipeline ranks, logits gathered over
  TP) and saves the base checkpoint (legacy ``torch`` format as ``megatron.training.checkpointing.
  save_checkpoint`` writes it, one ``mp_rank_TT[_PPP][_EEE]`` file per rank, or torch_dist through
  ``megatron.core.dist_checkpointing.save``);
* wraps every model chunk with PEFT 0.7.1 exactly as MindSpeed-LLM does (``LoraConfig(...,
  megatron_config=<TransformerConfig>, megatron_core="megatron.core")`` + ``get_peft_model``; for MoE
  models MindSpeed's ``LoraParallelLinearMoE``), checks what PEFT built, fills lora_A / lora_B with
  seeded values, runs the LoRA forward and saves the LoRA at iteration 10 (filtered like
  ``--lora-ckpt-filter`` or unfiltered) next to a leftover iteration 5 holding other LoRA values;
* records every MoE router decision (tokens per expert, the margin of every top-k choice);
* the main process then writes ``logits.pt`` (real Megatron logits with and without LoRA, trimmed to the
  real vocabulary), ``hf_ref/`` (config, generation config, tiny tokenizer, chat template; no weights),
  runs the family's independent HF check (transformers' own model class built from the canonical global
  tensors, LoRA merged in fp32, against the Megatron logits), writes ``fixture.json`` with the family's
  description, and derives the fixtures that are rewrites of a built one.

Everything is deterministic: regenerating a fixture reproduces its bytes on the same machine and library
versions (``.metadata`` of torch_dist checkpoints included: its save id, directory and write order are
pinned).  The HF names and mappings in the families are oracles: nothing here imports lora_merge.

    PYTHONPATH=.fixture-deps python scripts/make_fixtures.py --family {dense,moe,deepseek} [--only NAME ...]

PEFT 0.7.1 must be installed apart (PEFT >= 0.8's Megatron path is broken or different):
    pip install --no-deps --target .fixture-deps peft==0.7.1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import itertools
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("dense", "moe", "deepseek")

# The tiny model every family starts from (a family's dims override some of it).
TINY = dict(
    num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=8, ffn_hidden_size=96,
    vocab_size=250, make_vocab_size_divisible_by=64, seq_length=16, max_position_embeddings=32,
    rotary_base=10000, norm_epsilon=1e-6,
)
BATCH = 2
LORA_R = 4
LORA_ALPHA = 12
GQA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
BASE_ITER = 1
LORA_ITER = 10
STALE_LORA_ITER = 5
STALE_SEED_OFFSET = 777  # the leftover iter_0000005 LoRA uses lora_seed + this
INPUT_SEED = 1234
MIN_REL_MARGIN = 1e-3  # smallest top-k router margin, relative to the row's score range
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")


def padded_vocab(tp: int) -> int:
    m = TINY["make_vocab_size_divisible_by"] * tp
    return -(-TINY["vocab_size"] // m) * m


def layer_layout(spec: dict, num_layers: int) -> dict:
    """{(pp_rank, vp_stage): [global layer indices]}: the chunks take the layers in order, chunk (p, v)
    coming after every chunk of an earlier virtual stage (for v: for p); a stage's count is split evenly
    over its virtual stages (the first stage's count may differ: num_layers_in_first_pipeline_stage)."""
    PP, VPP = spec.get("pp", 1), spec.get("vpp") or 1
    first = spec.get("first_stage_layers")
    counts = [num_layers // PP] * PP if first is None else [first] + [(num_layers - first) // (PP - 1)] * (PP - 1)
    assert sum(counts) == num_layers and all(c % VPP == 0 for c in counts), counts
    chunks = [(p, v) for v in range(VPP) for p in range(PP)]
    sizes = [counts[p] // VPP for p, _ in chunks]
    return {chunk: list(range(end - n, end)) for chunk, n, end in zip(chunks, sizes, itertools.accumulate(sizes))}


def rank_dir(tp_rank: int, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM get_checkpoint_name: mp_rank_TT, plus _PPP when PP > 1 and _EEE when EP > 1."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


# --------------------------------------------------------------------------------------------
# Canonical global tensors (Megatron TP=1 layout, global layer indices)
# --------------------------------------------------------------------------------------------

def randn(torch, seed: int, name: str, shape, std: float, mean: float = 0.0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean


def canonical_gpt_base(torch, seed: int, qkv_bias: bool, vpad: int, dm: dict,
                       qk_norm: bool = False, tied: bool = False) -> dict:
    """A GQA GPTModel's tensors (swiglu MLP in every layer); MoE and MLA families replace some of them."""
    H, F = dm["hidden_size"], dm["ffn_hidden_size"]
    NH, NG, D = dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    QKV = (NH + 2 * NG) * D
    t = {}
    # (tied: the embedding is the output layer too; a smaller scale keeps the logits moderate)
    t["embedding.word_embeddings.weight"] = randn(torch, seed, "emb", (vpad, H), 0.1 if tied else 0.5)
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}."
        t[p + "input_layernorm.weight"] = randn(torch, seed, p + "ln1", (H,), 0.1, 1.0)
        # global qkv, already in Megatron's group-interleaved row order [q_g | k_g | v_g] per group
        t[p + "self_attention.linear_qkv.weight"] = randn(torch, seed, p + "qkv", (QKV, H), 0.06)
        if qkv_bias:
            t[p + "self_attention.linear_qkv.bias"] = randn(torch, seed, p + "qkvb", (QKV,), 0.05)
        if qk_norm:  # Qwen3: RMSNorm over head_dim on q and k
            t[p + "self_attention.q_layernorm.weight"] = randn(torch, seed, p + "qln", (D,), 0.1, 1.0)
            t[p + "self_attention.k_layernorm.weight"] = randn(torch, seed, p + "kln", (D,), 0.1, 1.0)
        t[p + "self_attention.linear_proj.weight"] = randn(torch, seed, p + "proj", (H, NH * D), 0.06)
        t[p + "pre_mlp_layernorm.weight"] = randn(torch, seed, p + "ln2", (H,), 0.1, 1.0)
        # global fc1 = [gate ; up]
        t[p + "mlp.linear_fc1.weight"] = randn(torch, seed, p + "fc1", (2 * F, H), 0.06)
        t[p + "mlp.linear_fc2.weight"] = randn(torch, seed, p + "fc2", (H, F), 0.06)
    t["decoder.final_layernorm.weight"] = randn(torch, seed, "lnf", (H,), 0.1, 1.0)
    if not tied:
        t["output_layer.weight"] = randn(torch, seed, "out", (vpad, H), 0.06)
    return t


def add_experts(torch, t: dict, spec: dict, dm: dict, layers, shared_ffn, shared_gate=False, bias_std=None) -> dict:
    """The MoE layers of a canonical base: router (its own seed, picked so that no top-k choice is near a
    tie), optional expert bias, every expert as one [2F, H] / [H, F] pair, optional shared expert."""
    seed, router_seed = spec["base_seed"], spec.get("router_seed", spec["base_seed"])
    H, F, E = dm["hidden_size"], dm["moe_ffn_hidden_size"], spec["num_experts"]
    for i in layers:
        p = f"decoder.layers.{i}.mlp."
        del t[p + "linear_fc1.weight"], t[p + "linear_fc2.weight"]
        t[p + "router.weight"] = randn(torch, router_seed, p + "router", (E, H), spec["router_std"])
        if bias_std is not None:
            t[p + "router.expert_bias"] = randn(torch, router_seed, p + "bias", (E,), bias_std)
        for e in range(E):
            q = f"{p}experts.{e}."
            t[q + "linear_fc1.weight"] = randn(torch, seed, q + "fc1", (2 * F, H), 0.1)  # [gate; up]
            t[q + "linear_fc2.weight"] = randn(torch, seed, q + "fc2", (H, F), 0.1)
        if shared_ffn:
            q = p + "shared_experts."
            t[q + "linear_fc1.weight"] = randn(torch, seed, q + "fc1", (2 * shared_ffn, H), 0.08)
            t[q + "linear_fc2.weight"] = randn(torch, seed, q + "fc2", (H, shared_ffn), 0.08)
            if shared_gate:
                t[q + "gate_weight"] = randn(torch, seed, q + "gate", (1, H), 0.3)
    return t


def mlp_lora_modules(out: dict, i: int, moe: bool, dm: dict, num_experts: int, shared_ffn) -> dict:
    """{global module path: (in, out)} of layer i's MLP linears PEFT wraps (every expert, the shared one)."""
    p, H, F, Fd = f"decoder.layers.{i}.mlp.", dm["hidden_size"], dm.get("moe_ffn_hidden_size"), dm["ffn_hidden_size"]
    if not moe:
        out[p + "linear_fc1"], out[p + "linear_fc2"] = (H, 2 * Fd), (Fd, H)
        return out
    for e in range(num_experts):
        out[f"{p}experts.{e}.linear_fc1"], out[f"{p}experts.{e}.linear_fc2"] = (H, 2 * F), (F, H)
    if shared_ffn:
        out[p + "shared_experts.linear_fc1"], out[p + "shared_experts.linear_fc2"] = (H, 2 * shared_ffn), (shared_ffn, H)
    return out


def lora_factors(torch, seed: int, modules: dict) -> dict:
    """lora_A [r, in], lora_B [out, r] per module {global path: (in, out)}; B's rows in W's global row order."""
    t = {}
    for m, (fin, fout) in modules.items():
        t[m + ".lora_A.weight"] = randn(torch, seed, m + ".A", (LORA_R, fin), 0.1)
        t[m + ".lora_B.weight"] = randn(torch, seed, m + ".B", (fout, LORA_R), 0.1)
    return t


def mtp_name(name: str, num_layers: int) -> str:
    """A decoder layer L+k's name -> MTP layer k's transformer layer's (other names unchanged)."""
    if name.startswith("decoder.layers."):
        i, rest = name.split(".", 3)[2:]
        if int(i) >= num_layers:
            return f"mtp.layers.{int(i) - num_layers}.transformer_layer.{rest}"
    return name


def mtp_as_layers(t: dict, num_layers: int) -> dict:
    """mtp_name's inverse on a whole dict: MTP layer k's transformer layer named as decoder layer L+k."""
    out = {}
    for name, x in t.items():
        if name.startswith("mtp.layers.") and ".transformer_layer." in name:
            k, rest = name[len("mtp.layers."):].split(".transformer_layer.")
            name = f"decoder.layers.{num_layers + int(k)}.{rest}"
        out[name] = x
    return out


def as_mtp_layers(torch, t: dict, spec: dict, dm: dict) -> dict:
    """A canonical base made with L+n decoder layers (n = spec["mtp"]) -> L layers and n MTP layers, each with
    its own enorm, hnorm (RMSNorms), eh_proj [H, 2H] and final_layernorm; their routers get a seed of their own
    (spec["mtp_router_seed"], chosen for their top-k margins)."""
    L, H, seed = dm["num_layers"], dm["hidden_size"], spec["base_seed"]
    t = {mtp_name(name, L): x for name, x in t.items()}
    for k in range(spec.get("mtp", 0)):
        p = f"mtp.layers.{k}."
        t[p + "enorm.weight"] = randn(torch, seed, p + "enorm", (H,), 0.1, 1.0)
        t[p + "hnorm.weight"] = randn(torch, seed, p + "hnorm", (H,), 0.1, 1.0)
        t[p + "eh_proj.weight"] = randn(torch, seed, p + "eh_proj", (H, 2 * H), 0.06)
        t[p + "final_layernorm.weight"] = randn(torch, seed, p + "lnf", (H,), 0.1, 1.0)
        r = p + "transformer_layer.mlp.router."
        if r + "weight" in t:
            t[r + "weight"] = randn(torch, spec["mtp_router_seed"], r + "weight", t[r + "weight"].shape,
                                    spec["router_std"])
        if r + "expert_bias" in t:
            t[r + "expert_bias"] = randn(torch, spec["mtp_router_seed"], r + "bias", (spec["num_experts"],),
                                         spec["bias_std"])
    return t


def hf_mtp_extras(out: dict, base: dict, num_layers: int, n: int) -> None:
    """MTP layer k's own HF tensors as releases store them under model.layers.{L+k}: enorm, hnorm, eh_proj,
    shared_head.norm (Megatron's final_layernorm) and copies of the embedding and lm_head (out has the main ones)."""
    for k in range(n):
        p, h = f"mtp.layers.{k}.", f"model.layers.{num_layers + k}."
        for mine, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("final_layernorm", "shared_head.norm")):
            out[h + theirs + ".weight"] = base[p + mine + ".weight"]
        out[h + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[h + "shared_head.head.weight"] = out["lm_head.weight"]


def shard(torch, name: str, x, tp_rank: int, tp: int):
    """Slice rank tp_rank's shard of a canonical global tensor, as Megatron / PEFT lay it out."""
    if tp == 1:
        return x.clone()
    col0 = lambda: x.chunk(tp, dim=0)[tp_rank].clone()  # noqa: E731
    col1 = lambda: x.chunk(tp, dim=1)[tp_rank].clone()  # noqa: E731
    if name.endswith(("layernorm.weight", ".enorm.weight", ".hnorm.weight")):
        return x.clone()  # replicated (the MTP layers' enorm / hnorm too)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return col0()  # vocab parallel
    is_fc1 = ".linear_fc1." in name
    if is_fc1 and name.endswith(("linear_fc1.weight", "linear_fc1.bias", "lora_B.weight")):
        # swiglu: every rank holds [gate shard ; up shard] (its bias too)
        gate, up = x.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]]).clone()
    # MLA: Megatron-Core's local spec builds the down-projections as ColumnParallelLinear too (their output
    # is gathered before q_layernorm / kv_layernorm); TransformerEngine's spec duplicates them instead
    mla_column = (".linear_q_down_proj.", ".linear_kv_down_proj.", ".linear_q_up_proj.", ".linear_kv_up_proj.",
                  ".linear_q_proj.")
    column = ".linear_qkv." in name or ".eh_proj." in name or is_fc1 or any(m in name for m in mla_column)
    row = ".linear_proj." in name or ".linear_fc2." in name
    if name.endswith(".core_attention.softmax_offset"):
        return col0()  # attention sinks (softmax_type="learnable"): one per head, split over TP by heads
    if row and name.endswith(".bias"):
        return x.clone()  # a row-parallel linear's bias is replicated (added after the all-reduce)
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
    if name.startswith(("decoder.final_layernorm.", "output_layer.", "mtp.")):
        return name if last else None
    return name


# --------------------------------------------------------------------------------------------
# Training args and checkpoint files as megatron.training writes them
# --------------------------------------------------------------------------------------------

def megatron_args(torch, spec: dict, dm: dict, iteration: int, world_size: int, lora: bool, lora_filter: bool,
                  load: str, save: str):
    """Megatron-LM 0.16.1 training args of a GPT run; spec["family"] (qwen2 | qwen3 | llama) sets the
    attention's qkv bias and q/k layernorm. First-generation fixtures (gen 1) keep their exact args."""
    from argparse import Namespace
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    bf16 = spec["dtype"] == "bfloat16"
    qkv_bias = spec["family"] == "qwen2"
    a = Namespace(
        # parallelism
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False, world_size=world_size,
        data_parallel_size=1, rank=0,
        # model
        num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], ffn_hidden_size=dm["ffn_hidden_size"],
        num_attention_heads=dm["num_attention_heads"], group_query_attention=True,
        num_query_groups=dm["num_query_groups"], kv_channels=dm["kv_channels"],
        padded_vocab_size=padded_vocab(spec["tp"]), make_vocab_size_divisible_by=dm["make_vocab_size_divisible_by"],
        add_qkv_bias=qkv_bias, add_bias_linear=False, add_dense_bias=False, swiglu=True,
        untie_embeddings_and_output_weights=True, normalization="RMSNorm", norm_epsilon=dm["norm_epsilon"],
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=dm["rotary_base"],
        rotary_percent=1.0, rotary_interleaved=False, rope_scaling_type=None, seq_length=dm["seq_length"],
        max_position_embeddings=dm["max_position_embeddings"], qk_layernorm=False, num_experts=None,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16, fp16=False, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        transformer_impl="local", use_mcore_models=True, use_legacy_models=False, spec=None,
        # MindSpeed layer knobs
        noop_layers=None, num_layer_list=None,
        # checkpointing
        ckpt_format="torch", use_dist_ckpt=False, load=load, save=save, finetune=lora, no_load_optim=True,
        no_load_rng=True, no_save_optim=True,
        # tokenizer / training
        tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="/data/models/tiny-hf", micro_batch_size=1,
        global_batch_size=2, train_iters=LORA_ITER, lr=1e-4, min_lr=1e-6, iteration=iteration,
        # LoRA (MindSpeed defaults when not fine-tuning with LoRA: r=16, alpha=32, no targets)
        lora_r=LORA_R if lora else 16, lora_alpha=LORA_ALPHA if lora else 32,
        lora_target_modules=list(spec["targets"]) if lora else [], lora_ckpt_filter=bool(lora_filter),
        lora_load=None, lora_fusion=False, lora_register_forward_hook=["word_embeddings", "input_layernorm"],
    )
    if spec.get("gen", 2) >= 2:
        # second-generation fixtures: the fields that vary, plus a few more Megatron-LM 0.16.1
        # training args (names as in megatron/training/arguments.py).
        vpp = spec.get("vpp")
        dist_base = spec.get("base_format", "torch") == "torch_dist"
        fmt = "torch_dist" if (dist_base and not lora) else "torch"
        vars(a).update(
            num_layers=dm["num_layers"], kv_channels=dm["kv_channels"], add_qkv_bias=qkv_bias,
            untie_embeddings_and_output_weights=not spec.get("tied", False), qk_layernorm=spec["family"] == "qwen3",
            virtual_pipeline_model_parallel_size=vpp,
            num_layers_per_virtual_pipeline_stage=(dm["num_layers"] // spec["pp"] // vpp) if vpp else None,
            ckpt_format=fmt, use_dist_ckpt=fmt != "torch", num_virtual_stages_per_pipeline_rank=None,
            decoder_first_pipeline_num_layers=spec.get("first_stage_layers"), decoder_last_pipeline_num_layers=None,
            pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False, overlap_p2p_comm=vpp is not None, use_distributed_optimizer=False,
            auto_detect_ckpt_format=dist_base and lora,  # the LoRA run loads a torch_dist base, saves legacy
            ckpt_fully_parallel_save=True, ckpt_assume_constant_structure=False, async_save=False, no_save_rng=False,
        )
    return a


def moe_args(torch, spec: dict, dm: dict, attention: str, topk: int, iteration, world, lora, filtered, load, save,
             grouped=False):
    """megatron_args of an MoE run (PP = 1, the four GQA targets): expert parallelism, router, experts.
    spec: tp, ep, etp, num_experts, pre_softmax, moe_layer_freq, shared, shared_gate (base_format)."""
    like = dict(tp=spec["tp"], pp=1, dtype="float32", family=attention, targets=GQA_TARGETS, gen=2,
                base_format=spec.get("base_format", "torch"))
    a = megatron_args(torch, like, dm, iteration, world, lora=lora, lora_filter=filtered, load=load, save=save)
    vars(a).update(
        ffn_hidden_size=dm["ffn_hidden_size"], data_parallel_size=world // spec["tp"],
        expert_model_parallel_size=spec["ep"], expert_tensor_parallel_size=spec["etp"],
        num_experts=spec["num_experts"], moe_ffn_hidden_size=dm["moe_ffn_hidden_size"], moe_router_topk=topk,
        moe_router_pre_softmax=spec["pre_softmax"], moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
        moe_router_enable_expert_bias=False, moe_router_dtype=None, moe_input_jitter_eps=None,
        moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=False, moe_permute_fusion=False,
        moe_layer_freq=copy.deepcopy(spec["moe_layer_freq"]), moe_shared_expert_intermediate_size=spec["shared"],
        moe_shared_expert_gate=bool(spec["shared_gate"]), moe_shared_expert_overlap=False,
        moe_tp_extend_ep=False,  # MindSpeed flag (LoRA refuses it)
    )
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


def save_legacy(torch, root: Path, iteration: int, dirname: str, args, model_sd, gen: int) -> Path:
    """Legacy checkpoint file; model_sd is one state dict, or a list of them (VPP: model0, model1, ...)."""
    d = root / f"iter_{iteration:07d}" / dirname
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(model_sd, list):
        models = {f"model{v}": sd for v, sd in enumerate(model_sd)} if len(model_sd) > 1 else {"model": model_sd[0]}
    else:
        models = {"model": model_sd}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, **models,
             "rng_state": make_rng_state(torch, gen)}
    if gen < 2:
        state["opt_param_scheduler"] = {
            "max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": iteration * 2,
            "lr_decay_style": "cosine", "lr_decay_steps": LORA_ITER * 2, "min_lr": 1e-6,
            "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
        }
    else:
        # Megatron's generate_state_dict saves opt_param_scheduler only without --no-save-optim
        # (args.no_save_optim is True here), and puts rng_state after it
        assert args.no_save_optim
    state["num_floating_point_operations_so_far"] = 0
    path = d / "model_optim_rng.pt"
    torch.save(state, path)
    return path


def pinned_dist_save(state: dict, d: Path, ckpt_id: str, metadata: dict) -> None:
    """megatron.core.dist_checkpointing.save of `state` into `d`, reproducibly: .metadata's storage_meta records
    the save directory and a random uuid4 save_id; both are pinned (`ckpt_id`: the directory as the training
    run's save path would name it, so no local path ends up in it). The write threads (2 per rank) also finish
    in any order, which only permutes the storage_data dict of .metadata: every rank's results are sorted by
    (file, offset)."""
    import uuid

    import torch.distributed.checkpoint.filesystem as dcp_fs
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from torch.distributed.checkpoint.metadata import StorageMeta

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


def save_dist_checkpoint(torch, root: Path, iteration: int, args, model, singleton: bool, rng_state):
    """torch_dist checkpoint as megatron.training.checkpointing.save_checkpoint (0.16.1) writes it:
    generate_state_dict(...) with model.sharded_state_dict(metadata=_build_sharded_state_dict_metadata
    (args)), rng_state as a ShardedObject, then dist_checkpointing.save(..., content_metadata=...)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    d = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = {
        # Megatron-LM 0.16.1 _build_sharded_state_dict_metadata (no distributed optimizer): it
        # hard-codes singleton_local_shards=False; the singleton fixtures set it to True here.
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
    pinned_dist_save(state, d, f"{args.save}/iter_{iteration:07d}", metadata)
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


# --------------------------------------------------------------------------------------------
# CPU shims (none changes the arithmetic) and MindSpeed's LoRA linear for MoE
# --------------------------------------------------------------------------------------------

def patch_cuda(torch):
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # LanguageModule.setup_embeddings_and_output_layer does `weight.data = weight.data.cuda()`
    # before the embedding-group all-reduce (tied embeddings with PP > 1)
    torch.Tensor.cuda = lambda self, *a, **k: self


def patch_moe_cpu(torch):
    """The MoE forward of megatron-core 0.16.1 on CPU: the alltoall dispatcher's CUDA stream / event become
    no-op objects, its split sizes are handed to gloo's all_to_all_single as Python lists, and
    moe_utils.te_general_gemm (undefined without TransformerEngine -> NameError) is set to None, which
    selects the plain matmul router."""
    class _Event:
        def synchronize(self):
            pass

    class _Stream:
        def wait_stream(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return _Event()

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None  # never defined without TransformerEngine -> NameError
    orig = token_dispatcher.all_to_all

    def as_list(s):
        if s is None:
            return None
        return [int(v) for v in (s.tolist() if hasattr(s, "tolist") else s)]

    def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
        # on a GPU the splits are moved to host numpy arrays; here they stay CPU tensors, which
        # gloo's all_to_all_single rejects: hand them over as lists
        return orig(group, input_, as_list(output_split_sizes), as_list(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all


def patch_sliding_window_cpu():
    """Sliding-window attention (TransformerConfig.window_size) on CPU: megatron-core 0.16.1's
    transformer.utils.get_sliding_window_causal_mask builds its mask with device="cuda"; the local
    FusedScaleMaskSoftmax (fusions.fused_softmax, which imported it by name) gets the same mask on the CPU."""
    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_sliding_window_causal_mask(sq, skv, window_size):
        # megatron-core 0.16.1's own body, device="cuda" dropped: True = masked; query i sees keys j with
        # i - window_size[0] <= j <= i + window_size[1] (sq == skv)
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
        return ~ml

    utils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def make_lora_parallel_linear_moe():
    """MindSpeed-LLM's LoraParallelLinearMoE (mindspeed_llm/tasks/posttrain/lora/lora_moe.py) for
    PEFT 0.7.1: identical to PEFT's LoraParallelLinear except that lora_A / lora_B are built with
    is_expert=base_layer.is_expert (expert TP group, no TP all-reduce inside an expert)."""
    import torch
    from peft.tuners.lora import tp_layer
    from torch import nn
    from torch.nn import init

    class LoraParallelLinearMoE(tp_layer.LoraParallelLinear):
        def update_layer(self, adapter_name, r, lora_alpha, lora_dropout, init_lora_weights,
                         init_method=init.xavier_normal_, input_is_parallel=True, gather_output=False,
                         **parallel_linear_kwargs):
            is_expert = getattr(self.get_base_layer(), "is_expert", False)
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            self.lora_dropout[adapter_name] = nn.Dropout(p=lora_dropout) if lora_dropout > 0 else nn.Identity()
            megatron_config = parallel_linear_kwargs["megatron_config"]
            megatron_config.params_dtype = torch.float32
            if self.is_paralle_a:
                lora_a = self.backend.RowParallelLinear(
                    input_size=self.in_features, output_size=r, bias=False,
                    input_is_parallel=input_is_parallel, skip_bias_add=True, init_method=init_method,
                    config=megatron_config, is_expert=is_expert)
                lora_b = nn.Linear(in_features=r, out_features=self.out_features, bias=False, dtype=torch.float32)
            else:
                lora_a = nn.Linear(in_features=self.in_features, out_features=r, bias=False, dtype=torch.float32)
                lora_b = self.backend.ColumnParallelLinear(
                    input_size=r, output_size=self.out_features, bias=False, gather_output=gather_output,
                    init_method=init_method, config=megatron_config, is_expert=is_expert)
            self.lora_A[adapter_name] = lora_a
            self.lora_B[adapter_name] = lora_b
            self.scaling[adapter_name] = lora_alpha / r
            if init_lora_weights:
                self.reset_lora_parameters(adapter_name, init_lora_weights)
            weight = getattr(self.get_base_layer(), "weight", None)
            if weight is not None:
                self.to(weight.device, dtype=weight.dtype)
            self.set_adapter(self.active_adapters)

    return LoraParallelLinearMoE


def config_kwargs(rk) -> dict:
    """TransformerConfig keywords every fixture model shares: CPU initialisation, an fp32 forward (bf16
    checkpoints are cast afterwards, as Float16Module does), no fusion, no dropout, swiglu, RMSNorm."""
    import torch
    import torch.nn.functional as F

    dm = rk.dm
    return dict(
        num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
        ffn_hidden_size=dm["ffn_hidden_size"], add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=dm["norm_epsilon"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=rk.TP, pipeline_model_parallel_size=rk.PP, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, mtp_num_layers=rk.spec.get("mtp"),
    )


def moe_config_kwargs(rk, topk: int, score: str, layer_freq, shared_ffn, grouped: bool = False) -> dict:
    """TransformerConfig keywords of the MoE layers (alltoall dispatcher, no load balancing loss)."""
    spec = rk.spec
    return dict(
        expert_model_parallel_size=rk.EP, expert_tensor_parallel_size=rk.ETP, num_moe_experts=spec["num_experts"],
        moe_ffn_hidden_size=rk.dm["moe_ffn_hidden_size"], moe_router_topk=topk, moe_router_score_function=score,
        moe_router_pre_softmax=spec["pre_softmax"], moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped, moe_layer_freq=copy.deepcopy(layer_freq),
        moe_shared_expert_intermediate_size=shared_ffn,
    )


# --------------------------------------------------------------------------------------------
# A family: what a fixture family changes in the outline (a spec module subclasses it)
# --------------------------------------------------------------------------------------------

class Family:
    name = ""          # the --family value, and the spec module's name
    out = ""           # default output folder, under the repository
    built: dict = {}   # fixtures made by a Megatron run: name -> spec
    derived: dict = {}  # fixtures rewritten from a built one's files: name -> how
    json_indent = 2
    mindspeed_moe_lora = False  # MindSpeed's LoraParallelLinearMoE replaces PEFT's LoraParallelLinear
    routed = False     # MoE layers: every router decision is recorded

    # ---- in every rank ----
    def patch_cpu(self, torch):
        """CPU shims beyond patch_cuda."""

    def dims(self, spec: dict) -> dict:
        raise NotImplementedError

    def make_config(self, rk, **variant):
        raise NotImplementedError

    def layer_spec(self, rk, config, **variant):
        raise NotImplementedError

    def targets(self, spec: dict) -> list:
        return list(spec["targets"])

    def model_kwargs(self, spec: dict) -> dict:
        """GPTModel keywords beyond the shared ones (e.g. rotary_percent)."""
        return {}

    def canonical_base(self, torch, spec: dict, vpad: int) -> dict:
        raise NotImplementedError

    def canonical_lora(self, torch, spec: dict, seed: int) -> dict:
        raise NotImplementedError

    def lora_modules(self, spec: dict) -> dict:
        """MoE families: {global module path: (in, out)} of every module PEFT wraps (expert_peft_layout)."""
        raise NotImplementedError

    def make_args(self, torch, spec, iteration, world, lora, filtered, load, save):
        raise NotImplementedError

    def after_build(self, rk):
        """Runs once the model is built (rk.extra: more summary entries)."""

    def routing_stats(self, torch, spec, logits, rmap, bias) -> dict:
        raise NotImplementedError

    def after_base_save(self, rk, base_sd):
        """Runs once the base checkpoint is saved, before PEFT wraps the model."""

    def peft_layout(self, rk):
        """(what PEFT built per module kind, the wrapped module names); asserts it is what MindSpeed gets."""
        raise NotImplementedError

    def extra_forwards(self, rk):
        """Runs after the LoRA checkpoint is saved (rk.extra: more summary entries)."""

    def rank_summary(self, rk) -> dict:
        """Summary entries that every rank helps gather (collectives allowed)."""
        return {}

    # ---- in the main process ----
    def all(self) -> list:
        return list(self.built) + list(self.derived)

    def to_build(self, names: list, out: Path) -> list:
        """The built fixtures a run over `names` makes (a derived one may need its source)."""
        return [n for n in self.built if n in names]

    def hf_config(self, spec: dict):
        raise NotImplementedError

    def finish_hf_ref(self, spec: dict, d: Path):
        """Runs after hf_ref/ is written."""

    def fixture_json(self, torch, name, spec, d: Path, summary: dict, opts) -> dict:
        raise NotImplementedError

    def derive(self, torch, name: str, out: Path, opts):
        raise NotImplementedError

    def finish(self, out: Path, built: list):
        """Runs after every fixture of the run is made."""


def family(name: str) -> Family:
    return importlib.import_module(f"{__package__}.{name}").FAMILY


# --------------------------------------------------------------------------------------------
# One rank of a fixture's Megatron world
# --------------------------------------------------------------------------------------------

def canonical_key(state_dict_key: str) -> str:
    return state_dict_key.replace(".base_layer.", ".").replace(".default.", ".")


class Rank:
    """A rank's model chunks, the canonical values sliced for it, and the passes over them."""

    def __init__(self, fam: Family, rank: int, world: int, name: str, spec: dict, out_dir: str):
        import random

        import numpy as np
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.family, self.rank, self.world, self.name, self.spec = fam, rank, world, name, spec
        self.torch, self.dist, self.ps = torch, dist, ps
        self.out = Path(out_dir) / name
        self.TP, self.PP, self.VPP = spec["tp"], spec.get("pp", 1), spec.get("vpp")  # VPP: None or >= 2
        self.EP, self.ETP = spec.get("ep", 1), spec.get("etp")
        ps.initialize_model_parallel(tensor_model_parallel_size=self.TP, pipeline_model_parallel_size=self.PP,
                                     virtual_pipeline_model_parallel_size=self.VPP,
                                     expert_model_parallel_size=self.EP, expert_tensor_parallel_size=self.ETP)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        torch.manual_seed(1)  # instead of model_parallel_cuda_manual_seed (needs CUDA)
        random.seed(1)  # the rng_state saved in the checkpoints must be deterministic too
        np.random.seed(1)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

        self.dm = fam.dims(spec)
        self.vpad = padded_vocab(self.TP)
        self.layout = layer_layout(spec, self.dm["num_layers"])
        self.bf16 = spec.get("dtype", "float32") == "bfloat16"
        self.gen = spec.get("gen", 2)
        self.filtered = spec.get("lora", "filtered") == "filtered"
        self.tied = spec.get("tied", False)
        self.dirname = rank_dir(self.tp_rank, self.pp_rank, self.PP, self.ep_rank, self.EP)
        self.saves = self.edp_rank == 0  # Megatron-LM legacy save: expert-data-parallel rank 0 writes
        self.writer = self.last and self.tp_rank == 0 and self.dp_rank == 0
        self.extra = {}  # summary entries the family's hooks add
        self.route_log = []

    # ---- model ----
    def build(self, config, **variant):
        """The model chunks of this rank, as megatron.training.get_model builds them (one per virtual
        stage, pre_process / post_process per chunk); Megatron's own layer numbering checked."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        chunks, firsts, lasts = [], [], []
        for v in range(self.VPP or 1):
            vp = v if self.VPP else None
            pre = self.ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            post = self.ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            layer_spec = self.family.layer_spec(self, config, **variant)
            mtp = {}
            if self.spec.get("mtp"):  # multi-token-prediction layers: on the last stage, the last layer's spec
                mtp["mtp_block_spec"] = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False,
                                                               vp_stage=vp, pp_rank=self.pp_rank)
            m = GPTModel(
                config=config, transformer_layer_spec=layer_spec, **mtp,
                vocab_size=self.vpad, max_sequence_length=self.dm["max_position_embeddings"], pre_process=pre,
                post_process=post, parallel_output=True, share_embeddings_and_output_weights=self.tied,
                position_embedding_type="rope", rotary_base=self.dm["rotary_base"],
                **self.family.model_kwargs(self.spec), **({"vp_stage": vp} if self.VPP else {}),
            )
            m.eval()
            got = [layer.layer_number - 1 for layer in m.decoder.layers]
            assert got == self.layout[(self.pp_rank, v)], (self.pp_rank, v, got, self.layout[(self.pp_rank, v)])
            chunks.append(m)
            firsts.append(pre)
            lasts.append(post)
        return chunks, firsts, lasts

    def localize(self, glob: dict) -> list:
        """Canonical global tensors -> per model chunk, this rank's state-dict names and shards (local
        expert k of EP rank p is global expert p * E_local + k; experts shard over the expert TP group)."""
        torch = self.torch
        res = []
        for v in range(len(self.chunks)):
            d = {}
            for k, x in glob.items():
                lk = to_local_layer(k, self.layout[(self.pp_rank, v)], self.chunk_first[v], self.chunk_last[v])
                if lk is None:
                    continue
                if ".mlp.experts." in k:
                    parts, e_loc = lk.split("."), self.spec["num_experts"] // self.EP
                    at = parts.index("experts") + 1  # decoder.layers.i.mlp.experts.E / mtp.layers.k.….experts.E
                    if int(parts[at]) // e_loc != self.ep_rank:
                        continue
                    lk = ".".join(parts[:at] + ["local_experts", str(int(parts[at]) % e_loc)] + parts[at + 1:])
                    x = shard(torch, lk, x, self.etp_rank, self.spec["etp"])
                elif k.endswith(("mlp.router.weight", "mlp.router.bias", "mlp.router.expert_bias",
                                 "shared_experts.gate_weight")):
                    x = x.clone()  # replicated
                else:
                    x = shard(torch, k, x, self.tp_rank, self.TP)
                d[lk] = x.to(torch.bfloat16).to(torch.float32) if self.bf16 else x
            res.append(d)
        return res

    def fill(self, values: list):
        """Load values into the (maybe PEFT-wrapped) model chunks; every non-extra-state key must be set,
        and every value used."""
        for v, m in enumerate(self.chunks):
            sd = m.state_dict()
            new = {}
            for k, x in sd.items():
                if k.endswith("_extra_state"):
                    new[k] = x
                    continue
                ck = canonical_key(k)
                assert ck in values[v], f"rank {self.rank} chunk {v}: no value for {k}"
                assert values[v][ck].shape == x.shape, f"{k}: {tuple(values[v][ck].shape)} vs {tuple(x.shape)}"
                new[k] = values[v][ck]
            unused = set(values[v]) - {canonical_key(k) for k in sd}
            assert not unused, sorted(unused)[:5]
            m.load_state_dict(new, strict=True)
        if self.tied and self.PP > 1:
            for m in self.chunks:
                m.setup_embeddings_and_output_layer()  # collective over the embedding group
            if self.chunk_last[-1]:
                assert self.torch.equal(self.chunks[-1].output_layer.weight.detach(), self.embedding_shard())

    def embedding_shard(self):
        emb = "embedding.word_embeddings.weight"
        return shard(self.torch, emb, self.base_global[emb], self.tp_rank, self.TP)

    def forward(self):
        """Chunks run in the interleaved order: (v=0: pp0, pp1, ...), (v=1: pp0, pp1, ...), ...;
        activations go to the next pipeline rank (ring: the last rank's chunk v feeds pp0's v+1).
        The logits on the last stage (trimmed to the vocabulary), None elsewhere."""
        torch, S, B = self.torch, self.dm["seq_length"], BATCH
        res, mtp = None, self.spec.get("mtp")
        with torch.no_grad():
            for v, m in enumerate(self.chunks):
                if not self.chunk_first[v]:
                    recv = torch.empty(S, B, self.dm["hidden_size"], dtype=torch.float32)
                    self.dist.recv(recv, src=self.ps.get_pipeline_model_parallel_prev_rank())
                    m.set_input_tensor(recv)
                calls, hook = [], None
                if mtp and self.chunk_last[v]:
                    # GPTModel with MTP needs labels and then returns the loss: the logits are the output layer's
                    # calls, one per MTP layer, then the main one
                    hook = m.output_layer.register_forward_hook(lambda mod, a, out: calls.append(out[0].detach().clone()))
                res = m(
                    input_ids=self.input_ids if self.chunk_first[v] else None,
                    position_ids=self.position_ids,
                    attention_mask=self.mask,
                    runtime_gather_output=True,
                    **({"labels": torch.zeros_like(self.input_ids)} if mtp and self.chunk_last[v] else {}),
                )
                if hook is not None:
                    hook.remove()
                    assert len(calls) == mtp + 1, len(calls)
                    res = calls[-1].transpose(0, 1)
                    self.mtp_logits = torch.stack([c.transpose(0, 1)[..., : self.dm["vocab_size"]].float()
                                                   for c in calls[:-1]]).contiguous()
                if not self.chunk_last[v]:
                    self.dist.send(res.contiguous().float(), dst=self.ps.get_pipeline_model_parallel_next_rank())
                    res = None
        if res is None:
            return None
        assert res.shape == (B, S, self.vpad), res.shape
        return res[..., : self.dm["vocab_size"]].float().contiguous()

    def record_routing(self):
        from megatron.core.transformer.moe.router import TopKRouter

        log, E, orig_routing = self.route_log, self.spec["num_experts"], TopKRouter.routing

        def routing(router, logits, *a, **k):
            probs, rmap = orig_routing(router, logits, *a, **k)
            bias = router.expert_bias.detach().clone() if router.expert_bias is not None else None
            log.append((router.layer_number - 1, logits.detach().float().reshape(-1, E).clone(), rmap.clone(), bias))
            return probs, rmap

        TopKRouter.routing = routing

    def routing_stats(self):
        """Per MoE layer, the family's statistics of the router decisions since the last call."""
        res = {str(layer): self.family.routing_stats(self.torch, self.spec, logits, rmap, bias)
               for layer, logits, rmap, bias in self.route_log}
        self.route_log.clear()
        return res if self.family.routed else None

    # ---- checkpoints ----
    def cast_sd(self, sd):
        # Megatron's Float16Module does module.bfloat16(): every floating tensor, norms included
        if not self.bf16:
            return sd
        torch = self.torch
        return type(sd)((k, v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
                        for k, v in sd.items())

    def chunk_sds(self, lora_only: bool = False):
        sds = []
        for m in self.chunks:
            sd = self.cast_sd(m.state_dict_for_save_checkpoint())
            if lora_only:
                sd = type(sd)((k, v) for k, v in sd.items() if "lora" in k)  # --lora-ckpt-filter
            sds.append(sd)
        return sds[0] if not self.VPP else sds

    def check_replicated(self, sds, lora: bool = False):
        """Tensors replicated over TP must be bitwise equal across the TP ranks: norms, and with LoRA the
        A of column-parallel and the B of row-parallel linears (experts: another group, not checked)."""
        if self.TP == 1:
            return
        torch = self.torch
        for sd in (sds if self.VPP else [sds]):
            for k, v in sd.items():
                if v is None or ".experts." in k:
                    continue
                rep = k.endswith("layernorm.weight") or k.endswith("layernorm.bias")
                # (add_bias_linear: row-parallel biases and the router's are replicated over TP)
                rep = rep or k.endswith(("linear_proj.bias", "linear_fc2.bias", "mlp.router.bias"))
                if lora:
                    rep = (("linear_qkv" in k or "linear_fc1" in k) and ".lora_A." in k) or (
                        ("linear_proj" in k or "linear_fc2" in k) and ".lora_B." in k
                    ) or k.endswith("layernorm.weight")
                if rep:
                    gathered = [torch.empty_like(v) for _ in range(self.TP)]
                    self.dist.all_gather(gathered, v.contiguous(), group=self.ps.get_tensor_model_parallel_group())
                    assert all(torch.equal(gathered[0], x) for x in gathered), k

    def args(self, iteration: int, lora: bool):
        fam, name = self.family, self.name
        if lora:
            return fam.make_args(self.torch, self.spec, iteration, self.world, lora=True, filtered=self.filtered,
                                 load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
        return fam.make_args(self.torch, self.spec, iteration, self.world, lora=False, filtered=False,
                             load=f"/data/ckpt/{name}/hf-converted", save=f"/data/ckpt/{name}/base")

    def save_lora(self, iteration: int, sds):
        if self.saves:
            save_legacy(self.torch, self.out / "lora", iteration, self.dirname, self.args(iteration, lora=True),
                        sds, self.gen)

    # ---- the outline ----
    def run(self):
        fam, spec, torch = self.family, self.spec, self.torch
        self.chunks, self.chunk_first, self.chunk_last = self.build(fam.make_config(self))
        self.model = self.chunks[0]
        fam.after_build(self)
        if fam.routed:
            self.record_routing()

        self.base_global = fam.canonical_base(torch, spec, self.vpad)
        self.base_local = self.localize(self.base_global)
        if self.tied and self.PP > 1 and self.chunk_last[-1] and not self.chunk_first[-1]:
            # the last stage's own copy of the embedding: Megatron zeroes it and all-reduces it with
            # the first stage's embedding over the embedding group (setup_embeddings_and_output_layer)
            self.base_local[-1]["output_layer.weight"] = torch.zeros(self.vpad // self.TP, self.dm["hidden_size"])

        S, B = self.dm["seq_length"], BATCH
        g = torch.Generator().manual_seed(INPUT_SEED)
        self.input_ids = torch.randint(0, self.dm["vocab_size"], (B, S), generator=g, dtype=torch.int64)
        self.position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        self.mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)

        # ---------- base ----------
        self.fill(self.base_local)
        self.logits_base = self.forward()
        self.mtp_logits_base = getattr(self, "mtp_logits", None)
        self.route_base = self.routing_stats()
        base_sd = self.chunk_sds()
        self.check_replicated(base_sd)
        args = self.args(BASE_ITER, lora=False)
        if spec.get("base_format", "torch") == "torch_dist":  # Megatron's own dist_checkpointing.save, every rank
            save_dist_checkpoint(torch, self.out / "base", BASE_ITER, args, self.model, spec.get("singleton", False),
                                 make_rng_state(torch, self.gen))
        elif self.saves:
            save_legacy(torch, self.out / "base", BASE_ITER, self.dirname, args, base_sd, self.gen)
        fam.after_base_save(self, base_sd)

        # ---------- PEFT wrap, as MindSpeed-LLM's model_provider_func_wrapper does (per model chunk) ----------
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import tp_layer

        if fam.mindspeed_moe_lora:
            tp_layer.LoraParallelLinear = make_lora_parallel_linear_moe()
        self.peft_models = []
        for m in self.chunks:
            config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=fam.targets(spec), lora_dropout=0.0,
                                bias="none", megatron_config=fam.make_config(self), megatron_core="megatron.core")
            pm = get_peft_model(m, config)
            assert pm.base_model.model is m
            pm.eval()
            self.peft_models.append(pm)
        self.layout_info, self.wrapped = fam.peft_layout(self)

        def with_lora(lora_global):
            return [{**b, **lo} for b, lo in zip(self.base_local, self.localize(lora_global))]

        # leftover, older LoRA checkpoint with other values (the tracker file will not point to it)
        self.fill(with_lora(fam.canonical_lora(torch, spec, spec["lora_seed"] + STALE_SEED_OFFSET)))
        self.save_lora(STALE_LORA_ITER, self.chunk_sds(lora_only=self.filtered))
        self.logits_stale = self.forward()
        self.routing_stats()

        self.lora_global = fam.canonical_lora(torch, spec, spec["lora_seed"])
        self.fill(with_lora(self.lora_global))
        self.logits_lora = self.forward()
        self.mtp_logits_lora = getattr(self, "mtp_logits", None)
        self.route_lora = self.routing_stats()
        lora_sd = self.chunk_sds(lora_only=self.filtered)
        self.check_replicated(lora_sd, lora=True)
        self.save_lora(LORA_ITER, lora_sd)
        self.with_lora = with_lora
        fam.extra_forwards(self)

        gathered = fam.rank_summary(self)
        if self.writer:
            assert self.logits_lora.shape == (B, S, self.dm["vocab_size"])
            mtp = ({"mtp_logits_lora": self.mtp_logits_lora.clone(), "mtp_logits_base": self.mtp_logits_base.clone()}
                   if self.spec.get("mtp") else {})
            torch.save({"input_ids": self.input_ids.clone(), "logits_lora": self.logits_lora.clone(),
                        "logits_base": self.logits_base.clone(), **mtp}, self.out / "logits.pt")
            summary = dict(
                layout=self.layout_info,
                lora_vs_base_max_abs=(self.logits_lora - self.logits_base).abs().max().item(),
                stale_vs_lora_max_abs=(self.logits_stale - self.logits_lora).abs().max().item(),
                **gathered, **self.extra,
            )
            (self.out / ".summary.json").write_text(json.dumps(summary, indent=1, default=str))
        self.dist.barrier()
        self.dist.destroy_process_group()


def worker(rank: int, world: int, family_name: str, name: str, spec: dict, out_dir: str, port: int, peft_dir: str):
    if peft_dir not in sys.path:
        sys.path.insert(0, peft_dir)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    fam = family(family_name)
    patch_cuda(torch)
    fam.patch_cpu(torch)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import peft

    assert peft.__version__ == "0.7.1", f"need PEFT 0.7.1, got {peft.__version__} ({peft.__file__})"
    Rank(fam, rank, world, name, spec, out_dir).run()


# --------------------------------------------------------------------------------------------
# MoE helpers shared by the MoE families (in the ranks, then in the main process)
# --------------------------------------------------------------------------------------------

def expert_peft_layout(rk, dense_prefix: bool):
    """What PEFT (with MindSpeed's LoraParallelLinearMoE) built: per module kind the wrapper, base and
    LoRA linears with their is_expert; every module of family.lora_modules wrapped (this EP rank's experts),
    the router never."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    layout_info, wrapped = {}, []
    for mname, mod in rk.model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            wrapped.append(mname)
            A, Bm = mod.lora_A["default"], mod.lora_B["default"]
            kind = ("expert_" if ".experts." in mname else "shared_" if ".shared_experts." in mname
                    else "dense_" if dense_prefix and ".mlp." in mname else "") + mname.split(".")[-1]
            li = dict(wrapper=type(mod).__name__, base=type(mod.base_layer).__name__,
                      base_is_expert=bool(getattr(mod.base_layer, "is_expert", False)),
                      A=type(A).__name__, A_shape=tuple(A.weight.shape),
                      A_is_expert=bool(getattr(A, "is_expert", False)),
                      B=type(Bm).__name__, B_shape=tuple(Bm.weight.shape),
                      B_is_expert=bool(getattr(Bm, "is_expert", False)), scaling=mod.scaling["default"])
            if isinstance(mod.base_layer, RowParallelLinear):
                assert isinstance(A, RowParallelLinear) and li["A_is_expert"] == li["base_is_expert"], li
            else:
                assert isinstance(mod.base_layer, ColumnParallelLinear)
                assert isinstance(Bm, ColumnParallelLinear) and li["B_is_expert"] == li["base_is_expert"], li
            layout_info.setdefault(kind, li)
    e_loc = rk.spec["num_experts"] // rk.EP
    def expert_at(name):
        return name.split(".").index("experts") + 1

    expect = {k for k in rk.family.lora_modules(rk.spec)
              if ".experts." not in k or int(k.split(".")[expert_at(k)]) // e_loc == rk.ep_rank}

    def global_name(w):
        parts, at = w.split("."), expert_at(w)
        return ".".join(parts[:at] + [str(rk.ep_rank * e_loc + int(parts[at + 1]))] + parts[at + 2:])

    got = {global_name(w) if ".experts.local_experts." in w else w for w in wrapped}
    assert got == expect, (sorted(got ^ expect)[:6])
    assert not [w for w in wrapped if "router" in w]
    return layout_info, wrapped


def expert_rank_summary(rk) -> dict:
    """Every rank computes the same logits (data-parallel replicas of one batch): their largest difference,
    every rank's place (rank dir, local experts) and the router records."""
    torch, dist = rk.torch, rk.dist
    gathered = [torch.empty_like(rk.logits_lora) for _ in range(rk.world)]
    dist.all_gather(gathered, rk.logits_lora)
    replica_diff = max((x - rk.logits_lora).abs().max().item() for x in gathered)
    e_loc = rk.spec["num_experts"] // rk.EP
    info = dict(rank=rk.rank, tp_rank=rk.tp_rank, ep_rank=rk.ep_rank, etp_rank=rk.etp_rank, edp_rank=rk.edp_rank,
                dp_rank=rk.dp_rank, dir=rk.dirname if rk.saves else None,
                local_experts=[rk.ep_rank * e_loc + k for k in range(e_loc)])
    infos = [None] * rk.world
    dist.all_gather_object(infos, info)
    return dict(wrapped_modules_rank0=rk.wrapped, ranks=infos, routing_base=rk.route_base,
                routing_lora=rk.route_lora, replica_logits_max_abs_diff=replica_diff)


def routing_checks(name: str, spec: dict, summary: dict, keys) -> tuple:
    """(smallest relative top-k margin over every forward and MoE layer, tokens per expert per layer):
    no top-k choice near a tie, every expert receiving tokens."""
    min_rel = min(v["min_rel_gap"] for r in keys for v in summary[r].values())
    assert min_rel >= MIN_REL_MARGIN, f"{name}: top-k margin {min_rel} too small: change router seed/scale"
    counts = {r: {layer: v["tokens_per_expert"] for layer, v in summary[r].items()} for r in keys}
    for r, per_layer in counts.items():
        tot = [sum(c[e] for c in per_layer.values()) for e in range(spec["num_experts"])]
        assert all(t > 0 for t in tot), (name, r, tot)
    return min_rel, counts


def routing_margins(torch, spec, logits, rmap):
    """Recompute the routing decisions from the router logits; per token the gap between the last
    chosen and the first rejected candidate (group choice, then expert choice), absolute and relative
    to the row's score range. Asserts the recomputed top-k equals Megatron's routing map."""
    E, K = spec["num_experts"], spec["topk"]
    if spec["score"] == "sigmoid":
        scores = torch.sigmoid(logits)
        if spec["expert_bias"] is not None and isinstance(spec["expert_bias"], torch.Tensor):
            scores = scores + spec["expert_bias"]
    elif spec["pre_softmax"]:
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits
    res = {}
    cand = scores
    if spec["groups"]:
        G, GK = spec["groups"]
        gs = scores.view(-1, G, E // G).topk(K // GK, dim=-1).values.sum(-1)
        s = gs.sort(dim=-1, descending=True).values
        ggap = s[:, GK - 1] - s[:, GK]
        res["min_group_gap"] = float(ggap.min())
        res["min_group_rel_gap"] = float((ggap / (s[:, 0] - s[:, -1])).min())
        gmask = torch.zeros_like(gs, dtype=torch.bool)
        gmask.scatter_(1, gs.topk(GK, dim=-1).indices, True)
        emask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        cand = scores.masked_fill(~emask, float("-inf"))
    s = cand.sort(dim=-1, descending=True).values
    gap = s[:, K - 1] - s[:, K]
    rng = scores.max(-1).values - scores.min(-1).values
    res["min_expert_gap"] = float(gap.min())
    res["min_expert_rel_gap"] = float((gap / rng).min())
    top = torch.zeros_like(rmap)
    top.scatter_(1, cand.topk(K, dim=-1).indices, True)
    assert torch.equal(top, rmap)
    res["tokens_per_expert"] = [int(v) for v in rmap.sum(0)]
    res["min_rel_gap"] = min(v for k, v in res.items() if k.endswith("rel_gap"))
    return res


def check_ep_replicas(torch, d: Path, spec) -> int:
    """Non-expert tensors of every EP rank file of one TP rank must be identical."""
    n = 0
    for part in ("base", "lora"):
        idir = d / part / f"iter_{(BASE_ITER if part == 'base' else LORA_ITER):07d}"
        if (idir / "metadata.json").exists():
            continue
        for t in range(spec["tp"]):
            files = sorted(idir.glob(f"mp_rank_{t:02d}_*"))
            # with ETP < TP the world is smaller than TP x EP: only some (tp, ep) dirs exist
            assert len(files) == (spec["ep"] if spec["etp"] == spec["tp"] else len(files)) and files, files
            sds = [torch.load(f / "model_optim_rng.pt", weights_only=False)["model"] for f in files]
            for k, v in sds[0].items():
                if ".mlp.experts." in k or not torch.is_tensor(v):
                    continue
                for o in sds[1:]:
                    assert torch.equal(o[k], v), (part, k)
                    n += 1
    return n


def key_listing(torch, d: Path) -> dict:
    """{base|lora: {rank dir: [[key, shape], ...]}} of the tracker's iteration, every rank file
    (torch_dist: {"torch_dist": the global keys and shapes})."""
    out = {}
    for part in ("base", "lora"):
        it = int((d / part / "latest_checkpointed_iteration.txt").read_text().strip())
        out[part] = {}
        idir = d / part / f"iter_{it:07d}"
        if (idir / "metadata.json").exists():
            from torch.distributed.checkpoint import FileSystemReader
            md = FileSystemReader(str(idir)).read_metadata()
            out[part]["torch_dist"] = [[k, list(getattr(m, "size", []) or [])] for k, m in md.state_dict_metadata.items()]
            continue
        for rd in sorted(idir.iterdir()):
            sd = torch.load(rd / "model_optim_rng.pt", weights_only=False)["model"]
            out[part][rd.name] = [[k, list(v.shape) if torch.is_tensor(v) else None] for k, v in sd.items()]
    return out


def regroup_experts(sd: dict, build) -> dict:
    """sd with each layer's per-expert keys (mlp.experts.local_experts.*) replaced, where its first one
    stood, by build(prefix) (prefix: "decoder.layers.N.mlp.experts.")."""
    out, done = {}, set()
    for k, v in sd.items():
        if ".mlp.experts.local_experts." not in k:
            out[k] = v
            continue
        pre = k.split("experts.local_experts.")[0] + "experts."
        if pre not in done:
            done.add(pre)
            out.update(build(pre))
    return type(sd)(out) if hasattr(sd, "move_to_end") else out


def rewrite_rank_files(torch, src: Path, dst: Path, iteration: int, edit):
    """Every rank file of src's iteration, loaded, changed by edit(rank dir name, checkpoint) and saved
    under dst (same iteration and rank dir names)."""
    for rd in sorted((src / f"iter_{iteration:07d}").iterdir()):
        ck = torch.load(rd / "model_optim_rng.pt", weights_only=False)
        edit(rd.name, ck)
        od = dst / f"iter_{iteration:07d}" / rd.name
        od.mkdir(parents=True)
        torch.save(ck, od / "model_optim_rng.pt")


def fresh_dir(d: Path) -> Path:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


# --------------------------------------------------------------------------------------------
# hf_ref and the independent HF check (transformers' own classes, canonical global tensors)
# --------------------------------------------------------------------------------------------

def hf_common(dm: dict, dtype: str = "float32", tied: bool = False) -> dict:
    """HF config keywords every family's config shares."""
    return dict(
        vocab_size=dm["vocab_size"], hidden_size=dm["hidden_size"], num_hidden_layers=dm["num_layers"],
        num_attention_heads=dm["num_attention_heads"], num_key_value_heads=dm["num_query_groups"],
        max_position_embeddings=dm["max_position_embeddings"], rms_norm_eps=dm["norm_epsilon"],
        tie_word_embeddings=tied, hidden_act="silu", bos_token_id=BOS, eos_token_id=EOS, dtype=dtype,
    )


def write_hf_ref(d: Path, config):
    """config, generation config, a tiny word-level tokenizer over the vocabulary and a chat template."""
    import warnings

    warnings.filterwarnings("ignore")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    V = TINY["vocab_size"]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for i in range(V - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    assert len(vocab) == V
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
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
        model_max_length=TINY["max_position_embeddings"],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(d))
    if not (d / "chat_template.jinja").exists():
        (d / "chat_template.jinja").write_text(chat_template)
    config.save_pretrained(str(d))
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, do_sample=False, max_new_tokens=8).save_pretrained(str(d))
    for f in d.iterdir():
        assert not f.name.endswith((".safetensors", ".bin")), f


def merged_weight(base: dict, lora: dict | None, name: str):
    """A (maybe LoRA-targeted) module's global weight with the LoRA merged: W + alpha/r * B @ A (fp64, fp32)."""
    s = LORA_ALPHA / LORA_R
    w = base[name + ".weight"].double()
    if lora is not None and name + ".lora_A.weight" in lora:
        w = w + s * lora[name + ".lora_B.weight"].double() @ lora[name + ".lora_A.weight"].double()
    return w.float()


def hf_glu(out: dict, base: dict, lora, mname: str, hname: str, names=("gate_proj", "up_proj", "down_proj")):
    """Megatron swiglu fc1 = [gate; up] and fc2 -> the HF gate / up / down projections."""
    g, u = merged_weight(base, lora, mname + ".linear_fc1").chunk(2, dim=0)
    out[f"{hname}.{names[0]}.weight"] = g
    out[f"{hname}.{names[1]}.weight"] = u
    out[f"{hname}.{names[2]}.weight"] = merged_weight(base, lora, mname + ".linear_fc2")


def hf_outer(base: dict, dm: dict) -> dict:
    """The HF tensors around the layers (vocabulary padding dropped), and every layer's two norms."""
    V = dm["vocab_size"]
    out = {"model.embed_tokens.weight": base["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": base["decoder.final_layernorm.weight"],
           "lm_head.weight": base["output_layer.weight"][:V]}
    for i in range(dm["num_layers"]):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = base[p + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = base[p + "pre_mlp_layernorm.weight"]
    return out


def hf_check(d: Path, state_dict, extra=None, mtp: int = 0) -> dict:
    """transformers' own model class (hf_ref/config.json) loaded by from_pretrained from state_dict(tag)
    (tag base: no LoRA; lora: LoRA merged), no missing / unexpected / mismatched keys; max |logits -
    Megatron logits| per tag. extra(tag, state dict, model, folder, logits.pt): more result entries."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import mtp_oracle  # transformers' MtpModel, as the tests use it

    ref = torch.load(d / "logits.pt", weights_only=True)
    res = {}
    for tag in ("base", "lora"):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(d / "hf_ref" / "config.json", tmp)
            sd = state_dict(tag)
            save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            num_layers = json.loads((d / "hf_ref" / "config.json").read_text())["num_hidden_layers"]
            cls = AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(tmp))]
            with (mtp_oracle.expecting_mtp_at(cls, num_layers) if mtp else contextlib.nullcontext()):
                model, info = AutoModelForCausalLM.from_pretrained(
                    tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            assert not bad, bad
            model.eval()
            with torch.no_grad():
                logits = model(ref["input_ids"]).logits.float()
            res[f"hf_{type(model).__name__}_vs_megatron_{tag}_max_abs"] = \
                (logits - ref[f"logits_{tag}"]).abs().max().item()
            if mtp:  # transformers' MtpModel on the MTP layers, against Megatron's MTP logits
                got = mtp_oracle.mtp_logits(model, ref["input_ids"])
                res[f"hf_MtpModel_vs_megatron_mtp_{tag}_max_abs"] = (got - ref[f"mtp_logits_{tag}"]).abs().max().item()
            if extra is not None:
                res.update(extra(tag, sd, model, tmp, ref))
    return res


# --------------------------------------------------------------------------------------------
# Main process
# --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_peft(peft_dir: str) -> str:
    peft_dir = str(Path(peft_dir).resolve())
    init = Path(peft_dir) / "peft" / "__init__.py"
    if not init.is_file() or '__version__ = "0.7.1"' not in init.read_text():
        sys.exit(f"error: PEFT 0.7.1 not found in {peft_dir}.\n"
                 f"Install it apart with:  pip install --no-deps --target {peft_dir} peft==0.7.1")
    sys.path.insert(0, peft_dir)
    os.environ["PYTHONPATH"] = peft_dir + os.pathsep + os.environ.get("PYTHONPATH", "")
    return peft_dir


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Make the committed test fixtures with the real megatron-core 0.16.1 and PEFT 0.7.1 "
                    "(see scripts/fixturegen/library.py).")
    ap.add_argument("--family", required=True, choices=FAMILIES,
                    help="dense: tests/fixtures; moe: tests/fixtures_moe; deepseek: tests/fixtures_deepseek")
    ap.add_argument("--out", help="the family's fixture folder (default: the one under tests/)")
    ap.add_argument("--peft-dir", default=str(REPO_ROOT / ".fixture-deps"),
                    help="directory holding PEFT 0.7.1 (pip install --no-deps --target DIR peft==0.7.1)")
    ap.add_argument("--only", nargs="*", metavar="NAME", help="fixtures to (re)build; default all of the family's")
    ap.add_argument("--no-hf-check", action="store_true",
                    help="skip the check against transformers' own model class (moe, deepseek)")
    opts = ap.parse_args(argv)
    fam = family(opts.family)
    names = opts.only or fam.all()
    unknown = [n for n in names if n not in fam.all()]
    if unknown:
        ap.error(f"no {opts.family} fixture {', '.join(unknown)} (there are: {', '.join(fam.all())})")
    peft_dir = use_peft(opts.peft_dir)

    import torch
    import torch.multiprocessing as mp

    out = Path(opts.out or REPO_ROOT / fam.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    built = fam.to_build(names, out)
    for name in built:
        spec = fam.built[name]
        d = fresh_dir(out / name)
        tp, pp, ep = spec["tp"], spec.get("pp", 1), spec.get("ep", 1)
        # world = PP x TP x DP (attention) = PP x ETP x EP x EDP (experts): the smallest such world
        world = pp * math.lcm(tp, (spec.get("etp") or tp) * ep)
        print(f"[{name}] spawning {world} ranks (TP={tp} PP={pp} EP={ep}, {spec.get('dtype', 'float32')})", flush=True)
        mp.spawn(worker, args=(world, fam.name, name, spec, str(out), free_port(), peft_dir), nprocs=world, join=True)
        (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
        (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
        write_hf_ref(d / "hf_ref", fam.hf_config(spec))
        fam.finish_hf_ref(spec, d / "hf_ref")
        summary = json.loads((d / ".summary.json").read_text())
        (d / ".summary.json").unlink()
        fx = fam.fixture_json(torch, name, spec, d, summary, opts)
        (d / "fixture.json").write_text(json.dumps(fx, indent=fam.json_indent) + "\n")
        print(f"[{name}] done: lora-vs-base max|dlogit| {summary['lora_vs_base_max_abs']:.4f}, stale-vs-lora "
              f"{summary['stale_vs_lora_max_abs']:.4f}" + (f", hf {fx['hf_check']}" if "hf_check" in fx else ""),
              flush=True)
    for name in [n for n in fam.derived if n in names]:
        fam.derive(torch, name, out, opts)
        print(f"[{name}] derived from {fam.derived[name]['source']}", flush=True)
    fam.finish(out, built)
