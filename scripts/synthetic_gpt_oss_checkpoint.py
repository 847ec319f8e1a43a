"""Write a synthetic gpt-oss-20b-shaped HF model in its release's form (hidden 2880, 64 heads / 8 kv heads of 64,
32 experts of ffn 2880 stored as MXFP4 `_blocks`/`_scales`, everything else bf16, vocab 201088) and a PEFT adapter
(r=16, alpha 32) on q_proj and, through target_parameters, on every expert's gate_up_proj and down_proj, named as
PEFT 0.21 saves it (the two parameter wrappers nested, gate_up_proj innermost). For benchmarks at realistic sizes;
correctness is proven on tiny models in tests/test_gpt_oss.py.

    python scripts/synthetic_gpt_oss_checkpoint.py OUT --layers 2      # OUT/base, OUT/adapter
    python scripts/synthetic_gpt_oss_checkpoint.py OUT --layers 1 --experts 128   # gpt-oss-120b's layer shapes
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "tests/data/published_configs/openai__gpt-oss-20b.json"
TOKENIZER = ROOT / "tests/fixtures_moe/qwen3moe_ep2/hf_ref"
H, E, F, V, NH, NKV, D, R = 2880, 32, 2880, 201088, 64, 8, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=E, help="experts a layer (gpt-oss-20b: 32, gpt-oss-120b: 128)")
    opts = ap.parse_args()
    make(opts.out, opts.layers, opts.experts)


def make(out: Path, layers: int, E: int) -> None:  # noqa: N803  (E: the experts, as the module's shapes are named)
    base, adapter = out / "base", out / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)

    def bf(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": bf(V, H), "lm_head.weight": bf(V, H), "model.norm.weight": bf(H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                            ("self_attn.q_proj.weight", (NH * D, H)), ("self_attn.q_proj.bias", (NH * D,)),
                            ("self_attn.k_proj.weight", (NKV * D, H)), ("self_attn.k_proj.bias", (NKV * D,)),
                            ("self_attn.v_proj.weight", (NKV * D, H)), ("self_attn.v_proj.bias", (NKV * D,)),
                            ("self_attn.o_proj.weight", (H, NH * D)), ("self_attn.o_proj.bias", (H,)),
                            ("self_attn.sinks", (NH,)), ("mlp.router.weight", (E, H)), ("mlp.router.bias", (E,)),
                            ("mlp.experts.gate_up_proj_bias", (E, 2 * F)), ("mlp.experts.down_proj_bias", (E, H))):
            t[p + name] = bf(*shape)
        for name, rows, cols in (("gate_up_proj", 2 * F, H), ("down_proj", H, F)):  # [E, out, in/32, 16]
            t[f"{p}mlp.experts.{name}_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8,
                                                               generator=g)
            t[f"{p}mlp.experts.{name}_scales"] = torch.randint(118, 126, (E, rows, cols // 32), dtype=torch.uint8,
                                                               generator=g)
    save_file(t, base / "model.safetensors", metadata={"format": "pt"})
    config = json.loads(PUBLISHED.read_text())
    config.update(num_hidden_layers=layers, num_local_experts=E,
                  layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"]
                  * (layers % 2))
    (base / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER.glob("tokenizer*"):
        shutil.copy(f, base / f.name)

    factors = {}
    for i in range(layers):
        p = f"base_model.model.model.layers.{i}."
        for name, shape in (("self_attn.q_proj.lora_A.weight", (R, H)), ("self_attn.q_proj.lora_B.weight", (NH * D, R)),
                            ("mlp.experts.base_layer.lora_A.weight", (E * R, H)),  # gate_up_proj
                            ("mlp.experts.base_layer.lora_B.weight", (2 * F, R * E)),
                            ("mlp.experts.lora_A.weight", (E * R, F)), ("mlp.experts.lora_B.weight", (H, R * E))):
            factors[p + name] = torch.randn(*shape, generator=g) * 0.01
    save_file(factors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "rank_pattern": {},
        "alpha_pattern": {}, "base_model_name_or_path": None, "task_type": None, "peft_version": "0.21.2"}))


if __name__ == "__main__":
    main()
