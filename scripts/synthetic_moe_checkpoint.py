"""Write a synthetic Mixture-of-Experts Megatron-Core legacy checkpoint (base + filtered LoRA) with
Qwen3-30B-A3B layer shapes (hidden 2048, 32 heads, 4 query groups, head_dim 128, 128 experts, expert ffn
768, vocab 151936, bf16) at expert parallelism EP, in either expert layout:

  sequential  SequentialMLP experts (`local_experts.{k}.linear_fc1/fc2`) with PEFT's per-expert LoRA
  grouped     GroupedMLP (`mlp.experts.weight1/weight2`) with MindSpeed's grouped LoRA (`weight1_lora_a` …)

Every EP rank's file repeats the dense part (embedding, attention, output layer), as Megatron writes it.
For benchmarks at realistic sizes; correctness is proven on the real-Megatron fixtures in tests/fixtures_moe.

    python scripts/synthetic_moe_checkpoint.py OUT --layers 2 --ep 4 --layout grouped
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

SHAPES = dict(hidden=2048, heads=32, groups=4, head_dim=128, experts=128, ffn=768, vocab=151936)


def _args(d, layers, ep, padded, grouped, lora):
    return argparse.Namespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, num_layers=layers, hidden_size=d["hidden"],
        ffn_hidden_size=6144, num_attention_heads=d["heads"], group_query_attention=True,
        num_query_groups=d["groups"], kv_channels=d["head_dim"], padded_vocab_size=padded, add_qkv_bias=False,
        add_bias_linear=False, qk_layernorm=True, swiglu=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", params_dtype=torch.bfloat16, bf16=True, fp16=False, ckpt_format="torch",
        num_experts=d["experts"], moe_ffn_hidden_size=d["ffn"], moe_router_topk=8, moe_router_pre_softmax=False,
        moe_layer_freq=1, moe_grouped_gemm=grouped, rotary_base=1000000, norm_epsilon=1e-6,
        lora_r=8 if lora else None, lora_alpha=16 if lora else None,
        lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] if lora else [],
    )


_drawn = iter(range(1 << 62))  # each tensor its own slice of the value pool


def _rand(*shape):
    return normal_like(shape, torch.bfloat16, key=next(_drawn))


def write_checkpoint(out: Path, layers: int = 2, ep: int = 4, layout: str = "grouped", r: int = 8) -> dict:
    d, grouped = SHAPES, layout == "grouped"
    h, f, local = d["hidden"], d["ffn"], d["experts"] // ep
    q, kv = d["heads"] * d["head_dim"], d["groups"] * d["head_dim"]
    padded = -(-d["vocab"] // 128) * 128
    torch.manual_seed(0)
    dense = {"embedding.word_embeddings.weight": _rand(padded, h), "decoder.final_layernorm.weight": _rand(h) + 1,
             "output_layer.weight": _rand(padded, h)}
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        dense.update({pre + "input_layernorm.weight": _rand(h) + 1, pre + "pre_mlp_layernorm.weight": _rand(h) + 1,
                      pre + "self_attention.linear_qkv.weight": _rand(q + 2 * kv, h),
                      pre + "self_attention.linear_proj.weight": _rand(h, q),
                      pre + "self_attention.q_layernorm.weight": _rand(d["head_dim"]) + 1,
                      pre + "self_attention.k_layernorm.weight": _rand(d["head_dim"]) + 1,
                      pre + "mlp.router.weight": _rand(d["experts"], h)})
    dense_lora = {}
    for i in range(layers):
        pre = f"decoder.layers.{i}.self_attention."
        dense_lora.update({pre + "linear_qkv.lora_A.default.weight": _rand(r, h),
                           pre + "linear_qkv.lora_B.default.weight": _rand(q + 2 * kv, r),
                           pre + "linear_proj.lora_A.default.weight": _rand(r, q),
                           pre + "linear_proj.lora_B.default.weight": _rand(h, r)})
    for kind in ("base", "lora"):
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / "latest_checkpointed_iteration.txt").write_text("1")
        for e in range(ep):
            model = dict(dense if kind == "base" else dense_lora)
            for i in range(layers):
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
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": h,
              "intermediate_size": 6144, "moe_intermediate_size": f, "num_experts": d["experts"],
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": layers, "num_attention_heads": d["heads"], "num_key_value_heads": d["groups"],
              "head_dim": d["head_dim"], "vocab_size": d["vocab"], "tie_word_embeddings": False,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
              "torch_dtype": "bfloat16"}
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--layout", choices=["sequential", "grouped"], default="grouped")
    args = p.parse_args()
    write_checkpoint(args.out, args.layers, args.ep, args.layout)


if __name__ == "__main__":
    main()
