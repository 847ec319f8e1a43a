"""Mixture-of-Experts fixtures (tests/fixtures_moe): Qwen3-MoE-, Qwen2-MoE-, Mixtral-, GLM-4.5- and gpt-oss-like
GPTModels.

TP x EP ranks (PP = 1); the MLPs are ``MoELayer`` = ``TopKRouter`` + ``SequentialMLP`` experts (local
spec, ``get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, ...)``, or
``get_gpt_decoder_block_spec`` when ``moe_layer_freq`` mixes dense and MoE layers), optionally a gated
``SharedExpertMLP``, with the ``alltoall`` token dispatcher and expert parallelism. The canonical global
tensors hold every expert of layer l as one ``[2F, H]`` / ``[H, F]`` pair (expert TP shards like a dense
fc1/fc2). Legacy files: ``mp_rank_TT_EEE`` per (tp, ep) rank, each holding the whole non-expert model and
its local experts; or a torch_dist base. PEFT is wrapped with MindSpeed's ``LoraParallelLinearMoE`` (LoRA
linears built with ``is_expert=base_layer.is_expert``).

* Every router decision of both forwards is recorded: tokens routed to each expert and the smallest gap
  between the k-th and (k+1)-th router score (no top-k choice sits on a tie), written to fixture.json.
* The GroupedMLP fixtures are derived from the SequentialMLP one by the documented layouts (GroupedMLP
  ``weight1`` / ``weight2`` and MindSpeed's ``LoraParallelGroupedMLP`` ``weight{1,2}_lora_{a,b}``),
  checked against Megatron's own GroupedMLP resharding (a GroupedMLP model loading the torch_dist base)
  and by recomputing every expert's output from the rewritten tensors in plain torch.
* GLM-4.5 (glm4_moe): q/k/v biases and q/k layernorm, head_dim 16 (hidden / heads = 8), partial RoPE
  (GPTModel rotary_percent 0.5: 8 of 16 dims rotated), a dense first layer, sigmoid routing with a non-zero
  random ``router.expert_bias``, renormalised top-k weights times ``moe_router_topk_scaling_factor`` 2.5, an
  ungated shared expert (``mlp.shared_experts``); its router decisions are recomputed from the logits and bias.
* gpt-oss (gpt_oss): add_bias_linear (random biases on qkv, proj, router, every expert's fc1 / fc2), attention sinks
  (softmax_type "learnable": core_attention.softmax_offset), a sliding window on alternate layers (window_size,
  window_attn_skip_freq=2; the CPU mask shim library.patch_sliding_window_cpu), quick-GeGLU experts with
  glu_linear_offset 1 and activation_func_clamp_value 7 (fc1 scaled so that the clamp changes values; counted),
  YaRN RoPE set on the config object; every layer MoE, no shared expert.
* Independent HF check: transformers' own Qwen3MoeForCausalLM / Qwen2MoeForCausalLM / MixtralForCausalLM /
  Glm4MoeForCausalLM built from the canonical global tensors (per-expert HF names), and GptOssForCausalLM from its
  stacked on-disk layout (gate_up_proj with gate / up columns interleaved), against the real Megatron logits.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

from fixturegen import library as lib

MOE_MODEL = dict(lib.TINY, moe_ffn_hidden_size=32)  # ffn_hidden_size: dense layers; moe_ffn: every routed expert
TOPK = 2
TARGETS = lib.GQA_TARGETS
ATTENTION = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "llama", "glm4_moe": "glm", "gpt_oss": "gpt_oss"}


def qkv_bias(spec) -> bool:
    return ATTENTION[spec["family"]] in ("qwen2", "glm", "gpt_oss")  # gpt-oss: add_bias_linear (every linear)


def gptoss(spec) -> bool:
    return spec["family"] == "gpt_oss"


def qk_norm(spec) -> bool:
    return ATTENTION[spec["family"]] in ("qwen3", "glm")


def sigmoid(spec) -> bool:
    return spec.get("score", "softmax") == "sigmoid"

QWEN3MOE = dict(family="qwen3_moe", tp=1, ep=2, etp=1, num_experts=4, kv_channels=16, moe_layer_freq=1,
                pre_softmax=False, shared=None, shared_gate=False, base_seed=11000, lora_seed=12000, router_std=0.3)
# gpt-oss's mechanics as megatron-core 0.16.1 builds them (docs/formats.md, "gpt-oss in megatron-core 0.16.1"):
# attention sinks, sliding window on alternate layers, biases on every linear, clamped quick-GeGLU with the
# linear half offset by 1, YaRN RoPE. The values are those of openai/gpt-oss-20b's config.
GPTOSS = dict(
    rotary_base=150000, norm_epsilon=1e-5, clamp=7.0, glu_linear_offset=1.0, quick_gelu_alpha=1.702,
    # set on the TransformerConfig object as yarn_<name> (GPTModel's 'yarn' branch reads them with getattr)
    yarn=dict(rotary_scaling_factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
              mscale=1.0, mscale_all_dim=0.0, correction_range_round_to_int=False),
)

# family: qwen3_moe | qwen2_moe | mixtral | glm4_moe | gpt_oss
BUILT = {
    "qwen3moe_ep2": QWEN3MOE,
    "qwen3moe_dist_ep2": dict(QWEN3MOE, base_format="torch_dist"),
    # singleton_local_shards: per-layer keys, each expert its own `mlp.experts.experts.{e}.linear_fc1.weight_w/_v`
    "qwen3moe_dist_singleton_ep2": dict(QWEN3MOE, base_format="torch_dist", singleton=True),
    "qwen2moe_tp2ep2": dict(QWEN3MOE, family="qwen2_moe", tp=2, etp=2, kv_channels=8, moe_layer_freq=[0, 1, 1, 1],
                            pre_softmax=True, shared=48, shared_gate=True, base_seed=13000, lora_seed=14000),
    # ETP=1 under TP=2: experts are not tensor-split, and only the (tp, ep) dirs of ranks with expert-data-
    # parallel rank 0 exist (world 2: mp_rank_00_000 and mp_rank_01_001), so the dir grid is sparse.
    "qwen3moe_tp2etp1_ep2": dict(QWEN3MOE, tp=2, base_seed=17000, lora_seed=18000),
    "mixtral_ep2": dict(QWEN3MOE, family="mixtral", num_experts=8, kv_channels=8, base_seed=15000, lora_seed=16000,
                        ffn_hidden_size=32, router_seed=15004),
    # GLM-4.5: TP=2 with ETP=1 (the q/k/v biases and the partial-RoPE heads split over TP), a dense first
    # layer (first_k_dense_replace=1), sigmoid + expert bias, scaling 2.5, one shared expert of the expert ffn
    "glm4moe_tp2etp1_ep2": dict(QWEN3MOE, family="glm4_moe", tp=2, num_experts=8, moe_layer_freq=[0, 1, 1, 1],
                                shared=32, score="sigmoid", bias_std=0.05, scaling=2.5, rotary_percent=0.5,
                                base_seed=19000, lora_seed=20000, router_seed=19007),
    # the same GLM-4.5 model and LoRA with one multi-token-prediction layer (mtp.layers.0: enorm, hnorm, eh_proj,
    # a MoE transformer_layer, final_layernorm) that the LoRA trains too
    "glm4moe_mtp_tp2etp1_ep2": dict(QWEN3MOE, family="glm4_moe", tp=2, num_experts=8, moe_layer_freq=[0, 1, 1, 1],
                                    shared=32, score="sigmoid", bias_std=0.05, scaling=2.5, rotary_percent=0.5,
                                    base_seed=19000, lora_seed=20000, router_seed=19007, mtp=1,
                                    mtp_router_seed=30001),
    # gpt-oss: TP=2 with ETP=1 (sparse grid as glm4moe_tp2etp1_ep2), every layer MoE (4 experts, top-2, no shared
    # expert), head_dim 16 != hidden / heads, sinks, a 4-token window on layers 0 and 2, biases everywhere (random,
    # non-zero), experts' fc1 scaled by fc1_scale so that the clamp at 7 bites; router_seed 21001: the first seed from
    # 21000 whose top-k margins clear 1e-3
    "gptoss_tp2etp1_ep2": dict(QWEN3MOE, family="gpt_oss", tp=2, num_experts=4, kv_channels=16, ffn_hidden_size=32,
                               sliding_window=4, fc1_scale=3.5, linear_bias_std=0.1, sink_std=1.0,
                               router_bias_std=0.1, base_seed=21000, lora_seed=22000, router_seed=21001),
}
# derived (no Megatron run): from qwen3moe_ep2's real checkpoint by the documented layouts
DERIVED = {
    "qwen3moe_grouped_ep2": dict(source="qwen3moe_ep2", lora="copy"),
    "qwen3moe_mindspeed_grouped_lora_ep2": dict(source="qwen3moe_ep2", lora="grouped"),
}


def dims(spec: dict) -> dict:
    d = dict(MOE_MODEL, kv_channels=spec["kv_channels"])
    if "ffn_hidden_size" in spec:
        d["ffn_hidden_size"] = spec["ffn_hidden_size"]
        d["moe_ffn_hidden_size"] = spec["ffn_hidden_size"]
    if gptoss(spec):  # (max positions: YaRN's factor x original, as gpt-oss's config; no learned positions)
        d.update(rotary_base=GPTOSS["rotary_base"], norm_epsilon=GPTOSS["norm_epsilon"],
                 max_position_embeddings=int(GPTOSS["yarn"]["rotary_scaling_factor"]
                                             * GPTOSS["yarn"]["original_max_position_embeddings"]))
    return d


def window_layers(spec) -> list:
    """gpt-oss: the (0-indexed) layers with sliding-window attention. Megatron's window_attn_skip_freq=2 windows
    layer_number % 2 != 0 (1-indexed 1, 3, ...) = HF layer_types "sliding_attention" at 0, 2, ..."""
    return [i for i in range(MOE_MODEL["num_layers"]) if (i + 1) % 2 != 0] if gptoss(spec) else []


def layer_pattern(spec):
    """Megatron's moe_layer_freq -> [1 = MoE, 0 = dense] per layer (an int N: every N-th layer).
    Megatron-LM's default is the int 1 (all MoE): the torch_dist checkpoint then stacks the layers
    ([L, ...] keys); a list (e.g. [0, 1, 1, 1]) makes it use per-layer keys."""
    f, L = spec["moe_layer_freq"], MOE_MODEL["num_layers"]
    return [1 if i % f == 0 else 0 for i in range(L)] if isinstance(f, int) else list(f)


def moe_layers(spec):
    return [i for i, f in enumerate(layer_pattern(spec)) if f == 1]


def canonical_moe_base(torch, spec: dict, vpad: int) -> dict:
    """The global tensors; MTP layer k is made as decoder layer L+k (the last layer's kind: MoE) and moved under
    mtp.layers.{k}.transformer_layer, beside its own enorm, hnorm, eh_proj and final_layernorm."""
    dm, n = dims(spec), spec.get("mtp", 0)
    L = dm["num_layers"]
    t = lib.canonical_gpt_base(torch, spec["base_seed"], qkv_bias(spec), vpad, dict(dm, num_layers=L + n),
                               qk_norm=qk_norm(spec))
    t = lib.add_experts(torch, t, spec, dm, moe_layers(spec) + list(range(L, L + n)), spec["shared"],
                        spec["shared_gate"], bias_std=spec.get("bias_std"))
    if gptoss(spec):
        t = add_gptoss_tensors(torch, t, spec, dm)
    return lib.as_mtp_layers(torch, t, spec, dm)


def add_gptoss_tensors(torch, t: dict, spec: dict, dm: dict) -> dict:
    """gpt-oss's extra tensors (add_bias_linear: linear_proj / router / every expert's fc1 and fc2 biases; the
    qkv bias is canonical_gpt_base's), the attention sinks (core_attention.softmax_offset [heads]), and every
    expert's fc1 scaled by spec["fc1_scale"] so that some fc1 outputs pass the clamp."""
    seed, rseed = spec["base_seed"], spec.get("router_seed", spec["base_seed"])
    H, F, NH, E = dm["hidden_size"], dm["moe_ffn_hidden_size"], dm["num_attention_heads"], spec["num_experts"]
    b = spec["linear_bias_std"]
    for i in range(dm["num_layers"]):
        p = f"decoder.layers.{i}."
        t[p + "self_attention.linear_proj.bias"] = lib.randn(torch, seed, p + "projb", (H,), b)
        t[p + "self_attention.core_attention.softmax_offset"] = lib.randn(torch, seed, p + "sinks", (NH,),
                                                                         spec["sink_std"])
        t[p + "mlp.router.bias"] = lib.randn(torch, rseed, p + "mlp.router.bias", (E,), spec["router_bias_std"])
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t[q + "linear_fc1.weight"] = t[q + "linear_fc1.weight"] * spec["fc1_scale"]
            t[q + "linear_fc1.bias"] = lib.randn(torch, seed, q + "fc1b", (2 * F,), b)  # [gate; up]
            t[q + "linear_fc2.bias"] = lib.randn(torch, seed, q + "fc2b", (H,), b)
    return t


def gptoss_config_kwargs(spec: dict) -> dict:
    """TransformerConfig keywords of gpt-oss (replacing config_kwargs' add_bias_linear / activation): what Megatron-LM's
    core_transformer_config_from_args makes of the gpt-oss arguments (gptoss_args)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu  # the one arguments.py's --quick-geglu sets

    return dict(
        add_bias_linear=True, gated_linear_unit=True, activation_func=quick_gelu,
        glu_linear_offset=GPTOSS["glu_linear_offset"], activation_func_clamp_value=GPTOSS["clamp"],
        # --no-bias-gelu-fusion (with --quick-geglu, bias_activation_fusion = args.bias_gelu_fusion): the fused
        # kernel would clamp before adding the fc1 bias
        bias_activation_fusion=False,
        softmax_type="learnable",  # attention sinks: core_attention.softmax_offset [heads]
        window_size=(spec["sliding_window"] - 1, 0),  # a query sees itself and window - 1 earlier keys
        window_attn_skip_freq=2,  # layer_number % 2 != 0 windowed: 1-indexed 1, 3 = 0-indexed 0, 2
    )


def gptoss_args(spec: dict) -> dict:
    """The gpt-oss training arguments as Megatron-LM's arguments.py stores them (dest names and value types):
    core_v0.16.1 (55ac7082) for everything but YaRN, whose CLI arguments 0.16.1 lacks (its
    --position-embedding-type has no 'yarn'; only post_training's --enable-gpt-oss set YaRN, with
    original_max_position_embeddings 131072); the YaRN names are those of Megatron-LM main (d98e8a64, added by
    fcbb6ed8: --position-embedding-type yarn, --rotary-scaling-factor, --yarn-original-max-position-embeddings,
    --yarn-beta-fast, --yarn-beta-slow, --no-yarn-correction-range-round-to-int, --mscale, --mscale-all-dim)."""
    y, W = GPTOSS["yarn"], spec["sliding_window"]
    return dict(
        add_bias_linear=True,  # TransformerConfig field (--disable-bias-linear not given)
        add_qkv_bias=True,  # validate_args: add_bias_linear forces add_qkv_bias
        swiglu=False, quick_geglu=True,  # --quick-geglu: gated_linear_unit=True, activation_func=quick_gelu
        glu_linear_offset=GPTOSS["glu_linear_offset"],  # --glu-linear-offset 1.0 (float)
        activation_func_clamp_value=GPTOSS["clamp"],  # --activation-func-clamp-value 7.0 (float)
        bias_gelu_fusion=False,  # --no-bias-gelu-fusion (store_false): with --quick-geglu it is bias_activation_fusion
        bias_swiglu_fusion=True,  # its default (store_false, unused without --swiglu)
        softmax_type="learnable",  # --softmax-type learnable (str)
        window_size=(W - 1, 0),  # --window-size 3,0 (tuple_type: a tuple of ints)
        window_attn_skip_freq=2,  # --window-attn-skip-freq 2 (moe_freq_type: an int)
        layernorm_epsilon=GPTOSS["norm_epsilon"],  # --norm-epsilon's dest (TransformerConfig.layernorm_epsilon)
        position_embedding_type="yarn", use_rotary_position_embeddings=False,  # (True would make validate_args
        # reset position_embedding_type to 'rope')
        rotary_base=GPTOSS["rotary_base"],  # --rotary-base 150000 (int)
        rotary_scaling_factor=y["rotary_scaling_factor"], yarn_original_max_position_embeddings=int(
            y["original_max_position_embeddings"]), yarn_beta_fast=y["beta_fast"], yarn_beta_slow=y["beta_slow"],
        yarn_correction_range_round_to_int=y["correction_range_round_to_int"], mscale=y["mscale"],
        mscale_all_dim=y["mscale_all_dim"],
        apply_rope_fusion=False,  # validate_args: no rope fusion unless position_embedding_type == 'rope'
    )


def count_clamps(rk):
    """Count, per forward of this rank, the experts' fc1 outputs (bias added, LoRA included) that the clamp
    changes: gate half above the clamp, linear half outside [-clamp, clamp] (hooks on every local expert's
    linear_fc1, whichever module sits there: PEFT's wrapper once it wraps)."""
    import re

    clamp, pat = GPTOSS["clamp"], re.compile(r"local_experts\.\d+\.linear_fc1$")
    rk.torch._dynamo.config.disable = True  # quick_gelu is torch.compile'd (jit_fuser): run it eagerly on CPU
    rk.clamp_counts, orig = [], rk.forward

    def forward():
        c = dict(gate_above=0, linear_outside=0, values_per_half=0, expert_token_rows=0)

        def hook(mod, inp, out):
            y, b = out
            y = y if b is None else y + b
            g, u = y.chunk(2, dim=-1)
            c["gate_above"] += int((g > clamp).sum())
            c["linear_outside"] += int((u.abs() > clamp).sum())
            c["values_per_half"] += g.numel()
            c["expert_token_rows"] += int(y.reshape(-1, y.shape[-1]).shape[0])

        hooks = [m.register_forward_hook(hook) for ch in rk.chunks for n, m in ch.named_modules() if pat.search(n)]
        assert hooks
        try:
            res = orig()
        finally:
            for h in hooks:
                h.remove()
        rk.clamp_counts.append(c)
        return res

    rk.forward = forward


def lora_modules(spec: dict) -> dict:
    """{global module path: (in, out)} of every module PEFT wraps for TARGETS (the MTP layers' too: PEFT
    matches by suffix)."""
    dm, n = dims(spec), spec.get("mtp", 0)
    H, NH, NG, D = dm["hidden_size"], dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    L, out = dm["num_layers"], {}
    for i in range(L + n):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv"] = (H, (NH + 2 * NG) * D)
        out[p + "self_attention.linear_proj"] = (NH * D, H)
        lib.mlp_lora_modules(out, i, i in moe_layers(spec) or i >= L, dm, spec["num_experts"], spec["shared"])
    return {lib.mtp_name(k, L): v for k, v in out.items()}


def canonical_moe_lora(torch, spec: dict, seed: int) -> dict:
    return lib.lora_factors(torch, seed, lora_modules(spec))


def gptoss_hf_config(spec, dm):
    """transformers' GptOssConfig of the same model: sinks, q/k/v/o biases, experts with biases (swiglu_limit =
    the clamp, swiglu_alpha = quick_gelu's 1.702), sliding_window W on the "sliding_attention" layers, YaRN with
    the values Megatron used (truncate false = yarn_correction_range_round_to_int False)."""
    from transformers import GptOssConfig

    y, L = GPTOSS["yarn"], dm["num_layers"]
    assert y["mscale"] == 1.0 and y["mscale_all_dim"] == 0.0  # Megatron: concentration = HF's default attention_factor
    wl = window_layers(spec)
    return GptOssConfig(
        architectures=["GptOssForCausalLM"], **lib.hf_common(dm), head_dim=dm["kv_channels"],
        intermediate_size=dm["moe_ffn_hidden_size"], num_local_experts=spec["num_experts"],
        num_experts_per_tok=TOPK, output_router_logits=False, attention_bias=True,
        sliding_window=spec["sliding_window"],
        layer_types=["sliding_attention" if i in wl else "full_attention" for i in range(L)],
        swiglu_limit=GPTOSS["clamp"], swiglu_alpha=GPTOSS["quick_gelu_alpha"],
        rope_parameters={"rope_type": "yarn", "rope_theta": float(GPTOSS["rotary_base"]),
                         "factor": y["rotary_scaling_factor"], "beta_fast": y["beta_fast"], "beta_slow": y["beta_slow"],
                         "truncate": y["correction_range_round_to_int"],
                         "original_max_position_embeddings": y["original_max_position_embeddings"]})


class MoE(lib.Family):
    name = "moe"
    out = "tests/fixtures_moe"
    built = BUILT
    derived = DERIVED
    mindspeed_moe_lora = True
    routed = True
    grouped_ref = None  # Megatron's own GroupedMLP tensors per rank dir (from qwen3moe_dist_ep2's run)

    def patch_cpu(self, torch):
        lib.patch_moe_cpu(torch)
        lib.patch_sliding_window_cpu()  # (gpt-oss's windowed layers; never called by the other models)

    dims = staticmethod(dims)
    canonical_base = staticmethod(canonical_moe_base)
    canonical_lora = staticmethod(canonical_moe_lora)
    lora_modules = staticmethod(lora_modules)

    def targets(self, spec):
        return list(TARGETS)

    def model_kwargs(self, spec):  # (MTP: library.Rank.build)
        return {"rotary_percent": spec["rotary_percent"]} if "rotary_percent" in spec else {}

    def make_config(self, rk, grouped=False):
        from megatron.core.transformer.transformer_config import TransformerConfig

        spec, dm, kw = rk.spec, rk.dm, {}
        if qk_norm(spec):
            kw["qk_layernorm"] = True
        if sigmoid(spec):
            kw.update(moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=spec["scaling"],
                      moe_router_dtype="fp32")
        common = lib.config_kwargs(rk)
        if gptoss(spec):
            common.update(gptoss_config_kwargs(spec))
        config = TransformerConfig(
            **common, num_query_groups=dm["num_query_groups"], kv_channels=dm["kv_channels"],
            add_qkv_bias=qkv_bias(spec), moe_shared_expert_gate=bool(spec["shared_gate"]),
            **lib.moe_config_kwargs(rk, TOPK, spec.get("score", "softmax"), spec["moe_layer_freq"], spec["shared"],
                                    grouped), **kw)
        if gptoss(spec):
            # YaRN as Megatron-LM sets it (post_training/model_builder.py's --enable-gpt-oss in 0.16.1; later
            # argument_utils._apply_yarn_config_from_args): attributes on the config object, which GPTModel
            # prefers to its position_embedding_type argument
            config.position_embedding_type = "yarn"
            for k, v in GPTOSS["yarn"].items():
                setattr(config, "yarn_" + k, v)
        return config

    def layer_spec(self, rk, config, grouped=False):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

        if all(f == 1 for f in layer_pattern(rk.spec)):
            return get_gpt_layer_local_spec(num_experts=rk.spec["num_experts"], moe_grouped_gemm=grouped,
                                            qk_layernorm=qk_norm(rk.spec),
                                            normalization="RMSNorm")
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")

    def make_args(self, torch, spec, iteration, world, lora, filtered, load, save):
        a = lib.moe_args(torch, spec, dims(spec), ATTENTION[spec["family"]], TOPK, iteration, world, lora,
                         filtered, load, save)
        vars(a).update(add_qkv_bias=qkv_bias(spec), qk_layernorm=qk_norm(spec),
                       rotary_percent=spec.get("rotary_percent", 1.0))
        if gptoss(spec):
            vars(a).update(gptoss_args(spec))
        if spec.get("mtp"):  # Megatron-LM: --mtp-num-layers N (--mtp-loss-scaling-factor keeps its 0.1)
            vars(a).update(mtp_num_layers=spec["mtp"], mtp_loss_scaling_factor=0.1)
        if sigmoid(spec):  # Megatron-LM 0.16.1: --moe-router-score-function sigmoid --moe-router-enable-expert-bias
            vars(a).update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                           moe_router_bias_update_rate=1e-3, moe_router_topk_scaling_factor=spec["scaling"],
                           moe_router_dtype="fp32")
        return a

    def routing_stats(self, torch, spec, logits, rmap, bias):
        """Tokens per expert, smallest k-th vs (k+1)-th gap (abs and relative)."""
        if sigmoid(spec):  # the choice is made on sigmoid scores plus the expert bias
            return lib.routing_margins(torch, dict(spec, topk=TOPK, groups=None, expert_bias=bias), logits, rmap)
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
        assert torch.equal(top, rmap)
        return dict(
            tokens_per_expert=[int(v) for v in rmap.sum(0)],
            min_gap_router_logit=float(gap_logit.min()),
            min_gap_score=float(gap.min()),
            min_rel_gap=float(rel.min()),
        )

    def after_build(self, rk):
        if gptoss(rk.spec):
            count_clamps(rk)

    def extra_forwards(self, rk):
        if gptoss(rk.spec):  # every rank's clamp counts (its own experts' tokens), per forward
            per_rank = [None] * rk.world
            rk.dist.all_gather_object(per_rank, rk.clamp_counts)
            names = ("base", "stale", "lora")
            assert all(len(c) == len(names) for c in per_rank), [len(c) for c in per_rank]
            rk.extra["activation_clamp"] = {
                name: {k: sum(c[f][k] for c in per_rank) for k in per_rank[0][f]}
                | {"per_rank": [c[f] for c in per_rank]}
                for f, name in enumerate(names) if name != "stale"}

    def after_base_save(self, rk, base_sd):
        """Megatron's own GroupedMLP layout: a GroupedMLP model (legacy GroupedMLP, construction only:
        grouped_gemm is not needed to build it) loads the torch_dist base via dist_checkpointing."""
        if rk.spec.get("base_format") != "torch_dist" or rk.spec.get("singleton", False) or gptoss(rk.spec):
            return  # (gpt-oss: the local GroupedMLP has no biases)
        torch = rk.torch
        from megatron.core import dist_checkpointing
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        gmodel = rk.build(self.make_config(rk, grouped=True), grouped=True)[0][0]
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                    "dp_cp_group": rk.ps.get_data_parallel_group(with_context_parallel=True)}
        loaded = dist_checkpointing.load({"model": gmodel.sharded_state_dict(metadata=metadata)},
                                         str(rk.out / "base" / f"iter_{lib.BASE_ITER:07d}"))
        gsd = {k: v for k, v in loaded["model"].items() if torch.is_tensor(v)}
        missing, unexpected = gmodel.load_state_dict(gsd, strict=False)
        assert not [m for m in missing if not m.endswith("_extra_state")], missing
        torch.save({k: v.clone() for k, v in gmodel.state_dict().items() if ".mlp.experts." in k},
                   rk.out / f".megatron_grouped_{rk.dirname}.pt")

    def peft_layout(self, rk):
        return lib.expert_peft_layout(rk, dense_prefix=False)

    def rank_summary(self, rk):
        return lib.expert_rank_summary(rk)

    # ---- main process ----
    def to_build(self, names, out):
        # the derived fixtures need their source (and the dist one for Megatron's GroupedMLP layout)
        need = [n for n in BUILT if n in names]
        if any(n in DERIVED for n in names):
            for n in ("qwen3moe_ep2", "qwen3moe_dist_ep2"):
                if n not in need and not (out / n / "fixture.json").exists():
                    need.append(n)
        return [n for n in BUILT if n in need]

    def hf_config(self, spec):
        from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

        dm = dims(spec)
        if gptoss(spec):
            return gptoss_hf_config(spec, dm)
        common = dict(lib.hf_common(dm), rope_theta=float(dm["rotary_base"]), num_experts_per_tok=TOPK,
                      output_router_logits=False)
        mlp_only = [i for i, f in enumerate(layer_pattern(spec)) if f == 0]
        if spec["family"] == "qwen3_moe":
            return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], head_dim=dm["kv_channels"],
                                  attention_bias=False, intermediate_size=dm["ffn_hidden_size"],
                                  moe_intermediate_size=dm["moe_ffn_hidden_size"], num_experts=spec["num_experts"],
                                  norm_topk_prob=not spec["pre_softmax"], decoder_sparse_step=1,
                                  mlp_only_layers=mlp_only, **common)
        if spec["family"] == "glm4_moe":
            dense = [i for i, f in enumerate(layer_pattern(spec)) if f == 0]
            assert dense == list(range(len(dense))) and spec["shared"] == dm["moe_ffn_hidden_size"]
            common.pop("rope_theta")
            return Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"], head_dim=dm["kv_channels"],
                                 attention_bias=True, use_qk_norm=True, intermediate_size=dm["ffn_hidden_size"],
                                 moe_intermediate_size=dm["moe_ffn_hidden_size"], n_routed_experts=spec["num_experts"],
                                 n_shared_experts=1, first_k_dense_replace=len(dense), n_group=1, topk_group=1,
                                 norm_topk_prob=True, routed_scaling_factor=spec["scaling"],
                                 num_nextn_predict_layers=spec.get("mtp", 0),
                                 rope_parameters={"rope_type": "default", "rope_theta": float(dm["rotary_base"]),
                                                  "partial_rotary_factor": spec["rotary_percent"]}, **common)
        if spec["family"] == "qwen2_moe":
            assert spec["shared"] and spec["shared_gate"]
            return Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], qkv_bias=True,
                                  intermediate_size=dm["ffn_hidden_size"],
                                  moe_intermediate_size=dm["moe_ffn_hidden_size"],
                                  shared_expert_intermediate_size=spec["shared"], num_experts=spec["num_experts"],
                                  norm_topk_prob=not spec["pre_softmax"], decoder_sparse_step=1,
                                  mlp_only_layers=mlp_only, **common)
        assert not mlp_only and not spec["pre_softmax"] and not spec["shared"]
        return MixtralConfig(architectures=["MixtralForCausalLM"], head_dim=dm["kv_channels"],
                             intermediate_size=dm["moe_ffn_hidden_size"], num_local_experts=spec["num_experts"],
                             router_jitter_noise=0.0, **common)

    def fixture_json(self, torch, name, spec, d, summary, opts):
        grp = sorted(d.glob(".megatron_grouped_*.pt"))
        if grp:
            self.grouped_ref = {f.name[len(".megatron_grouped_"):-3]: torch.load(f, weights_only=True) for f in grp}
            for f in grp:
                f.unlink()
        keys = ("routing_base", "routing_lora")
        min_rel, counts = lib.routing_checks(name, spec, summary, keys)
        min_abs = min(v.get("min_gap_router_logit", v.get("min_expert_gap")) for r in keys for v in summary[r].values())
        nrep = lib.check_ep_replicas(torch, d, spec)
        dm = dims(spec)
        world = math.lcm(spec["tp"], spec["etp"] * spec["ep"])
        fx = dict(
            model_type=spec["family"],
            megatron_family=ATTENTION[spec["family"]],
            tp=spec["tp"], pp=1, ep=spec["ep"], etp=spec["etp"], world_size=world,
            dtype="float32", lora="filtered", r=lib.LORA_R, alpha=lib.LORA_ALPHA, targets=TARGETS,
            num_layers=dm["num_layers"], hidden_size=dm["hidden_size"], num_attention_heads=dm["num_attention_heads"],
            num_query_groups=dm["num_query_groups"], kv_channels=dm["kv_channels"],
            ffn_hidden_size=dm["ffn_hidden_size"], moe_ffn_hidden_size=dm["moe_ffn_hidden_size"],
            vocab_size=dm["vocab_size"], padded_vocab_size=lib.padded_vocab(spec["tp"]),
            num_experts=spec["num_experts"], experts_per_ep_rank=spec["num_experts"] // spec["ep"],
            moe_router_topk=TOPK, moe_router_pre_softmax=spec["pre_softmax"], hf_norm_topk_prob=not spec["pre_softmax"],
            moe_router_score_function=spec.get("score", "softmax"), moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, expert_layout="SequentialMLP",
            moe_layer_freq=spec["moe_layer_freq"], moe_layers=moe_layers(spec),
            dense_layers=[i for i in range(dm["num_layers"]) if i not in moe_layers(spec)],
            moe_shared_expert_intermediate_size=spec["shared"], moe_shared_expert_gate=bool(spec["shared_gate"]),
            qkv_bias=qkv_bias(spec), qk_layernorm=qk_norm(spec), rotary_percent=spec.get("rotary_percent", 1.0),
            **({"mtp_num_layers": spec["mtp"], "mtp_layers_in_hf": "model.layers.{num_layers + k}"} if spec.get("mtp")
               else {}),
            router_weight_std=spec["router_std"], base_seed=spec["base_seed"], lora_seed=spec["lora_seed"],
            **({"moe_router_enable_expert_bias": True, "expert_bias_std": spec["bias_std"],
                "moe_router_topk_scaling_factor": spec["scaling"]} if sigmoid(spec) else {}),
            base_format=spec.get("base_format", "torch"), lora_format="torch",
            base_iteration=lib.BASE_ITER, lora_iteration=lib.LORA_ITER, stale_lora_iteration=lib.STALE_LORA_ITER,
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
            lst = lib.key_listing(torch, d)["base"]["torch_dist"]
            fx["torch_dist_moe_keys"] = {k: v for k, v in lst if (".mlp.router." in k or ".mlp.experts." in k)
                                         and "_extra_state" not in k}
        if gptoss(spec):
            fx.update(gptoss_fixture_fields(torch, spec, d, summary))
        if not opts.no_hf_check:
            base = canonical_moe_base(torch, spec, lib.padded_vocab(spec["tp"]))
            lora = canonical_moe_lora(torch, spec, spec["lora_seed"])
            fx["hf_check"] = lib.hf_check(d, lambda tag: hf_state_dict(spec, base, lora if tag == "lora" else None),
                                          mtp=spec.get("mtp", 0),
                                          extra=gptoss_hf_extra(spec, summary) if gptoss(spec) else None)
        fx["description"] = describe(spec)
        return fx

    def derive(self, torch, name, out, opts):
        res, meg_eq, n_meg = derive(torch, name, out, self.grouped_ref)
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


# --------------------------------------------------------------------------------------------
# Independent HF check: the Megatron -> HF mapping (an oracle, written from the HF classes)
# --------------------------------------------------------------------------------------------

def hf_state_dict(spec, base: dict, lora: dict | None) -> dict:
    """The HF tensors, MTP layer k as the releases store it: model.layers.{L+k} with enorm, hnorm, eh_proj,
    shared_head.norm (Megatron's final_layernorm), copies of the embedding and the output layer, and a decoder
    layer."""
    if gptoss(spec):
        return hf_state_dict_gptoss(spec, base, lora)
    dm, n = dims(spec), spec.get("mtp", 0)
    L = dm["num_layers"]
    H, NH, NG, D = dm["hidden_size"], dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"]
    base, lora = lib.mtp_as_layers(base, L), lib.mtp_as_layers(lora, L) if lora is not None else None
    out = lib.hf_outer(base, dict(dm, num_layers=L + n))
    mix = spec["family"] == "mixtral"
    lib.hf_mtp_extras(out, base, L, n)
    for i in range(L + n):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = lib.merged_weight(base, lora, p + "self_attention.linear_qkv").view(NG, NH // NG + 2, D, H)
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
        out[h + "self_attn.o_proj.weight"] = lib.merged_weight(base, lora, p + "self_attention.linear_proj")
        if i in moe_layers(spec) or i >= L:
            m = h + ("block_sparse_moe." if mix else "mlp.")
            out[m + "gate.weight"] = base[p + "mlp.router.weight"]
            if p + "mlp.router.expert_bias" in base:
                out[m + "gate.e_score_correction_bias"] = base[p + "mlp.router.expert_bias"]
            for e in range(spec["num_experts"]):
                lib.hf_glu(out, base, lora, f"{p}mlp.experts.{e}", f"{m}experts.{e}",
                           ("w1", "w3", "w2") if mix else ("gate_proj", "up_proj", "down_proj"))
            if spec["shared"] and spec["family"] == "glm4_moe":
                lib.hf_glu(out, base, lora, p + "mlp.shared_experts", m + "shared_experts")
            elif spec["shared"]:
                lib.hf_glu(out, base, lora, p + "mlp.shared_experts", m + "shared_expert")
                out[m + "shared_expert_gate.weight"] = base[p + "mlp.shared_experts.gate_weight"]
        else:
            lib.hf_glu(out, base, lora, p + "mlp", h + "mlp")
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_state_dict_gptoss(spec, base: dict, lora: dict | None) -> dict:
    """gpt-oss's HF tensors in the release's on-disk layout (what GptOssForCausalLM holds): q/k/v/o_proj weights
    and biases, self_attn.sinks (= softmax_offset), mlp.router.weight/bias, and per layer the experts stacked:
    gate_up_proj [E, H, 2F] in -> out with gate / up columns INTERLEAVED (gate = [..., 0::2], up = [..., 1::2]),
    gate_up_proj_bias [E, 2F] interleaved the same way, down_proj [E, F, H] (in -> out), down_proj_bias [E, H].
    Megatron expert e: linear_fc1.weight [2F, H] = [gate; up] (out x in), its bias [2F] = [gate; up],
    linear_fc2.weight [H, F], its bias [H]."""
    import torch

    dm = dims(spec)
    L, H, F = dm["num_layers"], dm["hidden_size"], dm["moe_ffn_hidden_size"]
    NH, NG, D, E = dm["num_attention_heads"], dm["num_query_groups"], dm["kv_channels"], spec["num_experts"]
    out = lib.hf_outer(base, dm)
    for i in range(L):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = lib.merged_weight(base, lora, p + "self_attention.linear_qkv").view(NG, NH // NG + 2, D, H)
        b = base[p + "self_attention.linear_qkv.bias"].view(NG, NH // NG + 2, D)
        for name, rows in (("q", slice(0, NH // NG)), ("k", slice(NH // NG, NH // NG + 1)),
                           ("v", slice(NH // NG + 1, NH // NG + 2))):
            out[f"{h}self_attn.{name}_proj.weight"] = qkv[:, rows].reshape(-1, H)
            out[f"{h}self_attn.{name}_proj.bias"] = b[:, rows].reshape(-1)
        out[h + "self_attn.o_proj.weight"] = lib.merged_weight(base, lora, p + "self_attention.linear_proj")
        out[h + "self_attn.o_proj.bias"] = base[p + "self_attention.linear_proj.bias"]
        out[h + "self_attn.sinks"] = base[p + "self_attention.core_attention.softmax_offset"]
        out[h + "mlp.router.weight"] = base[p + "mlp.router.weight"]
        out[h + "mlp.router.bias"] = base[p + "mlp.router.bias"]
        gate_up = torch.empty(E, H, 2 * F)
        gate_up_bias = torch.empty(E, 2 * F)
        down, down_bias = torch.empty(E, F, H), torch.empty(E, H)
        for e in range(E):
            m = f"{p}mlp.experts.{e}."
            g, u = lib.merged_weight(base, lora, m + "linear_fc1").chunk(2, dim=0)  # [F, H] each
            gate_up[e, :, 0::2], gate_up[e, :, 1::2] = g.t(), u.t()
            bg, bu = base[m + "linear_fc1.bias"].chunk(2)
            gate_up_bias[e, 0::2], gate_up_bias[e, 1::2] = bg, bu
            down[e] = lib.merged_weight(base, lora, m + "linear_fc2").t()
            down_bias[e] = base[m + "linear_fc2.bias"]
        x = h + "mlp.experts."
        out[x + "gate_up_proj"], out[x + "gate_up_proj_bias"] = gate_up, gate_up_bias
        out[x + "down_proj"], out[x + "down_proj_bias"] = down, down_bias
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Derived GroupedMLP fixtures
# --------------------------------------------------------------------------------------------

def to_grouped_base(torch, sd: dict, E_loc: int, H: int) -> dict:
    """SequentialMLP rank state dict -> GroupedMLP (legacy) rank state dict, keys in place.
    weight1 [H, E_loc*2F] = stack_k(fc1_k.T) (E_loc, H, 2F) flattened; weight2 [E_loc*F, H] =
    stack_k(fc2_k.T) (E_loc, F, H) flattened (GroupedMLP.forward: weight1.view(E_loc, H, -1),
    weight2.view(E_loc, -1, H))."""
    def grouped(pre):
        fc1 = [sd[f"{pre}local_experts.{j}.linear_fc1.weight"] for j in range(E_loc)]
        fc2 = [sd[f"{pre}local_experts.{j}.linear_fc2.weight"] for j in range(E_loc)]
        return {pre + "weight1": torch.stack([w.t() for w in fc1]).reshape(H, -1).contiguous(),
                pre + "weight2": torch.stack([w.t() for w in fc2]).reshape(-1, H).contiguous()}

    return lib.regroup_experts(sd, grouped)


def to_grouped_lora(torch, sd: dict, E_loc: int, H: int, r: int) -> dict:
    """PEFT per-expert LoRA -> MindSpeed LoraParallelGroupedMLP keys (mlp.experts.weight{1,2}_lora_{a,b}).
    weight1_lora_a [H, r*E_loc] = view (E_loc, H, r), expert k = A1_k.T; weight1_lora_b
    [r, E_loc*2F] = view (E_loc, r, 2F), expert k = B1_k.T; weight2_lora_a [E_loc*F, r] = view
    (E_loc, F, r), expert k = A2_k.T; weight2_lora_b [r*E_loc, H] = view (E_loc, r, H), expert k = B2_k.T."""
    def grouped(pre):
        def stack(m, ab):  # (E, in, r) for A, (E, r, out) for B
            return torch.stack([sd[f"{pre}local_experts.{j}.{m}.lora_{ab}.default.weight"].t() for j in range(E_loc)])

        return {pre + "weight1_lora_a": stack("linear_fc1", "A").reshape(H, r * E_loc).contiguous(),
                pre + "weight1_lora_b": stack("linear_fc1", "B").reshape(r, -1).contiguous(),
                pre + "weight2_lora_a": stack("linear_fc2", "A").reshape(-1, r).contiguous(),
                pre + "weight2_lora_b": stack("linear_fc2", "B").reshape(r * E_loc, H).contiguous()}

    return lib.regroup_experts(sd, grouped)


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
                L = lambda m, ab: seq_lora[f"{pre}local_experts.{j}.{m}.lora_{ab}.default.weight"]  # noqa: E731
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
    H, E_loc, r = dm["hidden_size"], spec["num_experts"] // spec["ep"], lib.LORA_R
    d = lib.fresh_dir(out / name)
    for f in ("hf_ref", "logits.pt"):
        (shutil.copytree if (src / f).is_dir() else shutil.copy)(src / f, d / f)
    checks = {}
    megatron_equal = []

    def grouped_base(rd_name, ck):
        seq = ck["model"]
        ck["model"] = to_grouped_base(torch, seq, E_loc, H)
        ck["args"] = copy.deepcopy(ck["args"])
        ck["args"].moe_grouped_gemm = True
        ck["args"].save = ck["args"].save.replace(dspec["source"], name)
        if grouped_ref is not None and rd_name in grouped_ref:
            for k, v in grouped_ref[rd_name].items():
                megatron_equal.append(bool(torch.equal(ck["model"][k], v)))
                assert torch.equal(ck["model"][k], v), (rd_name, k)
        checks[rd_name] = dict(base=(seq, ck["model"]))

    lib.rewrite_rank_files(torch, src / "base", d / "base", lib.BASE_ITER, grouped_base)
    (d / "base" / "latest_checkpointed_iteration.txt").write_text(str(lib.BASE_ITER))
    s = lib.LORA_ALPHA / lib.LORA_R
    for it in (lib.STALE_LORA_ITER, lib.LORA_ITER):
        if dspec["lora"] == "copy":
            for rd in sorted((src / "lora" / f"iter_{it:07d}").iterdir()):
                od = d / "lora" / f"iter_{it:07d}" / rd.name
                od.mkdir(parents=True)
                shutil.copy(rd / "model_optim_rng.pt", od / "model_optim_rng.pt")
            continue

        def grouped_lora(rd_name, ck, it=it):
            seq_lora = ck["model"]
            ck["model"] = to_grouped_lora(torch, seq_lora, E_loc, H, r)
            a = ck["args"] = copy.deepcopy(ck["args"])
            a.moe_grouped_gemm = True
            a.moe_token_dispatcher_type = "alltoall_seq"  # what MindSpeed requires for MoE + LoRA
            a.load = a.load.replace(dspec["source"], name)
            a.save = a.save.replace(dspec["source"], name)
            if it == lib.LORA_ITER:
                checks[rd_name]["lora"] = (seq_lora, ck["model"])

        lib.rewrite_rank_files(torch, src / "lora", d / "lora", it, grouped_lora)
    (d / "lora" / "latest_checkpointed_iteration.txt").write_text(str(lib.LORA_ITER))
    res = {}
    for rdn, c in checks.items():
        seq_b, g_b = c["base"]
        seq_l, g_l = c.get("lora", (None, None))
        res[rdn] = check_grouped(torch, seq_b, seq_l, g_b, g_l, E_loc, H, r, s)
    return res, (all(megatron_equal) if megatron_equal else None), len(megatron_equal)


def gptoss_hf_extra(spec, summary):
    """hf_check's extra entries for gpt-oss: the fc1 values transformers' GptOssExperts clamps (its _apply_gate
    counted) must be Megatron's counts per TP copy of the batch (each of the TP ranks sends its identical copy of
    the tokens through the experts); and the same HF model in float64 (eager experts), against Megatron's float32
    logits and HF's float32 ones, to show where the float32 differences lie."""
    def extra(tag, sd, model, folder, ref):
        import torch
        from transformers import AutoModelForCausalLM

        clamp, counts = GPTOSS["clamp"], dict(gate_above=0, linear_outside=0, values_per_half=0)

        def counting(experts):
            apply_gate = experts._apply_gate

            def gate(gate_up):
                g, u = gate_up[..., ::2], gate_up[..., 1::2]
                counts["gate_above"] += int((g > clamp).sum())
                counts["linear_outside"] += int((u.abs() > clamp).sum())
                counts["values_per_half"] += g.numel()
                return apply_gate(gate_up)
            return gate

        for layer in model.model.layers:
            layer.mlp.experts._apply_gate = counting(layer.mlp.experts)
        with torch.no_grad():
            model(ref["input_ids"])
        for layer in model.model.layers:
            del layer.mlp.experts._apply_gate
        meg = summary["activation_clamp"][tag]
        assert all(meg[k] == spec["tp"] * counts[k] for k in counts), (meg, counts)
        m64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                   experts_implementation="eager").eval()
        with torch.no_grad():
            l64 = m64(ref["input_ids"]).logits
            l32 = model(ref["input_ids"]).logits.double()
        return {f"hf_clamped_{tag}": counts,
                f"hf_GptOssForCausalLM_float64_vs_megatron_{tag}_max_abs": (ref[f"logits_{tag}"].double() - l64)
                .abs().max().item(),
                f"hf_GptOssForCausalLM_float64_vs_float32_{tag}_max_abs": (l32 - l64).abs().max().item()}
    return extra


def gptoss_fixture_fields(torch, spec, d: Path, summary: dict) -> dict:
    """fixture.json's gpt-oss entries: the mechanics, the args as saved (value and type), the clamp counts and
    layer 0's keys in every base rank file."""
    W, dm, L = spec["sliding_window"], dims(spec), MOE_MODEL["num_layers"]
    clamp = summary["activation_clamp"]
    for tag in ("base", "lora"):  # the clamp must actually change some fc1 outputs
        assert clamp[tag]["gate_above"] > 0 and clamp[tag]["linear_outside"] > 0, clamp
    idir, layer0 = d / "base" / f"iter_{lib.BASE_ITER:07d}", {}
    if (idir / "metadata.json").exists():  # torch_dist: args in common.pt; the layers' keys (stacked: [L, ...])
        args = torch.load(idir / "common.pt", weights_only=False)["args"]
        layer0["torch_dist"] = {k: v for k, v in lib.key_listing(torch, d)["base"]["torch_dist"]
                                if k.startswith("decoder.layers.") and "_extra_state" not in k}
    else:
        args = torch.load(next(idir.iterdir()) / "model_optim_rng.pt", weights_only=False)["args"]
        for rd in sorted(idir.iterdir()):
            sd = torch.load(rd / "model_optim_rng.pt", weights_only=False)["model"]
            layer0[rd.name] = {k: (list(v.shape) if torch.is_tensor(v) else None) for k, v in sd.items()
                               if k.startswith("decoder.layers.0.")}
    return dict(
        add_bias_linear=True, linear_bias_std=spec["linear_bias_std"], router_bias_std=spec["router_bias_std"],
        softmax_type="learnable", sink_std=spec["sink_std"],
        window_size=[W - 1, 0], window_attn_skip_freq=2, window_layers=window_layers(spec), hf_sliding_window=W,
        hf_layer_types=["sliding_attention" if i in window_layers(spec) else "full_attention" for i in range(L)],
        activation="quick_geglu (gated_linear_unit, activation_func=megatron.core.fusions.fused_bias_geglu."
                   "quick_gelu)", glu_linear_offset=GPTOSS["glu_linear_offset"],
        activation_func_clamp_value=GPTOSS["clamp"], bias_activation_fusion=False, expert_fc1_scale=spec["fc1_scale"],
        activation_clamp=dict(
            clamp, note="experts' fc1 outputs (bias added, LoRA included) changed by the clamp, summed over the "
                        "ranks (each counts its own experts' rows): gate half > clamp, linear half outside "
                        "[-clamp, clamp], out of values_per_half per half. With TP=2 and ETP=1 each TP rank sends "
                        "its own (identical) copy of the batch through the experts, so every routed (token, expert) "
                        "row is computed twice: expert_token_rows = 2 x 32 tokens x top-2 x 4 layers; per copy "
                        "the counts are half, and equal what transformers' GptOssExperts clamps (hf_check)"),
        position_embedding_type="yarn", rotary_base=GPTOSS["rotary_base"],
        yarn={f"yarn_{k}": v for k, v in GPTOSS["yarn"].items()}, norm_epsilon=dm["norm_epsilon"],
        args_gpt_oss={k: dict(value=getattr(args, k), type=type(getattr(args, k)).__name__)
                      for k in gptoss_args(spec)},
        base_layer_0_keys=layer0,
    )


def describe(spec) -> str:
    dm = dims(spec)
    fam = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "glm4_moe": "GLM-4.5",
           "gpt_oss": "gpt-oss"}[spec["family"]]
    ml = moe_layers(spec)
    parts = [
        f"{fam}-like Megatron-Core GPTModel (local spec, MoELayer = TopKRouter + SequentialMLP, alltoall "
        f"dispatcher), TP={spec['tp']} EP={spec['ep']} ETP={spec['etp']} PP=1, float32; {dm['num_layers']} layers "
        f"(MoE layers {ml}" + (f", dense layers {[i for i in range(dm['num_layers']) if i not in ml]} with ffn "
                               f"{dm['ffn_hidden_size']}" if len(ml) < dm['num_layers'] else "") +
        f"), hidden {dm['hidden_size']}, heads {dm['num_attention_heads']}, query groups {dm['num_query_groups']}, "
        f"head_dim {dm['kv_channels']}, {spec['num_experts']} experts ({spec['num_experts'] // spec['ep']} per EP "
        f"rank; global expert = ep_rank*{spec['num_experts'] // spec['ep']} + local), expert ffn "
        f"{dm['moe_ffn_hidden_size']}, top-{TOPK}, "
        + (f"sigmoid scores with a random fp32 router.expert_bias (std {spec.get('bias_std')}) choosing the experts, "
           f"renormalised weights times moe_router_topk_scaling_factor {spec.get('scaling')} (HF "
           f"e_score_correction_bias, norm_topk_prob=true, routed_scaling_factor)" if sigmoid(spec) else
           f"moe_router_pre_softmax={spec['pre_softmax']} (HF norm_topk_prob={not spec['pre_softmax']})")
        + (", qkv bias" if qkv_bias(spec) else "")
        + (", q/k layernorm" if qk_norm(spec) else "")
        + (f", partial RoPE (GPTModel rotary_percent {spec['rotary_percent']}: the first "
           f"{int(dm['kv_channels'] * spec['rotary_percent'])} of {dm['kv_channels']} dims of each head rotated; HF "
           f"partial_rotary_factor)" if spec.get("rotary_percent", 1.0) != 1.0 else "")
        + (f", shared expert (ffn {spec['shared']}) with sigmoid gate (shared_experts.gate_weight [1, H])"
           if spec["shared"] and spec["shared_gate"] else
           f", ungated shared expert (ffn {spec['shared']})" if spec["shared"] else ", no shared expert")
        + f", vocab {dm['vocab_size']} (padded {lib.padded_vocab(spec['tp'])}).",
    ]
    if gptoss(spec):
        W, y = spec["sliding_window"], GPTOSS["yarn"]
        parts.append(
            f"gpt-oss mechanics: add_bias_linear (random biases on linear_qkv, linear_proj, the router and every "
            f"expert's linear_fc1 / linear_fc2); attention sinks (softmax_type='learnable', "
            f"self_attention.core_attention.softmax_offset [heads], split over TP by heads; HF self_attn.sinks); "
            f"sliding window window_size=({W - 1}, 0) with window_attn_skip_freq=2 on layers {window_layers(spec)} "
            f"(HF sliding_window {W}, layer_types sliding/full alternating); quick-GeGLU experts "
            f"(activation_func=quick_gelu, glu_linear_offset {GPTOSS['glu_linear_offset']}, "
            f"activation_func_clamp_value {GPTOSS['clamp']}, bias_activation_fusion=False; experts' fc1 scaled by "
            f"{spec['fc1_scale']} so that the clamp changes some values: activation_clamp); YaRN RoPE "
            f"(position_embedding_type 'yarn', rotary_base {GPTOSS['rotary_base']}, scaling factor "
            f"{y['rotary_scaling_factor']}, original max positions {y['original_max_position_embeddings']}, beta "
            f"fast/slow {y['beta_fast']}/{y['beta_slow']}, correction range not rounded; HF truncate false); RMSNorm "
            f"eps {dm['norm_epsilon']}; untied embeddings. HF gpt_oss on-disk layout: experts stacked "
            f"(mlp.experts.gate_up_proj [E, H, 2F] with gate/up columns interleaved, down_proj [E, F, H], their "
            f"biases).")
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
        f"built with is_expert=True), filtered, legacy, iter {lib.LORA_ITER} + stale "
        f"iter_{lib.STALE_LORA_ITER:07d}; targets {TARGETS} wrap every expert's linear_fc1/linear_fc2"
        + (" and the shared expert's" if spec["shared"] else "") + " (not the router). "
        "logits.pt = real Megatron forward with (logits_lora) and without (logits_base) LoRA.")
    return " ".join(parts)


FAMILY = MoE()
