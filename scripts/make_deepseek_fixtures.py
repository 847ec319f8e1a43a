#!/usr/bin/env python
"""Generate DeepSeek-V3 / V2-Lite-like test fixtures with the REAL megatron-core 0.16.1 and PEFT 0.7.1.

    PYTHONPATH=.fixture-deps .venv/bin/python scripts/make_deepseek_fixtures.py \
        [--out tests/fixtures_deepseek] [--only NAME ...] [--no-hf-check]

Like scripts/make_moe_fixtures.py (whose helpers it imports, as it imports make_fixtures.py), for
models with multi-latent attention (MLA):

* spawns EP ranks (gloo, CPU; TP = PP = 1) and builds a Megatron-Core ``GPTModel`` from an
  ``MLATransformerConfig`` with the local (non-TE) spec, ``get_gpt_decoder_block_spec(config,
  use_transformer_engine=False)``: ``MLASelfAttention`` (``linear_q_down_proj`` / ``q_layernorm`` /
  ``linear_q_up_proj`` or ``linear_q_proj``, ``linear_kv_down_proj`` / ``kv_layernorm`` /
  ``linear_kv_up_proj``, ``linear_proj``; the norms exist only with ``qk_layernorm=True``), layer 0 a
  dense MLP (``moe_layer_freq=[0, 1, 1]``), the others ``MoELayer`` = ``TopKRouter`` +
  ``SequentialMLP`` + an ungated ``SharedExpertMLP``;
* DeepSeek-V3 routing (sigmoid scores, aux-free ``router.expert_bias`` filled with non-zero random
  values, group-limited top-k, renormalised top-k weights times ``moe_router_topk_scaling_factor``)
  or DeepSeek-V2 routing (softmax over all experts, greedy top-k, no renormalisation, scaled);
* fills every parameter from seeded canonical GLOBAL tensors, runs the base forward, saves the base
  (legacy ``mp_rank_00_00{ep}``), wraps the model with PEFT 0.7.1 as MindSpeed-LLM does
  (``LoraParallelLinearMoE``), fills lora_A / lora_B, runs the LoRA forward, saves the filtered LoRA
  at iteration 10 plus a stale iteration 5, and records every router decision's margin (group
  choice and expert choice) so that no top-k choice sits on a tie;
* for deepseek_v3_ep2 also runs the forward of MindSpeed's fused down-projection LoRA (one A shared by
  q_down and kv_down, B split at q_lora_rank) and derives ``deepseek_v3_mindspeed_fused_qkv_ep2``
  from it (MindSpeed naming ``self_attention.linear_qkv``);
* deepseek_v3_yarn_ep2 (2 layers, 8 experts) trains with YaRN in MLA: MLATransformerConfig
  rope_type="yarn" with the values that Megatron-LM 0.16.1's --rope-type / --rotary-scaling-factor /
  --mscale / --mscale-all-dim give (recorded under those names in args; original_max_position_embeddings,
  beta_fast and beta_slow have no argument and keep the config defaults 4096 / 32 / 1). Its hf_ref
  config.json carries rope_scaling {"type": "yarn", ...} as the released DeepSeek-V3 config does; the HF
  check also compares Megatron's and HF's YaRN numbers and runs controls (plain rope, wrong mscales,
  wrong original_max_position_embeddings, ...), and the worker runs the base model with plain rope;
* independent HF check: transformers' own DeepseekV3ForCausalLM / DeepseekV2ForCausalLM built from the
  canonical global tensors (LoRA merged in fp32), saved with per-expert names, reloaded with
  ``from_pretrained`` (no missing / unexpected keys) and compared with the Megatron logits.

CPU shims on top of make_moe_fixtures' (none changes the arithmetic): the local
``DotProductAttention`` does not accept the ``k_channels`` / ``v_channels`` keywords that
``MultiLatentAttention`` passes (only TE's attention does), so the spec uses a subclass that drops them
(with ``kv_channels == v_head_dim`` its output view is the right one; MLA passes its own softmax
scale); and ``multi_latent_attention.HAVE_TE`` is set to False, since without TransformerEngine
``TELinear`` is a MagicMock placeholder that ``isinstance`` rejects.
"""

from __future__ import annotations

import argparse
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
import make_fixtures as mf  # noqa: E402
import make_moe_fixtures as mmf  # noqa: E402

REPO_ROOT = SCRIPTS.parent

# --------------------------------------------------------------------------------------------
# Fixture definitions
# --------------------------------------------------------------------------------------------

DS_MODEL = dict(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,          # the dense layer 0 (HF intermediate_size)
    moe_ffn_hidden_size=16,      # every routed expert (HF moe_intermediate_size)
    kv_lora_rank=32,
    qk_head_dim=16,              # HF qk_nope_head_dim
    qk_pos_emb_head_dim=8,       # HF qk_rope_head_dim
    v_head_dim=12,
    vocab_size=250,
    seq_length=16,
    max_position_embeddings=32,
    rotary_base=10000,
    norm_epsilon=1e-6,
)
MOE_LAYER_FREQ = [0, 1, 1]
LORA_R, LORA_ALPHA = mf.LORA_R, mf.LORA_ALPHA
BASE_ITER, LORA_ITER, STALE_LORA_ITER = mf.BASE_ITER, mf.LORA_ITER, mf.STALE_LORA_ITER
MIN_REL_MARGIN = 1e-3
MLP_TARGETS = ["linear_fc1", "linear_fc2"]

BUILT = {
    # DeepSeek-V3: q_lora_rank set, sigmoid + expert bias, 16 experts in 4 groups, 2 groups per token,
    # top-4 (Megatron's group score is the sum of the top topk/group_topk = 2 scores of a group, HF's is
    # hard-coded to the top 2: they agree only when topk == 2 * group_topk), 1 shared expert.
    "deepseek_v3_ep2": dict(
        family="deepseek_v3", tp=1, ep=2, etp=1, num_experts=16, topk=4, q_lora_rank=48,
        score="sigmoid", pre_softmax=False, expert_bias=True, groups=(4, 2), scaling=2.5, n_shared=1,
        base_seed=21000, lora_seed=22000, router_std=0.3, router_seed=21014, bias_std=0.05, fused=True,
    ),
    # DeepSeek-V2-Lite: q_proj directly (q_lora_rank None), softmax over all experts then greedy top-2
    # (moe_router_pre_softmax=True: no renormalisation, HF norm_topk_prob=False), 8 experts, 2 shared.
    "deepseek_v2_lite_ep2": dict(
        family="deepseek_v2", tp=1, ep=2, etp=1, num_experts=8, topk=2, q_lora_rank=None,
        score="softmax", pre_softmax=True, expert_bias=False, groups=None, scaling=2.0, n_shared=2,
        base_seed=23000, lora_seed=24000, router_std=0.3, router_seed=23081, bias_std=None, fused=False,
    ),
}
# DeepSeek-V3 with YaRN RoPE in MLA (MLATransformerConfig rope_type="yarn"). Smaller: 2 layers (dense,
# MoE), 8 experts in 2 groups, 1 group per token, top-2. Only the YaRN knobs that Megatron-LM 0.16.1 has
# command-line arguments for are chosen here (--rope-type, --rotary-scaling-factor, --mscale,
# --mscale-all-dim); original_max_position_embeddings / beta_fast / beta_slow have no argument there, so
# core_transformer_config_from_args leaves MLATransformerConfig's defaults (MLA_YARN_CONFIG_DEFAULTS).
BUILT["deepseek_v3_yarn_ep2"] = dict(
    family="deepseek_v3", tp=1, ep=2, etp=1, num_experts=8, topk=2, q_lora_rank=48,
    score="sigmoid", pre_softmax=False, expert_bias=True, groups=(2, 1), scaling=2.5, n_shared=1,
    base_seed=25000, lora_seed=26000, router_std=0.3, router_seed=25016, bias_std=0.05, fused=False,
    num_layers=2, moe_layer_freq=[0, 1],
    yarn=dict(rotary_scaling_factor=40.0, mscale=0.9, mscale_all_dim=0.7),
)
# DeepSeek-V3 at TP=2 with experts not tensor-split (ETP=1, EP=2: world 2, dirs mp_rank_00_000 and
# mp_rank_01_001). Megatron-Core's local spec makes every MLA linear but linear_proj a ColumnParallelLinear:
# the down-projections too are split by rows over TP (their outputs gathered before the norms), where
# TransformerEngine's spec duplicates them. 2 layers (dense, MoE), 8 experts in 2 groups, top-2.
BUILT["deepseek_v3_tp2etp1_ep2"] = dict(
    family="deepseek_v3", tp=2, ep=2, etp=1, num_experts=8, topk=2, q_lora_rank=48,
    score="sigmoid", pre_softmax=False, expert_bias=True, groups=(2, 1), scaling=2.5, n_shared=1,
    base_seed=27000, lora_seed=28000, router_std=0.3, router_seed=27016, bias_std=0.05, fused=False,
    num_layers=2, moe_layer_freq=[0, 1],
)
# The same model and values with the base saved as torch_dist by Megatron's dist_checkpointing: the
# column-split down-projections become TP chunks of one global tensor.
BUILT["deepseek_v3_dist_tp2etp1_ep2"] = dict(BUILT["deepseek_v3_tp2etp1_ep2"], base_format="torch_dist")
# MLATransformerConfig (megatron-core 0.16.1) defaults of the YaRN fields that no Megatron-LM argument sets
# (checked against the built config in the worker)
MLA_YARN_CONFIG_DEFAULTS = dict(original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
DERIVED = {
    "deepseek_v3_mindspeed_fused_qkv_ep2": dict(source="deepseek_v3_ep2"),
}
ALL = list(BUILT) + list(DERIVED)


def dims(spec: dict) -> dict:
    d = dict(DS_MODEL)
    if "num_layers" in spec:
        d["num_layers"] = spec["num_layers"]
    if spec.get("yarn"):  # HF checks max_position_embeddings == factor * original_max_position_embeddings
        d["max_position_embeddings"] = int(spec["yarn"]["rotary_scaling_factor"]
                                           * MLA_YARN_CONFIG_DEFAULTS["original_max_position_embeddings"])
    d["q_lora_rank"] = spec["q_lora_rank"]
    d["q_head_dim"] = d["qk_head_dim"] + d["qk_pos_emb_head_dim"]
    d["shared_ffn"] = spec["n_shared"] * d["moe_ffn_hidden_size"]
    return d


def attn_targets(spec: dict) -> list:
    q = ["linear_q_down_proj", "linear_q_up_proj"] if spec["q_lora_rank"] else ["linear_q_proj"]
    return q + ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]


def targets(spec: dict) -> list:
    return attn_targets(spec) + MLP_TARGETS


def moe_freq(spec: dict) -> list:
    return spec.get("moe_layer_freq", MOE_LAYER_FREQ)


def moe_layers(spec: dict) -> list:
    return [i for i, f in enumerate(moe_freq(spec)) if f == 1]


def yarn_of(spec: dict) -> dict | None:
    """The full YaRN parameters of a yarn fixture (Megatron names), or None for plain rope."""
    if not spec.get("yarn"):
        return None
    return dict(spec["yarn"], **MLA_YARN_CONFIG_DEFAULTS)


def padded_vocab() -> int:
    return mf.padded_vocab(1)


# --------------------------------------------------------------------------------------------
# Canonical global tensors (Megatron TP=1 layout)
# --------------------------------------------------------------------------------------------

def attn_shapes(spec: dict) -> dict:
    """{module name under self_attention: (in, out)} of the MLA linears."""
    dm = dims(spec)
    H, NH, ql, kvl = dm["hidden_size"], dm["num_attention_heads"], dm["q_lora_rank"], dm["kv_lora_rank"]
    out = {}
    if ql:
        out["linear_q_down_proj"] = (H, ql)
        out["linear_q_up_proj"] = (ql, NH * dm["q_head_dim"])
    else:
        out["linear_q_proj"] = (H, NH * dm["q_head_dim"])
    out["linear_kv_down_proj"] = (H, kvl + dm["qk_pos_emb_head_dim"])
    out["linear_kv_up_proj"] = (kvl, NH * (dm["qk_head_dim"] + dm["v_head_dim"]))
    out["linear_proj"] = (NH * dm["v_head_dim"], H)
    return out


def canonical_ds_base(torch, spec: dict, vpad: int) -> dict:
    dm = dims(spec)
    seed = spec["base_seed"]
    H, E, F = dm["hidden_size"], spec["num_experts"], dm["moe_ffn_hidden_size"]
    # embedding, norms, output layer, linear_proj [H, NH*v_head_dim] and the dense MLPs come from
    # make_fixtures (kv_channels = v_head_dim); its GQA linear_qkv is replaced by the MLA linears
    like = dict(dm, num_query_groups=dm["num_attention_heads"], kv_channels=dm["v_head_dim"])
    t = mf.canonical_base(torch, seed, False, vpad, like)
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}.self_attention."
        del t[p + "linear_qkv.weight"]
        for m, (fin, fout) in attn_shapes(spec).items():
            if m != "linear_proj":
                t[f"{p}{m}.weight"] = mf._randn(torch, seed, p + m, (fout, fin), 0.1)
        if dm["q_lora_rank"]:
            t[p + "q_layernorm.weight"] = mf._randn(torch, seed, p + "qln", (dm["q_lora_rank"],), 0.1, 1.0)
        t[p + "kv_layernorm.weight"] = mf._randn(torch, seed, p + "kvln", (dm["kv_lora_rank"],), 0.1, 1.0)
    for i in moe_layers(spec):
        p = f"decoder.layers.{i}.mlp."
        del t[p + "linear_fc1.weight"], t[p + "linear_fc2.weight"]
        t[p + "router.weight"] = mf._randn(torch, spec["router_seed"], p + "router", (E, H), spec["router_std"])
        if spec["expert_bias"]:
            t[p + "router.expert_bias"] = mf._randn(torch, spec["router_seed"], p + "bias", (E,), spec["bias_std"])
        for e in range(E):
            q = f"{p}experts.{e}."
            t[q + "linear_fc1.weight"] = mf._randn(torch, seed, q + "fc1", (2 * F, H), 0.1)  # [gate; up]
            t[q + "linear_fc2.weight"] = mf._randn(torch, seed, q + "fc2", (H, F), 0.1)
        Fs = dm["shared_ffn"]
        q = p + "shared_experts."
        t[q + "linear_fc1.weight"] = mf._randn(torch, seed, q + "fc1", (2 * Fs, H), 0.08)
        t[q + "linear_fc2.weight"] = mf._randn(torch, seed, q + "fc2", (H, Fs), 0.08)
    return t


def lora_modules(spec: dict) -> dict:
    """{global module path: (in, out)} of every module PEFT wraps."""
    dm = dims(spec)
    H, Fd, F, Fs = dm["hidden_size"], dm["ffn_hidden_size"], dm["moe_ffn_hidden_size"], dm["shared_ffn"]
    out = {}
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}."
        for m, io in attn_shapes(spec).items():
            out[p + "self_attention." + m] = io
        if i in moe_layers(spec):
            for e in range(spec["num_experts"]):
                out[f"{p}mlp.experts.{e}.linear_fc1"] = (H, 2 * F)
                out[f"{p}mlp.experts.{e}.linear_fc2"] = (F, H)
            out[p + "mlp.shared_experts.linear_fc1"] = (H, 2 * Fs)
            out[p + "mlp.shared_experts.linear_fc2"] = (Fs, H)
        else:
            out[p + "mlp.linear_fc1"] = (H, 2 * Fd)
            out[p + "mlp.linear_fc2"] = (Fd, H)
    return out


def canonical_ds_lora(torch, spec: dict, seed: int) -> dict:
    t = {}
    for m, (fin, fout) in lora_modules(spec).items():
        t[m + ".lora_A.weight"] = mf._randn(torch, seed, m + ".A", (LORA_R, fin), 0.1)
        t[m + ".lora_B.weight"] = mf._randn(torch, seed, m + ".B", (fout, LORA_R), 0.1)
    return t


def canonical_fused_lora(torch, spec: dict, seed: int) -> dict:
    """MindSpeed's LoRA on the fused down-projection linear_qkv = [q_down; kv_down]: one A [r, H],
    B [q_lora + kv_lora + rope, r] (per layer, global names)."""
    dm = dims(spec)
    H, out_f = dm["hidden_size"], dm["q_lora_rank"] + dm["kv_lora_rank"] + dm["qk_pos_emb_head_dim"]
    t = {}
    for i in range(dm["num_layers"]):
        m = f"decoder.layers.{i}.self_attention.linear_qkv"
        t[m + ".lora_A.weight"] = mf._randn(torch, seed, m + ".A", (LORA_R, H), 0.1)
        t[m + ".lora_B.weight"] = mf._randn(torch, seed, m + ".B", (out_f, LORA_R), 0.1)
    return t


def fused_as_upstream(spec: dict, lora: dict, fused: dict) -> dict:
    """The upstream-named LoRA that computes exactly what the fused LoRA computes: q_down and kv_down
    both get the shared A; B splits at q_lora_rank (the rest of the LoRA unchanged)."""
    ql = dims(spec)["q_lora_rank"]
    out = dict(lora)
    for k, v in fused.items():
        p = k.split("linear_qkv.")[0]
        if k.endswith("lora_A.weight"):
            out[p + "linear_q_down_proj.lora_A.weight"] = v
            out[p + "linear_kv_down_proj.lora_A.weight"] = v
        else:
            out[p + "linear_q_down_proj.lora_B.weight"] = v[:ql]
            out[p + "linear_kv_down_proj.lora_B.weight"] = v[ql:]
    return out


# --------------------------------------------------------------------------------------------
# Megatron -> HF mapping (the single source of truth for the HF check and fixture.json)
# --------------------------------------------------------------------------------------------

def hf_mapping(spec: dict, fused_qkv: bool = False) -> list:
    """[(megatron global name, HF name, how)] for one dense layer (0) and one MoE layer (1), plus
    the global tensors. how: "copy" | "rows[a:b]" | "fc1 gate half" | "fc1 up half" | "rows[:V]"."""
    dm = dims(spec)
    V, ql, kvd = dm["vocab_size"], dm["q_lora_rank"], dm["kv_lora_rank"] + dm["qk_pos_emb_head_dim"]
    rows = [("embedding.word_embeddings.weight", "model.embed_tokens.weight", f"rows[:{V}] (drop vocab padding)"),
            ("decoder.final_layernorm.weight", "model.norm.weight", "copy"),
            ("output_layer.weight", "lm_head.weight", f"rows[:{V}] (drop vocab padding)")]
    for i in (0, moe_layers(spec)[0]):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, ha = p + "self_attention.", h + "self_attn."
        rows.append((p + "input_layernorm.weight", h + "input_layernorm.weight", "copy"))
        if ql and fused_qkv:
            rows.append((a + "linear_qkv.weight", ha + "q_a_proj.weight", f"rows[0:{ql}]"))
            rows.append((a + "linear_qkv.weight", ha + "kv_a_proj_with_mqa.weight", f"rows[{ql}:{ql + kvd}]"))
        elif ql:
            rows.append((a + "linear_q_down_proj.weight", ha + "q_a_proj.weight", "copy"))
        if ql:
            rows.append((a + "q_layernorm.weight", ha + "q_a_layernorm.weight", "copy"))
            rows.append((a + "linear_q_up_proj.weight", ha + "q_b_proj.weight", "copy"))
        else:
            rows.append((a + "linear_q_proj.weight", ha + "q_proj.weight", "copy"))
        if not (ql and fused_qkv):
            rows.append((a + "linear_kv_down_proj.weight", ha + "kv_a_proj_with_mqa.weight", "copy"))
        rows.append((a + "kv_layernorm.weight", ha + "kv_a_layernorm.weight", "copy"))
        rows.append((a + "linear_kv_up_proj.weight", ha + "kv_b_proj.weight", "copy"))
        rows.append((a + "linear_proj.weight", ha + "o_proj.weight", "copy"))
        rows.append((p + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight", "copy"))
        if i in moe_layers(spec):
            rows.append((p + "mlp.router.weight", h + "mlp.gate.weight", "copy"))
            if spec["expert_bias"]:
                rows.append((p + "mlp.router.expert_bias", h + "mlp.gate.e_score_correction_bias", "copy (fp32)"))
            pairs = [(f"{p}mlp.experts.{{e}}", f"{h}mlp.experts.{{e}}"), (p + "mlp.shared_experts", h + "mlp.shared_experts")]
        else:
            pairs = [(p + "mlp", h + "mlp")]
        for m, hm in pairs:
            rows.append((m + ".linear_fc1.weight", hm + ".gate_proj.weight", "fc1 rows[0:F] (gate half)"))
            rows.append((m + ".linear_fc1.weight", hm + ".up_proj.weight", "fc1 rows[F:2F] (up half)"))
            rows.append((m + ".linear_fc2.weight", hm + ".down_proj.weight", "copy"))
    return rows


def hf_state_dict(torch, spec: dict, base: dict, lora: dict | None, fused: dict | None = None) -> dict:
    """HF tensors from canonical global Megatron tensors, the LoRA merged in fp32: W + alpha/r * B @ A.
    fused: MindSpeed's linear_qkv LoRA (replaces the q_down / kv_down LoRA)."""
    dm = dims(spec)
    V, ql = dm["vocab_size"], dm["q_lora_rank"]
    s = LORA_ALPHA / LORA_R
    if fused is not None:
        lora = fused_as_upstream(spec, lora, fused)

    def W(name):
        w = base[name + ".weight"].double()
        if lora is not None and name + ".lora_A.weight" in lora:
            w = w + s * lora[name + ".lora_B.weight"].double() @ lora[name + ".lora_A.weight"].double()
        return w.float()

    out = {"model.embed_tokens.weight": base["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": base["decoder.final_layernorm.weight"],
           "lm_head.weight": base["output_layer.weight"][:V]}
    for i in range(dm["num_layers"]):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, ha = p + "self_attention.", h + "self_attn."
        out[h + "input_layernorm.weight"] = base[p + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = base[p + "pre_mlp_layernorm.weight"]
        if ql:
            out[ha + "q_a_proj.weight"] = W(a + "linear_q_down_proj")
            out[ha + "q_a_layernorm.weight"] = base[a + "q_layernorm.weight"]
            out[ha + "q_b_proj.weight"] = W(a + "linear_q_up_proj")
        else:
            out[ha + "q_proj.weight"] = W(a + "linear_q_proj")
        out[ha + "kv_a_proj_with_mqa.weight"] = W(a + "linear_kv_down_proj")
        out[ha + "kv_a_layernorm.weight"] = base[a + "kv_layernorm.weight"]
        out[ha + "kv_b_proj.weight"] = W(a + "linear_kv_up_proj")
        out[ha + "o_proj.weight"] = W(a + "linear_proj")

        def glu(mname, hname):
            g, u = W(mname + ".linear_fc1").chunk(2, dim=0)
            out[hname + ".gate_proj.weight"] = g
            out[hname + ".up_proj.weight"] = u
            out[hname + ".down_proj.weight"] = W(mname + ".linear_fc2")

        if i in moe_layers(spec):
            out[h + "mlp.gate.weight"] = base[p + "mlp.router.weight"]
            if spec["expert_bias"]:
                out[h + "mlp.gate.e_score_correction_bias"] = base[p + "mlp.router.expert_bias"]
            for e in range(spec["num_experts"]):
                glu(f"{p}mlp.experts.{e}", f"{h}mlp.experts.{e}")
            glu(p + "mlp.shared_experts", h + "mlp.shared_experts")
        else:
            glu(p + "mlp", h + "mlp")
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# args
# --------------------------------------------------------------------------------------------

def make_ds_args(torch, spec, iteration, world, lora, filtered, load, save):
    """Megatron-LM 0.16.1 training args of a DeepSeek MLA + MoE run (make_moe_args, then MLA / routing)."""
    dm = dims(spec)
    shim = dict(tp=spec["tp"], ep=spec["ep"], etp=spec["etp"], num_experts=spec["num_experts"],
                kv_channels=dm["v_head_dim"], family="mixtral", pre_softmax=spec["pre_softmax"],
                moe_layer_freq=moe_freq(spec), shared=dm["shared_ffn"], shared_gate=False,
                base_format=spec.get("base_format", "torch"))
    a = mmf.make_moe_args(torch, shim, iteration, world, lora=lora, filtered=filtered, load=load, save=save)
    a.num_layers = dm["num_layers"]
    a.hidden_size = dm["hidden_size"]
    a.ffn_hidden_size = dm["ffn_hidden_size"]
    a.num_attention_heads = dm["num_attention_heads"]
    a.group_query_attention = False
    a.num_query_groups = dm["num_attention_heads"]
    a.kv_channels = dm["v_head_dim"]
    a.moe_ffn_hidden_size = dm["moe_ffn_hidden_size"]
    a.padded_vocab_size = padded_vocab()
    a.qk_layernorm = True
    a.multi_latent_attention = True
    a.q_lora_rank = dm["q_lora_rank"]
    a.kv_lora_rank = dm["kv_lora_rank"]
    a.qk_head_dim = dm["qk_head_dim"]
    a.qk_pos_emb_head_dim = dm["qk_pos_emb_head_dim"]
    a.v_head_dim = dm["v_head_dim"]
    a.rope_type = "rope"
    a.rotary_scaling_factor = 1.0
    a.mscale = 1.0
    a.mscale_all_dim = 0.0
    y = yarn_of(spec)
    if y:
        # Megatron-LM 0.16.1: --rope-type yarn --rotary-scaling-factor F --mscale M --mscale-all-dim A
        # (_add_training_args / _add_mla_args; core_transformer_config_from_args copies every args
        # attribute named like an MLATransformerConfig field). There is no argument for
        # original_max_position_embeddings, beta_fast or beta_slow (MLATransformerConfig defaults), and
        # --position-embedding-type has no "yarn" choice: DeepSeek recipes pass rope, which GPTModel
        # ignores with MLA (MLA builds its own YarnRotaryEmbedding). --max-position-embeddings = F * 4096.
        a.rope_type = "yarn"
        a.rotary_scaling_factor = y["rotary_scaling_factor"]
        a.mscale = y["mscale"]
        a.mscale_all_dim = y["mscale_all_dim"]
        a.max_position_embeddings = dm["max_position_embeddings"]
        a.use_rope_scaling = False   # Llama-3.x rope scaling (GPTModel's RotaryEmbedding): off; its
        a.rope_scaling_factor = 8.0  # --rope-scaling-factor keeps the default 8.0 and is unused
        a.apply_rope_fusion = False  # --no-rope-fusion (the unfused MLA rope path ran here)
    a.moe_router_topk = spec["topk"]
    a.moe_router_score_function = spec["score"]
    a.moe_router_pre_softmax = spec["pre_softmax"]
    a.moe_router_enable_expert_bias = spec["expert_bias"]
    a.moe_router_bias_update_rate = 1e-3
    a.moe_router_topk_scaling_factor = spec["scaling"]
    a.moe_router_num_groups = spec["groups"][0] if spec["groups"] else None
    a.moe_router_group_topk = spec["groups"][1] if spec["groups"] else None
    a.moe_router_dtype = "fp32"
    a.lora_target_modules = list(targets(spec)) if lora else []
    return a


# --------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------

def _patch_mla_cpu():
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # TELinear is a MagicMock placeholder without TE


def cpu_mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """The local DotProductAttention, taking (and checking) the k/v channel keywords MLA passes."""

        def __init__(self, config, *a, k_channels=None, v_channels=None, **k):
            # (Attention.__init__ first builds one without them; MultiLatentAttention replaces it)
            assert v_channels in (None, config.kv_channels), (v_channels, config.kv_channels)
            super().__init__(config, *a, **k)

    return MLADotProductAttention


def yarn_internals(config, model, dm) -> dict:
    """What Megatron's MLA actually uses for YaRN (read from the built model), and a check that the fields
    no Megatron-LM argument sets kept MLATransformerConfig's defaults."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_find_correction_range,
        _yarn_get_mscale,
    )

    for k, v in MLA_YARN_CONFIG_DEFAULTS.items():
        assert getattr(config, k) == v, (k, getattr(config, k), v)
    sa = model.decoder.layers[0].self_attention
    rpe = sa.rotary_pos_emb
    assert isinstance(rpe, YarnRotaryEmbedding) and rpe.dim == dm["qk_pos_emb_head_dim"], rpe
    emb, cs_mscale = rpe(dm["seq_length"])
    half = rpe.dim // 2
    low, high = _yarn_find_correction_range(rpe.beta_fast, rpe.beta_slow, rpe.dim, rpe.rotary_base,
                                            rpe.original_max_position_embeddings, rpe.correction_range_round_to_int)
    assert sa.core_attention.softmax_scale == sa.softmax_scale
    return dict(
        config={k: getattr(config, k) for k in ("rope_type", "rotary_base", "rotary_scaling_factor",
                                                "original_max_position_embeddings", "beta_fast", "beta_slow",
                                                "mscale", "mscale_all_dim")},
        rotary_class=type(rpe).__name__,
        rotary_dim=rpe.dim,
        correction_range_round_to_int=rpe.correction_range_round_to_int,
        correction_range=[low, high],
        inv_freq=[float(x) for x in emb[1, 0, 0, :half]],           # freqs at position 1
        inv_freq_plain=[float(x) for x in rpe.inv_freq_extra],
        cos_sin_mscale=float(cs_mscale),                            # mscale(f, mscale) / mscale(f, mscale_all_dim)
        softmax_scale=float(sa.softmax_scale),                      # mscale(f, mscale_all_dim)^2 / sqrt(q_head_dim)
        softmax_scale_over_plain=float(sa.softmax_scale * math.sqrt(sa.q_head_dim)),
        mscale_all_dim_factor=_yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim),
    )


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


def worker(rank: int, world: int, name: str, spec: dict, out_dir: str, port: int, peft_dir: str):
    if peft_dir not in sys.path:
        sys.path.insert(0, peft_dir)
    import warnings

    warnings.filterwarnings("ignore")
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    mf._patch_cuda(torch)
    mmf._patch_moe_cpu(torch)
    _patch_mla_cpu()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import peft
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import MLATransformerConfig
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
    random.seed(1)
    np.random.seed(1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    out = Path(out_dir) / name
    dm = dims(spec)
    vpad = padded_vocab()
    E_loc = E // EP

    def make_config(yarn=True):
        kw = {}
        if spec["groups"]:
            kw.update(moe_router_num_groups=spec["groups"][0], moe_router_group_topk=spec["groups"][1])
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0)
        if spec.get("yarn") and yarn:  # only what Megatron-LM's arguments can set (see make_ds_args)
            rope = dict(rope_type="yarn", **spec["yarn"])
        return MLATransformerConfig(
            num_layers=dm["num_layers"], hidden_size=dm["hidden_size"],
            num_attention_heads=dm["num_attention_heads"], kv_channels=dm["v_head_dim"],
            ffn_hidden_size=dm["ffn_hidden_size"],
            q_lora_rank=dm["q_lora_rank"], kv_lora_rank=dm["kv_lora_rank"], qk_head_dim=dm["qk_head_dim"],
            qk_pos_emb_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"], qk_layernorm=True,
            rotary_base=dm["rotary_base"], **rope,
            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
            layernorm_epsilon=dm["norm_epsilon"], hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
            expert_model_parallel_size=EP, expert_tensor_parallel_size=ETP,
            num_moe_experts=E, moe_ffn_hidden_size=dm["moe_ffn_hidden_size"], moe_router_topk=spec["topk"],
            moe_router_score_function=spec["score"], moe_router_pre_softmax=spec["pre_softmax"],
            moe_router_enable_expert_bias=spec["expert_bias"],
            moe_router_topk_scaling_factor=spec["scaling"], moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
            moe_layer_freq=copy.deepcopy(moe_freq(spec)),
            moe_shared_expert_intermediate_size=dm["shared_ffn"], moe_shared_expert_gate=False,
            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            **kw,
        )

    core_attention = cpu_mla_core_attention()

    def build(config):
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        for ls in block.layer_specs:
            ls.submodules.self_attention.submodules.core_attention = core_attention
        m = GPTModel(config=config, transformer_layer_spec=block, vocab_size=vpad,
                     max_sequence_length=dm["max_position_embeddings"], pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=dm["rotary_base"])
        m.eval()
        return m

    config = make_config()
    model = build(config)
    yarn_info = yarn_internals(config, model, dm) if spec.get("yarn") else None

    # ---------- routing records ----------
    route_log = []
    orig_routing = TopKRouter.routing

    def routing(self, logits, *a, **k):
        probs, rmap = orig_routing(self, logits, *a, **k)
        bias = self.expert_bias.detach().clone() if self.expert_bias is not None else None
        route_log.append((self.layer_number - 1, logits.detach().float().reshape(-1, E).clone(), rmap.clone(), bias))
        return probs, rmap

    TopKRouter.routing = routing

    def routing_stats():
        res = {}
        for layer, logits, rmap, bias in route_log:
            sp = dict(spec, expert_bias=bias)
            res[str(layer)] = routing_margins(torch, sp, logits, rmap)
        route_log.clear()
        return res

    # ---------- values ----------
    base_global = canonical_ds_base(torch, spec, vpad)
    base_local = mmf.localize(torch, spec, base_global, tp_rank, ep_rank, etp_rank)

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

    dirname = mmf.rank_dir(tp_rank, ep_rank, EP)
    saves = edp_rank == 0
    info = dict(rank=rank, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank, edp_rank=edp_rank,
                dp_rank=ps.get_data_parallel_rank(), dir=dirname if saves else None,
                local_experts=[ep_rank * E_loc + k for k in range(E_loc)])

    # ---------- base ----------
    fill(base_local)
    logits_base = forward()
    route_base = routing_stats()
    base_sd = model.state_dict_for_save_checkpoint()
    args = make_ds_args(torch, spec, BASE_ITER, world, lora=False, filtered=False,
                        load=f"/data/ckpt/{name}/hf-converted", save=f"/data/ckpt/{name}/base")
    if spec.get("base_format") == "torch_dist":  # Megatron's own dist_checkpointing.save, every rank
        mf.save_dist_checkpoint(torch, out / "base", BASE_ITER, args, model, False, mf.make_rng_state(torch, 2))
    elif saves:
        mmf.save_legacy(torch, out / "base", BASE_ITER, dirname, args, base_sd)

    # ---------- PEFT, as MindSpeed-LLM's model_provider_func_wrapper ----------
    tp_layer.LoraParallelLinear = mmf.make_lora_parallel_linear_moe()
    lcfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(targets(spec)), lora_dropout=0.0,
                      bias="none", megatron_config=make_config(), megatron_core="megatron.core")
    pm = get_peft_model(model, lcfg)
    assert pm.base_model.model is model
    pm.eval()

    layout_info, wrapped = {}, []
    for mname, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            wrapped.append(mname)
            A, Bm = mod.lora_A["default"], mod.lora_B["default"]
            kind = ("expert_" if ".experts." in mname else "shared_" if ".shared_experts." in mname
                    else "dense_" if ".mlp." in mname else "") + mname.split(".")[-1]
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
    expect = {k for k in lora_modules(spec) if ".experts." not in k or int(k.split(".")[5]) // E_loc == ep_rank}
    got = {(".".join(w.split(".")[:5] + [str(ep_rank * E_loc + int(w.split(".")[6]))] + w.split(".")[7:])
            if ".experts.local_experts." in w else w) for w in wrapped}
    assert got == expect, (sorted(got ^ expect)[:6])
    routers_wrapped = [w for w in wrapped if "router" in w]
    assert not routers_wrapped

    def lora_vals(lora_global):
        return {**base_local, **mmf.localize(torch, spec, lora_global, tp_rank, ep_rank, etp_rank)}

    def lora_sd():
        sd = model.state_dict_for_save_checkpoint()
        return type(sd)((k, v) for k, v in sd.items() if "lora" in k)  # --lora-ckpt-filter

    lora_root = out / "lora"
    fill(lora_vals(canonical_ds_lora(torch, spec, spec["lora_seed"] + mf.STALE_SEED_OFFSET)))
    if saves:
        args = make_ds_args(torch, spec, STALE_LORA_ITER, world, lora=True, filtered=True,
                            load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
        mmf.save_legacy(torch, lora_root, STALE_LORA_ITER, dirname, args, lora_sd())
    logits_stale = forward()
    routing_stats()

    lora_global = canonical_ds_lora(torch, spec, spec["lora_seed"])
    fill(lora_vals(lora_global))
    logits_lora = forward()
    route_lora = routing_stats()
    if saves:
        args = make_ds_args(torch, spec, LORA_ITER, world, lora=True, filtered=True,
                            load=f"/data/ckpt/{name}/base", save=f"/data/ckpt/{name}/lora")
        mmf.save_legacy(torch, lora_root, LORA_ITER, dirname, args, lora_sd())

    # ---------- MindSpeed's fused down-projection LoRA, run through the upstream modules ----------
    logits_fused = route_fused = None
    if spec["fused"]:
        fused = canonical_fused_lora(torch, spec, spec["lora_seed"])
        fill(lora_vals(fused_as_upstream(spec, lora_global, fused)))
        logits_fused = forward()
        route_fused = routing_stats()

    # ---------- YaRN control: the same base model with plain rope (rope_type="rope", factor 1) ----------
    plain_vs_yarn = None
    if spec.get("yarn"):
        plain = build(make_config(yarn=False))
        assert type(plain.decoder.layers[0].self_attention.rotary_pos_emb).__name__ == "RotaryEmbedding"
        psd = plain.state_dict()
        plain.load_state_dict({k: v if k.endswith("_extra_state") else base_local[k] for k, v in psd.items()},
                              strict=True)
        with torch.no_grad():
            res = plain(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                        runtime_gather_output=True)
        route_log.clear()
        plain_vs_yarn = (res[..., : dm["vocab_size"]].float() - logits_base).abs().max().item()

    gathered = [torch.empty_like(logits_lora) for _ in range(world)]
    dist.all_gather(gathered, logits_lora)
    replica_diff = max((x - logits_lora).abs().max().item() for x in gathered)
    infos = [None] * world
    dist.all_gather_object(infos, info)

    if rank == 0:
        torch.save({"input_ids": input_ids.clone(), "logits_lora": logits_lora.clone(),
                    "logits_base": logits_base.clone()}, out / "logits.pt")
        if logits_fused is not None:
            torch.save({"input_ids": input_ids.clone(), "logits_lora": logits_fused.clone(),
                        "logits_base": logits_base.clone()}, out / ".fused_logits.pt")
        summary = dict(
            layout=layout_info,
            wrapped_modules_rank0=wrapped,
            ranks=infos,
            routing_base=route_base,
            routing_lora=route_lora,
            routing_fused=route_fused,
            lora_vs_base_max_abs=(logits_lora - logits_base).abs().max().item(),
            fused_vs_lora_max_abs=((logits_fused - logits_lora).abs().max().item()
                                   if logits_fused is not None else None),
            stale_vs_lora_max_abs=(logits_stale - logits_lora).abs().max().item(),
            replica_logits_max_abs_diff=replica_diff,
        )
        if yarn_info is not None:
            summary["megatron_yarn"] = yarn_info
            summary["megatron_plain_rope_base_vs_yarn_base_max_abs"] = plain_vs_yarn
        (out / ".summary.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# hf_ref and the HF check
# --------------------------------------------------------------------------------------------

def _num(x):
    return int(x) if float(x).is_integer() else float(x)


def hf_rope_scaling(spec) -> dict | None:
    """rope_scaling as in the released DeepSeek-V3 config.json (legacy key, "type": "yarn", integral
    values written as ints) for a yarn fixture: Megatron's rotary_scaling_factor is HF's factor, the rest
    keep their names."""
    y = yarn_of(spec)
    if y is None:
        return None
    return {"beta_fast": _num(y["beta_fast"]), "beta_slow": _num(y["beta_slow"]),
            "factor": _num(y["rotary_scaling_factor"]), "mscale": _num(y["mscale"]),
            "mscale_all_dim": _num(y["mscale_all_dim"]),
            "original_max_position_embeddings": int(y["original_max_position_embeddings"]), "type": "yarn"}


def hf_config(spec):
    from transformers import DeepseekV2Config, DeepseekV3Config

    dm = dims(spec)
    rope = {"rope_type": "default", "rope_theta": float(dm["rotary_base"])}
    if spec.get("yarn"):
        rs = hf_rope_scaling(spec)
        rope = dict({k: v for k, v in rs.items() if k != "type"}, rope_type="yarn", rope_theta=float(dm["rotary_base"]))
        assert dm["max_position_embeddings"] == rs["factor"] * rs["original_max_position_embeddings"]
    common = dict(
        vocab_size=dm["vocab_size"], hidden_size=dm["hidden_size"], intermediate_size=dm["ffn_hidden_size"],
        moe_intermediate_size=dm["moe_ffn_hidden_size"], num_hidden_layers=dm["num_layers"],
        num_attention_heads=dm["num_attention_heads"], num_key_value_heads=dm["num_attention_heads"],
        n_shared_experts=spec["n_shared"], n_routed_experts=spec["num_experts"],
        routed_scaling_factor=float(spec["scaling"]), kv_lora_rank=dm["kv_lora_rank"],
        q_lora_rank=dm["q_lora_rank"], qk_rope_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"],
        qk_nope_head_dim=dm["qk_head_dim"], num_experts_per_tok=spec["topk"],
        first_k_dense_replace=moe_freq(spec).index(1), hidden_act="silu",
        max_position_embeddings=dm["max_position_embeddings"], rms_norm_eps=dm["norm_epsilon"],
        bos_token_id=1, eos_token_id=3, tie_word_embeddings=False, attention_bias=False,
        rope_parameters=rope,
        dtype="float32", moe_layer_freq=1,
    )
    assert moe_freq(spec) == [0] * common["first_k_dense_replace"] + [1] * (dm["num_layers"] - common["first_k_dense_replace"])
    if spec["family"] == "deepseek_v3":
        G, GK = spec["groups"]
        assert spec["topk"] == 2 * GK  # HF's group score is the sum of the top 2 (Megatron's: top topk/GK)
        assert spec["score"] == "sigmoid" and spec["expert_bias"] and not spec["pre_softmax"]
        return DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], n_group=G, topk_group=GK,
                                norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0,
                                scoring_func="sigmoid", topk_method="noaux_tc", **common)
    assert spec["score"] == "softmax" and spec["pre_softmax"] and not spec["groups"] and not spec["expert_bias"]
    return DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], n_group=1, topk_group=1,
                            topk_method="greedy", norm_topk_prob=False, scoring_func="softmax",
                            mlp_bias=False, **common)


def write_ds_hf_ref(spec, d: Path):
    mf.write_hf_ref(dict(family="llama", dtype="float32"), d)  # tokenizer, chat template, generation config
    (d / "config.json").unlink()
    hf_config(spec).save_pretrained(str(d))
    for f in d.iterdir():
        assert not f.name.endswith((".safetensors", ".bin")), f
    if spec.get("yarn"):
        # as the released DeepSeek-V3 config.json writes it: rope_theta + rope_scaling {"type": "yarn", ...}
        # (transformers 5 would save rope_parameters; it reads both)
        cfg = json.loads((d / "config.json").read_text())
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = _num(rp["rope_theta"])
        cfg["rope_scaling"] = hf_rope_scaling(spec)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        check_hf_yarn_config(spec, d)


def check_hf_yarn_config(spec, d: Path):
    """transformers' DeepseekV3Config reads the legacy rope_scaling into the intended rope_parameters,
    without a rope-validation warning."""
    import logging

    from transformers import DeepseekV3Config, modeling_rope_utils

    msgs = []

    class H(logging.Handler):
        def emit(self, r):
            msgs.append(r.getMessage())

    lg = logging.getLogger(modeling_rope_utils.__name__)
    h = H()
    lg.addHandler(h)
    try:
        c = DeepseekV3Config.from_pretrained(str(d))
    finally:
        lg.removeHandler(h)
    rs = hf_rope_scaling(spec)
    want = dict({k: v for k, v in rs.items() if k != "type"}, rope_type="yarn", rope_theta=float(DS_MODEL["rotary_base"]))
    got = {k: v for k, v in c.rope_parameters.items() if k != "type"}
    assert got == want, (got, want)
    assert c.max_position_embeddings == dims(spec)["max_position_embeddings"]
    assert c.head_dim == dims(spec)["qk_pos_emb_head_dim"]  # HF's yarn dim (Megatron: qk_pos_emb_head_dim)
    assert not msgs, msgs


def hf_check(spec, d: Path, fused: bool = False) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = canonical_ds_base(torch, spec, padded_vocab())
    lora = canonical_ds_lora(torch, spec, spec["lora_seed"])
    fl = canonical_fused_lora(torch, spec, spec["lora_seed"]) if fused else None
    ref = torch.load(d / "logits.pt", weights_only=True)
    res = {}
    for tag, lo in (("base", None), ("lora", lora)):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(d / "hf_ref" / "config.json", tmp)
            sd = hf_state_dict(torch, spec, base, lo, fl if lo is not None else None)
            save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            model, info = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            assert not bad, bad
            if spec["expert_bias"]:  # the bias survived save/load
                for i in moe_layers(spec):
                    eb = model.model.layers[i].mlp.gate.e_score_correction_bias
                    assert eb.dtype == torch.float32 and torch.equal(eb, base[f"decoder.layers.{i}.mlp.router.expert_bias"])
            model.eval()
            with torch.no_grad():
                logits = model(ref["input_ids"]).logits.float()
            res[f"hf_{type(model).__name__}_vs_megatron_{tag}_max_abs"] = \
                (logits - ref[f"logits_{tag}"]).abs().max().item()
            res["hf_tensors_written"] = len(sd)
            if spec.get("yarn") and tag == "lora":
                res["hf_yarn"] = hf_yarn_internals(model)
                res["yarn_controls_lora_max_abs"] = yarn_controls(torch, spec, tmp, ref, model)
    return res


def hf_yarn_internals(model) -> dict:
    """What transformers' DeepseekV3 uses for YaRN (read from the loaded model)."""
    re_ = model.model.rotary_emb
    attn = model.model.layers[0].self_attn
    return dict(rope_parameters=dict(model.config.rope_parameters), rope_type=re_.rope_type,
                rotary_dim=2 * int(re_.inv_freq.numel()), inv_freq=[float(x) for x in re_.inv_freq],
                attention_scaling=float(re_.attention_scaling), softmax_scaling=float(attn.scaling),
                softmax_scaling_over_plain=float(attn.scaling * math.sqrt(attn.qk_head_dim)))


def yarn_controls(torch, spec, tmp, ref, model) -> dict:
    """max |HF - Megatron| LoRA logits when one YaRN ingredient is changed on the HF side: each must be
    far above the check's 1e-6, so the fixture pins every one of them."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
    )
    from transformers import AutoModelForCausalLM

    good = json.loads(Path(tmp, "config.json").read_text())
    rs = good["rope_scaling"]
    y = yarn_of(spec)
    conc = float(_yarn_get_concentration_factor(y["rotary_scaling_factor"], y["mscale"], y["mscale_all_dim"]))
    variants = {
        "plain rope (no rope_scaling)": None,
        "mscale = mscale_all_dim (cos/sin factor 1)": dict(rs, mscale=rs["mscale_all_dim"]),
        "mscale and mscale_all_dim swapped": dict(rs, mscale=rs["mscale_all_dim"], mscale_all_dim=rs["mscale"]),
        "no softmax mscale^2 (mscale_all_dim 0, attention_factor kept)": dict(rs, mscale_all_dim=0, attention_factor=conc),
        "original_max_position_embeddings = max_position_embeddings": dict(
            rs, original_max_position_embeddings=good["max_position_embeddings"]),
        "correction range not rounded (truncate false)": dict(rs, truncate=False),
    }
    out = {}

    def run(m):
        m.eval()
        with torch.no_grad():
            return (m(ref["input_ids"]).logits.float() - ref["logits_lora"]).abs().max().item()

    try:
        for name, v in variants.items():
            cfg = {k: x for k, x in good.items() if k != "rope_scaling"}
            if v is not None:
                cfg["rope_scaling"] = v
            Path(tmp, "config.json").write_text(json.dumps(cfg))
            out[name] = run(AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager"))
    finally:
        Path(tmp, "config.json").write_text(json.dumps(good))
    # the frequency interpolation alone: the right model with plain rope frequencies
    re_ = model.model.rotary_emb
    inv = re_.inv_freq.clone()
    dim = 2 * inv.numel()
    re_.inv_freq = 1.0 / (DS_MODEL["rotary_base"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    try:
        out["plain rope frequencies (yarn mscales kept)"] = run(model)
    finally:
        re_.inv_freq = inv
    return out


# --------------------------------------------------------------------------------------------
# Derived: MindSpeed's fused linear_qkv naming
# --------------------------------------------------------------------------------------------

def to_fused_base(torch, sd: dict) -> dict:
    """linear_q_down_proj.weight + linear_kv_down_proj.weight -> linear_qkv.weight = cat(dim 0), in
    the position of linear_q_down_proj; every other key unchanged (MindSpeed's pack_mla naming keeps
    q_layernorm / kv_layernorm / linear_q_up_proj / linear_kv_up_proj / linear_proj)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("self_attention.linear_q_down_proj.weight"):
            p = k[: -len("linear_q_down_proj.weight")]
            out[p + "linear_qkv.weight"] = torch.cat([v, sd[p + "linear_kv_down_proj.weight"]], dim=0).contiguous()
        elif k.endswith(("self_attention.linear_q_down_proj._extra_state", "self_attention.linear_kv_down_proj.weight",
                         "self_attention.linear_kv_down_proj._extra_state")):
            if k.endswith("linear_q_down_proj._extra_state"):
                out[k.replace("linear_q_down_proj", "linear_qkv")] = v
            continue
        else:
            out[k] = v
    return type(sd)(out) if hasattr(sd, "move_to_end") else out


def to_fused_lora(sd: dict, fused_local: dict) -> dict:
    """The PEFT LoRA of the upstream modules -> MindSpeed's: the q_down / kv_down factors are replaced
    by linear_qkv.lora_A.default.weight / lora_B.default.weight (fused_local: global-named, TP=1)."""
    out = {}
    for k, v in sd.items():
        if ".self_attention.linear_q_down_proj.lora_" in k:
            nk = k.replace(".linear_q_down_proj.", ".linear_qkv.")  # (also lora_B's _extra_state: a column linear)
            if k.endswith(".default.weight"):
                v = fused_local[nk.replace(".default.", ".")].clone()
            out[nk] = v
        elif ".self_attention.linear_kv_down_proj.lora_" in k:
            continue
        else:
            out[k] = v
    return type(sd)(out) if hasattr(sd, "move_to_end") else out


def mindspeed_args(a, name, src):
    """MindSpeed-LLM's own DeepSeek-V3 arguments (examples/mcore/deepseek3/tune_*_lora_ptd.sh), next to
    the Megatron ones."""
    a = copy.deepcopy(a)
    a.load = a.load.replace(src, name)
    a.save = a.save.replace(src, name)
    a.spec = ["mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"]
    a.multi_head_latent_attention = True
    a.qk_rope_head_dim = a.qk_pos_emb_head_dim
    a.qk_nope_head_dim = a.qk_head_dim
    a.first_k_dense_replace = MOE_LAYER_FREQ.index(1)
    a.moe_layer_freq = 1
    a.n_shared_experts = a.moe_shared_expert_intermediate_size // a.moe_ffn_hidden_size
    a.moe_intermediate_size = a.moe_ffn_hidden_size
    a.moe_router_load_balancing_type = "noaux_tc"
    a.n_group = a.moe_router_num_groups
    a.topk_group = a.moe_router_group_topk
    a.routed_scaling_factor = a.moe_router_topk_scaling_factor
    a.norm_topk_prob = True
    a.seq_aux = True
    a.mla_mm_split = False
    if a.lora_target_modules:
        a.lora_target_modules = [m for m in a.lora_target_modules
                                 if m not in ("linear_q_down_proj", "linear_kv_down_proj")] + ["linear_qkv"]
    return a


def derive_fused(torch, name: str, out: Path) -> dict:
    dspec = DERIVED[name]
    src_name = dspec["source"]
    spec = BUILT[src_name]
    src, d = out / src_name, out / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    shutil.copytree(src / "hf_ref", d / "hf_ref")
    shutil.copy(src / ".fused_logits.pt", d / "logits.pt")
    dm = dims(spec)
    ql = dm["q_lora_rank"]
    for rd in sorted((src / "base" / f"iter_{BASE_ITER:07d}").iterdir()):
        ck = torch.load(rd / "model_optim_rng.pt", weights_only=False)
        sd = ck["model"]
        ck["model"] = to_fused_base(torch, sd)
        for k, v in ck["model"].items():  # the fused tensor is exactly the two upstream ones
            if k.endswith("linear_qkv.weight"):
                p = k[: -len("linear_qkv.weight")]
                assert torch.equal(v[:ql], sd[p + "linear_q_down_proj.weight"])
                assert torch.equal(v[ql:], sd[p + "linear_kv_down_proj.weight"])
        ck["args"] = mindspeed_args(ck["args"], name, src_name)
        od = d / "base" / f"iter_{BASE_ITER:07d}" / rd.name
        od.mkdir(parents=True)
        torch.save(ck, od / "model_optim_rng.pt")
    (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
    for it, seed in ((STALE_LORA_ITER, spec["lora_seed"] + mf.STALE_SEED_OFFSET), (LORA_ITER, spec["lora_seed"])):
        fused = canonical_fused_lora(torch, spec, seed)
        for rd in sorted((src / "lora" / f"iter_{it:07d}").iterdir()):
            ck = torch.load(rd / "model_optim_rng.pt", weights_only=False)
            ck["model"] = to_fused_lora(ck["model"], fused)
            ck["args"] = mindspeed_args(ck["args"], name, src_name)
            od = d / "lora" / f"iter_{it:07d}" / rd.name
            od.mkdir(parents=True)
            torch.save(ck, od / "model_optim_rng.pt")
    (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
    return spec


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def key_listing(torch, d: Path) -> dict:
    """{base|lora: {rank dir: [[key, shape], ...]}} of the tracker's iteration, every rank file."""
    out = {}
    for part in ("base", "lora"):
        it = int((d / part / "latest_checkpointed_iteration.txt").read_text().strip())
        out[part] = {}
        idir = d / part / f"iter_{it:07d}"
        if (idir / "metadata.json").exists():  # torch_dist: the global keys and shapes
            from torch.distributed.checkpoint import FileSystemReader
            md = FileSystemReader(str(idir)).read_metadata()
            out[part]["torch_dist"] = [[k, list(getattr(m, "size", []) or [])] for k, m in md.state_dict_metadata.items()]
            continue
        for rd in sorted(idir.iterdir()):
            sd = torch.load(rd / "model_optim_rng.pt", weights_only=False)["model"]
            out[part][rd.name] = [[k, list(v.shape) if torch.is_tensor(v) else None] for k, v in sd.items()]
    return out


def margins_of(summary: dict, keys) -> tuple:
    per = [v for r in keys for v in summary[r].values()]
    return min(v["min_rel_gap"] for v in per), per


def rope_words(spec) -> str:
    y = yarn_of(spec)
    if y is None:
        return "plain rope"
    return (f"YaRN rope in MLA (rope_type yarn, rotary_scaling_factor {y['rotary_scaling_factor']}, mscale "
            f"{y['mscale']}, mscale_all_dim {y['mscale_all_dim']}; original_max_position_embeddings "
            f"{y['original_max_position_embeddings']}, beta_fast {y['beta_fast']}, beta_slow {y['beta_slow']} = "
            f"MLATransformerConfig defaults, no Megatron-LM 0.16.1 argument sets them)")


YARN_ARG_NAMES = ("multi_latent_attention", "position_embedding_type", "rope_type", "rotary_base", "rotary_percent",
                  "rotary_interleaved", "rotary_scaling_factor", "mscale", "mscale_all_dim", "max_position_embeddings",
                  "seq_length", "use_rope_scaling", "rope_scaling_factor", "apply_rope_fusion")
YARN_ABSENT_ARGS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "yarn_original_max_position_embeddings",
                    "yarn_beta_fast", "yarn_beta_slow", "yarn_rotary_scaling_factor", "yarn_mscale", "yarn_mscale_all_dim")


def yarn_fixture_fields(torch, spec, d: Path, summary: dict) -> dict:
    """fixture.json entries of a yarn fixture: the exact args saved (read back from every rank file of
    both checkpoints), their command line, Megatron's YaRN internals and the plain-rope control."""
    if not spec.get("yarn"):
        return {}
    seen = None
    for part, it in (("base", BASE_ITER), ("lora", LORA_ITER), ("lora", STALE_LORA_ITER)):
        for rd in sorted((d / part / f"iter_{it:07d}").iterdir()):
            a = torch.load(rd / "model_optim_rng.pt", weights_only=False)["args"]
            got = {k: getattr(a, k) for k in YARN_ARG_NAMES}
            assert seen is None or got == seen, (rd, got, seen)
            assert not any(hasattr(a, k) for k in YARN_ABSENT_ARGS), rd
            seen = got
    y = yarn_of(spec)
    cli = (f"--multi-latent-attention --position-embedding-type rope --rope-type yarn --rotary-base "
           f"{seen['rotary_base']} --rotary-scaling-factor {seen['rotary_scaling_factor']} --mscale {seen['mscale']} "
           f"--mscale-all-dim {seen['mscale_all_dim']} --max-position-embeddings {seen['max_position_embeddings']} "
           f"--no-rope-fusion")
    mc = summary["megatron_yarn"]["config"]
    assert all(mc[k] == v for k, v in y.items()) and mc["rope_type"] == "yarn", (mc, y)
    return dict(
        yarn=True,
        megatron_args_yarn=seen,
        megatron_cli_yarn=cli,
        megatron_args_yarn_note=(
            "Megatron-LM core_v0.16.1 megatron/training/arguments.py: --rope-type {rope,yarn} (default None: "
            "MLATransformerConfig's own default, yarn), --rotary-scaling-factor (default 1.0), --mscale (1.0), "
            "--mscale-all-dim (0.0); core_transformer_config_from_args copies every args attribute named like a "
            "MLATransformerConfig field. There is no argument for original_max_position_embeddings, beta_fast or "
            "beta_slow (nor yarn_* ones): MLA uses MLATransformerConfig's defaults 4096 / 32 / 1, and these names "
            "are absent from args. --position-embedding-type has no yarn choice in 0.16.1; GPTModel builds no "
            "rotary embedding with MLA. use_rope_scaling / rope_scaling_factor are Llama-3.x scaling (unused)."),
        megatron_yarn_config_defaults_used=dict(MLA_YARN_CONFIG_DEFAULTS),
        megatron_yarn=summary["megatron_yarn"],
        hf_rope_scaling=hf_rope_scaling(spec),
        megatron_plain_rope_base_vs_yarn_base_max_abs=summary["megatron_plain_rope_base_vs_yarn_base_max_abs"],
    )


def compare_yarn(mg: dict, hf: dict) -> dict:
    """Megatron's YaRN numbers vs HF's (same dim, frequencies, cos/sin factor and softmax scale)."""
    assert mg["rotary_dim"] == hf["rotary_dim"], (mg, hf)
    res = dict(
        inv_freq_max_abs=max(abs(a - b) for a, b in zip(mg["inv_freq"], hf["inv_freq"])),
        cos_sin_scale_abs=abs(mg["cos_sin_mscale"] - hf["attention_scaling"]),
        softmax_scale_abs=abs(mg["softmax_scale"] - hf["softmax_scaling"]),
    )
    assert all(v < 1e-7 for v in res.values()), res
    return res


def describe(name, spec):
    dm = dims(spec)
    v3 = spec["family"] == "deepseek_v3"
    attn = (f"q_lora_rank {dm['q_lora_rank']} (linear_q_down_proj -> q_layernorm -> linear_q_up_proj)" if dm["q_lora_rank"]
            else "q_lora_rank None (linear_q_proj directly)")
    route = (f"sigmoid scores + non-zero router.expert_bias, {spec['groups'][0]} groups / {spec['groups'][1]} per "
             f"token, top-{spec['topk']} renormalised x {spec['scaling']}" if v3 else
             f"softmax over all experts (moe_router_pre_softmax=True), greedy top-{spec['topk']}, no renormalisation, "
             f"x {spec['scaling']}")
    return (f"DeepSeek-{'V3' if v3 else 'V2-Lite'}-like Megatron-Core GPTModel, local spec (MLASelfAttention + "
            f"MoELayer = TopKRouter + SequentialMLP + ungated SharedExpertMLP, alltoall dispatcher), TP={spec['tp']} "
            f"EP={spec['ep']} ETP={spec['etp']} PP=1, {spec.get('base_format', 'torch')} base, float32; {dm['num_layers']} layers (layer 0 dense ffn {dm['ffn_hidden_size']}, layers "
            f"{moe_layers(spec)} MoE), hidden {dm['hidden_size']}, {dm['num_attention_heads']} heads, {attn}, kv_lora_rank "
            f"{dm['kv_lora_rank']}, qk_head_dim (nope) {dm['qk_head_dim']}, qk_pos_emb_head_dim (rope) "
            f"{dm['qk_pos_emb_head_dim']}, v_head_dim {dm['v_head_dim']}, {rope_words(spec)} base {dm['rotary_base']}; "
            f"{spec['num_experts']} experts ({spec['num_experts'] // spec['ep']} per EP rank) of ffn "
            f"{dm['moe_ffn_hidden_size']}, {spec['n_shared']} shared expert(s) (ffn {dm['shared_ffn']}); routing: "
            f"{route}. HF {spec['family']}. lora/ = PEFT 0.7.1 LoRA (LoraParallelLinearMoE) on {targets(spec)}, "
            f"every expert and the shared experts included (not the router), filtered, iter {LORA_ITER} + stale "
            f"iter_{STALE_LORA_ITER:07d}.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "tests" / "fixtures_deepseek"))
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
    need = [n for n in BUILT if n in names]
    for n in names:
        if n in DERIVED and DERIVED[n]["source"] not in need:
            need.append(DERIVED[n]["source"])  # the fused forward runs with its source

    for name in [n for n in BUILT if n in need]:
        spec = BUILT[name]
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        world = math.lcm(spec["tp"], spec["etp"] * spec["ep"])  # TP x DP (attention) = ETP x EP x EDP (experts)
        print(f"[{name}] spawning {world} ranks (TP={spec['tp']} EP={spec['ep']} ETP={spec['etp']})", flush=True)
        mp.spawn(worker, args=(world, name, spec, str(out), mf.free_port(), peft_dir), nprocs=world, join=True)
        (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
        (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
        write_ds_hf_ref(spec, d / "hf_ref")
        summary = json.loads((d / ".summary.json").read_text())
        (d / ".summary.json").unlink()
        rkeys = ["routing_base", "routing_lora"] + (["routing_fused"] if spec["fused"] else [])
        min_rel, per = margins_of(summary, rkeys)
        assert min_rel >= MIN_REL_MARGIN, f"{name}: top-k margin {min_rel} too small: change router seed/scale"
        counts = {r: {l: v["tokens_per_expert"] for l, v in summary[r].items()} for r in rkeys}
        for r, per_layer in counts.items():
            tot = [sum(c[e] for c in per_layer.values()) for e in range(spec["num_experts"])]
            assert all(t > 0 for t in tot), (name, r, tot)
        nrep = mmf.check_ep_replicas(torch, d, spec)
        dm = dims(spec)
        fx = dict(
            model_type=spec["family"],
            tp=spec["tp"], pp=1, ep=spec["ep"], etp=spec["etp"], world_size=world,
            dtype="float32", lora="filtered", r=LORA_R, alpha=LORA_ALPHA, targets=targets(spec),
            num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
            multi_latent_attention=True, q_lora_rank=dm["q_lora_rank"], kv_lora_rank=dm["kv_lora_rank"],
            qk_head_dim=dm["qk_head_dim"], qk_pos_emb_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"],
            kv_channels=dm["v_head_dim"], qk_layernorm=True, rope_type="yarn" if spec.get("yarn") else "rope",
            rotary_base=dm["rotary_base"], **yarn_fixture_fields(torch, spec, d, summary),
            ffn_hidden_size=dm["ffn_hidden_size"], moe_ffn_hidden_size=dm["moe_ffn_hidden_size"],
            moe_shared_expert_intermediate_size=dm["shared_ffn"], moe_shared_expert_gate=False,
            vocab_size=dm["vocab_size"], padded_vocab_size=padded_vocab(),
            num_experts=spec["num_experts"], experts_per_ep_rank=spec["num_experts"] // spec["ep"],
            moe_router_topk=spec["topk"], moe_router_score_function=spec["score"],
            moe_router_pre_softmax=spec["pre_softmax"], moe_router_enable_expert_bias=spec["expert_bias"],
            moe_router_topk_scaling_factor=spec["scaling"],
            moe_router_num_groups=spec["groups"][0] if spec["groups"] else None,
            moe_router_group_topk=spec["groups"][1] if spec["groups"] else None,
            moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
            expert_layout="SequentialMLP", moe_layer_freq=moe_freq(spec), moe_layers=moe_layers(spec),
            dense_layers=[i for i in range(dm["num_layers"]) if i not in moe_layers(spec)],
            hf_config=json.loads((d / "hf_ref" / "config.json").read_text()),
            router_weight_std=spec["router_std"], router_seed=spec["router_seed"], expert_bias_std=spec["bias_std"],
            base_seed=spec["base_seed"], lora_seed=spec["lora_seed"],
            base_format=spec.get("base_format", "torch"), lora_format="torch",
            base_iteration=BASE_ITER, lora_iteration=LORA_ITER, stale_lora_iteration=STALE_LORA_ITER,
            rank_dirs=sorted(x["dir"] for x in summary["ranks"] if x["dir"]),
            ranks=summary["ranks"],
            peft_layout=summary["layout"],
            peft_wrapped_modules_rank0=summary["wrapped_modules_rank0"],
            tokens_per_expert={r.split("_")[1]: c for r, c in counts.items() if r != "routing_fused"},
            routing=dict(base=summary["routing_base"], lora=summary["routing_lora"]),
            min_topk_margin_relative=min_rel,
            ep_replica_tensors_checked_equal=nrep,
            lora_vs_base_max_abs=summary["lora_vs_base_max_abs"],
            stale_vs_lora_max_abs=summary["stale_vs_lora_max_abs"],
            replica_logits_max_abs_diff=summary["replica_logits_max_abs_diff"],
            logits_computed_in="float32",
            megatron_to_hf=[list(r) for r in hf_mapping(spec)],
            megatron_keys=key_listing(torch, d),
        )
        if not opts.no_hf_check:
            fx["hf_check"] = hf_check(spec, d)
            if spec.get("yarn"):
                fx["hf_check"]["yarn_megatron_vs_hf"] = compare_yarn(fx["megatron_yarn"], fx["hf_check"]["hf_yarn"])
        fx["description"] = describe(name, spec)
        (d / "fixture.json").write_text(json.dumps(fx, indent=1) + "\n")
        if spec["fused"]:
            (d / ".fused_routing.json").write_text(json.dumps(dict(
                routing=summary["routing_fused"], tokens_per_expert=counts["routing_fused"],
                fused_vs_lora_max_abs=summary["fused_vs_lora_max_abs"])))
        print(f"[{name}] done: min top-k margin rel {min_rel:.4g}, lora-vs-base "
              f"{summary['lora_vs_base_max_abs']:.4f}, hf {fx.get('hf_check')}", flush=True)

    for name in [n for n in DERIVED if n in names]:
        spec = derive_fused(torch, name, out)
        src_name = DERIVED[name]["source"]
        src = json.loads((out / src_name / "fixture.json").read_text())
        fr = json.loads((out / src_name / ".fused_routing.json").read_text())
        d = out / name
        fx = {k: v for k, v in src.items() if k not in ("description", "hf_check", "megatron_keys", "megatron_to_hf",
                                                         "routing", "tokens_per_expert", "min_topk_margin_relative",
                                                         "peft_wrapped_modules_rank0", "lora_vs_base_max_abs",
                                                         "stale_vs_lora_max_abs", "peft_layout")}
        fx["derived_from"] = src_name
        fx["naming"] = "MindSpeed-LLM pack_mla (fused self_attention.linear_qkv)"
        fx["targets"] = [t for t in targets(spec) if t not in ("linear_q_down_proj", "linear_kv_down_proj")] + ["linear_qkv"]
        fx["routing"] = dict(base=src["routing"]["base"], lora=fr["routing"])
        fx["tokens_per_expert"] = dict(base=src["tokens_per_expert"]["base"], lora=fr["tokens_per_expert"])
        fx["min_topk_margin_relative"] = min(v["min_rel_gap"] for r in fx["routing"].values() for v in r.values())
        fx["peft_layout_note"] = ("linear_qkv as MindSpeed's ColumnParallelLinear at TP=1 under PEFT's LoraParallelLinear: "
                                  "lora_A nn.Linear [r, H] (replicated), lora_B ColumnParallelLinear "
                                  "[q_lora+kv_lora+rope, r] (hence lora_B.default._extra_state); other modules as in "
                                  "the source's peft_layout")
        fx["fused_lora_vs_upstream_lora_logits_max_abs"] = fr["fused_vs_lora_max_abs"]
        fx["megatron_to_hf"] = [list(r) for r in hf_mapping(spec, fused_qkv=True)]
        fx["megatron_keys"] = key_listing(torch, d)
        if not opts.no_hf_check:
            fx["hf_check"] = hf_check(spec, d, fused=True)
        fx["description"] = (
            "Derived from deepseek_v3_ep2's real checkpoint, in MindSpeed-LLM's fused naming: base "
            "self_attention.linear_qkv.weight [q_lora+kv_lora+rope, H] = cat(linear_q_down_proj.weight, "
            "linear_kv_down_proj.weight) along dim 0 (a replicated linear; everything else unchanged: q_layernorm, "
            "kv_layernorm, linear_q_up_proj, linear_kv_up_proj, linear_proj, MoE). LoRA: the q_down / kv_down factors "
            "are replaced by one PEFT LoRA on linear_qkv (lora_A [r, H] shared, lora_B [q_lora+kv_lora+rope, r], new "
            "seeded values); all other LoRA tensors are deepseek_v3_ep2's. logits_lora come from the real Megatron "
            "model of deepseek_v3_ep2 run with q_down.lora_A = kv_down.lora_A = linear_qkv.lora_A and lora_B split at "
            "q_lora_rank (what the fused LoRA linear computes, output rows split); logits_base are the source's. "
            "args carry MindSpeed's DeepSeek arguments (multi_head_latent_attention, first_k_dense_replace, n_group, "
            "topk_group, routed_scaling_factor, n_shared_experts, ...) next to Megatron's.")
        (d / "fixture.json").write_text(json.dumps(fx, indent=1) + "\n")
        print(f"[{name}] derived: hf {fx.get('hf_check')}", flush=True)

    # the fused forward's byproducts are not part of the source fixture
    for name in need:
        for f in (".fused_logits.pt", ".fused_routing.json"):
            (out / name / f).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
