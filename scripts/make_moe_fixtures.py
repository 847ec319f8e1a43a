#!/usr/bin/env python
"""Generate Mixture-of-Experts test fixtures with the REAL megatron-core 0.16.1 and PEFT 0.7.1.

    python scripts/make_moe_fixtures.py --out tests/fixtures_moe [--only NAME ...] [--no-hf-check]

Like scripts/make_fixtures.py (whose helpers it imports), but for MoE models:

* spawns TP x EP ranks (gloo, CPU; PP = 1), builds a Megatron-Core ``GPTModel`` whose MLPs are
  ``MoELayer`` = ``TopKRouter`` + ``SequentialMLP`` experts (local spec,
  ``get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, ...)``, or
  ``get_gpt_decoder_block_spec`` when ``moe_layer_freq`` mixes dense and MoE layers), optionally a
  gated ``SharedExpertMLP``, with the ``alltoall`` token dispatcher and expert parallelism;
* fills every parameter (norms, biases, router, every expert, shared expert and its gate) with
  seeded random values taken from canonical GLOBAL tensors (expert e of layer l as one
  ``[2F, H]`` / ``[H, F]`` pair, TP=1 layout) and slices each rank's shard from them (local expert
  k of EP rank p is global expert ``p * E_local + k``; expert TP shards like a dense fc1/fc2);
* runs the base forward, saves the base (legacy: ``mp_rank_TT_EEE`` per (tp, ep) rank, each
  holding the whole non-expert model and its local experts; or torch_dist), wraps the model with
  PEFT 0.7.1 as MindSpeed-LLM does -- including MindSpeed's replacement of PEFT's
  ``LoraParallelLinear`` by ``LoraParallelLinearMoE`` (LoRA linears built with
  ``is_expert=base_layer.is_expert``) -- fills lora_A / lora_B, runs the LoRA forward and saves
  the LoRA (filtered like ``--lora-ckpt-filter``) at iteration 10 plus a stale iteration 5;
* records the router logits of every MoE layer in both forwards: tokens routed to each expert and
  the smallest gap between the k-th and (k+1)-th router score (so that no top-k choice sits on a
  tie), written to fixture.json;
* derives the GroupedMLP fixtures from the SequentialMLP one by the documented layouts
  (FORMATS.md section 7; GroupedMLP ``weight1`` / ``weight2`` and MindSpeed's
  ``LoraParallelGroupedMLP`` ``weight{1,2}_lora_{a,b}``), checks them against Megatron's own
  GroupedMLP resharding (a GroupedMLP model loading the torch_dist base) and recomputes every
  expert's output from the rewritten tensors in plain torch;
* independent HF check: builds transformers' own model class (Qwen3MoeForCausalLM,
  Qwen2MoeForCausalLM, MixtralForCausalLM) from the canonical global tensors with the LoRA merged
  in fp32 (W + alpha/r * B @ A), saved with per-expert HF names and loaded by ``from_pretrained``,
  and compares its logits with the real Megatron logits.

CPU shims the MoE forward needs in megatron-core 0.16.1 (none changes the arithmetic): the
alltoall dispatcher's CUDA stream / event become no-op objects, its split sizes are passed to
gloo's all_to_all_single as Python lists, and ``moe_utils.te_general_gemm`` (undefined without
TransformerEngine -> NameError) is set to None, which selects the plain matmul router.

PEFT 0.7.1 must be installed apart:  pip install --no-deps --target .fixture-deps peft==0.7.1 accelerate
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import make_fixtures as mf

REPO_ROOT = SCRIPTS.parent

# --------------------------------------------------------------------------------------------
# Fixture definitions
# --------------------------------------------------------------------------------------------

MOE_MODEL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=8,
    ffn_hidden_size=96,          # dense layers (and HF intermediate_size)
    moe_ffn_hidden_size=32,      # every routed expert
    vocab_size=250,
    make_vocab_size_divisible_by=64,
    seq_length=16,
    max_position_embeddings=32,
    rotary_base=10000,
    norm_epsilon=1e-6,
)
TOPK = 2
LORA_R, LORA_ALPHA = mf.LORA_R, mf.LORA_ALPHA
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
BASE_ITER, LORA_ITER, STALE_LORA_ITER = mf.BASE_ITER, mf.LORA_ITER, mf.STALE_LORA_ITER
MIN_REL_MARGIN = 1e-3

# family: qwen3_moe | qwen2_moe | mixtral
BUILT = {
    "qwen3moe_ep2": dict(
        family="qwen3_moe", tp=1, ep=2, etp=1, num_experts=4, kv_channels=16,
        moe_layer_freq=1, pre_softmax=False, shared=None, shared_gate=False,
        base_seed=11000, lora_seed=12000, router_std=0.3,
    ),
    "qwen3moe_dist_ep2": dict(
        family="qwen3_moe", tp=1, ep=2, etp=1, num_experts=4, kv_channels=16,
        moe_layer_freq=1, pre_softmax=False, shared=None, shared_gate=False,
        base_seed=11000, lora_seed=12000, router_std=0.3, base_format="torch_dist",
    ),
    # singleton_local_shards: per-layer keys, each expert its own `mlp.experts.experts.{e}.linear_fc1.weight_w/_v`
    "qwen3moe_dist_singleton_ep2": dict(
        family="qwen3_moe", tp=1, ep=2, etp=1, num_experts=4, kv_channels=16,
        moe_layer_freq=1, pre_softmax=False, shared=None, shared_gate=False,
        base_seed=11000, lora_seed=12000, router_std=0.3, base_format="torch_dist", singleton=True,
    ),
    "qwen2moe_tp2ep2": dict(
        family="qwen2_moe", tp=2, ep=2, etp=2, num_experts=4, kv_channels=8,
        moe_layer_freq=[0, 1, 1, 1], pre_softmax=True, shared=48, shared_gate=True,
        base_seed=13000, lora_seed=14000, router_std=0.3,
    ),
    # ETP=1 under TP=2: experts are not tensor-split, and only the (tp, ep) dirs of ranks with expert-data-
    # parallel rank 0 exist (world 2: mp_rank_00_000 and mp_rank_01_001), so the dir grid is sparse.
    "qwen3moe_tp2etp1_ep2": dict(
        family="qwen3_moe", tp=2, ep=2, etp=1, num_experts=4, kv_channels=16,
        moe_layer_freq=1, pre_softmax=False, shared=None, shared_gate=False,
        base_seed=17000, lora_seed=18000, router_std=0.3,
    ),
    "mixtral_ep2": dict(
        family="mixtral", tp=1, ep=2, etp=1, num_experts=8, kv_channels=8,
        moe_layer_freq=1, pre_softmax=False, shared=None, shared_gate=False,
        base_seed=15000, lora_seed=16000, router_std=0.3, ffn_hidden_size=32, router_seed=15004,
    ),
}
# derived (no Megatron run): from qwen3moe_ep2's real checkpoint by the documented layouts
DERIVED = {
    "qwen3moe_grouped_ep2": dict(source="qwen3moe_ep2", lora="copy"),
    "qwen3moe_mindspeed_grouped_lora_ep2": dict(source="qwen3moe_ep2", lora="grouped"),
}
ALL = list(BUILT) + list(DERIVED)


def dims(spec: dict) -> dict:
    d = dict(MOE_MODEL)
    d["kv_channels"] = spec["kv_channels"]
    if "ffn_hidden_size" in spec:
        d["ffn_hidden_size"] = spec["ffn_hidden_size"]
        d["moe_ffn_hidden_size"] = spec["ffn_hidden_size"]
    return d


def mf_family(spec):  # make_fixtures' family for the non-MoE parts (qkv bias / qk layernorm)
    return {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "llama"}[spec["family"]]


def layer_pattern(spec):
    """Megatron's moe_layer_freq -> [1 = MoE, 0 = dense] per layer (an int N: every N-th layer).
    Megatron-LM's default is the int 1 (all MoE): the torch_dist checkpoint then stacks the layers
    ([L, ...] keys); a list (e.g. [0, 1, 1, 1]) makes it use per-layer keys."""
    f, L = spec["moe_layer_freq"], MOE_MODEL["num_layers"]
    return [1 if i % f == 0 else 0 for i in range(L)] if isinstance(f, int) else list(f)


def moe_layers(spec):
    return [i for i, f in enumerate(layer_pattern(spec)) if f == 1]


def rank_dir(tp_rank: int, ep_rank: int, ep: int) -> str:
    """Megatron-LM get_checkpoint_name with PP == 1: mp_rank_TT, plus _EEE when EP > 1."""
    d = f"mp_rank_{tp_rank:02d}"
    return d + (f"_{ep_rank:03d}" if ep > 1 else "")


# --------------------------------------------------------------------------------------------
# Canonical global tensors
# --------------------------------------------------------------------------------------------

def canonical_moe_base(torch, spec: dict, vpad: int) -> dict:
    dm = dims(spec)
    seed = spec["base_seed"]
    fam = mf_family(spec)
    t = mf.canonical_base(torch, seed, fam == "qwen2", vpad, dm, qk_norm=fam == "qwen3")
    H, F, E = dm["hidden_size"], dm["moe_ffn_hidden_size"], spec["num_experts"]
    for i in moe_layers(spec):
        p = f"decoder.layers.{i}.mlp."
        del t[p + "linear_fc1.weight"], t[p + "linear_fc2.weight"]
        # (router values have their own seed: picked so that no top-k choice is near a tie)
        t[p + "router.weight"] = mf._randn(torch, spec.get("router_seed", seed), p + "router", (E, H),
                                           spec["router_std"])
        for e in range(E):
            q = f"{p}experts.{e}."
            t[q + "linear_fc1.weight"] = mf._randn(torch, seed, q + "fc1", (2 * F, H), 0.1)  # [gate; up]
            t[q + "linear_fc2.weight"] = mf._randn(torch, seed, q + "fc2", (H, F), 0.1)
        if spec["shared"]:
            Fs = spec["shared"]
            q = p + "shared_experts."
            t[q + "linear_fc1.weight"] = mf._randn(torch, seed, q + "fc1", (2 * Fs, H), 0.08)
            t[q + "linear_fc2.weight"] = mf._randn(torch, seed, q + "fc2", (H, Fs), 0.08)
            if spec["shared_gate"]:
                t[q + "gate_weight"] = mf._randn(torch, seed, q + "gate", (1, H), 0.3)
    return t


def lora_modules(spec: dict) -> dict:
    """{global module path: (in, out)} of every module PEFT wraps for TARGETS."""
    dm = dims(spec)
    H, NH, NG, D = dm["hidden_size"], dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    F, Fd, E = dm["moe_ffn_hidden_size"], dm["ffn_hidden_size"], spec["num_experts"]
    out = {}
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv"] = (H, (NH + 2 * NG) * D)
        out[p + "self_attention.linear_proj"] = (NH * D, H)
        if i in moe_layers(spec):
            for e in range(E):
                out[f"{p}mlp.experts.{e}.linear_fc1"] = (H, 2 * F)
                out[f"{p}mlp.experts.{e}.linear_fc2"] = (F, H)
            if spec["shared"]:
                out[p + "mlp.shared_experts.linear_fc1"] = (H, 2 * spec["shared"])
                out[p + "mlp.shared_experts.linear_fc2"] = (spec["shared"], H)
        else:
            out[p + "mlp.linear_fc1"] = (H, 2 * Fd)
            out[p + "mlp.linear_fc2"] = (Fd, H)
    return out


def canonical_moe_lora(torch, spec: dict, seed: int) -> dict:
    t = {}
    for m, (fin, fout) in lora_modules(spec).items():
        t[m + ".lora_A.weight"] = mf._randn(torch, seed, m + ".A", (LORA_R, fin), 0.1)
        t[m + ".lora_B.weight"] = mf._randn(torch, seed, m + ".B", (fout, LORA_R), 0.1)
    return t


def localize(torch, spec: dict, glob: dict, tp_rank: int, ep_rank: int, etp_rank: int) -> dict:
    """Canonical global tensors -> this (tp, ep, etp) rank's state-dict names and shards."""
    TP, EP, ETP, E = spec["tp"], spec["ep"], spec["etp"], spec["num_experts"]
    E_loc = E // EP
    out = {}
    for k, x in glob.items():
        parts = k.split(".")
        if ".mlp.experts." in k:
            e = int(parts[5])
            if e // E_loc != ep_rank:
                continue
            lk = ".".join(parts[:5] + ["local_experts", str(e % E_loc)] + parts[6:])
            out[lk] = mf.shard(torch, lk, x, etp_rank, ETP)
        elif k.endswith(("mlp.router.weight", "mlp.router.expert_bias", "shared_experts.gate_weight")):
            out[k] = x.clone()  # replicated
        else:
            out[k] = mf.shard(torch, k, x, tp_rank, TP)
    return out


# --------------------------------------------------------------------------------------------
# CPU shims and MindSpeed's LoRA linear for MoE
# --------------------------------------------------------------------------------------------

def _patch_moe_cpu(torch):
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


# --------------------------------------------------------------------------------------------
# args / legacy save
# --------------------------------------------------------------------------------------------

def make_moe_args(torch, spec, iteration, world, lora, filtered, load, save, grouped=False):
    dm = dims(spec)
    like = dict(tp=spec["tp"], pp=1, dtype="float32", family=mf_family(spec), targets=TARGETS, gen=2,
                kv_channels=dm["kv_channels"],
                base_format=spec.get("base_format", "torch"))
    a = mf.make_args(torch, like, iteration, world, lora=lora, lora_filter=filtered, load=load, save=save)
    E = spec["num_experts"]
    a.ffn_hidden_size = dm["ffn_hidden_size"]
    a.data_parallel_size = world // spec["tp"]
    a.expert_model_parallel_size = spec["ep"]
    a.expert_tensor_parallel_size = spec["etp"]
    a.num_experts = E
    a.moe_ffn_hidden_size = dm["moe_ffn_hidden_size"]
    a.moe_router_topk = TOPK
    a.moe_router_pre_softmax = spec["pre_softmax"]
    a.moe_router_score_function = "softmax"
    a.moe_router_load_balancing_type = "none"
    a.moe_aux_loss_coeff = 0.0
    a.moe_z_loss_coeff = None
    a.moe_router_topk_scaling_factor = None
    a.moe_router_num_groups = None
    a.moe_router_group_topk = None
    a.moe_router_enable_expert_bias = False
    a.moe_router_dtype = None
    a.moe_input_jitter_eps = None
    a.moe_expert_capacity_factor = None
    a.moe_pad_expert_input_to_capacity = False
    a.moe_token_dispatcher_type = "alltoall"
    a.moe_grouped_gemm = grouped
    a.moe_use_legacy_grouped_gemm = False
    a.moe_permute_fusion = False
    a.moe_layer_freq = copy.deepcopy(spec["moe_layer_freq"])
    a.moe_shared_expert_intermediate_size = spec["shared"]
    a.moe_shared_expert_gate = bool(spec["shared_gate"])
    a.moe_shared_expert_overlap = False
    a.moe_tp_extend_ep = False  # MindSpeed flag (LoRA refuses it)
    return a


def save_legacy(torch, root: Path, iteration: int, dirname: str, args, model_sd) -> Path:
    """As make_fixtures.save_checkpoint (gen 2), with the EP rank dir name."""
    d = root / f"iter_{iteration:07d}" / dirname
    d.mkdir(parents=True, exist_ok=True)
    assert args.no_save_optim
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_sd,
        "rng_state": mf.make_rng_state(torch, 2),
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, d / "model_optim_rng.pt")
    return d


# --------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------

def worker(rank: int, world: int, name: str, spec: dict, out_dir: str, port: int, peft_dir: str):
    if peft_dir not in sys.path:
        sys.path.insert(0, peft_dir)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    mf._patch_cuda(torch)
    _patch_moe_cpu(torch)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import peft
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import tp_layer

    assert peft.__version__ == "0.7.1", peft.__version__

    TP, EP, ETP, E = spec["tp"], spec["ep"], spec["etp"], spec["num_experts"]
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=EP, expert_tensor_parallel_size=ETP)
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    torch.manual_seed(1)
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    out = Path(out_dir) / name
    dm = dims(spec)
    fam = mf_family(spec)
    qk_norm = fam == "qwen3"
    vpad = mf.padded_vocab(TP)
    L = dm["num_layers"]
    E_loc = E // EP
    dist_base = spec.get("base_format", "torch") == "torch_dist"

    def make_config(grouped=False):
        kw = {}
        if qk_norm:
            kw["qk_layernorm"] = True
        if spec["shared"]:
            kw["moe_shared_expert_intermediate_size"] = spec["shared"]
            kw["moe_shared_expert_gate"] = bool(spec["shared_gate"])
        return TransformerConfig(
            num_layers=L, hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
            num_query_groups=dm["num_query_groups"], kv_channels=dm["kv_channels"],
            ffn_hidden_size=dm["ffn_hidden_size"], add_bias_linear=False, add_qkv_bias=fam == "qwen2",
            gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
            layernorm_epsilon=dm["norm_epsilon"], hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
            expert_model_parallel_size=EP, expert_tensor_parallel_size=ETP,
            num_moe_experts=E, moe_ffn_hidden_size=dm["moe_ffn_hidden_size"], moe_router_topk=TOPK,
            moe_router_pre_softmax=spec["pre_softmax"], moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
            moe_layer_freq=copy.deepcopy(spec["moe_layer_freq"]),
            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            **kw,
        )

    def layer_spec(config, grouped=False):
        if all(f == 1 for f in layer_pattern(spec)):
            return get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped, qk_layernorm=qk_norm,
                                            normalization="RMSNorm")
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")

    config = make_config()
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(config), vocab_size=vpad,
                     max_sequence_length=dm["max_position_embeddings"], pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=dm["rotary_base"])
    model.eval()

    # ---------- routing records ----------
    route_log = []
    orig_routing = TopKRouter.routing

    def routing(self, logits, *a, **k):
        probs, rmap = orig_routing(self, logits, *a, **k)
        route_log.append((self.layer_number - 1, logits.detach().float().reshape(-1, E).clone(), rmap.clone()))
        return probs, rmap

    TopKRouter.routing = routing

    def routing_stats():
        """per MoE layer: tokens per expert, smallest k-th vs (k+1)-th gap (abs and relative)."""
        res = {}
        for layer, logits, rmap in route_log:
            s = logits.sort(dim=-1, descending=True).values
            if spec["pre_softmax"]:
                s = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
                s_log = logits.sort(dim=-1, descending=True).values
            else:
                s_log = s
            gap = s[:, TOPK - 1] - s[:, TOPK]
            gap_logit = s_log[:, TOPK - 1] - s_log[:, TOPK]
            rel = gap_logit / (s_log[:, 0] - s_log[:, -1])
            # the routing map must be exactly the top-k of the recorded logits
            top = torch.zeros_like(rmap)
            top.scatter_(1, logits.topk(TOPK, dim=-1).indices, True)
            assert torch.equal(top, rmap), layer
            res[str(layer)] = dict(
                tokens_per_expert=[int(v) for v in rmap.sum(0)],
                min_gap_router_logit=float(gap_logit.min()),
                min_gap_score=float(gap.min()),
                min_rel_gap=float(rel.min()),
            )
        route_log.clear()
        return res

    # ---------- values ----------
    base_global = canonical_moe_base(torch, spec, vpad)
    base_local = localize(torch, spec, base_global, tp_rank, ep_rank, etp_rank)

    def fill(values: dict):
        sd = model.state_dict()
        new = {}
        for k, x in sd.items():
            if k.endswith("_extra_state"):
                new[k] = x
                continue
            ck = k.replace(".base_layer.", ".").replace(".default.", ".")
            assert ck in values, f"rank {rank}: no value for {k}"
            assert values[ck].shape == x.shape, f"{k}: {tuple(values[ck].shape)} vs {tuple(x.shape)}"
            new[k] = values[ck]
        unused = set(values) - {k.replace(".base_layer.", ".").replace(".default.", ".") for k in sd}
        assert not unused, sorted(unused)[:5]
        model.load_state_dict(new, strict=True)

    S, B = dm["seq_length"], mf.BATCH
    g = torch.Generator().manual_seed(mf.INPUT_SEED)
    input_ids = torch.randint(0, dm["vocab_size"], (B, S), generator=g, dtype=torch.int64)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)

    def forward():
        with torch.no_grad():
            res = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                        runtime_gather_output=True)
        assert res.shape == (B, S, vpad), res.shape
        return res[..., : dm["vocab_size"]].float().contiguous()

    dirname = rank_dir(tp_rank, ep_rank, EP)
    saves = edp_rank == 0  # Megatron-LM legacy save: expert-data-parallel rank 0 writes
    info = dict(rank=rank, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank, edp_rank=edp_rank,
                dp_rank=ps.get_data_parallel_rank(), dir=dirname if saves else None,
                local_experts=[ep_rank * E_loc + k for k in range(E_loc)])

    # ---------- base ----------
    fill(base_local)
    logits_base = forward()
    route_base = routing_stats()
    base_sd = model.state_dict_for_save_checkpoint()
    base_root = out / "base"
    args = make_moe_args(torch, spec, BASE_ITER, world, lora=False, filtered=False,
                         load=f"/data/ckpt/{name}/hf-converted", save=f"/data/ckpt/{name}/base")
    if dist_base:
        mf.save_dist_checkpoint(torch, base_root, BASE_ITER, args, model, spec.get("singleton", False),
                                mf.make_rng_state(torch, 2))
    if dist_base and not spec.get("singleton", False):
        # Megatron's own GroupedMLP layout: a GroupedMLP model (legacy GroupedMLP, construction only:
        # grouped_gemm is not needed to build it) loads this torch_dist base via dist_checkpointing.
        from megatron.core import dist_checkpointing
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        gconfig = make_config(grouped=True)
        gmodel = GPTModel(config=gconfig, transformer_layer_spec=layer_spec(gconfig, grouped=True),
                          vocab_size=vpad, max_sequence_length=dm["max_position_embeddings"],
                          pre_process=True, post_process=True, parallel_output=True,
                          share_embeddings_and_output_weights=False, position_embedding_type="rope",
                          rotary_base=dm["rotary_base"])
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                    "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        loaded = dist_checkpointing.load({"model": gmodel.sharded_state_dict(metadata=metadata)},
                                         str(base_root / f"iter_{BASE_ITER:07d}"))
        gsd = {k: v for k, v in loaded["model"].items() if torch.is_tensor(v)}
        missing, unexpected = gmodel.load_state_dict(gsd, strict=False)
        assert not [m for m in missing if not m.endswith("_extra_state")], missing
        torch.save({k: v.clone() for k, v in gmodel.state_dict().items() if ".mlp.experts." in k},
                   out / f".megatron_grouped_{dirname}.pt")
    if not dist_base and saves:
        save_legacy(torch, base_root, BASE_ITER, dirname, args, base_sd)

    # ---------- PEFT, as MindSpeed-LLM's model_provider_func_wrapper ----------
    tp_layer.LoraParallelLinear = make_lora_parallel_linear_moe()
    lcfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(TARGETS), lora_dropout=0.0,
                      bias="none", megatron_config=make_config(), megatron_core="megatron.core")
    pm = get_peft_model(model, lcfg)
    assert pm.base_model.model is model
    pm.eval()

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    layout_info = {}
    wrapped = []
    for mname, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            wrapped.append(mname)
            A, Bm = mod.lora_A["default"], mod.lora_B["default"]
            kind = ("expert_" if ".experts." in mname else "shared_" if ".shared_experts." in mname
                    else "") + mname.split(".")[-1]
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

    def lora_vals(seed):
        return {**base_local, **localize(torch, spec, canonical_moe_lora(torch, spec, seed), tp_rank, ep_rank,
                                         etp_rank)}

    def lora_sd():
        sd = model.state_dict_for_save_checkpoint()
        return type(sd)((k, v) for k, v in sd.items() if "lora" in k)  # --lora-ckpt-filter

    lora_root = out / "lora"
    fill(lora_vals(spec["lora_seed"] + mf.STALE_SEED_OFFSET))
    args = make_moe_args(torch, spec, STALE_LORA_ITER, world, lora=True, filtered=True,
                         load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
    if saves:
        save_legacy(torch, lora_root, STALE_LORA_ITER, dirname, args, lora_sd())
    logits_stale = forward()
    routing_stats()

    fill(lora_vals(spec["lora_seed"]))
    logits_lora = forward()
    route_lora = routing_stats()
    args = make_moe_args(torch, spec, LORA_ITER, world, lora=True, filtered=True,
                         load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
    if saves:
        save_legacy(torch, lora_root, LORA_ITER, dirname, args, lora_sd())

    # every rank computes the same logits (DP replicas of the same batch)
    gathered = [torch.empty_like(logits_lora) for _ in range(world)]
    dist.all_gather(gathered, logits_lora)
    replica_diff = max((x - logits_lora).abs().max().item() for x in gathered)
    infos = [None] * world
    dist.all_gather_object(infos, info)

    if rank == 0:
        torch.save({"input_ids": input_ids.clone(), "logits_lora": logits_lora.clone(),
                    "logits_base": logits_base.clone()}, out / "logits.pt")
        summary = dict(
            layout=layout_info,
            wrapped_modules_rank0=wrapped,
            ranks=infos,
            routing_base=route_base,
            routing_lora=route_lora,
            lora_vs_base_max_abs=(logits_lora - logits_base).abs().max().item(),
            stale_vs_lora_max_abs=(logits_stale - logits_lora).abs().max().item(),
            replica_logits_max_abs_diff=replica_diff,
        )
        (out / ".summary.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# hf_ref
# --------------------------------------------------------------------------------------------

def hf_config(spec):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    dm = dims(spec)
    V = dm["vocab_size"]
    common = dict(
        vocab_size=V, hidden_size=dm["hidden_size"], num_hidden_layers=dm["num_layers"],
        num_attention_heads=dm["num_attention_heads"], num_key_value_heads=dm["num_query_groups"],
        max_position_embeddings=dm["max_position_embeddings"], rms_norm_eps=dm["norm_epsilon"],
        rope_theta=float(dm["rotary_base"]), tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=3, dtype="float32", num_experts_per_tok=TOPK,
        output_router_logits=False,
    )
    mlp_only = [i for i, f in enumerate(layer_pattern(spec)) if f == 0]
    if spec["family"] == "qwen3_moe":
        cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], head_dim=dm["kv_channels"],
                             attention_bias=False, intermediate_size=dm["ffn_hidden_size"],
                             moe_intermediate_size=dm["moe_ffn_hidden_size"], num_experts=spec["num_experts"],
                             norm_topk_prob=not spec["pre_softmax"], decoder_sparse_step=1,
                             mlp_only_layers=mlp_only, **common)
    elif spec["family"] == "qwen2_moe":
        cfg = Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], qkv_bias=True,
                             intermediate_size=dm["ffn_hidden_size"],
                             moe_intermediate_size=dm["moe_ffn_hidden_size"],
                             shared_expert_intermediate_size=spec["shared"], num_experts=spec["num_experts"],
                             norm_topk_prob=not spec["pre_softmax"], decoder_sparse_step=1,
                             mlp_only_layers=mlp_only, **common)
        assert spec["shared"] and spec["shared_gate"]
    else:
        assert not mlp_only and not spec["pre_softmax"] and not spec["shared"]
        cfg = MixtralConfig(architectures=["MixtralForCausalLM"], head_dim=dm["kv_channels"],
                            intermediate_size=dm["moe_ffn_hidden_size"], num_local_experts=spec["num_experts"],
                            router_jitter_noise=0.0, **common)
    return cfg


def write_moe_hf_ref(spec, d: Path):
    like = dict(family=mf_family(spec), dtype="float32", kv_channels=spec["kv_channels"])
    mf.write_hf_ref(like, d)  # tokenizer, chat template, generation config (+ a dense config.json)
    (d / "config.json").unlink()
    hf_config(spec).save_pretrained(str(d))
    for f in d.iterdir():
        assert not f.name.endswith((".safetensors", ".bin")), f


# --------------------------------------------------------------------------------------------
# Independent HF check (transformers' own model classes, canonical global tensors)
# --------------------------------------------------------------------------------------------

def hf_state_dict(torch, spec, base: dict, lora: dict | None) -> dict:
    dm = dims(spec)
    V, H = dm["vocab_size"], dm["hidden_size"]
    NH, NG, D = dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    s = LORA_ALPHA / LORA_R

    def W(name):  # merged global weight of a (maybe LoRA-targeted) module, fp32
        w = base[name + ".weight"].double()
        if lora is not None and name + ".lora_A.weight" in lora:
            w = w + s * lora[name + ".lora_B.weight"].double() @ lora[name + ".lora_A.weight"].double()
        return w.float()

    out = {"model.embed_tokens.weight": base["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": base["decoder.final_layernorm.weight"],
           "lm_head.weight": base["output_layer.weight"][:V]}
    mix = spec["family"] == "mixtral"
    for i in range(dm["num_layers"]):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = base[p + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = base[p + "pre_mlp_layernorm.weight"]
        qkv = W(p + "self_attention.linear_qkv").view(NG, NH // NG + 2, D, H)
        out[h + "self_attn.q_proj.weight"] = qkv[:, : NH // NG].reshape(-1, H)
        out[h + "self_attn.k_proj.weight"] = qkv[:, NH // NG].reshape(-1, H)
        out[h + "self_attn.v_proj.weight"] = qkv[:, NH // NG + 1].reshape(-1, H)
        if p + "self_attention.linear_qkv.bias" in base:
            b = base[p + "self_attention.linear_qkv.bias"].view(NG, NH // NG + 2, D)
            out[h + "self_attn.q_proj.bias"] = b[:, : NH // NG].reshape(-1)
            out[h + "self_attn.k_proj.bias"] = b[:, NH // NG].reshape(-1)
            out[h + "self_attn.v_proj.bias"] = b[:, NH // NG + 1].reshape(-1)
        if p + "self_attention.q_layernorm.weight" in base:
            out[h + "self_attn.q_norm.weight"] = base[p + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = base[p + "self_attention.k_layernorm.weight"]
        out[h + "self_attn.o_proj.weight"] = W(p + "self_attention.linear_proj")

        def glu(mname, hname, names=("gate_proj", "up_proj", "down_proj")):
            g, u = W(mname + ".linear_fc1").chunk(2, dim=0)
            out[f"{hname}.{names[0]}.weight"] = g
            out[f"{hname}.{names[1]}.weight"] = u
            out[f"{hname}.{names[2]}.weight"] = W(mname + ".linear_fc2")

        if i in moe_layers(spec):
            m = h + ("block_sparse_moe." if mix else "mlp.")
            out[m + "gate.weight"] = base[p + "mlp.router.weight"]
            for e in range(spec["num_experts"]):
                glu(f"{p}mlp.experts.{e}", f"{m}experts.{e}", ("w1", "w3", "w2") if mix else
                    ("gate_proj", "up_proj", "down_proj"))
            if spec["shared"]:
                glu(p + "mlp.shared_experts", m + "shared_expert")
                out[m + "shared_expert_gate.weight"] = base[p + "mlp.shared_experts.gate_weight"]
        else:
            glu(p + "mlp", h + "mlp")
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_check(spec, d: Path) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    vpad = mf.padded_vocab(spec["tp"])
    base = canonical_moe_base(torch, spec, vpad)
    lora = canonical_moe_lora(torch, spec, spec["lora_seed"])
    ref = torch.load(d / "logits.pt", weights_only=True)
    res = {}
    for tag, lo in (("base", None), ("lora", lora)):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(d / "hf_ref" / "config.json", tmp)
            save_file(hf_state_dict(torch, spec, base, lo), os.path.join(tmp, "model.safetensors"),
                      metadata={"format": "pt"})
            model, info = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            assert not bad, bad
            model.eval()
            with torch.no_grad():
                logits = model(ref["input_ids"]).logits.float()
            res[f"hf_{type(model).__name__}_vs_megatron_{tag}_max_abs"] = \
                (logits - ref[f"logits_{tag}"]).abs().max().item()
    return res


# --------------------------------------------------------------------------------------------
# Derived GroupedMLP fixtures
# --------------------------------------------------------------------------------------------

def to_grouped_base(torch, sd: dict, E_loc: int, H: int) -> dict:
    """SequentialMLP rank state dict -> GroupedMLP (legacy) rank state dict, keys in place.
    weight1 [H, E_loc*2F] = stack_k(fc1_k.T) (E_loc, H, 2F) flattened; weight2 [E_loc*F, H] =
    stack_k(fc2_k.T) (E_loc, F, H) flattened (GroupedMLP.forward: weight1.view(E_loc, H, -1),
    weight2.view(E_loc, -1, H))."""
    out = {}
    done = set()
    for k, v in sd.items():
        if ".mlp.experts.local_experts." not in k:
            out[k] = v
            continue
        pre = k.split("experts.local_experts.")[0] + "experts."
        if pre in done:
            continue
        done.add(pre)
        fc1 = [sd[f"{pre}local_experts.{j}.linear_fc1.weight"] for j in range(E_loc)]
        fc2 = [sd[f"{pre}local_experts.{j}.linear_fc2.weight"] for j in range(E_loc)]
        out[pre + "weight1"] = torch.stack([w.t() for w in fc1]).reshape(H, -1).contiguous()
        out[pre + "weight2"] = torch.stack([w.t() for w in fc2]).reshape(-1, H).contiguous()
    return type(sd)(out) if hasattr(sd, "move_to_end") else out


def to_grouped_lora(torch, sd: dict, E_loc: int, H: int, r: int) -> dict:
    """PEFT per-expert LoRA -> MindSpeed LoraParallelGroupedMLP keys (mlp.experts.weight{1,2}_lora_{a,b}).
    weight1_lora_a [H, r*E_loc] = view (E_loc, H, r), expert k = A1_k.T; weight1_lora_b
    [r, E_loc*2F] = view (E_loc, r, 2F), expert k = B1_k.T; weight2_lora_a [E_loc*F, r] = view
    (E_loc, F, r), expert k = A2_k.T; weight2_lora_b [r*E_loc, H] = view (E_loc, r, H), expert k = B2_k.T."""
    out = {}
    done = set()
    for k, v in sd.items():
        if ".mlp.experts.local_experts." not in k:
            out[k] = v
            continue
        pre = k.split("experts.local_experts.")[0] + "experts."
        if pre in done:
            continue
        done.add(pre)
        g = lambda j, m, ab: sd[f"{pre}local_experts.{j}.{m}.lora_{ab}.default.weight"]
        a1 = torch.stack([g(j, "linear_fc1", "A").t() for j in range(E_loc)])  # (E, H, r)
        b1 = torch.stack([g(j, "linear_fc1", "B").t() for j in range(E_loc)])  # (E, r, 2F)
        a2 = torch.stack([g(j, "linear_fc2", "A").t() for j in range(E_loc)])  # (E, F, r)
        b2 = torch.stack([g(j, "linear_fc2", "B").t() for j in range(E_loc)])  # (E, r, H)
        out[pre + "weight1_lora_a"] = a1.reshape(H, r * E_loc).contiguous()
        out[pre + "weight1_lora_b"] = b1.reshape(r, -1).contiguous()
        out[pre + "weight2_lora_a"] = a2.reshape(-1, r).contiguous()
        out[pre + "weight2_lora_b"] = b2.reshape(r * E_loc, H).contiguous()
    return type(sd)(out) if hasattr(sd, "move_to_end") else out


def check_grouped(torch, seq_base, seq_lora, g_base, g_lora, E_loc, H, r, s):
    """Recompute every local expert's output from the grouped tensors (as GroupedMLP /
    LoraParallelGroupedMLP.forward do) and from the per-expert ones; max abs difference."""
    F_ = torch.nn.functional
    gen = torch.Generator().manual_seed(7)
    worst_base = worst_lora = 0.0
    n = 0
    for k in g_base:
        if not k.endswith("mlp.experts.weight1"):
            continue
        pre = k[: -len("weight1")]
        w1 = g_base[pre + "weight1"].view(E_loc, H, -1)
        w2 = g_base[pre + "weight2"].view(E_loc, -1, H)
        for j in range(E_loc):
            x = torch.randn(9, H, generator=gen, dtype=torch.float64).float()
            fc1 = seq_base[f"{pre}local_experts.{j}.linear_fc1.weight"]
            fc2 = seq_base[f"{pre}local_experts.{j}.linear_fc2.weight"]

            def mlp(x, f1, f2):
                a, b = (x @ f1.t()).chunk(2, dim=-1)
                return (F_.silu(a) * b) @ f2.t()

            ref = mlp(x, fc1, fc2)
            a, b = (x @ w1[j]).chunk(2, dim=-1)
            got = (F_.silu(a) * b) @ w2[j]
            worst_base = max(worst_base, (got - ref).abs().max().item())
            if g_lora is not None:
                L = lambda m, ab: seq_lora[f"{pre}local_experts.{j}.{m}.lora_{ab}.default.weight"]
                ref = mlp(x, fc1 + s * L("linear_fc1", "B") @ L("linear_fc1", "A"),
                          fc2 + s * L("linear_fc2", "B") @ L("linear_fc2", "A"))
                a1 = g_lora[pre + "weight1_lora_a"].view(E_loc, -1, r)[j]
                b1 = g_lora[pre + "weight1_lora_b"].view(E_loc, r, -1)[j]
                a2 = g_lora[pre + "weight2_lora_a"].view(E_loc, -1, r)[j]
                b2 = g_lora[pre + "weight2_lora_b"].view(E_loc, r, -1)[j]
                h1 = x @ w1[j] + (x @ a1) @ b1 * s
                a, b = h1.chunk(2, dim=-1)
                hh = F_.silu(a) * b
                got = hh @ w2[j] + (hh @ a2) @ b2 * s
                worst_lora = max(worst_lora, (got - ref).abs().max().item())
            n += 1
    return dict(experts_checked=n, max_abs_diff_base=worst_base,
                max_abs_diff_with_lora=worst_lora if g_lora is not None else None)


def derive(torch, name: str, out: Path, grouped_ref: dict | None):
    """qwen3moe_grouped_ep2 / qwen3moe_mindspeed_grouped_lora_ep2 from qwen3moe_ep2."""
    dspec = DERIVED[name]
    src = out / dspec["source"]
    spec = BUILT[dspec["source"]]
    dm = dims(spec)
    H, E_loc, r = dm["hidden_size"], spec["num_experts"] // spec["ep"], LORA_R
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for f in ("hf_ref", "logits.pt"):
        (shutil.copytree if (src / f).is_dir() else shutil.copy)(src / f, d / f)
    checks = {}
    megatron_equal = []
    base_files = sorted((src / "base" / f"iter_{BASE_ITER:07d}").iterdir())
    for rd in base_files:
        ck = torch.load(rd / "model_optim_rng.pt", weights_only=False)
        seq = ck["model"]
        ck["model"] = to_grouped_base(torch, seq, E_loc, H)
        ck["args"] = copy.deepcopy(ck["args"])
        ck["args"].moe_grouped_gemm = True
        ck["args"].save = ck["args"].save.replace(dspec["source"], name)
        if grouped_ref is not None and rd.name in grouped_ref:
            ref = grouped_ref[rd.name]
            for k, v in ref.items():
                megatron_equal.append(bool(torch.equal(ck["model"][k], v)))
                assert torch.equal(ck["model"][k], v), (rd.name, k)
        od = d / "base" / f"iter_{BASE_ITER:07d}" / rd.name
        od.mkdir(parents=True)
        torch.save(ck, od / "model_optim_rng.pt")
        checks[rd.name] = dict(base=(seq, ck["model"]))
    (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
    s = LORA_ALPHA / LORA_R
    for it in (STALE_LORA_ITER, LORA_ITER):
        for rd in sorted((src / "lora" / f"iter_{it:07d}").iterdir()):
            od = d / "lora" / f"iter_{it:07d}" / rd.name
            od.mkdir(parents=True)
            if dspec["lora"] == "copy":
                shutil.copy(rd / "model_optim_rng.pt", od / "model_optim_rng.pt")
                continue
            ck = torch.load(rd / "model_optim_rng.pt", weights_only=False)
            seq_lora = ck["model"]
            ck["model"] = to_grouped_lora(torch, seq_lora, E_loc, H, r)
            a = ck["args"] = copy.deepcopy(ck["args"])
            a.moe_grouped_gemm = True
            a.moe_token_dispatcher_type = "alltoall_seq"  # what MindSpeed requires for MoE + LoRA
            a.load = a.load.replace(dspec["source"], name)
            a.save = a.save.replace(dspec["source"], name)
            torch.save(ck, od / "model_optim_rng.pt")
            if it == LORA_ITER:
                checks[rd.name]["lora"] = (seq_lora, ck["model"])
    (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
    res = {}
    for rdn, c in checks.items():
        seq_b, g_b = c["base"]
        seq_l, g_l = c.get("lora", (None, None))
        res[rdn] = check_grouped(torch, seq_b, seq_l, g_b, g_l, E_loc, H, r, s)
    return res, (all(megatron_equal) if megatron_equal else None), len(megatron_equal)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def key_listing(torch, d: Path) -> dict:
    """{base|lora: {rank dir: [(key, shape)]}} of the tracker's iteration (first rank dir only)."""
    out = {}
    for part in ("base", "lora"):
        it = (d / part / "latest_checkpointed_iteration.txt").read_text().strip()
        idir = d / part / f"iter_{int(it):07d}"
        if (idir / "metadata.json").exists():
            from torch.distributed.checkpoint import FileSystemReader
            md = FileSystemReader(str(idir)).read_metadata()
            out[part] = {"torch_dist": [(k, list(getattr(m, "size", []) or []))
                                        for k, m in md.state_dict_metadata.items()]}
            continue
        rd = sorted(idir.iterdir())[0]
        sd = torch.load(rd / "model_optim_rng.pt", weights_only=False)["model"]
        out[part] = {rd.name: [(k, list(v.shape) if torch.is_tensor(v) else None) for k, v in sd.items()]}
    return out


def check_ep_replicas(torch, d: Path, spec):
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


def describe(name, spec, summary, extra):
    dm = dims(spec)
    fam = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}[spec["family"]]
    ml = moe_layers(spec)
    parts = [
        f"{fam}-like Megatron-Core GPTModel (local spec, MoELayer = TopKRouter + SequentialMLP, alltoall "
        f"dispatcher), TP={spec['tp']} EP={spec['ep']} ETP={spec['etp']} PP=1, float32; {dm['num_layers']} layers "
        f"(MoE layers {ml}" + (f", dense layers {[i for i in range(dm['num_layers']) if i not in ml]} with ffn "
                               f"{dm['ffn_hidden_size']}" if len(ml) < dm['num_layers'] else "") +
        f"), hidden {dm['hidden_size']}, heads {dm['num_attention_heads']}, query groups {dm['num_query_groups']}, "
        f"head_dim {dm['kv_channels']}, {spec['num_experts']} experts ({spec['num_experts'] // spec['ep']} per EP "
        f"rank; global expert = ep_rank*{spec['num_experts'] // spec['ep']} + local), expert ffn "
        f"{dm['moe_ffn_hidden_size']}, top-{TOPK}, moe_router_pre_softmax={spec['pre_softmax']} (HF "
        f"norm_topk_prob={not spec['pre_softmax']})"
        + (", qkv bias" if spec["family"] == "qwen2_moe" else "")
        + (", q/k layernorm" if spec["family"] == "qwen3_moe" else "")
        + (f", shared expert (ffn {spec['shared']}) with sigmoid gate (shared_experts.gate_weight [1, H])"
           if spec["shared"] else ", no shared expert")
        + f", vocab {dm['vocab_size']} (padded {mf.padded_vocab(spec['tp'])}).",
    ]
    if spec.get("base_format") == "torch_dist":
        parts.append("base/ = torch_dist (dist_checkpointing.save as Megatron-LM does; experts under "
                     "decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2F, H] etc., stacked layers, "
                     "TE norm names).")
    else:
        parts.append("base/ = legacy, one mp_rank_TT_EEE file per (tp, ep) rank (PP=1): all non-expert "
                     "tensors (identical across EP ranks) plus the local experts "
                     "mlp.experts.local_experts.{k}.linear_fc1/linear_fc2.")
    parts.append(
        f"lora/ = PEFT 0.7.1 LoRA as MindSpeed-LLM applies it (LoraParallelLinearMoE: expert LoRA linears "
        f"built with is_expert=True), filtered, legacy, iter {LORA_ITER} + stale iter_{STALE_LORA_ITER:07d}; "
        f"targets {TARGETS} wrap every expert's linear_fc1/linear_fc2"
        + (" and the shared expert's" if spec["shared"] else "") + " (not the router). "
        "logits.pt = real Megatron forward with (logits_lora) and without (logits_base) LoRA.")
    return " ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "tests" / "fixtures_moe"))
    ap.add_argument("--peft-dir", default=str(REPO_ROOT / ".fixture-deps"))
    ap.add_argument("--only", nargs="*", help=f"fixture names (default all): {ALL}")
    ap.add_argument("--no-hf-check", action="store_true")
    opts = ap.parse_args()

    peft_dir = str(Path(opts.peft_dir).resolve())
    init = Path(peft_dir) / "peft" / "__init__.py"
    if not init.is_file() or '__version__ = "0.7.1"' not in init.read_text():
        sys.exit(f"error: PEFT 0.7.1 not found in {peft_dir} "
                 f"(pip install --no-deps --target {peft_dir} peft==0.7.1 accelerate)")
    sys.path.insert(0, peft_dir)
    os.environ["PYTHONPATH"] = peft_dir + os.pathsep + os.environ.get("PYTHONPATH", "")

    import torch
    import torch.multiprocessing as mp

    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = opts.only or ALL
    for n in names:
        assert n in ALL, n
    # the derived fixtures need their source (and the dist one for Megatron's GroupedMLP layout)
    need = [n for n in BUILT if n in names]
    if any(n in DERIVED for n in names):
        for n in ("qwen3moe_ep2", "qwen3moe_dist_ep2"):
            if n not in need and not (out / n / "fixture.json").exists():
                need.append(n)
    grouped_ref = None
    for name in [n for n in BUILT if n in need]:
        spec = BUILT[name]
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        # world = TP x DP (attention) = ETP x EP x EDP (experts): the smallest such world
        world = math.lcm(spec["tp"], spec["etp"] * spec["ep"])
        print(f"[{name}] spawning {world} ranks (TP={spec['tp']} EP={spec['ep']} ETP={spec['etp']})", flush=True)
        mp.spawn(worker, args=(world, name, spec, str(out), mf.free_port(), peft_dir), nprocs=world, join=True)
        (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
        (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
        write_moe_hf_ref(spec, d / "hf_ref")
        summary = json.loads((d / ".summary.json").read_text())
        (d / ".summary.json").unlink()
        grp = sorted(d.glob(".megatron_grouped_*.pt"))
        if grp:
            grouped_ref = {f.name[len(".megatron_grouped_"):-3]: torch.load(f, weights_only=True) for f in grp}
            for f in grp:
                f.unlink()
        margins = [v["min_rel_gap"] for r in ("routing_base", "routing_lora") for v in summary[r].values()]
        min_rel = min(margins)
        min_abs = min(v["min_gap_router_logit"] for r in ("routing_base", "routing_lora")
                      for v in summary[r].values())
        assert min_rel >= MIN_REL_MARGIN, f"{name}: top-k margin {min_rel} too small: change router seed/scale"
        counts = {r: {l: v["tokens_per_expert"] for l, v in summary[r].items()} for r in ("routing_base", "routing_lora")}
        for r, per_layer in counts.items():
            tot = [sum(c[e] for c in per_layer.values()) for e in range(spec["num_experts"])]
            assert all(t > 0 for t in tot), (name, r, tot)
        nrep = check_ep_replicas(torch, d, spec)
        dm = dims(spec)
        fx = dict(
            model_type=spec["family"],
            megatron_family=mf_family(spec),
            tp=spec["tp"], pp=1, ep=spec["ep"], etp=spec["etp"], world_size=world,
            dtype="float32", lora="filtered", r=LORA_R, alpha=LORA_ALPHA, targets=TARGETS,
            num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
            num_query_groups=dm["num_query_groups"], kv_channels=dm["kv_channels"],
            ffn_hidden_size=dm["ffn_hidden_size"], moe_ffn_hidden_size=dm["moe_ffn_hidden_size"],
            vocab_size=dm["vocab_size"], padded_vocab_size=mf.padded_vocab(spec["tp"]),
            num_experts=spec["num_experts"], experts_per_ep_rank=spec["num_experts"] // spec["ep"],
            moe_router_topk=TOPK, moe_router_pre_softmax=spec["pre_softmax"], hf_norm_topk_prob=not spec["pre_softmax"],
            moe_router_score_function="softmax", moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, expert_layout="SequentialMLP",
            moe_layer_freq=spec["moe_layer_freq"], moe_layers=moe_layers(spec),
            dense_layers=[i for i in range(dm["num_layers"]) if i not in moe_layers(spec)],
            moe_shared_expert_intermediate_size=spec["shared"], moe_shared_expert_gate=bool(spec["shared_gate"]),
            qkv_bias=spec["family"] == "qwen2_moe", qk_layernorm=spec["family"] == "qwen3_moe",
            router_weight_std=spec["router_std"], base_seed=spec["base_seed"], lora_seed=spec["lora_seed"],
            base_format=spec.get("base_format", "torch"), lora_format="torch",
            base_iteration=BASE_ITER, lora_iteration=LORA_ITER, stale_lora_iteration=STALE_LORA_ITER,
            rank_dirs=sorted(x["dir"] for x in summary["ranks"] if x["dir"]),
            ranks=summary["ranks"],
            peft_layout=summary["layout"],
            tokens_per_expert=dict(base=counts["routing_base"], lora=counts["routing_lora"]),
            routing=dict(base=summary["routing_base"], lora=summary["routing_lora"]),
            min_topk_margin_router_logit=min_abs, min_topk_margin_relative=min_rel,
            ep_replica_tensors_checked_equal=nrep,
            lora_vs_base_max_abs=summary["lora_vs_base_max_abs"],
            stale_vs_lora_max_abs=summary["stale_vs_lora_max_abs"],
            replica_logits_max_abs_diff=summary["replica_logits_max_abs_diff"],
            logits_computed_in="float32",
        )
        if spec.get("base_format") == "torch_dist":
            lst = key_listing(torch, d)["base"]["torch_dist"]
            fx["torch_dist_moe_keys"] = {k: v for k, v in lst if (".mlp.router." in k or ".mlp.experts." in k)
                                         and "_extra_state" not in k}
        if not opts.no_hf_check:
            fx["hf_check"] = hf_check(spec, d)
        fx["description"] = describe(name, spec, summary, None)
        (d / "fixture.json").write_text(json.dumps(fx, indent=2) + "\n")
        print(f"[{name}] done: min top-k margin {min_abs:.4g} (rel {min_rel:.4g}), lora-vs-base "
              f"{summary['lora_vs_base_max_abs']:.4f}, hf {fx.get('hf_check')}", flush=True)

    for name in [n for n in DERIVED if n in names]:
        res, meg_eq, n_meg = derive(torch, name, out, grouped_ref)
        src = json.loads((out / DERIVED[name]["source"] / "fixture.json").read_text())
        fx = {k: v for k, v in src.items() if k not in ("description", "hf_check")}
        fx["derived_from"] = DERIVED[name]["source"]
        fx["moe_grouped_gemm"] = True
        fx["expert_layout"] = "GroupedMLP"
        fx["lora_expert_layout"] = ("LoraParallelGroupedMLP (MindSpeed)" if DERIVED[name]["lora"] == "grouped"
                                    else "PEFT per-expert (copied from the source fixture)")
        fx["grouped_check"] = dict(per_rank_file=res, megatron_grouped_mlp_dist_load_equal=meg_eq,
                                   megatron_grouped_tensors_compared=n_meg)
        fx["hf_check_of_source"] = src.get("hf_check")
        if DERIVED[name]["lora"] == "grouped":
            desc = ("Derived from qwen3moe_ep2's real checkpoint (same model, same LoRA, same logits.pt): base "
                    "experts rewritten as legacy GroupedMLP (mlp.experts.weight1 [H, E_loc*2F], weight2 "
                    "[E_loc*F, H]; expert k = weight1.view(E_loc, H, -1)[k] (in->out, columns [gate; up]) and "
                    "weight2.view(E_loc, -1, H)[k]), and the expert LoRA rewritten as MindSpeed's "
                    "LoraParallelGroupedMLP (mlp.experts.weight1_lora_a [H, r*E_loc] = view (E_loc, H, r), "
                    "weight1_lora_b [r, E_loc*2F] = view (E_loc, r, 2F), weight2_lora_a [E_loc*F, r] = view "
                    "(E_loc, F, r), weight2_lora_b [r*E_loc, H] = view (E_loc, r, H); delta W1[k] (in->out) = "
                    "(alpha/r) * A1[k] @ B1[k], transposed for HF [out, in]); attention LoRA unchanged (PEFT). "
                    "LoRA args: moe_grouped_gemm=True, moe_token_dispatcher_type=alltoall_seq.")
        else:
            desc = ("Derived from qwen3moe_ep2's real checkpoint (same model, same logits.pt): base experts "
                    "rewritten as legacy GroupedMLP (mlp.experts.weight1 [H, E_loc*2F] = view (E_loc, H, 2F), "
                    "weight2 [E_loc*F, H] = view (E_loc, F, H), in->out, weight1 columns [gate; up] per expert); "
                    "args.moe_grouped_gemm=True. lora/ is qwen3moe_ep2's LoRA copied byte for byte (PEFT "
                    "per-expert local_experts.{k}.linear_fc1/fc2 LoRA): base and LoRA differ in expert layout, "
                    "as base and LoRA may differ in TP; the merge happens in HF layout.")
        desc += (" Checked: every expert's output recomputed in plain torch from the rewritten tensors equals "
                 "the per-expert one (grouped_check), and weight1/weight2 are bitwise equal to what Megatron's "
                 "own GroupedMLP holds after dist_checkpointing.load of qwen3moe_dist_ep2's torch_dist base.")
        fx["description"] = desc
        (out / name / "fixture.json").write_text(json.dumps(fx, indent=2) + "\n")
        print(f"[{name}] derived: {res} megatron-equal {meg_eq} ({n_meg} tensors)", flush=True)


if __name__ == "__main__":
    main()
