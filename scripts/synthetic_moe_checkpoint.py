"""Write a synthetic Mixture-of-Experts Megatron-Core legacy checkpoint (base + filtered LoRA) with
Qwen3-30B-A3B layer shapes (hidden 2048, 32 heads, 4 query groups, head_dim 128, q/k norms, 128 experts,
expert ffn 768, vocab 151936, bf16) or, with `--family glm4.5-air`, GLM-4.5-Air's (hidden 4096, 96 heads, 8
query groups, head_dim 128, q/k/v biases, partial RoPE 0.5, layer 0 dense with ffn 10944, then 128 experts of
ffn 1408 with a shared expert of 1408, sigmoid routing with an fp32 expert bias, vocab 151552) at expert
parallelism EP, in either expert layout:

  sequential  SequentialMLP experts (`local_experts.{k}.linear_fc1/fc2`) with PEFT's per-expert LoRA
  grouped     GroupedMLP (`mlp.experts.weight1/weight2`) with MindSpeed's grouped LoRA (`weight1_lora_a` …)

Every EP rank's file repeats the dense part (embedding, attention, output layer), as Megatron writes it.
For benchmarks at realistic sizes; correctness is proven on the real-Megatron fixtures in tests/fixtures_moe.

    python scripts/synthetic_moe_checkpoint.py OUT --layers 2 --ep 4 --layout grouped [--family glm4.5-air]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

try:
    from synthetic_values import normal_like
except ImportError:  # imported as scripts.<module>
    from scripts.synthetic_values import normal_like

QWEN3_30B = dict(hidden=2048, heads=32, groups=4, head_dim=128, experts=128, ffn=768, vocab=151936, dense_ffn=6144,
                 qkv_bias=False, qk_norm=True, dense_layers=0, shared_ffn=0, sigmoid=False, rotary_percent=1.0)
GLM45_AIR = dict(hidden=4096, heads=96, groups=8, head_dim=128, experts=128, ffn=1408, vocab=151552, dense_ffn=10944,
                 qkv_bias=True, qk_norm=False, dense_layers=1, shared_ffn=1408, sigmoid=True, rotary_percent=0.5)
FAMILIES = {"qwen3-30b": QWEN3_30B, "glm4.5-air": GLM45_AIR}


def _args(d, layers, ep, padded, grouped, lora):
    moe_freq = [int(i >= d["dense_layers"]) for i in range(layers)] if d["dense_layers"] else 1
    router = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=1.0, moe_router_dtype="fp32") if d["sigmoid"] else {}
    return argparse.Namespace(**router,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, num_layers=layers, hidden_size=d["hidden"],
        ffn_hidden_size=d["dense_ffn"], num_attention_heads=d["heads"], group_query_attention=True,
        num_query_groups=d["groups"], kv_channels=d["head_dim"], padded_vocab_size=padded, add_qkv_bias=d["qkv_bias"],
        add_bias_linear=False, qk_layernorm=d["qk_norm"], swiglu=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", params_dtype=torch.bfloat16, bf16=True, fp16=False, ckpt_format="torch",
        num_experts=d["experts"], moe_ffn_hidden_size=d["ffn"], moe_router_topk=8, moe_router_pre_softmax=False,
        moe_layer_freq=moe_freq, moe_grouped_gemm=grouped, rotary_base=1000000, norm_epsilon=1e-6,
        rotary_percent=d["rotary_percent"], moe_shared_expert_intermediate_size=d["shared_ffn"] or None,
        lora_r=8 if lora else None, lora_alpha=16 if lora else None,
        lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] if lora else [],
    )


_drawn = iter(range(1 << 62))  # each tensor its own slice of the value pool


def _rand(*shape):
    return normal_like(shape, torch.bfloat16, key=next(_drawn))


def write_checkpoint(out: Path, layers: int = 2, ep: int = 4, layout: str = "grouped", r: int = 8,
                     family: str = "qwen3-30b") -> dict:
    d, grouped = FAMILIES[family], layout == "grouped"
    h, f, local = d["hidden"], d["ffn"], d["experts"] // ep
    q, kv = d["heads"] * d["head_dim"], d["groups"] * d["head_dim"]
    padded = -(-d["vocab"] // 128) * 128
    torch.manual_seed(0)
    dense = {"embedding.word_embeddings.weight": _rand(padded, h), "decoder.final_layernorm.weight": _rand(h) + 1,
             "output_layer.weight": _rand(padded, h)}
    moe_layers = range(d["dense_layers"], layers)
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        dense.update({pre + "input_layernorm.weight": _rand(h) + 1, pre + "pre_mlp_layernorm.weight": _rand(h) + 1,
                      pre + "self_attention.linear_qkv.weight": _rand(q + 2 * kv, h),
                      pre + "self_attention.linear_proj.weight": _rand(h, q)})
        if d["qkv_bias"]:
            dense[pre + "self_attention.linear_qkv.bias"] = _rand(q + 2 * kv)
        if d["qk_norm"]:
            dense.update({pre + "self_attention.q_layernorm.weight": _rand(d["head_dim"]) + 1,
                          pre + "self_attention.k_layernorm.weight": _rand(d["head_dim"]) + 1})
        if i not in moe_layers:
            dense.update({pre + "mlp.linear_fc1.weight": _rand(2 * d["dense_ffn"], h),
                          pre + "mlp.linear_fc2.weight": _rand(h, d["dense_ffn"])})
            continue
        dense[pre + "mlp.router.weight"] = _rand(d["experts"], h)
        if d["sigmoid"]:
            dense[pre + "mlp.router.expert_bias"] = _rand(d["experts"]).float()
        if d["shared_ffn"]:
            dense.update({pre + "mlp.shared_experts.linear_fc1.weight": _rand(2 * d["shared_ffn"], h),
                          pre + "mlp.shared_experts.linear_fc2.weight": _rand(h, d["shared_ffn"])})
    dense_lora = {}
    for i in range(layers):
        pre = f"decoder.layers.{i}.self_attention."
        dense_lora.update({pre + "linear_qkv.lora_A.default.weight": _rand(r, h),
                           pre + "linear_qkv.lora_B.default.weight": _rand(q + 2 * kv, r),
                           pre + "linear_proj.lora_A.default.weight": _rand(r, q),
                           pre + "linear_proj.lora_B.default.weight": _rand(h, r)})
        # the MLPs outside the routed experts: the dense layers' and the shared experts'
        mlp = f"decoder.layers.{i}.mlp." if i not in moe_layers else \
            f"decoder.layers.{i}.mlp.shared_experts." if d["shared_ffn"] else None
        ffn = d["dense_ffn"] if i not in moe_layers else d["shared_ffn"]
        if mlp is not None:
            dense_lora.update({mlp + "linear_fc1.lora_A.default.weight": _rand(r, h),
                               mlp + "linear_fc1.lora_B.default.weight": _rand(2 * ffn, r),
                               mlp + "linear_fc2.lora_A.default.weight": _rand(r, ffn),
                               mlp + "linear_fc2.lora_B.default.weight": _rand(h, r)})
    for kind in ("base", "lora"):
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / "latest_checkpointed_iteration.txt").write_text("1")
        for e in range(ep):
            model = dict(dense if kind == "base" else dense_lora)
            for i in moe_layers:
                pre = f"decoder.layers.{i}.mlp.experts."
                if kind == "base" and grouped:
                    model[pre + "weight1"] = _rand(local, h, 2 * f).view(h, local * 2 * f)
                    model[pre + "weight2"] = _rand(local, f, h).view(local * f, h)
                elif kind == "base":
                    for k in range(local):
                        model[f"{pre}local_experts.{k}.linear_fc1.weight"] = _rand(2 * f, h)
                        model[f"{pre}local_experts.{k}.linear_fc2.weight"] = _rand(h, f)
                elif grouped:
                    model[pre + "weight1_lora_a"] = _rand(local, h, r).view(h, r * local)
                    model[pre + "weight1_lora_b"] = _rand(local, r, 2 * f).view(r, local * 2 * f)
                    model[pre + "weight2_lora_a"] = _rand(local, f, r).view(local * f, r)
                    model[pre + "weight2_lora_b"] = _rand(local, r, h).view(r * local, h)
                else:
                    for k in range(local):
                        for fc, a, b in (("linear_fc1", (r, h), (2 * f, r)), ("linear_fc2", (r, f), (h, r))):
                            model[f"{pre}local_experts.{k}.{fc}.lora_A.default.weight"] = _rand(*a)
                            model[f"{pre}local_experts.{k}.{fc}.lora_B.default.weight"] = _rand(*b)
            rank_dir = out / kind / "iter_0000001" / f"mp_rank_00_{e:03d}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"args": _args(d, layers, ep, padded, grouped, kind == "lora"), "checkpoint_version": 3.0,
                        "iteration": 1, "model": model}, rank_dir / "model_optim_rng.pt")
    hf = out / "hf_ref"
    hf.mkdir(parents=True, exist_ok=True)
    common = {"hidden_size": h, "intermediate_size": d["dense_ffn"], "moe_intermediate_size": f,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": layers,
              "num_attention_heads": d["heads"], "num_key_value_heads": d["groups"], "head_dim": d["head_dim"],
              "vocab_size": d["vocab"], "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    if family == "glm4.5-air":
        config = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
                  "n_routed_experts": d["experts"], "n_shared_experts": 1, "first_k_dense_replace": d["dense_layers"],
                  "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "attention_bias": True,
                  "use_qk_norm": False, "partial_rotary_factor": d["rotary_percent"], "num_nextn_predict_layers": 0}
    else:
        config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                  "num_experts": d["experts"], "decoder_sparse_step": 1, "mlp_only_layers": []}
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--layout", choices=["sequential", "grouped"], default="grouped")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3-30b")
    args = p.parse_args()
    write_checkpoint(args.out, args.layers, args.ep, args.layout, family=args.family)


if __name__ == "__main__":
    main()
