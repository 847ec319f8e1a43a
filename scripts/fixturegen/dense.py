"""Dense fixtures (tests/fixtures): Qwen2-, Llama- and Qwen3-like Megatron-Core GPTModels.

``get_gpt_layer_local_spec`` (RMSNorm, rope, swiglu, GQA, optional qkv bias); every fixture's LoRA at
iteration 10 (filtered like ``--lora-ckpt-filter`` or unfiltered) next to a stale iteration 5.  The fp32
Qwen2-like 4-layer fixtures (tp2, pp2, tp2pp2, dist_*, vpp2, uneven) hold the same model and the same
LoRA (values are seeded per tensor name); their logits agree to float rounding.

Variants: ``base_format="torch_dist"`` saves the base with ``megatron.core.dist_checkpointing.save`` as
Megatron-LM's training loop does (optionally with the ``singleton_local_shards`` sharded-state-dict
metadata); ``vpp`` builds that many model chunks per pipeline rank (saved as ``model0``, ``model1``, ...;
forward run chunk by chunk in the interleaved order); ``first_stage_layers`` sets
``num_layers_in_first_pipeline_stage`` (uneven split); ``tied`` shares the embedding and output weights
(the last stage keeps its own copy, synchronised by Megatron's embedding-group all-reduce); family
``qwen3`` adds q/k layernorms and a head_dim with heads*head_dim != hidden.  The bf16 fixture's logits
come from an fp32 forward of a model holding exactly the stored bf16 values.

First-generation fixtures (``gen=1``) keep their exact args and file contents; no HF check here
(scripts/check_fixture_by_hand.py is the independent one).
"""

from __future__ import annotations

from fixturegen import library as lib

MODEL = lib.TINY
ALL_TARGETS = lib.GQA_TARGETS

# seeds: the Qwen2-like fixtures share one base model and one LoRA; llama and qwen3 have their own.
QWEN2 = dict(pp=1, dtype="float32", lora="filtered", family="qwen2", targets=ALL_TARGETS, base_seed=1000,
             lora_seed=2000, gen=1)
LLAMA = dict(QWEN2, family="llama")
BUILT = {
    "tp2_fp32_filtered": dict(QWEN2, tp=2),
    "pp2_fp32_unfiltered": dict(QWEN2, tp=1, pp=2, lora="unfiltered"),
    "tp2pp2_fp32_filtered": dict(QWEN2, tp=2, pp=2),
    "tp2pp2_bf16_unfiltered": dict(QWEN2, tp=2, pp=2, dtype="bfloat16", lora="unfiltered"),
    "tp2_llama_fp32_partial": dict(LLAMA, tp=2, targets=["linear_qkv", "linear_fc2"], base_seed=3000, lora_seed=4000),
    # ---- second generation: torch_dist bases, VPP, uneven PP, tied embeddings, Qwen3 ----
    "dist_tp2pp2_fp32": dict(QWEN2, tp=2, pp=2, gen=2, base_format="torch_dist"),
    "dist_singleton_tp2_fp32": dict(QWEN2, tp=2, gen=2, base_format="torch_dist", singleton=True),
    "vpp2_fp32_filtered": dict(QWEN2, tp=1, pp=2, vpp=2, gen=2),
    "uneven_pp2_fp32": dict(QWEN2, tp=1, pp=2, first_stage_layers=1, gen=2),
    "tied_pp2_llama_fp32": dict(LLAMA, tp=1, pp=2, tied=True, lora="unfiltered", base_seed=5000, lora_seed=6000, gen=2),
    "qwen3_tp2_fp32": dict(QWEN2, tp=2, kv_channels=16, family="qwen3", base_seed=7000, lora_seed=8000, gen=2),
}


def dims(spec: dict) -> dict:
    """MODEL with the spec's overrides (num_layers, kv_channels)."""
    return dict(MODEL, **{k: spec[k] for k in ("num_layers", "kv_channels") if k in spec})


def has_qkv_bias(spec: dict) -> bool:
    return spec["family"] == "qwen2"


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


class Dense(lib.Family):
    name = "dense"
    out = "tests/fixtures"
    built = BUILT

    dims = staticmethod(dims)

    def make_config(self, rk, **variant):
        from megatron.core.transformer.transformer_config import TransformerConfig

        spec, dm, kw = rk.spec, rk.dm, {}
        if rk.VPP:
            kw["virtual_pipeline_model_parallel_size"] = rk.VPP
        if spec.get("first_stage_layers") is not None:
            kw["num_layers_in_first_pipeline_stage"] = spec["first_stage_layers"]
        if spec["family"] == "qwen3":
            kw["qk_layernorm"] = True
        return TransformerConfig(**lib.config_kwargs(rk), num_query_groups=dm["num_query_groups"],
                                 kv_channels=dm["kv_channels"], add_qkv_bias=has_qkv_bias(spec), **kw)

    def layer_spec(self, rk, config, **variant):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if rk.spec["family"] == "qwen3":
            return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
        return get_gpt_layer_local_spec(normalization="RMSNorm")

    def canonical_base(self, torch, spec, vpad):
        return lib.canonical_gpt_base(torch, spec["base_seed"], has_qkv_bias(spec), vpad, dims(spec),
                                      qk_norm=spec["family"] == "qwen3", tied=spec.get("tied", False))

    def canonical_lora(self, torch, spec, seed):
        dm = dims(spec)
        return lib.lora_factors(torch, seed, {f"decoder.layers.{i}.{module_path(m)}": lora_io(m, dm)
                                              for i in range(dm["num_layers"]) for m in spec["targets"]})

    def make_args(self, torch, spec, iteration, world, lora, filtered, load, save):
        return lib.megatron_args(torch, spec, dims(spec), iteration, world, lora=lora, lora_filter=filtered,
                                 load=load, save=save)

    def after_base_save(self, rk, base_sd):
        if rk.tied and rk.chunk_last[-1]:
            sd = base_sd[-1] if rk.VPP else base_sd
            rk.extra["tied_last_stage_has_output_layer"] = "output_layer.weight" in sd
            if "output_layer.weight" in sd:
                rk.extra["tied_output_layer_equals_embedding"] = bool(
                    rk.torch.equal(sd["output_layer.weight"], rk.embedding_shard()))

    def peft_layout(self, rk):
        """What PEFT 0.7.1 really built on megatron-core 0.16.1: column linears get a replicated
        nn.Linear A and a ColumnParallelLinear B, row linears a RowParallelLinear A and a replicated B."""
        import torch
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        layout_info, TP = {}, rk.TP
        for mname, mod in rk.model.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                short = mname.split(".")[-1]
                A, Bm = mod.lora_A["default"], mod.lora_B["default"]
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
                fin, fout = lora_io(short, rk.dm)
                if isinstance(mod.base_layer, RowParallelLinear):
                    assert isinstance(A, RowParallelLinear) and isinstance(Bm, torch.nn.Linear), li
                    assert li["A_shape"] == (lib.LORA_R, fin // TP) and li["A_partition_dim"] == 1, li
                    assert li["B_shape"] == (fout, lib.LORA_R), li
                else:
                    assert isinstance(mod.base_layer, ColumnParallelLinear)
                    assert isinstance(A, torch.nn.Linear) and isinstance(Bm, ColumnParallelLinear), li
                    assert li["A_shape"] == (lib.LORA_R, fin), li
                    assert li["B_shape"] == (fout // TP, lib.LORA_R) and li["B_partition_dim"] == 0, li
                assert li["scaling"] == lib.LORA_ALPHA / lib.LORA_R
                layout_info.setdefault(short, li)
        return layout_info, []

    def extra_forwards(self, rk):
        """bf16 fixtures: the same LoRA forward in real bf16 (for information only)."""
        torch, dist, ps, dm = rk.torch, rk.dist, rk.ps, rk.dm
        bf16_diff = None
        if rk.bf16:
            assert not rk.VPP
            rk.model.bfloat16()
            rk.peft_models[0].bfloat16()
            # pipeline send/recv buffers are fp32 in forward(); cast the received tensor on use
            with torch.no_grad():
                if not rk.first:
                    recv = torch.empty(dm["seq_length"], lib.BATCH, dm["hidden_size"], dtype=torch.float32)
                    dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                    rk.model.set_input_tensor(recv.to(torch.bfloat16))
                res = rk.model(input_ids=rk.input_ids if rk.first else None, position_ids=rk.position_ids,
                               attention_mask=rk.mask, runtime_gather_output=True)
                if not rk.last:
                    dist.send(res.float().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                else:
                    bf16_diff = (res[..., : dm["vocab_size"]].float() - rk.logits_lora).abs().max().item()
        rk.extra["real_bf16_forward_vs_fp32_max_abs"] = bf16_diff

    def hf_config(self, spec):
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        dm = dims(spec)
        common = dict(lib.hf_common(dm, spec["dtype"], bool(spec.get("tied", False))),
                      intermediate_size=dm["ffn_hidden_size"], rope_theta=float(dm["rotary_base"]))
        if spec["family"] == "qwen2":
            return Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
        if spec["family"] == "qwen3":
            return Qwen3Config(architectures=["Qwen3ForCausalLM"], attention_bias=False,
                               head_dim=dm["kv_channels"], **common)
        return LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False,
                           head_dim=dm["kv_channels"], **common)

    def fixture_json(self, torch, name, spec, d, summary, opts):
        extra = {}
        if spec["gen"] >= 2:
            desc, extra = describe_gen2(spec, summary)
        else:
            desc = describe_gen1(spec, summary)
        return dict(
            tp=spec["tp"],
            pp=spec["pp"],
            dtype=spec["dtype"],
            lora=spec["lora"],
            r=lib.LORA_R,
            alpha=lib.LORA_ALPHA,
            targets=list(spec["targets"]),
            model_type=spec["family"],
            vocab_size=MODEL["vocab_size"],
            padded_vocab_size=lib.padded_vocab(spec["tp"]),
            base_iteration=lib.BASE_ITER,
            lora_iteration=lib.LORA_ITER,
            stale_lora_iteration=lib.STALE_LORA_ITER,
            logits_computed_in="float32" + (" on bf16-rounded weights" if spec["dtype"] == "bfloat16" else ""),
            **extra,
            description=desc,
        )


def describe_gen1(spec: dict, summary: dict) -> str:
    desc = (
        f"{'Qwen2' if spec['family'] == 'qwen2' else 'Llama'}-like Megatron-Core GPTModel (local spec), "
        f"TP={spec['tp']} PP={spec['pp']}, {spec['dtype']} checkpoint; {MODEL['num_layers']} layers, "
        f"hidden {MODEL['hidden_size']}, heads {MODEL['num_attention_heads']}, query groups "
        f"{MODEL['num_query_groups']}, ffn {MODEL['ffn_hidden_size']}, vocab {MODEL['vocab_size']} "
        f"(padded {lib.padded_vocab(spec['tp'])}). base/ = base checkpoint (iter {lib.BASE_ITER}); lora/ = "
        f"PEFT 0.7.1 LoRA checkpoint ({spec['lora']}) at iter {lib.LORA_ITER} per "
        f"latest_checkpointed_iteration.txt, plus a stale iter_{lib.STALE_LORA_ITER:07d} with other "
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
    return desc


def describe_gen2(spec: dict, summary: dict):
    """(description, extra fixture.json fields) of a second-generation fixture."""
    dm = dims(spec)
    TP, PP, VPP = spec["tp"], spec["pp"], spec.get("vpp")
    fam = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[spec["family"]]
    dist_base = spec.get("base_format", "torch") == "torch_dist"
    lay = lib.layer_layout(spec, dm["num_layers"])
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
        f"vocab {dm['vocab_size']} (padded {lib.padded_vocab(TP)})"
        + (", qkv bias" if has_qkv_bias(spec) else ", no qkv bias")
        + (", q/k layernorm (RMSNorm over head_dim; heads*head_dim = "
           f"{dm['num_attention_heads'] * dm['kv_channels']} != hidden)" if spec["family"] == "qwen3" else "")
        + "."
    ]
    if dist_base:
        parts.append(
            f"base/ = torch_dist base checkpoint (iter {lib.BASE_ITER}) written by megatron-core 0.16.1 "
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
        parts.append(f"base/ = legacy base checkpoint (iter {lib.BASE_ITER}).")
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
        f"lora/ = PEFT 0.7.1 LoRA checkpoint, legacy format ({spec['lora']}) at iter {lib.LORA_ITER} per "
        f"latest_checkpointed_iteration.txt, plus a stale iter_{lib.STALE_LORA_ITER:07d} with other LoRA "
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


FAMILY = Dense()
