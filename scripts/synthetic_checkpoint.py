"""Write a synthetic Megatron-Core legacy checkpoint (base + filtered LoRA) and its HF reference config,
with the per-rank shapes and names real MindSpeed-LLM runs produce, filled with random values.

For benchmarks and kill tests at realistic sizes; correctness is proven on the real-Megatron fixtures.

    python scripts/synthetic_checkpoint.py OUT --layers 2 --preset qwen32b --tp 4
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

PRESETS = {
    # DeepSeek-R1-Distill-Qwen-32B layer shapes
    "qwen32b": dict(hidden=5120, heads=40, groups=8, ffn=27648, vocab=152064),
    "small": dict(hidden=512, heads=8, groups=4, ffn=2048, vocab=32000),
}
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _args(d, layers, tp, pp, dtype, padded_vocab, lora_r=None, lora_alpha=None):
    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers=layers, hidden_size=d["hidden"], ffn_hidden_size=d["ffn"], num_attention_heads=d["heads"],
        group_query_attention=True, num_query_groups=d["groups"], kv_channels=d["hidden"] // d["heads"],
        padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128, add_qkv_bias=True, add_bias_linear=False,
        swiglu=True, untie_embeddings_and_output_weights=True, normalization="RMSNorm", params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=False, ckpt_format="torch", lora_r=lora_r, lora_alpha=lora_alpha,
        lora_target_modules=LORA_TARGETS if lora_r else [],
    )


_drawn = iter(range(1 << 62))  # each tensor its own slice of the value pool


def _rand(gen, *shape, dtype, std=0.02):
    return normal_like(shape, dtype, std, key=next(_drawn))


def write_checkpoint(out: Path, preset: str = "qwen32b", layers: int = 2, tp: int = 4, pp: int = 1,
                     dtype: torch.dtype = torch.bfloat16, r: int = 8, alpha: float = 16.0, seed: int = 0) -> dict:
    d = PRESETS[preset]
    head_dim = d["hidden"] // d["heads"]
    qkv = (d["heads"] + 2 * d["groups"]) * head_dim
    unit = 128 * tp
    padded = -(-d["vocab"] // unit) * unit
    per_stage = layers // pp
    gen = torch.Generator().manual_seed(seed)
    for kind in ("base", "lora"):
        it = out / kind / "iter_0000001"
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / "latest_checkpointed_iteration.txt").write_text("1")
        for p in range(pp):
            for t in range(tp):
                model = {}
                for local in range(per_stage):
                    pre = f"decoder.layers.{local}."
                    if kind == "base":
                        model[pre + "input_layernorm.weight"] = torch.ones(d["hidden"], dtype=dtype)
                        model[pre + "self_attention.linear_qkv.weight"] = _rand(gen, qkv // tp, d["hidden"], dtype=dtype)
                        model[pre + "self_attention.linear_qkv.bias"] = _rand(gen, qkv // tp, dtype=dtype)
                        model[pre + "self_attention.linear_proj.weight"] = _rand(gen, d["hidden"], d["heads"] * head_dim // tp, dtype=dtype)
                        model[pre + "pre_mlp_layernorm.weight"] = torch.ones(d["hidden"], dtype=dtype)
                        model[pre + "mlp.linear_fc1.weight"] = _rand(gen, 2 * d["ffn"] // tp, d["hidden"], dtype=dtype)
                        model[pre + "mlp.linear_fc2.weight"] = _rand(gen, d["hidden"], d["ffn"] // tp, dtype=dtype)
                    else:
                        shapes = {"self_attention.linear_qkv": ((r, d["hidden"]), (qkv // tp, r)),
                                  "self_attention.linear_proj": ((r, d["heads"] * head_dim // tp), (d["hidden"], r)),
                                  "mlp.linear_fc1": ((r, d["hidden"]), (2 * d["ffn"] // tp, r)),
                                  "mlp.linear_fc2": ((r, d["ffn"] // tp), (d["hidden"], r))}
                        for module, (a_shape, b_shape) in shapes.items():
                            # column layers share A across TP ranks, row layers B: the same key gives the same values
                            row = module.endswith(("linear_proj", "linear_fc2"))
                            a_key, b_key = (seed, p, local, module, "A", t if row else None), \
                                (seed, p, local, module, "B", None if row else t)
                            model[f"{pre}{module}.lora_A.default.weight"] = normal_like(a_shape, dtype, key=a_key)
                            model[f"{pre}{module}.lora_B.default.weight"] = normal_like(b_shape, dtype, key=b_key)
                            model[f"{pre}{module}.lora_B.default._extra_state"] = None
                if kind == "base" and p == 0:
                    model["embedding.word_embeddings.weight"] = _rand(gen, padded // tp, d["hidden"], dtype=dtype)
                if kind == "base" and p == pp - 1:
                    model["decoder.final_layernorm.weight"] = torch.ones(d["hidden"], dtype=dtype)
                    model["output_layer.weight"] = _rand(gen, padded // tp, d["hidden"], dtype=dtype)
                args = _args(d, layers, tp, pp, dtype, padded, *((r, alpha) if kind == "lora" else ()))
                rank_dir = it / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                rank_dir.mkdir(parents=True, exist_ok=True)
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model},
                           rank_dir / "model_optim_rng.pt")
                del model
    hf = out / "hf_ref"
    hf.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": d["hidden"],
              "intermediate_size": d["ffn"], "num_hidden_layers": layers, "num_attention_heads": d["heads"],
              "num_key_value_heads": d["groups"], "vocab_size": d["vocab"], "tie_word_embeddings": False,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
              "torch_dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]}
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--preset", choices=PRESETS, default="qwen32b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    write_checkpoint(args.out, args.preset, args.layers, args.tp, args.pp, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
