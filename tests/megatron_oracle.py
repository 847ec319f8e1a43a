"""Megatron oracle for the tests: the logits the REAL megatron-core 0.16.1 ``GPTModel`` computes from a
Megatron checkpoint, at the checkpoint's own parallel layout, on CPU.

    logits = megatron_logits(iter_dir, hf_config, dict(tp=2, pp=2, vpp=None, ep=1, etp=1), input_ids)

It exists to prove that checkpoints written for Megatron load into Megatron itself and compute the right
function, so it is independent of ``lora_merge``: every Megatron convention used here is either stated
below or taken from megatron-core (parallel_state, GPTModel, its specs, dist_checkpointing).

How a call runs
---------------
* The HF config is translated, in the calling process, into a Megatron model description (the way
  scripts/make_*fixtures.py build their models: local spec, RMSNorm, rope, swiglu; MoE = TopKRouter +
  SequentialMLP / GroupedMLP with the alltoall dispatcher; MLA for DeepSeek; gpt-oss (_gptoss): biases on
  every linear, sinks (softmax_type "learnable"), sliding window on its "sliding_attention" layers, clamped
  quick-GeGLU experts, YaRN RoPE set on the config; its windowed softmax needs a CPU mask, see _patch_cpu).
  Anything the translation does not know is refused (NotImplementedError) instead of guessed.
* One start of the world per call (START_METHOD): pp * lcm(tp, etp * ep) gloo ranks on CPU (the attention
  grid is TP x DP, the expert grid ETP x EP x EDP; DP is the smallest that makes both cover the same ranks).
  Every rank builds all its model chunks (one per virtual stage, as megatron.training.get_model does),
  loads its share of the checkpoint strictly and runs the forward; pipeline activations are passed by hand
  (gloo send/recv, chunks in the interleaved order), the logits are gathered over TP (runtime_gather_output)
  and trimmed to the HF vocab_size. Every last-stage rank writes its logits; they must all agree (the DP / EP replicas
  compute the same function from their own rank file), and the caller gets them as float32 [B, S, vocab].
* A failure in any rank (missing / unexpected key, shape mismatch, args that disagree, a dead peer) comes
  back as MegatronOracleError naming the rank that failed first and its traceback; a hang ends after
  ``timeout`` seconds with MegatronOracleTimeout. Either way every rank process is gone afterwards.

Legacy ("torch") checkpoints
----------------------------
Megatron-LM 0.16.1 (megatron/training/checkpointing.py) names a rank's file with get_checkpoint_name:
``mp_rank_{tp_rank:02d}`` + ``_{pp_rank:03d}`` when PP > 1 + ``_{ep_rank:03d}`` when EP > 1, the rank's
tensor-, pipeline- and expert-model-parallel ranks. Only ranks with expert-data-parallel rank 0 save
(``mpu.get_expert_data_parallel_rank() == 0``); on load every rank opens the file of its own (tp, pp, ep)
and has no fallback. With parallel_state's rank order (stage-local rank r: tp_rank = r % TP, ep_rank =
(r // ETP) % EP, EDP rank = r // (ETP * EP)) the files are those of (r % TP, pp, (r // ETP) % EP) for
r < ETP * EP (legacy_rank_dirs):
* TP divides ETP * EP (ETP = TP, or e.g. TP=2 ETP=1 EP=2): the world per stage is ETP * EP, every rank
  saves and finds its own file. The grid may be sparse: TP=2 ETP=1 EP=2 gives only mp_rank_00_000 and
  mp_rank_01_001.
* otherwise (e.g. TP=4 ETP=1 EP=2) no file is written for some (tp, ep) that ranks load, so 0.16.1 cannot
  reload its own checkpoint (fixed upstream in 2026: DP rank 0 saves too). The oracle loads as Megatron
  does; a missing file is an error naming the rule.
A file is a dict with ``args``, ``checkpoint_version``, ``iteration`` and ``model`` (``model0``, ``model1``,
... with virtual pipeline), each loaded with ``load_state_dict(strict=True)`` and no fallback (Megatron-LM
itself retries a failed strict load with strict=False and only prints what was missing). The local spec's
state dict holds ``<linear>._extra_state`` = None for every ColumnParallelLinear / RowParallelLinear
(EXTRA_STATE_DOC); those linears fill a missing one in on load (a load pre-hook), so by default
(exact_keys=True) the oracle also demands the exact key set megatron-core's own save writes.

torch_dist checkpoints
----------------------
``dist_checkpointing.load`` of the chunks' sharded_state_dict (``model`` / ``model{v}``) built with the
checkpoint's own content metadata (e.g. singleton_local_shards), exactly as Megatron-LM does, then
``load_state_dict(strict=True)``. Keys the model asks for and the checkpoint lacks are errors, and so are
model keys in the checkpoint that no rank asked for (optimizer / rng / rerun state are not model keys).

GroupedMLP (expert_layout="grouped")
------------------------------------
The model is built with ``moe_grouped_gemm=True`` (legacy GroupedMLP: ``mlp.experts.weight1`` [H, E_loc*2F/etp]
and ``weight2`` [E_loc*F/etp, H]) and loads the checkpoint strictly. GroupedMLP.forward needs the
``grouped_gemm`` package and asserts bf16; here its own forward runs with the grouped GEMM replaced by
its definition in plain torch (``gmm(a, b, batch_sizes)``: the rows of ``a`` split by ``batch_sizes``, group
i multiplied by ``b[i]``) and a copy of the config with ``bf16=True`` given to the experts module only (the
flag only guards the kernel's dtype; the computation stays float32). So Megatron's own code decides how
weight1/weight2 are viewed per expert.

What the oracle needs from the checkpoint besides the tensors (ARGS_DOC)
------------------------------------------------------------------------
``args.padded_vocab_size`` (the GPTModel vocab size; cross-checked against the embedding / output-layer
shapes, and taken from them if args lack it), the fields Megatron-LM's check_checkpoint_args asserts for a
legacy checkpoint (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``tensor_model_parallel_size``,
``pipeline_model_parallel_size``; compared with the HF config and the layout), ``checkpoint_version`` >= 3.0
(below 3.0 Megatron reorders the QKV rows on load) and ``iteration``. Where present, the args must also agree
on ``expert_model_parallel_size``, ``expert_tensor_parallel_size``, ``virtual_pipeline_model_parallel_size``,
``num_experts`` and ``moe_grouped_gemm`` (Megatron builds its model from args: a disagreeing field builds
another model). For torch_dist the args and content metadata come from the checkpoint's common state, and
the saving run's layout fields are not compared: it loads at any layout (resharding), as in Megatron-LM.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch

DEFAULT_TIMEOUT_S = 300.0
TE_STANDIN = Path(__file__).parent / "te_standin"

# How the ranks start. A fresh interpreter per rank (spawn) spends ~3 s importing torch + megatron-core, and
# 4 ranks on 2 cores ~10 s per call; a forkserver imports them once per test session and forks every rank
# from it (~0.5 s per call afterwards). Each rank still is a new process with its own gloo world and its own
# CPU shims; the server only imports these modules (no thread pool, no process group before the fork).
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.dist_checkpointing",
           "megatron.core.transformer.moe.experts", "megatron.core.transformer.moe.token_dispatcher",
           "megatron.core.transformer.multi_latent_attention"]

EXTRA_STATE_DOC = (
    "local spec (megatron-core 0.16.1): every ColumnParallelLinear / RowParallelLinear has "
    "'<module>._extra_state' (get_extra_state() returns None): self_attention.linear_qkv, "
    "self_attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2, output_layer (also when tied and it "
    "holds no weight), MoE mlp.experts.local_experts.{k}.linear_fc1/linear_fc2 and "
    "mlp.shared_experts.linear_fc1/linear_fc2, MLA self_attention.linear_q_proj / linear_q_down_proj / "
    "linear_q_up_proj / linear_kv_down_proj / linear_kv_up_proj / linear_proj. None for the embedding, the "
    "norms (input_layernorm, pre_mlp_layernorm, q/k/kv layernorms, final_layernorm), mlp.router and "
    "shared_experts.gate_weight; GroupedMLP's weight1/weight2 have none (it also accepts and drops "
    "'_extra_state' keys under mlp.experts)."
)


class MegatronOracleError(RuntimeError):
    """A rank failed; the message names the rank that failed first and carries its traceback."""


class MegatronOracleTimeout(MegatronOracleError):
    """The ranks did not finish within the timeout (they were killed)."""


# --------------------------------------------------------------------------------------------------
# HF config -> Megatron model description (plain dict, built in the caller)
# --------------------------------------------------------------------------------------------------

DENSE = ("qwen2", "llama", "mistral", "qwen3", "phi3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")
MLA = ("deepseek_v3", "deepseek_v2")


def _rope(hf: dict) -> tuple[float, dict]:
    """(rope theta, scaling parameters or {}) from transformers 5 (rope_parameters) or 4 (rope_theta +
    rope_scaling) config keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype == "default":
        return float(theta), {}
    merged["rope_type"] = rtype
    return float(theta), merged


def _layer_pattern(hf: dict, num_layers: int) -> list[int]:
    """1 = MoE layer, 0 = dense, as the HF model class decides it."""
    mt = hf["model_type"]
    if mt in ("qwen2_moe", "qwen3_moe"):
        only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        return [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)]
    if mt in ("mixtral", "gpt_oss"):
        return [1] * num_layers
    k, freq = hf.get("first_k_dense_replace", 0) or 0, hf.get("moe_layer_freq", 1) or 1
    return [int(i >= k and i % freq == 0) for i in range(num_layers)]


def model_spec(hf_config: dict, tied: bool | None = None) -> dict:
    """The Megatron model that a HF config describes (JSON-able; see module docstring)."""
    hf = dict(hf_config)
    mt = hf.get("model_type")
    if mt not in DENSE + MOE + MLA:
        raise NotImplementedError(f"model_type {mt!r}: the oracle knows {DENSE + MOE + MLA}")
    if mt != "gpt_oss" and hf.get("hidden_act", "silu") != "silu":  # (gpt-oss's experts ignore hidden_act)
        raise NotImplementedError(f"hidden_act {hf.get('hidden_act')!r}: only silu (swiglu) is translated")
    L, H, NH = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    s = dict(
        model_type=mt, num_layers=L, hidden_size=H, num_attention_heads=NH,
        ffn_hidden_size=hf["intermediate_size"], norm_epsilon=hf["rms_norm_eps"],
        vocab_size=hf["vocab_size"], max_position_embeddings=hf["max_position_embeddings"],
        rotary_base=theta, tied=bool(hf.get("tie_word_embeddings", False)) if tied is None else bool(tied),
        mla=mt in MLA, moe=None, yarn=None, gptoss=None, yarn_rope=None,
        # multi-token-prediction layers (Megatron-Core's mtp block, on the last stage)
        mtp=int(hf.get("num_nextn_predict_layers") or 0) if mt in ("deepseek_v3", "glm4_moe") else 0,
        # partial RoPE: GPTModel(rotary_percent) rotates the first int(kv_channels * percent) dims of each head
        rotary_percent=float({**hf, **(hf.get("rope_parameters") or {})}.get("partial_rotary_factor", 1.0)),
        # (a window the local spec does not have; megatron_logits refuses inputs longer than it)
        sliding_window=hf.get("sliding_window") if (hf.get("use_sliding_window") or mt in ("mistral", "mixtral"))
        else None,
    )
    if mt in MLA:
        if scaling and scaling["rope_type"] != "yarn":
            raise NotImplementedError(f"MLA rope scaling {scaling['rope_type']!r}")
        if scaling:
            s["yarn"] = dict(
                rotary_scaling_factor=float(scaling["factor"]), mscale=float(scaling.get("mscale", 1.0)),
                mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
                beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)))
        # Megatron MLA keeps rotary_interleaved=False; HF's rope_interleave only says how HF stores the rope
        # rows, which is the converter's business, not the Megatron model's.
        s.update(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                 qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                 v_head_dim=hf["v_head_dim"], kv_channels=hf["v_head_dim"], num_query_groups=NH,
                 add_qkv_bias=False, qk_layernorm=True)
        if hf.get("attention_bias"):
            raise NotImplementedError("MLA with attention_bias")
    else:
        if mt == "gpt_oss":
            s.update(_gptoss(hf, scaling))
        elif scaling:
            raise NotImplementedError(f"rope scaling {scaling['rope_type']!r} for {mt}")
        bias = {"qwen2": True, "qwen2_moe": hf.get("qkv_bias", True), "mixtral": False}.get(
            mt, hf.get("attention_bias", False))
        if mt == "llama" and hf.get("mlp_bias"):
            raise NotImplementedError("llama mlp_bias")
        s.update(num_query_groups=hf.get("num_key_value_heads") or NH,
                 kv_channels=hf.get("head_dim") or H // NH, add_qkv_bias=bool(bias),
                 qk_layernorm=mt in ("qwen3", "qwen3_moe") or (mt == "glm4_moe" and bool(hf.get("use_qk_norm"))))
    if mt in MOE + MLA:
        pattern = _layer_pattern(hf, L)
        moe = dict(layer_freq=pattern, topk=hf["num_experts_per_tok"], score="softmax", expert_bias=False,
                   groups=None, scaling=None, shared=None, shared_gate=False)
        if mt == "mixtral":
            moe.update(num_experts=hf["num_local_experts"], ffn=hf["intermediate_size"], pre_softmax=False)
        elif mt in ("qwen2_moe", "qwen3_moe"):
            E = hf.get("num_experts", hf.get("num_local_experts"))
            # HF norm_topk_prob=True: softmax over the chosen k = Megatron top-k on logits then softmax
            # (pre_softmax=False); False: softmax over all experts, no renormalisation (pre_softmax=True)
            moe.update(num_experts=E, ffn=hf["moe_intermediate_size"], pre_softmax=not hf.get("norm_topk_prob", False))
            if mt == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
                moe.update(shared=hf["shared_expert_intermediate_size"], shared_gate=True)
        elif mt == "gpt_oss":
            # HF: top-k of the router logits (bias included), softmax over the chosen k = Megatron softmax scores,
            # top-k on the logits, pre_softmax=False; no shared expert
            moe.update(num_experts=hf.get("num_local_experts", hf.get("num_experts")), ffn=hf["intermediate_size"],
                       pre_softmax=False)
        else:
            E, F = hf["n_routed_experts"], hf["moe_intermediate_size"]
            moe.update(num_experts=E, ffn=F, scaling=float(hf.get("routed_scaling_factor", 1.0)))
            if hf.get("n_shared_experts"):
                moe.update(shared=hf["n_shared_experts"] * F)
            score = hf.get("scoring_func", "sigmoid" if mt in ("deepseek_v3", "glm4_moe") else "softmax")
            if mt in ("deepseek_v3", "glm4_moe") or score == "sigmoid":
                if score != "sigmoid" or not hf.get("norm_topk_prob", True):
                    raise NotImplementedError("DeepSeek-V3 routing other than sigmoid + renormalised top-k")
                moe.update(score="sigmoid", pre_softmax=False,
                           expert_bias=hf.get("topk_method", "noaux_tc") == "noaux_tc")
            else:
                if hf.get("topk_method", "greedy") != "greedy" or hf.get("norm_topk_prob", False):
                    raise NotImplementedError("DeepSeek-V2 routing other than greedy softmax without renormalisation")
                moe.update(pre_softmax=True)
            if (hf.get("n_group") or 1) > 1:
                moe.update(groups=[hf["n_group"], hf["topk_group"]])
        if sum(pattern) == 0:
            moe = None
        s["moe"] = moe
    return s


def _gptoss(hf: dict, scaling: dict) -> dict:
    """gpt-oss's model_spec entries. transformers' GptOssForCausalLM -> megatron-core 0.16.1 (docs/formats.md):
    biases on every linear (add_bias_linear), sinks = softmax_type "learnable" (core_attention.softmax_offset),
    HF sliding_window W on its "sliding_attention" layers = window_size (W - 1, 0) on those layers
    (window_attn_skip_freq as a per-layer list, 1 = windowed), experts (gate.clamp(max=limit) * sigmoid(alpha *
    gate)) * (up.clamp(-limit, limit) + 1) = quick_gelu GLU with activation_func_clamp_value=limit and
    glu_linear_offset=1 (Megatron's quick_gelu hard-codes alpha 1.702), and YaRN RoPE as attributes of the config
    (position_embedding_type "yarn", yarn_*: GPTModel reads them with getattr)."""
    import math

    if not hf.get("attention_bias", True):
        raise NotImplementedError("gpt_oss without attention_bias (Megatron's add_bias_linear puts biases on every "
                                  "linear, experts included)")
    if abs(float(hf.get("swiglu_alpha", 1.702)) - 1.702) > 1e-12:
        raise NotImplementedError(f"gpt_oss swiglu_alpha {hf.get('swiglu_alpha')}: megatron-core's quick_gelu is "
                                  "x * sigmoid(1.702 x)")
    L, W = hf["num_hidden_layers"], hf.get("sliding_window")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise NotImplementedError(f"gpt_oss layer_types {types!r}")
    windowed = [int(t == "sliding_attention") for t in types] if W else [0] * L
    out = dict(gptoss=dict(window=int(W) if any(windowed) else None, window_layers=windowed,
                           clamp=float(hf.get("swiglu_limit", 7.0)), glu_linear_offset=1.0))
    if scaling:
        if scaling["rope_type"] != "yarn":
            raise NotImplementedError(f"gpt_oss rope scaling {scaling['rope_type']!r}")
        orig = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or hf["max_position_embeddings"] / orig
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        get_mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
        if not (mscale and mscale_all_dim):  # HF's attention factor is then get_mscale(factor) = Megatron's with
            mscale, mscale_all_dim = 1.0, 0.0  # yarn_mscale 1, yarn_mscale_all_dim 0 (Megatron-LM's defaults)
        inferred = get_mscale(mscale) / get_mscale(mscale_all_dim)
        if scaling.get("attention_factor") is not None and abs(scaling["attention_factor"] - inferred) > 1e-9:
            raise NotImplementedError(f"gpt_oss YaRN attention_factor {scaling['attention_factor']} (Megatron derives "
                                      f"{inferred} from factor, mscale, mscale_all_dim)")
        out["yarn_rope"] = dict(
            rotary_scaling_factor=float(factor), original_max_position_embeddings=orig,
            beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
            mscale=float(mscale), mscale_all_dim=float(mscale_all_dim),
            correction_range_round_to_int=bool(scaling.get("truncate", True)))
    return out


# --------------------------------------------------------------------------------------------------
# Layout, rank files
# --------------------------------------------------------------------------------------------------

def normalize_layout(layout: dict) -> dict:
    lay = dict(tp=int(layout.get("tp", 1)), pp=int(layout.get("pp", 1)), vpp=layout.get("vpp"),
               ep=int(layout.get("ep", 1) or 1), etp=layout.get("etp"),
               first_stage_layers=layout.get("first_stage_layers"), last_stage_layers=layout.get("last_stage_layers"))
    if lay["etp"] is None:
        lay["etp"] = lay["tp"]  # Megatron's default: expert TP = TP
    lay["etp"] = int(lay["etp"])
    if lay["vpp"] is not None:
        lay["vpp"] = int(lay["vpp"])
        if lay["vpp"] < 2:
            raise ValueError(f"vpp must be None or >= 2, got {lay['vpp']}")
    unknown = set(layout) - set(lay)
    if unknown:
        raise ValueError(f"unknown layout keys {sorted(unknown)}")
    return lay


def world_size(layout: dict) -> int:
    lay = normalize_layout(layout)
    return lay["pp"] * math.lcm(lay["tp"], lay["etp"] * lay["ep"])


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM get_checkpoint_name's directory for these model-parallel ranks."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def legacy_rank_dirs(layout: dict) -> list[str]:
    """The rank dirs megatron-core 0.16.1 + Megatron-LM write for this layout (expert-data-parallel rank 0)."""
    lay = normalize_layout(layout)
    tp, pp, ep, etp = lay["tp"], lay["pp"], lay["ep"], lay["etp"]
    # (stage-local rank r: tp_rank = r % tp; expert grid etp-ep-edp: ep_rank = (r // etp) % ep, edp = r // (etp*ep))
    return sorted({rank_dir_name(r % tp, p, (r // etp) % ep, pp, ep) for p in range(pp) for r in range(etp * ep)})


# --------------------------------------------------------------------------------------------------
# The caller's side
# --------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_logits(ckpt: Path, hf_config: dict, layout: dict, input_ids: torch.Tensor,
                    ckpt_format: str = "torch", expert_layout: str = "sequential", tied: bool | None = None,
                    *, exact_keys: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
                    mtp_out: dict | None = None, transformer_impl: str = "local") -> torch.Tensor:
    """float32 logits [B, S, vocab_size] of the real Megatron GPTModel loading the checkpoint iteration dir
    `ckpt` (legacy rank dirs or torch_dist) at `layout` (tp, pp, vpp, ep, etp, first/last_stage_layers).

    exact_keys: every model state dict in the checkpoint must hold exactly the keys megatron-core's own save
    writes for that model chunk (state_dict_for_save_checkpoint), ``_extra_state`` entries included. With
    False, only what ``load_state_dict(strict=True)`` enforces: the local spec's linears fill a missing
    ``_extra_state`` with None themselves (a load pre-hook), so those may be absent.

    A config with num_nextn_predict_layers builds Megatron-Core's MTP block; its logits [MTP layers, B, S, vocab]
    (the output layer's calls on each MTP layer's output) go to mtp_out["logits"].

    transformer_impl="transformer_engine": the model is megatron-core's TransformerEngine spec (what Megatron-LM
    builds by default) over tests/te_standin, TransformerEngine's leaf modules re-created for CPU (see its
    README: their parameter names, extra state and arithmetic are the stand-in's; the spec, the wrappers, their
    sharded state dicts and the loaders are megatron-core's). Ranks then start fresh (spawn), with the stand-in
    importable before megatron-core is."""
    ckpt = Path(ckpt)
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {transformer_impl!r}")
    if expert_layout not in ("sequential", "grouped"):
        raise ValueError(f"expert_layout must be 'sequential' or 'grouped', got {expert_layout!r}")
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: not a checkpoint iteration directory")
    is_dist = (ckpt / "metadata.json").is_file()
    if is_dist != (ckpt_format == "torch_dist"):
        raise ValueError(f"{ckpt}: ckpt_format={ckpt_format!r} but the directory "
                         f"{'is' if is_dist else 'is not'} a torch_dist checkpoint (metadata.json)")
    lay = normalize_layout(layout)
    spec = model_spec(hf_config, tied)
    if expert_layout == "grouped" and not spec["moe"]:
        raise ValueError("expert_layout='grouped' for a model without MoE layers")
    input_ids = torch.as_tensor(input_ids, dtype=torch.int64).detach().cpu().contiguous()
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(input_ids.shape)}")
    if int(input_ids.max()) >= spec["vocab_size"] or int(input_ids.min()) < 0:
        raise ValueError("input_ids outside the HF vocabulary")
    if spec["sliding_window"] is not None and input_ids.shape[1] > spec["sliding_window"]:
        raise NotImplementedError(f"sliding window {spec['sliding_window']} < sequence length {input_ids.shape[1]}: "
                                  "the local spec has no sliding-window attention")
    world = world_size(lay)
    job = dict(ckpt=str(ckpt.resolve()), fmt=ckpt_format, grouped=expert_layout == "grouped", spec=spec,
               exact_keys=bool(exact_keys), layout=lay, world=world, timeout=float(timeout),
               te=transformer_impl == "transformer_engine")

    ctx = _context() if not job["te"] else __import__("multiprocessing").get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megatron_oracle_") as tmp:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, port, job, input_ids, tmp), daemon=True,
                             name=f"megatron-oracle-rank{r}") for r in range(world)]
        try:
            for p in procs:
                p.start()
            _wait(procs, tmp, timeout)
        finally:
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
            for p in procs:
                if p.pid is not None:
                    p.join(5)
        if mtp_out is not None:
            mtp_out["logits"] = _collect(tmp, "mtp_logits")
        return _collect(tmp)


def _context():
    import multiprocessing

    if START_METHOD not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD + [__name__])  # (no effect once the server runs)
    return ctx


def run_isolated(fn, *args, timeout: float = 120.0):
    """fn(*args) in a child process started like the ranks; its (picklable) return value comes back, its
    exception as MegatronOracleError. For checkpoint surgery in tests: unpickling a Megatron rank file imports
    megatron.core, and importing megatron.core adds Namespace, numpy arrays, BytesIO, PosixPath, ... to
    torch's process-wide weights_only allow-list (megatron/core/safe_globals.py), which a test process that
    checks weights-only loading must not get. The oracle never imports megatron in the calling process."""
    import pickle

    with tempfile.TemporaryDirectory(prefix="megatron_oracle_") as tmp:
        p = _context().Process(target=_isolated_main, args=(fn, args, tmp), daemon=True)
        try:
            p.start()
            _wait([p], tmp, timeout, what="isolated call")
        finally:
            if p.pid is not None and p.exitcode is None:
                p.kill()
            if p.pid is not None:
                p.join(5)
        return pickle.loads(Path(tmp, "result.pkl").read_bytes())


def _isolated_main(fn, args, tmp: str):
    import pickle

    try:
        Path(tmp, "result.pkl").write_bytes(pickle.dumps(fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        rec = dict(rank=0, time=time.time(), summary=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc())
        Path(tmp, "error_0.json").write_text(json.dumps(rec))
        os._exit(1)
    os._exit(0)


def _errors(tmp: str) -> list[dict]:
    out = []
    for f in sorted(Path(tmp).glob("error_*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return sorted(out, key=lambda e: e["time"])


def _raise_errors(errs: list[dict], extra: str = "", what: str = "Megatron rank"):
    first = errs[0]
    others = "".join(f"\n  then rank {e['rank']}: {e['summary']}" for e in errs[1:])
    raise MegatronOracleError(f"{what} {first['rank']} failed: {first['summary']}{extra}{others}\n"
                              f"--- {what} {first['rank']} traceback ---\n{first['traceback']}")


def _wait(procs, tmp: str, timeout: float, what: str = "Megatron rank"):
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            # let the other ranks notice and report (their own errors sort after the first one)
            grace = time.monotonic() + 3.0
            while time.monotonic() < grace and any(p.exitcode is None for p in procs):
                time.sleep(0.05)
            errs = _errors(tmp)
            if errs:
                _raise_errors(errs, what=what)
            r, c = bad[0]
            raise MegatronOracleError(f"{what} {r} died with exit code {c} without a Python error "
                                      "(killed, out of memory or a crash in native code)")
        if time.monotonic() > deadline:
            alive = [r for r, c in enumerate(codes) if c is None]
            errs = _errors(tmp)
            msg = f"{what}s {alive} still running after {timeout:.0f} s (killed)"
            if errs:
                _raise_errors(errs, f" [{msg}]", what)
            raise MegatronOracleTimeout(msg)
        time.sleep(0.05)


def _collect(tmp: str, what: str = "logits") -> torch.Tensor:
    files = sorted(Path(tmp).glob(f"{what}_*.pt"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
    if not files:
        raise MegatronOracleError("no rank wrote logits")
    got = [(int(f.stem.rsplit("_", 1)[1]), torch.load(f, weights_only=True)) for f in files]
    r0, ref = got[0]
    for r, x in got[1:]:
        if x.shape != ref.shape or not torch.equal(x, ref):
            diff = (x - ref).abs().max().item() if x.shape == ref.shape else f"shape {tuple(x.shape)}"
            raise MegatronOracleError(
                f"last-stage ranks {r0} and {r} computed different logits (max |diff| {diff}): the replicated "
                "(non-expert, or TP-replicated) tensors differ between their rank files")
    return ref


# --------------------------------------------------------------------------------------------------
# The ranks
# --------------------------------------------------------------------------------------------------

def _rank_main(rank: int, port: int, job: dict, input_ids, tmp: str):
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # the test process may have left them ignored
        signal.signal(sig, signal.SIG_DFL)
    if job["te"]:
        import sys

        if "megatron.core" in sys.modules:
            raise RuntimeError("the TransformerEngine stand-in must be importable before megatron-core is imported")
        sys.path.insert(0, str(TE_STANDIN))
    try:
        _run_rank(rank, port, job, input_ids, tmp)
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        summary = f"{type(e).__name__}: {e}".strip().splitlines()
        rec = dict(rank=rank, time=time.time(), summary=" | ".join(summary)[:2000], traceback=traceback.format_exc())
        Path(tmp, f"error_{rank}.json").write_text(json.dumps(rec))
        os._exit(1)  # no atexit / process-group teardown that could block on dead peers
    os._exit(0)


def _patch_cpu(torch, grouped: bool):
    """CPU shims megatron-core 0.16.1 needs without CUDA / TransformerEngine; none changes the arithmetic
    (the same as scripts/make_*fixtures.py use)."""
    import contextlib

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # LanguageModule.setup_embeddings_and_output_layer moves the tied weight with .cuda() (PP > 1)
    torch.Tensor.cuda = lambda self, *a, **k: self

    class _Event:
        def synchronize(self):
            pass

    class _Stream:
        def wait_stream(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return _Event()

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream  # the alltoall dispatcher's side stream / events
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import grouped_gemm_util, moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None  # undefined without TransformerEngine (NameError): plain matmul router
    multi_latent_attention.HAVE_TE = False  # TE placeholders are MagicMocks that isinstance rejects
    orig = token_dispatcher.all_to_all

    def as_list(s):
        if s is None:
            return None
        return [int(v) for v in (s.tolist() if hasattr(s, "tolist") else s)]

    def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
        # gloo's all_to_all_single takes the split sizes as lists (on a GPU they are host arrays)
        return orig(group, input_, as_list(output_split_sizes), as_list(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def get_sliding_window_causal_mask(sq, skv, window_size):
        """megatron-core 0.16.1's transformer.utils.get_sliding_window_causal_mask without its device="cuda" (True =
        masked: query i sees keys i - window_size[0] .. i + window_size[1]); the local softmax imported it by name."""
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    transformer_utils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask

    if grouped:
        from types import SimpleNamespace

        def gmm(a, b, batch_sizes, trans_b=False):
            """grouped_gemm.ops.gmm: rows of `a` split by batch_sizes, group i times b[i] (b[i].T if trans_b)."""
            sizes = [int(v) for v in (batch_sizes.tolist() if hasattr(batch_sizes, "tolist") else batch_sizes)]
            assert len(sizes) == b.shape[0] and sum(sizes) == a.shape[0], (sizes, tuple(a.shape), tuple(b.shape))
            parts = [x @ (w.t() if trans_b else w) for x, w in zip(a.split(sizes, dim=0), b)]
            return torch.cat(parts, dim=0) if parts else a.new_zeros(0, b.shape[-2 if trans_b else -1])

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        grouped_gemm_util.ops = SimpleNamespace(gmm=gmm)


def _moe_layer_freq(spec: dict, args) -> int | list:
    """Megatron's moe_layer_freq: the checkpoint's args.moe_layer_freq when it has one (Megatron builds the
    model from args; an int N and the equivalent list give different torch_dist keys: stacked
    ``decoder.layers.*`` vs per-layer ``decoder.layers.{i}.*``), else the int when the HF pattern is one
    (Megatron-LM's default is the int 1), else the list."""
    pattern = list(spec["moe"]["layer_freq"])
    L = len(pattern)
    as_pattern = lambda f: [int(i % f == 0) for i in range(L)] if isinstance(f, int) else list(f)  # noqa: E731
    got = getattr(args, "moe_layer_freq", None) if args is not None else None
    k = getattr(args, "first_k_dense_replace", None) if args is not None else None
    if got is not None and k:  # MindSpeed-LLM's own argument: its layer spec makes layers < k dense
        got = [0 if i < k else x for i, x in enumerate(as_pattern(got))]
    if got is not None:
        if as_pattern(got) != pattern:
            raise ValueError(f"args.moe_layer_freq {got!r} gives MoE layers {as_pattern(got)}, the HF config {pattern}")
        return got
    for f in range(1, L + 1):
        if as_pattern(f) == pattern:
            return f
    return pattern


def _make_config(torch, spec: dict, lay: dict, grouped: bool, moe_layer_freq=None):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = {"mtp_num_layers": spec["mtp"]} if spec["mtp"] else {}
    if lay["vpp"]:
        kw["virtual_pipeline_model_parallel_size"] = lay["vpp"]
    if lay["first_stage_layers"] is not None:
        kw["num_layers_in_first_pipeline_stage"] = int(lay["first_stage_layers"])
    if lay["last_stage_layers"] is not None:
        kw["num_layers_in_last_pipeline_stage"] = int(lay["last_stage_layers"])
    if spec["qk_layernorm"]:
        kw["qk_layernorm"] = True
    moe = spec["moe"]
    if moe:
        kw.update(
            expert_model_parallel_size=lay["ep"], expert_tensor_parallel_size=lay["etp"],
            num_moe_experts=moe["num_experts"], moe_ffn_hidden_size=moe["ffn"], moe_router_topk=moe["topk"],
            moe_router_pre_softmax=moe["pre_softmax"], moe_router_score_function=moe["score"],
            moe_router_enable_expert_bias=moe["expert_bias"], moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
            moe_layer_freq=moe_layer_freq,
        )
        if moe["scaling"] is not None:
            kw["moe_router_topk_scaling_factor"] = moe["scaling"]
        if moe["groups"]:
            kw.update(moe_router_num_groups=moe["groups"][0], moe_router_group_topk=moe["groups"][1])
        if moe["shared"]:
            kw.update(moe_shared_expert_intermediate_size=moe["shared"], moe_shared_expert_gate=moe["shared_gate"])
    if spec.get("gptoss"):  # (see _gptoss); bias_activation_fusion stays off: the fused kernel clamps before the bias
        from megatron.core.fusions.fused_bias_geglu import quick_gelu  # the one Megatron-LM's --quick-geglu sets

        g = spec["gptoss"]
        kw.update(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=g["glu_linear_offset"],
                  activation_func_clamp_value=g["clamp"], softmax_type="learnable")
        if g["window"]:
            kw.update(window_size=(g["window"] - 1, 0), window_attn_skip_freq=list(g["window_layers"]))
    kw.setdefault("add_bias_linear", False)
    kw.setdefault("activation_func", F.silu)
    common = dict(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
        num_attention_heads=spec["num_attention_heads"], kv_channels=spec["kv_channels"],
        ffn_hidden_size=spec["ffn_hidden_size"], gated_linear_unit=True,
        normalization="RMSNorm", layernorm_epsilon=spec["norm_epsilon"],
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
        use_cpu_initialization=True, perform_initialization=False,  # every value comes from the checkpoint
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        **kw,
    )
    if spec["mla"]:
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0)
        if spec["yarn"]:
            rope = dict(rope_type="yarn", **spec["yarn"])
        return MLATransformerConfig(
            q_lora_rank=spec["q_lora_rank"], kv_lora_rank=spec["kv_lora_rank"], qk_head_dim=spec["qk_head_dim"],
            qk_pos_emb_head_dim=spec["qk_pos_emb_head_dim"], v_head_dim=spec["v_head_dim"],
            rotary_base=spec["rotary_base"], **rope, **common)
    config = TransformerConfig(num_query_groups=spec["num_query_groups"], add_qkv_bias=spec["add_qkv_bias"], **common)
    if spec.get("yarn_rope"):  # YaRN RoPE (non-MLA): GPTModel prefers config.position_embedding_type to its argument
        config.position_embedding_type = "yarn"
        for k, v in spec["yarn_rope"].items():
            setattr(config, "yarn_" + k, v)
    return config


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """The local DotProductAttention, taking the k/v channel keywords that MLA passes (only TE's takes
        them); with kv_channels == v_head_dim its output view is the right one, MLA passes its softmax scale."""

        def __init__(self, config, *a, k_channels=None, v_channels=None, **k):
            assert v_channels in (None, config.kv_channels), (v_channels, config.kv_channels)
            super().__init__(config, *a, **k)

    return MLADotProductAttention


def _check_args(state: dict, spec: dict, lay: dict, grouped: bool, vpad: int, where: str, dist: bool):
    """The checkpoint fields Megatron-LM reads / asserts on load, against the model and layout (ARGS_DOC).
    torch_dist holds global tensors and loads at any layout and expert implementation: there the saving run's
    parallel sizes and moe_grouped_gemm are not compared (Megatron-LM does not either)."""
    problems = []
    ver = state.get("checkpoint_version")
    if ver is None or float(ver) < 3.0:
        problems.append(f"checkpoint_version {ver!r} (Megatron reorders QKV below 3.0; need 3.0)")
    if "iteration" not in state:
        problems.append("no 'iteration'")
    a = state.get("args")
    if a is None:
        problems.append("no 'args'")
    else:
        want = dict(num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                    num_attention_heads=spec["num_attention_heads"], padded_vocab_size=vpad)
        if not dist:
            want.update(tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"])
        for k, v in want.items():
            if not hasattr(a, k):
                problems.append(f"args.{k} missing")
            elif getattr(a, k) != v:
                problems.append(f"args.{k} = {getattr(a, k)!r}, expected {v!r}")
        opt = {} if dist else dict(expert_model_parallel_size=lay["ep"],
                                   virtual_pipeline_model_parallel_size=lay["vpp"])
        if spec["moe"]:
            opt.update(num_experts=spec["moe"]["num_experts"])
            if not dist:
                opt.update(expert_tensor_parallel_size=lay["etp"], moe_grouped_gemm=grouped)
        unset = dict(expert_tensor_parallel_size=lay["tp"], moe_grouped_gemm=False)  # what None means
        for k, v in opt.items():
            got = getattr(a, k, v)
            if got != v and not (got is None and unset.get(k, object()) == v):
                problems.append(f"args.{k} = {got!r}, expected {v!r}")
        if spec.get("gptoss"):
            problems += _gptoss_args_problems(a, spec)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def _gptoss_args_problems(a, spec: dict) -> list[str]:
    """gpt-oss: the Megatron-LM arguments (megatron/training/arguments.py names) that build a different model when
    they disagree with the HF config, compared where the checkpoint's args have them."""
    g, L, problems = spec["gptoss"], spec["num_layers"], []
    want = dict(add_bias_linear=True, quick_geglu=True, swiglu=False, softmax_type="learnable",
                glu_linear_offset=g["glu_linear_offset"], activation_func_clamp_value=g["clamp"])
    for k, v in want.items():
        if hasattr(a, k) and getattr(a, k) != v:
            problems.append(f"args.{k} = {getattr(a, k)!r}, expected {v!r} (gpt_oss)")
    if hasattr(a, "window_size"):
        ws = getattr(a, "window_size")
        expect = (g["window"] - 1, 0) if g["window"] else None
        if (tuple(ws) if ws is not None else None) != expect:
            problems.append(f"args.window_size = {ws!r}, expected {expect!r} (HF sliding_window {g['window']})")
    if g["window"] and hasattr(a, "window_attn_skip_freq") and getattr(a, "window_size", None) is not None:
        freq = a.window_attn_skip_freq  # (Megatron's is_layer_window_attention; None: every layer windowed)
        got = ([1] * L if freq is None else [int(i % freq != 0) for i in range(1, L + 1)] if isinstance(freq, int)
               else [int(bool(x)) for x in freq])
        if got != list(g["window_layers"]):
            problems.append(f"args.window_attn_skip_freq = {freq!r} windows layers {got}, HF layer_types "
                            f"{g['window_layers']}")
    return problems


def _run_rank(rank: int, port: int, job: dict, input_ids, tmp: str):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # megatron-core's jit_fuser is torch.compile (GroupedMLP's activations): run those functions eagerly,
    # the same ops without a compiler (inductor would need a C++ toolchain and seconds per rank)
    torch._dynamo.config.disable = True
    spec, lay, grouped = job["spec"], job["layout"], job["grouped"]
    _patch_cpu(torch, grouped)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=job["world"],
                            timeout=datetime.timedelta(seconds=max(30.0, job["timeout"])))

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.moe.experts import GroupedMLP

    TP, PP, VPP, EP = lay["tp"], lay["pp"], lay["vpp"], lay["ep"]
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                                 virtual_pipeline_model_parallel_size=VPP, expert_model_parallel_size=EP,
                                 expert_tensor_parallel_size=lay["etp"])
    tp_rank, pp_rank, ep_rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 ps.get_expert_model_parallel_rank())
    torch.manual_seed(0)  # (model_parallel_cuda_manual_seed needs CUDA); no dropout, no random init used
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    ckpt = Path(job["ckpt"])
    me = f"rank {rank} (tp {tp_rank}, pp {pp_rank}, ep {ep_rank})"

    # ---- what this rank reads: its legacy file, or the torch_dist common state ----
    if job["fmt"] == "torch":
        dname = rank_dir_name(tp_rank, pp_rank, ep_rank, PP, EP)
        path = ckpt / dname / "model_optim_rng.pt"
        if not path.is_file():
            have = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("mp_rank_"))
            raise FileNotFoundError(
                f"{me}: no {dname}/model_optim_rng.pt in {ckpt} (has {have}); Megatron-LM loads the file "
                f"of each rank's own (tp, pp, ep) ranks, and 0.16.1 writes {legacy_rank_dirs(lay)} for this layout")
        state = torch.load(path, map_location="cpu", weights_only=False)
        where = f"{me}: {dname}"
        models = [f"model{v}" for v in range(VPP)] if VPP else ["model"]
        missing = [m for m in models if m not in state]
        extra = sorted(k for k in state if k.startswith("model") and k not in models)
        if missing or extra:
            raise KeyError(f"{where}: model state keys {sorted(k for k in state if k.startswith('model'))}, "
                           f"expected {models}")
        sds = [state[m] for m in models]
        shapes = [sd[k].shape for sd in sds for k in ("embedding.word_embeddings.weight", "output_layer.weight")
                  if torch.is_tensor(sd.get(k))]
    else:
        state = dist_checkpointing.load_common_state_dict(str(ckpt))
        where = f"{me}: {ckpt.name} (torch_dist common state)"
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        shapes = [md[k].size for k in ("embedding.word_embeddings.weight", "output_layer.weight") if k in md]
        sds = None
    # padded vocab: args, cross-checked with the (per-rank or global) embedding / output shapes
    vocab_rows = {int(s[0]) * (TP if job["fmt"] == "torch" else 1) for s in shapes}
    a = state.get("args")
    vpad = getattr(a, "padded_vocab_size", None) if a is not None else None
    if vpad is None:
        if len(vocab_rows) != 1:
            raise ValueError(f"{where}: no args.padded_vocab_size and no embedding / output layer to infer it")
        vpad = vocab_rows.pop()
    elif vocab_rows and vocab_rows != {vpad}:
        raise ValueError(f"{where}: args.padded_vocab_size {vpad} but embedding / output rows give "
                         f"{sorted(vocab_rows)}")
    _check_args(state, spec, lay, grouped, vpad, where, job["fmt"] == "torch_dist")

    # ---- the model chunks, as megatron.training.get_model builds them ----
    config = _make_config(torch, spec, lay, grouped, _moe_layer_freq(spec, a) if spec["moe"] else None)
    core_attention = _mla_core_attention() if spec["mla"] else None
    chunks, firsts, lasts = [], [], []
    for v in range(VPP or 1):
        vp = v if VPP else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=job["te"], normalization="RMSNorm",
                                           vp_stage=vp, pp_rank=pp_rank)
        if core_attention is not None and not job["te"]:
            for ls in block.layer_specs:
                ls.submodules.self_attention.submodules.core_attention = core_attention
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        mtp = ({"mtp_block_spec": get_gpt_mtp_block_spec(config, block, use_transformer_engine=job["te"], vp_stage=vp,
                                                         pp_rank=pp_rank)} if spec["mtp"] else {})
        m = GPTModel(config=config, transformer_layer_spec=block, vocab_size=vpad, **mtp,
                     max_sequence_length=spec["max_position_embeddings"], pre_process=pre, post_process=post,
                     parallel_output=True, share_embeddings_and_output_weights=spec["tied"],
                     position_embedding_type="rope", rotary_base=spec["rotary_base"],
                     rotary_percent=spec["rotary_percent"], **({"vp_stage": vp} if VPP else {}))
        m.eval()
        chunks.append(m)
        firsts.append(pre)
        lasts.append(post)

    # ---- load ----
    if job["fmt"] == "torch_dist":
        meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=state) or {}
        meta = dict(meta, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
        keys = [f"model{v}" for v in range(VPP)] if VPP else ["model"]
        request = {k: m.sharded_state_dict(metadata=meta) for k, m in zip(keys, chunks)}
        from megatron.core.dist_checkpointing.validation import StrictHandling

        loaded, ckpt_only, absent = dist_checkpointing.load(request, str(ckpt), strict=StrictHandling.RETURN_ALL)
        if not job["exact_keys"]:
            absent = {k for k in absent if not k.endswith("_extra_state")}
        if absent:
            raise KeyError(f"{where}: keys the model needs are not in the checkpoint: {sorted(absent)[:8]}")
        not_model = ("optimizer", "rng_state", "rerun_state_machine", "common_state")
        ckpt_only = sorted(k for k in ckpt_only if not k.startswith(not_model))
        if ckpt_only:
            raise KeyError(f"{where}: checkpoint keys no rank of this model asked for: {ckpt_only[:8]}")
        sds = [loaded[k] for k in keys]
    if job["fmt"] == "torch" and job["exact_keys"]:
        for v, (m, sd) in enumerate(zip(chunks, sds)):
            want, have = set(m.state_dict_for_save_checkpoint()), set(sd)
            if want != have:
                lack, extra = sorted(want - have), sorted(have - want)
                raise KeyError(
                    f"{where} chunk {v}: the keys differ from what megatron-core's own save writes: missing "
                    f"{lack[:8]}{' ...' if len(lack) > 8 else ''}, unexpected {extra[:8]}"
                    f"{' ...' if len(extra) > 8 else ''}" + (" (a missing '_extra_state' alone would load: "
                    "pass exact_keys=False)" if lack and all(k.endswith("_extra_state") for k in lack)
                    and not extra else ""))
    for v, (m, sd) in enumerate(zip(chunks, sds)):
        if job["te"] and job["fmt"] == "torch_dist":
            # TEDotProductAttention's sharded state dict leaves out its _extra_state, so no torch_dist checkpoint
            # has it, and the strict load that follows fails on it; Megatron-LM's load_model_state_dict then loads
            # with strict=False. Only that key may be missing here.
            result = m.load_state_dict(sd, strict=False)
            lack = [k for k in result.missing_keys if not k.endswith(".core_attention._extra_state")]
            if lack or result.unexpected_keys:
                raise KeyError(f"{where} chunk {v}: missing {lack[:8]}, unexpected {result.unexpected_keys[:8]}")
            continue
        try:
            m.load_state_dict(sd, strict=True)
        except Exception as e:
            raise type(e)(f"{where} chunk {v}: {e}") from None
    if grouped and not job["te"]:  # (TEGroupedMLP with TE)
        n = 0
        for mod in (x for m in chunks for x in m.modules()):
            if isinstance(mod, GroupedMLP):
                import copy

                mod.config = copy.copy(mod.config)
                mod.config.bf16 = True  # GroupedMLP.forward asserts it (kernel dtype); the math stays fp32
                n += 1
        assert n, "grouped expert layout but the model has no GroupedMLP"

    # ---- forward: chunks in the interleaved order, activations over the pipeline ring ----
    B, S = input_ids.shape
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)  # True = masked
    res = None
    with torch.no_grad():
        for v, m in enumerate(chunks):
            if not firsts[v]:
                recv = torch.empty(S, B, spec["hidden_size"], dtype=torch.float32)
                dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                m.set_input_tensor(recv)
            calls, hook = [], None
            if spec["mtp"] and lasts[v]:  # with MTP: labels needed, the loss returned; logits from the output layer
                # (cloned: the loss turns the logits tensor into probabilities in place)
                hook = m.output_layer.register_forward_hook(lambda mod, a, out: calls.append(out[0].detach().clone()))
            # (the MTP layers embed the next tokens: the last stage takes the input ids too, as in training)
            res = m(input_ids=input_ids if firsts[v] or (spec["mtp"] and lasts[v]) else None,
                    position_ids=position_ids, attention_mask=mask,
                    runtime_gather_output=True,
                    **({"labels": torch.zeros_like(input_ids)} if spec["mtp"] and lasts[v] else {}))
            if hook is not None:
                hook.remove()
                if len(calls) != spec["mtp"] + 1:
                    raise RuntimeError(f"{me}: {len(calls)} output-layer calls, expected {spec['mtp'] + 1}")
                res = calls[-1].transpose(0, 1)
                torch.save(torch.stack([c.transpose(0, 1)[..., : spec["vocab_size"]].float() for c in calls[:-1]])
                           .contiguous().clone(), Path(tmp, f"mtp_logits_{rank}.pt"))
            if not lasts[v]:
                dist.send(res.float().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                res = None
    if res is not None:
        if tuple(res.shape) != (B, S, vpad):
            raise RuntimeError(f"{me}: logits shape {tuple(res.shape)}, expected {(B, S, vpad)}")
        torch.save(res[..., : spec["vocab_size"]].float().contiguous().clone(), Path(tmp, f"logits_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
