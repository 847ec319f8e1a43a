"""DeepSeek-V3 / V2-Lite-like fixtures (tests/fixtures_deepseek): multi-latent attention (MLA) and MoE.

EP ranks (TP = 1, or TP = 2 with ETP = 1; PP = 1); the ``GPTModel`` is built from an ``MLATransformerConfig``
with the local (non-TE) spec, ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)``:
``MLASelfAttention`` (``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` or ``linear_q_proj``,
``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``linear_proj``; the norms exist only
with ``qk_layernorm=True``), layer 0 a dense MLP (``moe_layer_freq=[0, 1, 1]``), the others ``MoELayer`` =
``TopKRouter`` + ``SequentialMLP`` + an ungated ``SharedExpertMLP``.

* DeepSeek-V3 routing (sigmoid scores, aux-free ``router.expert_bias`` filled with non-zero random values,
  group-limited top-k, renormalised top-k weights times ``moe_router_topk_scaling_factor``) or DeepSeek-V2
  routing (softmax over all experts, greedy top-k, no renormalisation, scaled); every router decision's
  margin (group choice and expert choice) is recorded so that no top-k choice sits on a tie.
* deepseek_v3_ep2 also runs the forward of MindSpeed's fused down-projection LoRA (one A shared by q_down
  and kv_down, B split at q_lora_rank); ``deepseek_v3_mindspeed_fused_qkv_ep2`` is derived from it
  (MindSpeed naming ``self_attention.linear_qkv``).
* deepseek_v3_yarn_ep2 (2 layers, 8 experts) trains with YaRN in MLA: MLATransformerConfig rope_type="yarn"
  with the values that Megatron-LM 0.16.1's --rope-type / --rotary-scaling-factor / --mscale /
  --mscale-all-dim give (recorded under those names in args; original_max_position_embeddings, beta_fast
  and beta_slow have no argument and keep the config defaults 4096 / 32 / 1). Its hf_ref config.json
  carries rope_scaling {"type": "yarn", ...} as the released DeepSeek-V3 config does; the HF check also
  compares Megatron's and HF's YaRN numbers and runs controls (plain rope, wrong mscales, wrong
  original_max_position_embeddings, ...), and the worker runs the base model with plain rope.
* Independent HF check: transformers' own DeepseekV3ForCausalLM / DeepseekV2ForCausalLM built from the
  canonical global tensors (LoRA merged in fp32), saved with per-expert names, reloaded with
  ``from_pretrained`` (no missing / unexpected keys) and compared with the Megatron logits.

CPU shims on top of the MoE ones (none changes the arithmetic): the local ``DotProductAttention`` does not
accept the ``k_channels`` / ``v_channels`` keywords that ``MultiLatentAttention`` passes (only TE's
attention does), so the spec uses a subclass that drops them (with ``kv_channels == v_head_dim`` its output
view is the right one; MLA passes its own softmax scale); and ``multi_latent_attention.HAVE_TE`` is set to
False, since without TransformerEngine ``TELinear`` is a MagicMock placeholder that ``isinstance`` rejects.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

from fixturegen import library as lib

# MLA has no GQA: num_query_groups = heads, and Megatron's kv_channels is v_head_dim
DS_MODEL = dict(lib.TINY, num_layers=3, num_attention_heads=4, num_query_groups=4, kv_channels=12,
                moe_ffn_hidden_size=16,  # every routed expert (HF moe_intermediate_size); ffn: the dense layer 0
                kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)  # qk: HF nope / rope dims
MOE_LAYER_FREQ = [0, 1, 1]
BASE_ITER, LORA_ITER, STALE_LORA_ITER = lib.BASE_ITER, lib.LORA_ITER, lib.STALE_LORA_ITER
MLP_TARGETS = ["linear_fc1", "linear_fc2"]

# DeepSeek-V3: q_lora_rank set, sigmoid + expert bias, 16 experts in 4 groups, 2 groups per token, top-4
# (Megatron's group score is the sum of the top topk/group_topk = 2 scores of a group, HF's is hard-coded to
# the top 2: they agree only when topk == 2 * group_topk), 1 shared expert.
V3 = dict(family="deepseek_v3", tp=1, ep=2, etp=1, num_experts=16, topk=4, q_lora_rank=48, score="sigmoid",
          pre_softmax=False, expert_bias=True, groups=(4, 2), scaling=2.5, n_shared=1, base_seed=21000,
          lora_seed=22000, router_std=0.3, router_seed=21014, bias_std=0.05, fused=True)
# Smaller V3: 2 layers (dense, MoE), 8 experts in 2 groups, 1 group per token, top-2.
V3_SMALL = dict(V3, num_experts=8, topk=2, groups=(2, 1), fused=False, num_layers=2, moe_layer_freq=[0, 1])
BUILT = {
    "deepseek_v3_ep2": V3,
    # DeepSeek-V2-Lite: q_proj directly (q_lora_rank None), softmax over all experts then greedy top-2
    # (moe_router_pre_softmax=True: no renormalisation, HF norm_topk_prob=False), 8 experts, 2 shared.
    "deepseek_v2_lite_ep2": dict(V3, family="deepseek_v2", num_experts=8, topk=2, q_lora_rank=None, score="softmax",
                                 pre_softmax=True, expert_bias=False, groups=None, scaling=2.0, n_shared=2,
                                 base_seed=23000, lora_seed=24000, router_seed=23081, bias_std=None, fused=False),
    # DeepSeek-V3 with YaRN RoPE in MLA (MLATransformerConfig rope_type="yarn"). Only the YaRN knobs that
    # Megatron-LM 0.16.1 has command-line arguments for are chosen here (--rope-type, --rotary-scaling-factor,
    # --mscale, --mscale-all-dim); original_max_position_embeddings / beta_fast / beta_slow have no argument
    # there, so core_transformer_config_from_args leaves MLATransformerConfig's defaults (MLA_YARN_CONFIG_DEFAULTS).
    "deepseek_v3_yarn_ep2": dict(V3_SMALL, base_seed=25000, lora_seed=26000, router_seed=25016,
                                 yarn=dict(rotary_scaling_factor=40.0, mscale=0.9, mscale_all_dim=0.7)),
    # DeepSeek-V3 at TP=2 with experts not tensor-split (ETP=1, EP=2: world 2, dirs mp_rank_00_000 and
    # mp_rank_01_001). Megatron-Core's local spec makes every MLA linear but linear_proj a ColumnParallelLinear:
    # the down-projections too are split by rows over TP (their outputs gathered before the norms), where
    # TransformerEngine's spec duplicates them.
    "deepseek_v3_tp2etp1_ep2": dict(V3_SMALL, tp=2, base_seed=27000, lora_seed=28000, router_seed=27016),
}
# The same model and values with the base saved as torch_dist by Megatron's dist_checkpointing: the
# column-split down-projections become TP chunks of one global tensor.
BUILT["deepseek_v3_dist_tp2etp1_ep2"] = dict(BUILT["deepseek_v3_tp2etp1_ep2"], base_format="torch_dist")
# The same model and LoRA with one multi-token-prediction layer (an MLA + MoE layer under mtp.layers.0, which the
# LoRA trains too): DeepSeek-V3's own MTP, as MindSpeed-LLM's DeepSeek-V3 recipes train with --mtp-num-layers 1
BUILT["deepseek_v3_mtp_tp2etp1_ep2"] = dict(BUILT["deepseek_v3_tp2etp1_ep2"], mtp=1, mtp_router_seed=31001)
# MLATransformerConfig (megatron-core 0.16.1) defaults of the YaRN fields that no Megatron-LM argument sets
# (checked against the built config in the worker)
MLA_YARN_CONFIG_DEFAULTS = dict(original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
DERIVED = {
    "deepseek_v3_mindspeed_fused_qkv_ep2": dict(source="deepseek_v3_ep2"),
}


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
    return lib.padded_vocab(1)


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
    """The GPT base of lib.canonical_gpt_base (embedding, norms, output layer, linear_proj [H, NH*v_head_dim],
    the dense MLPs) with its GQA linear_qkv replaced by the MLA linears, and the MoE layers."""
    dm, n = dims(spec), spec.get("mtp", 0)
    L, seed = dm["num_layers"], spec["base_seed"]
    t = lib.canonical_gpt_base(torch, seed, False, vpad, dict(dm, num_layers=L + n))  # MTP: made as layers L+k
    for i in range(L + n):
        p = f"decoder.layers.{i}.self_attention."
        del t[p + "linear_qkv.weight"]
        for m, (fin, fout) in attn_shapes(spec).items():
            if m != "linear_proj":
                t[f"{p}{m}.weight"] = lib.randn(torch, seed, p + m, (fout, fin), 0.1)
        if dm["q_lora_rank"]:
            t[p + "q_layernorm.weight"] = lib.randn(torch, seed, p + "qln", (dm["q_lora_rank"],), 0.1, 1.0)
        t[p + "kv_layernorm.weight"] = lib.randn(torch, seed, p + "kvln", (dm["kv_lora_rank"],), 0.1, 1.0)
    t = lib.add_experts(torch, t, spec, dm, moe_layers(spec) + list(range(L, L + n)), dm["shared_ffn"],
                        bias_std=spec["bias_std"] if spec["expert_bias"] else None)
    return lib.as_mtp_layers(torch, t, spec, dm)


def lora_modules(spec: dict) -> dict:
    """{global module path: (in, out)} of every module PEFT wraps (the MTP layers' too)."""
    dm, n = dims(spec), spec.get("mtp", 0)
    L, out = dm["num_layers"], {}
    for i in range(L + n):
        for m, io in attn_shapes(spec).items():
            out[f"decoder.layers.{i}.self_attention." + m] = io
        lib.mlp_lora_modules(out, i, i in moe_layers(spec) or i >= L, dm, spec["num_experts"], dm["shared_ffn"])
    return {lib.mtp_name(k, L): v for k, v in out.items()}


def canonical_ds_lora(torch, spec: dict, seed: int) -> dict:
    return lib.lora_factors(torch, seed, lora_modules(spec))


def canonical_fused_lora(torch, spec: dict, seed: int) -> dict:
    """MindSpeed's LoRA on the fused down-projection linear_qkv = [q_down; kv_down]: one A [r, H],
    B [q_lora + kv_lora + rope, r] (per layer, global names)."""
    dm = dims(spec)
    H, out_f = dm["hidden_size"], dm["q_lora_rank"] + dm["kv_lora_rank"] + dm["qk_pos_emb_head_dim"]
    return lib.lora_factors(torch, seed, {f"decoder.layers.{i}.self_attention.linear_qkv": (H, out_f)
                                          for i in range(dm["num_layers"])})


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
# Megatron -> HF mapping (the single source of truth for the HF check and fixture.json; an oracle,
# written from the HF classes)
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


def hf_state_dict(spec: dict, base: dict, lora: dict | None, fused: dict | None = None) -> dict:
    """HF tensors from canonical global Megatron tensors, the LoRA merged in fp32: W + alpha/r * B @ A.
    fused: MindSpeed's linear_qkv LoRA (replaces the q_down / kv_down LoRA)."""
    dm, n = dims(spec), spec.get("mtp", 0)
    L, ql = dm["num_layers"], dm["q_lora_rank"]
    if fused is not None:
        lora = fused_as_upstream(spec, lora, fused)
    base, lora = lib.mtp_as_layers(base, L), lib.mtp_as_layers(lora, L) if lora is not None else None

    def W(name):
        return lib.merged_weight(base, lora, name)

    out = lib.hf_outer(base, dict(dm, num_layers=L + n))
    lib.hf_mtp_extras(out, base, L, n)
    for i in range(L + n):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, ha = p + "self_attention.", h + "self_attn."
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
        if i in moe_layers(spec) or i >= L:
            out[h + "mlp.gate.weight"] = base[p + "mlp.router.weight"]
            if spec["expert_bias"]:
                out[h + "mlp.gate.e_score_correction_bias"] = base[p + "mlp.router.expert_bias"]
            for e in range(spec["num_experts"]):
                lib.hf_glu(out, base, lora, f"{p}mlp.experts.{e}", f"{h}mlp.experts.{e}")
            lib.hf_glu(out, base, lora, p + "mlp.shared_experts", h + "mlp.shared_experts")
        else:
            lib.hf_glu(out, base, lora, p + "mlp", h + "mlp")
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# args
# --------------------------------------------------------------------------------------------

def make_ds_args(torch, spec, iteration, world, lora, filtered, load, save):
    """Megatron-LM 0.16.1 training args of a DeepSeek MLA + MoE run (lib.moe_args, then MLA / routing)."""
    dm = dims(spec)
    shim = dict(tp=spec["tp"], ep=spec["ep"], etp=spec["etp"], num_experts=spec["num_experts"],
                pre_softmax=spec["pre_softmax"], moe_layer_freq=moe_freq(spec), shared=dm["shared_ffn"],
                shared_gate=False, base_format=spec.get("base_format", "torch"))
    a = lib.moe_args(torch, shim, dm, "llama", spec["topk"], iteration, world, lora=lora, filtered=filtered, load=load,
                     save=save)
    y = yarn_of(spec)
    vars(a).update(
        num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], ffn_hidden_size=dm["ffn_hidden_size"],
        num_attention_heads=dm["num_attention_heads"], group_query_attention=False,
        num_query_groups=dm["num_attention_heads"], kv_channels=dm["v_head_dim"],
        moe_ffn_hidden_size=dm["moe_ffn_hidden_size"], padded_vocab_size=padded_vocab(), qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=dm["q_lora_rank"], kv_lora_rank=dm["kv_lora_rank"],
        qk_head_dim=dm["qk_head_dim"], qk_pos_emb_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"],
        # Megatron-LM 0.16.1: --rope-type yarn --rotary-scaling-factor F --mscale M --mscale-all-dim A
        # (_add_training_args / _add_mla_args; core_transformer_config_from_args copies every args
        # attribute named like an MLATransformerConfig field); plain rope: factor 1, mscales 1 and 0.
        rope_type="yarn" if y else "rope", rotary_scaling_factor=y["rotary_scaling_factor"] if y else 1.0,
        mscale=y["mscale"] if y else 1.0, mscale_all_dim=y["mscale_all_dim"] if y else 0.0,
    )
    if y:
        # There is no argument for original_max_position_embeddings, beta_fast or beta_slow
        # (MLATransformerConfig defaults), and --position-embedding-type has no "yarn" choice: DeepSeek recipes
        # pass rope, which GPTModel ignores with MLA (MLA builds its own YarnRotaryEmbedding).
        # --max-position-embeddings = F * 4096.
        vars(a).update(
            max_position_embeddings=dm["max_position_embeddings"],
            use_rope_scaling=False,  # Llama-3.x rope scaling (GPTModel's RotaryEmbedding): off; its
            rope_scaling_factor=8.0,  # --rope-scaling-factor keeps the default 8.0 and is unused
            apply_rope_fusion=False,  # --no-rope-fusion (the unfused MLA rope path ran here)
        )
    vars(a).update(
        moe_router_topk=spec["topk"], moe_router_score_function=spec["score"], moe_router_pre_softmax=spec["pre_softmax"],
        moe_router_enable_expert_bias=spec["expert_bias"], moe_router_bias_update_rate=1e-3,
        moe_router_topk_scaling_factor=spec["scaling"], moe_router_num_groups=spec["groups"][0] if spec["groups"] else None,
        moe_router_group_topk=spec["groups"][1] if spec["groups"] else None, moe_router_dtype="fp32",
        lora_target_modules=list(targets(spec)) if lora else [],
    )
    if spec.get("mtp"):  # Megatron-LM: --mtp-num-layers N (--mtp-loss-scaling-factor keeps its 0.1)
        vars(a).update(mtp_num_layers=spec["mtp"], mtp_loss_scaling_factor=0.1)
    return a


# --------------------------------------------------------------------------------------------
# In the ranks: MLA on CPU, YaRN and routing records
# --------------------------------------------------------------------------------------------

def patch_mla_cpu():
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
        lib.hf_common(dm), intermediate_size=dm["ffn_hidden_size"], moe_intermediate_size=dm["moe_ffn_hidden_size"],
        n_shared_experts=spec["n_shared"], n_routed_experts=spec["num_experts"],
        routed_scaling_factor=float(spec["scaling"]), kv_lora_rank=dm["kv_lora_rank"],
        q_lora_rank=dm["q_lora_rank"], qk_rope_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"],
        qk_nope_head_dim=dm["qk_head_dim"], num_experts_per_tok=spec["topk"],
        first_k_dense_replace=moe_freq(spec).index(1), attention_bias=False, rope_parameters=rope, moe_layer_freq=1,
    )
    assert moe_freq(spec) == [0] * common["first_k_dense_replace"] + [1] * (dm["num_layers"] - common["first_k_dense_replace"])
    if spec["family"] == "deepseek_v3":
        G, GK = spec["groups"]
        assert spec["topk"] == 2 * GK  # HF's group score is the sum of the top 2 (Megatron's: top topk/GK)
        assert spec["score"] == "sigmoid" and spec["expert_bias"] and not spec["pre_softmax"]
        return DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], n_group=G, topk_group=GK,
                                norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=spec.get("mtp", 0),
                                scoring_func="sigmoid", topk_method="noaux_tc", **common)
    assert spec["score"] == "softmax" and spec["pre_softmax"] and not spec["groups"] and not spec["expert_bias"]
    return DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], n_group=1, topk_group=1,
                            topk_method="greedy", norm_topk_prob=False, scoring_func="softmax",
                            mlp_bias=False, **common)


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
    import torch

    base = canonical_ds_base(torch, spec, padded_vocab())
    lora = canonical_ds_lora(torch, spec, spec["lora_seed"])
    fl = canonical_fused_lora(torch, spec, spec["lora_seed"]) if fused else None

    def state_dict(tag):
        return hf_state_dict(spec, base, lora, fl) if tag == "lora" else hf_state_dict(spec, base, None)

    def extra(tag, sd, model, tmp, ref):
        if spec["expert_bias"]:  # the bias survived save/load
            for i in moe_layers(spec):
                eb = model.model.layers[i].mlp.gate.e_score_correction_bias
                assert eb.dtype == torch.float32 and torch.equal(eb, base[f"decoder.layers.{i}.mlp.router.expert_bias"])
        res = {"hf_tensors_written": len(sd)}
        if spec.get("yarn") and tag == "lora":
            res["hf_yarn"] = hf_yarn_internals(model)
            res["yarn_controls_lora_max_abs"] = yarn_controls(torch, spec, tmp, ref, model)
        return res

    return lib.hf_check(d, state_dict, extra, mtp=spec.get("mtp", 0))


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
    src, d = out / src_name, lib.fresh_dir(out / name)
    shutil.copytree(src / "hf_ref", d / "hf_ref")
    shutil.copy(src / ".fused_logits.pt", d / "logits.pt")
    ql = dims(spec)["q_lora_rank"]

    def fused_base(rd_name, ck):
        sd = ck["model"]
        ck["model"] = to_fused_base(torch, sd)
        for k, v in ck["model"].items():  # the fused tensor is exactly the two upstream ones
            if k.endswith("linear_qkv.weight"):
                p = k[: -len("linear_qkv.weight")]
                assert torch.equal(v[:ql], sd[p + "linear_q_down_proj.weight"])
                assert torch.equal(v[ql:], sd[p + "linear_kv_down_proj.weight"])
        ck["args"] = mindspeed_args(ck["args"], name, src_name)

    lib.rewrite_rank_files(torch, src / "base", d / "base", BASE_ITER, fused_base)
    (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
    for it, seed in ((STALE_LORA_ITER, spec["lora_seed"] + lib.STALE_SEED_OFFSET), (LORA_ITER, spec["lora_seed"])):
        fused = canonical_fused_lora(torch, spec, seed)

        def fused_lora(rd_name, ck, fused=fused):
            ck["model"] = to_fused_lora(ck["model"], fused)
            ck["args"] = mindspeed_args(ck["args"], name, src_name)

        lib.rewrite_rank_files(torch, src / "lora", d / "lora", it, fused_lora)
    (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
    return spec


# --------------------------------------------------------------------------------------------
# fixture.json: YaRN fields and the description
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------

class DeepSeek(lib.Family):
    name = "deepseek"
    out = "tests/fixtures_deepseek"
    built = BUILT
    derived = DERIVED
    json_indent = 1
    mindspeed_moe_lora = True
    routed = True

    def patch_cpu(self, torch):
        lib.patch_moe_cpu(torch)
        patch_mla_cpu()

    dims = staticmethod(dims)
    targets = staticmethod(targets)
    canonical_base = staticmethod(canonical_ds_base)
    canonical_lora = staticmethod(canonical_ds_lora)
    lora_modules = staticmethod(lora_modules)
    make_args = staticmethod(make_ds_args)
    hf_config = staticmethod(hf_config)

    def make_config(self, rk, yarn=True):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        spec, dm, kw = rk.spec, rk.dm, {}
        if spec["groups"]:
            kw.update(moe_router_num_groups=spec["groups"][0], moe_router_group_topk=spec["groups"][1])
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0)
        if spec.get("yarn") and yarn:  # only what Megatron-LM's arguments can set (see make_ds_args)
            rope = dict(rope_type="yarn", **spec["yarn"])
        return MLATransformerConfig(
            **lib.config_kwargs(rk), kv_channels=dm["v_head_dim"], q_lora_rank=dm["q_lora_rank"],
            kv_lora_rank=dm["kv_lora_rank"], qk_head_dim=dm["qk_head_dim"],
            qk_pos_emb_head_dim=dm["qk_pos_emb_head_dim"], v_head_dim=dm["v_head_dim"], qk_layernorm=True,
            rotary_base=dm["rotary_base"], **rope, moe_router_enable_expert_bias=spec["expert_bias"],
            moe_router_topk_scaling_factor=spec["scaling"], moe_router_dtype="fp32", moe_shared_expert_gate=False,
            **lib.moe_config_kwargs(rk, spec["topk"], spec["score"], moe_freq(spec), dm["shared_ffn"]), **kw)

    def layer_spec(self, rk, config, **variant):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        core_attention = cpu_mla_core_attention()
        for ls in block.layer_specs:
            ls.submodules.self_attention.submodules.core_attention = core_attention
        return block

    def after_build(self, rk):
        if rk.spec.get("yarn"):
            rk.extra["megatron_yarn"] = yarn_internals(rk.model.config, rk.model, rk.dm)

    def routing_stats(self, torch, spec, logits, rmap, bias):
        return lib.routing_margins(torch, dict(spec, expert_bias=bias), logits, rmap)

    def peft_layout(self, rk):
        return lib.expert_peft_layout(rk, dense_prefix=True)

    def extra_forwards(self, rk):
        torch, spec = rk.torch, rk.spec
        # ---------- MindSpeed's fused down-projection LoRA, run through the upstream modules ----------
        rk.logits_fused = rk.route_fused = None
        if spec["fused"]:
            fused = canonical_fused_lora(torch, spec, spec["lora_seed"])
            rk.fill(rk.with_lora(fused_as_upstream(spec, rk.lora_global, fused)))
            rk.logits_fused = rk.forward()
            rk.route_fused = rk.routing_stats()
        # ---------- YaRN control: the same base model with plain rope (rope_type="rope", factor 1) ----------
        if spec.get("yarn"):
            plain = rk.build(self.make_config(rk, yarn=False))[0][0]
            assert type(plain.decoder.layers[0].self_attention.rotary_pos_emb).__name__ == "RotaryEmbedding"
            psd = plain.state_dict()
            plain.load_state_dict({k: v if k.endswith("_extra_state") else rk.base_local[0][k] for k, v in psd.items()},
                                  strict=True)
            with torch.no_grad():
                res = plain(input_ids=rk.input_ids, position_ids=rk.position_ids, attention_mask=rk.mask,
                            runtime_gather_output=True)
            rk.route_log.clear()
            rk.extra["megatron_plain_rope_base_vs_yarn_base_max_abs"] = \
                (res[..., : rk.dm["vocab_size"]].float() - rk.logits_base).abs().max().item()

    def rank_summary(self, rk):
        fused = rk.logits_fused
        if rk.writer and fused is not None:
            rk.torch.save({"input_ids": rk.input_ids.clone(), "logits_lora": fused.clone(),
                           "logits_base": rk.logits_base.clone()}, rk.out / ".fused_logits.pt")
        return dict(lib.expert_rank_summary(rk), routing_fused=rk.route_fused,
                    fused_vs_lora_max_abs=(fused - rk.logits_lora).abs().max().item() if fused is not None else None)

    # ---- main process ----
    def to_build(self, names, out):
        need = [n for n in BUILT if n in names]
        for n in names:
            if n in DERIVED and DERIVED[n]["source"] not in need:
                need.append(DERIVED[n]["source"])  # the fused forward runs with its source
        return [n for n in BUILT if n in need]

    def finish_hf_ref(self, spec, d):
        if spec.get("yarn"):
            # as the released DeepSeek-V3 config.json writes it: rope_theta + rope_scaling {"type": "yarn", ...}
            # (transformers 5 would save rope_parameters; it reads both)
            cfg = json.loads((d / "config.json").read_text())
            rp = cfg.pop("rope_parameters")
            cfg["rope_theta"] = _num(rp["rope_theta"])
            cfg["rope_scaling"] = hf_rope_scaling(spec)
            (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            check_hf_yarn_config(spec, d)

    def fixture_json(self, torch, name, spec, d, summary, opts):
        rkeys = ["routing_base", "routing_lora"] + (["routing_fused"] if spec["fused"] else [])
        min_rel, counts = lib.routing_checks(name, spec, summary, rkeys)
        nrep = lib.check_ep_replicas(torch, d, spec)
        dm = dims(spec)
        world = math.lcm(spec["tp"], spec["etp"] * spec["ep"])
        fx = dict(
            model_type=spec["family"],
            tp=spec["tp"], pp=1, ep=spec["ep"], etp=spec["etp"], world_size=world,
            dtype="float32", lora="filtered", r=lib.LORA_R, alpha=lib.LORA_ALPHA, targets=targets(spec),
            num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
            **({"mtp_num_layers": spec["mtp"]} if spec.get("mtp") else {}),
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
            megatron_keys=lib.key_listing(torch, d),
        )
        if not opts.no_hf_check:
            fx["hf_check"] = hf_check(spec, d)
            if spec.get("yarn"):
                fx["hf_check"]["yarn_megatron_vs_hf"] = compare_yarn(fx["megatron_yarn"], fx["hf_check"]["hf_yarn"])
        fx["description"] = describe(name, spec)
        if spec["fused"]:
            (d / ".fused_routing.json").write_text(json.dumps(dict(
                routing=summary["routing_fused"], tokens_per_expert=counts["routing_fused"],
                fused_vs_lora_max_abs=summary["fused_vs_lora_max_abs"])))
        return fx

    def derive(self, torch, name, out, opts):
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
        fx["megatron_keys"] = lib.key_listing(torch, d)
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

    def finish(self, out, built):
        # the fused forward's byproducts are not part of the source fixture
        for name in built:
            for f in (".fused_logits.pt", ".fused_routing.json"):
                (out / name / f).unlink(missing_ok=True)


FAMILY = DeepSeek()
