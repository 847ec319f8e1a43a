"""Write a synthetic gpt-oss-20b-shaped HF model in its release's form (hidden 2880, 64 heads / 8 kv heads of 64,
32 experts of ffn 2880 stored as MXFP4 `_blocks`/`_scales`, everything else bf16, vocab 201088) and a PEFT adapter
(r=16, alpha 32) on q_proj and, through target_parameters, on every expert's gate_up_proj and down_proj, named as
PEFT 0.21 saves it (the two parameter wrappers nested, gate_up_proj innermost). For benchmarks at realistic sizes;
correctness is proven on tiny models in tests/test_gpt_oss.py.

    python scripts/synthetic_gpt_oss_checkpoint.py OUT --layers 2      # OUT/base, OUT/adapter
    python scripts/synthetic_gpt_oss_checkpoint.py OUT --layers 1 --experts 128   # gpt-oss-120b's layer shapes
    python scripts/synthetic_gpt_oss_checkpoint.py OUT --megatron 4   # also OUT/mcore (that base as Megatron, bf16,
                                                                      # EP 4) and OUT/mcore_lora (its Megatron LoRA)

With --megatron EP the HF base is converted by lora-merge itself (`--to megatron`, ETP 1) and a Megatron LoRA (r=16,
alpha 32, legacy, MindSpeed's names) is written beside it on linear_qkv and every expert's linear_fc1/linear_fc2.
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
    ap.add_argument("--megatron", type=int, metavar="EP", help="also the base as a Megatron checkpoint at this EP, "
                    "with a Megatron LoRA")
    opts = ap.parse_args()
    make(opts.out, opts.layers, opts.experts)
    if opts.megatron:
        make_megatron(opts.out, opts.layers, opts.experts, opts.megatron)


def make_megatron(out: Path, layers: int, E: int, ep: int) -> None:  # noqa: N803
    import sys

    sys.path.insert(0, str(ROOT))
    import lora_merge

    lora_merge.to_megatron(base=out / "base", out=out / "mcore", ep=ep, etp=1, dtype="bfloat16", warn=lambda m: None)
    g = torch.Generator().manual_seed(1)

    def small(*shape):
        return (torch.randn(*shape, generator=g) * 0.01).to(torch.bfloat16)

    local = E // ep
    for rank_file in sorted((out / "mcore/release").glob("mp_rank_*/model_optim_rng.pt")):
        state = torch.load(rank_file, weights_only=False, mmap=True)
        args = state["args"]
        vars(args).update(lora_r=R, lora_alpha=2 * R, lora_target_modules=["linear_qkv", "linear_fc1", "linear_fc2"])
        model = {}
        for i in range(layers):
            p = f"decoder.layers.{i}."
            model[p + "self_attention.linear_qkv.lora_A.default.weight"] = small(R, H)
            model[p + "self_attention.linear_qkv.lora_B.default.weight"] = small((NH + 2 * NKV) * D, R)
            for k in range(local):
                x = f"{p}mlp.experts.local_experts.{k}."
                model[x + "linear_fc1.lora_A.default.weight"] = small(R, H)
                model[x + "linear_fc1.lora_B.default.weight"] = small(2 * F, R)
                model[x + "linear_fc2.lora_A.default.weight"] = small(R, F)
                model[x + "linear_fc2.lora_B.default.weight"] = small(H, R)
        target = out / "mcore_lora/iter_0000010" / rank_file.parent.name / rank_file.name
        target.parent.mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": model}, target)
    (out / "mcore_lora/latest_checkpointed_iteration.txt").write_text("10")


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
