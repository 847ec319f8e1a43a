#!/usr/bin/env python
"""Oracle cross-check of the fixtures, independent of the lora_merge package.

For each fixture: read the Megatron shards by hand (following latest_checkpointed_iteration.txt),
merge LoRA shard by shard in float32 (column layers W_i + s * B_i @ A, row layers W_i + s * B @ A_i),
un-shard (qkv: concat ranks on dim 0 then view(NG, NH/NG + 2, D, H) -> q, k, v; fc1: split every
rank's [gate ; up] in halves; row layers: concat dim 1; embedding / output: concat dim 0 and trim
the vocab padding), load the result into the transformers model built from hf_ref/config.json
(float32, eager attention) and compare its logits with the real Megatron logits in logits.pt.

    python scripts/check_fixture_by_hand.py [tests/fixtures/NAME ...]   (default: every fixture)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
REPO_ROOT = Path(__file__).resolve().parent.parent


def read_tracker(root: Path) -> Path:
    it = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    return root / ("release" if it == "release" else f"iter_{int(it):07d}")


def load_shards(root: Path, tp: int, pp: int):
    """{(tp_rank, pp_rank): checkpoint dict}"""
    d = read_tracker(root)
    out = {}
    for p in range(pp):
        for t in range(tp):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            out[(t, p)] = torch.load(d / name / "model_optim_rng.pt", weights_only=False, map_location="cpu")
    return out


def hf_state_dict(base, lora, args, with_lora: bool, hf_vocab: int) -> dict:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    L, NH, NG, D, H = args.num_layers, args.num_attention_heads, args.num_query_groups, args.kv_channels, args.hidden_size
    lps = L // pp
    s = args.lora_alpha / args.lora_r if with_lora else 0.0
    f32 = lambda x: x.detach().to(torch.float32)  # noqa: E731

    def merged(t, p, local_prefix):
        """merged shard (t, p) of the weight at local_prefix (e.g. decoder.layers.0.self_attention.linear_qkv)"""
        W = f32(base[(t, p)]["model"][local_prefix + ".weight"])
        if not with_lora:
            return W
        lsd = lora[(t, p)]["model"]
        ka = local_prefix + ".lora_A.default.weight"
        if ka not in lsd:
            return W  # not a LoRA target
        if local_prefix + ".base_layer.weight" in lsd:  # unfiltered: check the base it carries
            assert torch.equal(lsd[local_prefix + ".base_layer.weight"], base[(t, p)]["model"][local_prefix + ".weight"])
        A, B = f32(lsd[ka]), f32(lsd[local_prefix + ".lora_B.default.weight"])
        # shard by shard: column -> B is this rank's rows, A replicated; row -> A is this rank's cols
        return W + s * (B @ A)

    out = {}
    for p in range(pp):
        for j in range(lps):
            i = p * lps + j
            lp = f"decoder.layers.{j}."
            hp = f"model.layers.{i}."
            sd0 = base[(0, p)]["model"]
            out[hp + "input_layernorm.weight"] = f32(sd0[lp + "input_layernorm.weight"])
            out[hp + "post_attention_layernorm.weight"] = f32(sd0[lp + "pre_mlp_layernorm.weight"])
            # qkv: concat ranks on dim 0 -> group-interleaved global
            qkv = torch.cat([merged(t, p, lp + "self_attention.linear_qkv") for t in range(tp)], 0)
            qkv = qkv.view(NG, NH // NG + 2, D, H)
            out[hp + "self_attn.q_proj.weight"] = qkv[:, : NH // NG].reshape(NH * D, H)
            out[hp + "self_attn.k_proj.weight"] = qkv[:, NH // NG].reshape(NG * D, H)
            out[hp + "self_attn.v_proj.weight"] = qkv[:, NH // NG + 1].reshape(NG * D, H)
            if args.add_qkv_bias:
                b = torch.cat([f32(base[(t, p)]["model"][lp + "self_attention.linear_qkv.bias"]) for t in range(tp)])
                b = b.view(NG, NH // NG + 2, D)
                out[hp + "self_attn.q_proj.bias"] = b[:, : NH // NG].reshape(-1)
                out[hp + "self_attn.k_proj.bias"] = b[:, NH // NG].reshape(-1)
                out[hp + "self_attn.v_proj.bias"] = b[:, NH // NG + 1].reshape(-1)
            out[hp + "self_attn.o_proj.weight"] = torch.cat(
                [merged(t, p, lp + "self_attention.linear_proj") for t in range(tp)], 1)
            fc1 = [merged(t, p, lp + "mlp.linear_fc1") for t in range(tp)]
            out[hp + "mlp.gate_proj.weight"] = torch.cat([x.chunk(2, 0)[0] for x in fc1], 0)
            out[hp + "mlp.up_proj.weight"] = torch.cat([x.chunk(2, 0)[1] for x in fc1], 0)
            out[hp + "mlp.down_proj.weight"] = torch.cat(
                [merged(t, p, lp + "mlp.linear_fc2") for t in range(tp)], 1)
    out["model.embed_tokens.weight"] = torch.cat(
        [f32(base[(t, 0)]["model"]["embedding.word_embeddings.weight"]) for t in range(tp)])[:hf_vocab]
    out["model.norm.weight"] = f32(base[(0, pp - 1)]["model"]["decoder.final_layernorm.weight"])
    out["lm_head.weight"] = torch.cat(
        [f32(base[(t, pp - 1)]["model"]["output_layer.weight"]) for t in range(tp)])[:hf_vocab]
    return out


def check(fixture: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    fx = json.loads((fixture / "fixture.json").read_text())
    tp, pp = fx["tp"], fx["pp"]
    base = load_shards(fixture / "base", tp, pp)
    lora = load_shards(fixture / "lora", tp, pp)
    args = lora[(0, 0)]["args"]
    assert (args.lora_r, args.lora_alpha) == (fx["r"], fx["alpha"])
    ref = torch.load(fixture / "logits.pt", weights_only=True)

    cfg = AutoConfig.from_pretrained(fixture / "hf_ref")
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    res = {}
    for tag, with_lora in (("lora", True), ("base", False)):
        sd = hf_state_dict(base, lora, args, with_lora, cfg.vocab_size)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"]).logits
        res[tag] = (logits - ref[f"logits_{tag}"]).abs().max().item()
    res["lora_vs_base_ref"] = (ref["logits_lora"] - ref["logits_base"]).abs().max().item()
    return res


def main():
    dirs = [Path(a) for a in sys.argv[1:]] or sorted(
        p for p in (REPO_ROOT / "tests" / "fixtures").iterdir() if (p / "fixture.json").is_file())
    ok = True
    for d in dirs:
        r = check(d)
        good = r["lora"] < 1e-4 and r["base"] < 1e-4 and r["lora_vs_base_ref"] > 0.1
        ok &= good
        print(f"{d.name:26s} max|HF-Megatron| lora {r['lora']:.2e}  base {r['base']:.2e}  "
              f"(lora vs base in logits.pt: {r['lora_vs_base_ref']:.3f})  {'OK' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
