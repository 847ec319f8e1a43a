#!/usr/bin/env python
"""Oracle cross-check of the fixtures, independent of the lora_merge package.

For each fixture: read the Megatron shards by hand (following latest_checkpointed_iteration.txt),
merge LoRA shard by shard in float32 (column layers W_i + s * B_i @ A, row layers W_i + s * B @ A_i),
un-shard (qkv: concat ranks on dim 0 then view(NG, NH/NG + 2, D, H) -> q, k, v; fc1: split every
rank's [gate ; up] in halves; row layers: concat dim 1; embedding / output: concat dim 0 and trim
the vocab padding), load the result into the transformers model built from hf_ref/config.json
(float32, eager attention) and compare its logits with the real Megatron logits in logits.pt.

Legacy checkpoints: one file per (tp, pp) rank, ``model`` or ``model0``, ``model1``, ... (virtual
pipeline); the global layer index of a chunk-local layer is found by counting the layers of every
chunk in ``for v: for pp:`` order (and checked against the split the args describe: even, uneven
with decoder_first/last_pipeline_num_layers, VPP).  Tied embeddings: the HF lm_head is the
embedding (the last stage's output_layer copy is checked to be equal).  Qwen3: q/k layernorms.

torch_dist base checkpoints: the global tensors are read with torch.distributed.checkpoint
(``FileSystemReader(dir).read_metadata()`` -- a plain pickle load of our own ``.metadata``, fine
here -- and ``torch.distributed.checkpoint.load(..., no_dist=True)`` into pre-allocated tensors),
turned into per-layer global tensors (stacked ``decoder.layers.*`` [L, ...] or per-layer keys with
``singleton_local_shards``; TE norm names; fc1 ``[all gate ; all up]`` or ``weight_w`` / ``weight_v``)
and sliced into the TP shards the legacy LoRA was trained against, then merged as above.

    python scripts/check_fixture_by_hand.py [tests/fixtures/NAME ...]   (default: every fixture)
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
REPO_ROOT = Path(__file__).resolve().parent.parent
LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


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


def chunk_dicts(ckpt: dict) -> list:
    """[model] or [model0, model1, ...]"""
    if "model" in ckpt:
        assert not any(re.fullmatch(r"model\d+", k) for k in ckpt)
        return [ckpt["model"]]
    n = sum(1 for k in ckpt if re.fullmatch(r"model\d+", k))
    assert n >= 1, list(ckpt)
    return [ckpt[f"model{v}"] for v in range(n)]


def local_layer_count(sd: dict) -> int:
    idx = {int(m.group(1)) for k in sd if (m := LAYER_RE.match(k))}
    assert idx == set(range(len(idx))), sorted(idx)
    return len(idx)


def expected_layout(args) -> dict:
    """{(pp, v): [global layers]} from the args alone (even / uneven first-last / VPP)."""
    L, PP = args.num_layers, args.pipeline_model_parallel_size
    VPP = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    counts = [None] * PP
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = L - sum(c for c in counts if c is not None)
    n_mid = sum(1 for c in counts if c is None)
    counts = [c if c is not None else rest // n_mid for c in counts]
    assert sum(counts) == L
    out, nxt = {}, 0
    for v in range(VPP):
        for p in range(PP):
            n = counts[p] // VPP
            out[(p, v)] = list(range(nxt, nxt + n))
            nxt += n
    return out


def counted_layout(ckpts: dict, tp: int, pp: int) -> dict:
    """{(pp, v): [global layers]} by counting chunk-local layers in `for v: for pp:` order."""
    nchunks = len(chunk_dicts(ckpts[(0, 0)]))
    out, nxt = {}, 0
    for v in range(nchunks):
        for p in range(pp):
            n = local_layer_count(chunk_dicts(ckpts[(0, p)])[v])
            for t in range(tp):
                assert local_layer_count(chunk_dicts(ckpts[(t, p)])[v]) == n
            out[(p, v)] = list(range(nxt, nxt + n))
            nxt += n
    return out


# ------------------------------------------------------------------------------------------
# torch_dist base -> legacy-like per-rank local dicts
# ------------------------------------------------------------------------------------------

def read_dist_globals(d: Path):
    """(global tensors by key, common.pt dict, metadata.json dict)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    cfg = json.loads((d / "metadata.json").read_text())
    assert cfg["sharded_backend"] == "torch_dist", cfg
    reader = FileSystemReader(str(d))
    md = reader.read_metadata()  # unsafe pickle: our own file
    skip = ("optimizer.", "rng_state", "rerun_state_machine", "common_state")
    sd = {}
    for k, m in md.state_dict_metadata.items():
        if k.startswith(skip) or "_extra_state" in k or not isinstance(m, TensorStorageMetadata):
            continue
        sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    dcp_load(sd, storage_reader=reader, no_dist=True)
    common = torch.load(d / "common.pt", weights_only=False, map_location="cpu")
    return sd, common, cfg


def dist_to_layers(g: dict, L: int):
    """global dist keys -> ({i: {legacy layer-relative name: global tensor}}, {other legacy name: tensor})"""
    te = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    layers = {i: {} for i in range(L)}
    other = {}
    for k, x in g.items():
        m = LAYER_RE.match(k)
        if m:  # singleton_local_shards: per-layer keys
            i, rest = int(m.group(1)), m.group(2)
            layers[i][te.get(rest, rest)] = x
        elif k.startswith("decoder.layers."):  # stacked [L, ...]
            rest = k[len("decoder.layers."):]
            assert x.shape[0] == L, (k, x.shape)
            for i in range(L):
                layers[i][te.get(rest, rest)] = x[i]
        else:
            other[k] = x
    for i in range(L):
        d = layers[i]
        if "mlp.linear_fc1.weight_w" in d:  # singleton: gate / up kept apart
            gate, up = d.pop("mlp.linear_fc1.weight_w"), d.pop("mlp.linear_fc1.weight_v")
            d["mlp.linear_fc1.weight"] = torch.cat([gate, up])
        # (stacked: mlp.linear_fc1.weight is already [all gate ; all up])
    return layers, other


def slice_tp(name: str, x: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """rank t's legacy shard of a global tensor"""
    if name.endswith("layernorm.weight"):
        return x
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return x.chunk(tp, 0)[t]
    if "linear_fc1.weight" in name:
        gate, up = x.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])
    if "linear_qkv." in name:
        return x.chunk(tp, 0)[t]
    if "linear_proj." in name or "linear_fc2." in name:
        return x.chunk(tp, 1)[t]
    raise KeyError(name)


def dist_base_as_shards(d: Path, args, layout: dict, tp: int, pp: int):
    g, common, cfg = read_dist_globals(d)
    layers, other = dist_to_layers(g, args.num_layers)
    nch = len({v for (_, v) in layout})
    shards = {}
    for p in range(pp):
        for t in range(tp):
            chunks = []
            for v in range(nch):
                sd = {}
                for j, i in enumerate(layout[(p, v)]):
                    for rest, x in layers[i].items():
                        sd[f"decoder.layers.{j}.{rest}"] = slice_tp(rest, x, t, tp)
                names = []
                if p == 0 and v == 0:
                    names.append("embedding.word_embeddings.weight")
                if p == pp - 1 and v == nch - 1:
                    names += [n for n in ("decoder.final_layernorm.weight", "output_layer.weight") if n in other]
                for n in names:
                    sd[n] = slice_tp(n, other[n], t, tp)
                chunks.append(sd)
            shards[(t, p)] = {"model": chunks[0]} if nch == 1 else {f"model{v}": c for v, c in enumerate(chunks)}
    return shards, common, cfg


# ------------------------------------------------------------------------------------------
# merge + convert
# ------------------------------------------------------------------------------------------

def hf_state_dict(base, lora, args, layout, with_lora: bool, hf_vocab: int, tied: bool) -> dict:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    NH, NG, D, H = args.num_attention_heads, args.num_query_groups, args.kv_channels, args.hidden_size
    s = args.lora_alpha / args.lora_r if with_lora else 0.0
    f32 = lambda x: x.detach().to(torch.float32)  # noqa: E731
    nch = len({v for (_, v) in layout})
    bm = lambda t, p, v: chunk_dicts(base[(t, p)])[v]  # noqa: E731
    lm = lambda t, p, v: chunk_dicts(lora[(t, p)])[v]  # noqa: E731

    def merged(t, p, v, local_prefix):
        """merged shard (t, p, chunk v) of the weight at local_prefix (e.g. decoder.layers.0.self_attention.linear_qkv)"""
        W = f32(bm(t, p, v)[local_prefix + ".weight"])
        if not with_lora:
            return W
        lsd = lm(t, p, v)
        ka = local_prefix + ".lora_A.default.weight"
        if ka not in lsd:
            return W  # not a LoRA target
        if local_prefix + ".base_layer.weight" in lsd:  # unfiltered: check the base it carries
            assert torch.equal(f32(lsd[local_prefix + ".base_layer.weight"]), W)
        A, B = f32(lsd[ka]), f32(lsd[local_prefix + ".lora_B.default.weight"])
        # shard by shard: column -> B is this rank's rows, A replicated; row -> A is this rank's cols
        return W + s * (B @ A)

    out = {}
    for (p, v), glist in layout.items():
        for j, i in enumerate(glist):
            lp = f"decoder.layers.{j}."
            hp = f"model.layers.{i}."
            sd0 = bm(0, p, v)
            out[hp + "input_layernorm.weight"] = f32(sd0[lp + "input_layernorm.weight"])
            out[hp + "post_attention_layernorm.weight"] = f32(sd0[lp + "pre_mlp_layernorm.weight"])
            if lp + "self_attention.q_layernorm.weight" in sd0:
                out[hp + "self_attn.q_norm.weight"] = f32(sd0[lp + "self_attention.q_layernorm.weight"])
                out[hp + "self_attn.k_norm.weight"] = f32(sd0[lp + "self_attention.k_layernorm.weight"])
            # qkv: concat ranks on dim 0 -> group-interleaved global
            qkv = torch.cat([merged(t, p, v, lp + "self_attention.linear_qkv") for t in range(tp)], 0)
            qkv = qkv.view(NG, NH // NG + 2, D, H)
            out[hp + "self_attn.q_proj.weight"] = qkv[:, : NH // NG].reshape(NH * D, H)
            out[hp + "self_attn.k_proj.weight"] = qkv[:, NH // NG].reshape(NG * D, H)
            out[hp + "self_attn.v_proj.weight"] = qkv[:, NH // NG + 1].reshape(NG * D, H)
            if args.add_qkv_bias:
                b = torch.cat([f32(bm(t, p, v)[lp + "self_attention.linear_qkv.bias"]) for t in range(tp)])
                b = b.view(NG, NH // NG + 2, D)
                out[hp + "self_attn.q_proj.bias"] = b[:, : NH // NG].reshape(-1)
                out[hp + "self_attn.k_proj.bias"] = b[:, NH // NG].reshape(-1)
                out[hp + "self_attn.v_proj.bias"] = b[:, NH // NG + 1].reshape(-1)
            out[hp + "self_attn.o_proj.weight"] = torch.cat(
                [merged(t, p, v, lp + "self_attention.linear_proj") for t in range(tp)], 1)
            fc1 = [merged(t, p, v, lp + "mlp.linear_fc1") for t in range(tp)]
            out[hp + "mlp.gate_proj.weight"] = torch.cat([x.chunk(2, 0)[0] for x in fc1], 0)
            out[hp + "mlp.up_proj.weight"] = torch.cat([x.chunk(2, 0)[1] for x in fc1], 0)
            out[hp + "mlp.down_proj.weight"] = torch.cat(
                [merged(t, p, v, lp + "mlp.linear_fc2") for t in range(tp)], 1)
    emb = torch.cat([f32(bm(t, 0, 0)["embedding.word_embeddings.weight"]) for t in range(tp)])
    out["model.embed_tokens.weight"] = emb[:hf_vocab]
    out["model.norm.weight"] = f32(bm(0, pp - 1, nch - 1)["decoder.final_layernorm.weight"])
    if tied:
        if "output_layer.weight" in bm(0, pp - 1, nch - 1):  # PP > 1: the last stage's own copy
            copy = torch.cat([f32(bm(t, pp - 1, nch - 1)["output_layer.weight"]) for t in range(tp)])
            assert torch.equal(copy, emb), "tied output_layer copy differs from the embedding"
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # same parameter in HF
    else:
        out["lm_head.weight"] = torch.cat(
            [f32(bm(t, pp - 1, nch - 1)["output_layer.weight"]) for t in range(tp)])[:hf_vocab]
    return out


def check(fixture: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    fx = json.loads((fixture / "fixture.json").read_text())
    tp, pp = fx["tp"], fx["pp"]
    lora = load_shards(fixture / "lora", tp, pp)
    args = lora[(0, 0)]["args"]
    assert (args.lora_r, args.lora_alpha) == (fx["r"], fx["alpha"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    layout = expected_layout(args)
    info = {}
    if fx.get("base_format", "torch") == "torch_dist":
        base, common, cfg = dist_base_as_shards(read_tracker(fixture / "base"), args, layout, tp, pp)
        bargs = common["args"]
        assert bargs.ckpt_format == "torch_dist" and common["iteration"] == fx["base_iteration"]
        assert (bargs.num_layers, bargs.tensor_model_parallel_size) == (args.num_layers, tp)
        info["common"] = sorted(common)
    else:
        base = load_shards(fixture / "base", tp, pp)
        assert counted_layout(base, tp, pp) == layout, (counted_layout(base, tp, pp), layout)
    if fx["lora"] == "unfiltered":
        assert counted_layout(lora, tp, pp) == layout
    if "layer_layout" in fx:
        assert {(e["pp_rank"], e["vp_stage"]): e["global_layers"] for e in fx["layer_layout"]} == layout
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    ref = torch.load(fixture / "logits.pt", weights_only=True)

    cfg = AutoConfig.from_pretrained(fixture / "hf_ref")
    assert bool(cfg.tie_word_embeddings) == tied
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    res = {}
    for tag, with_lora in (("lora", True), ("base", False)):
        sd = hf_state_dict(base, lora, args, layout, with_lora, cfg.vocab_size, tied)
        assert set(sd) <= set(model.state_dict()), set(sd) - set(model.state_dict())
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
        if tied:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"]).logits
        res[tag] = (logits - ref[f"logits_{tag}"]).abs().max().item()
    res["lora_vs_base_ref"] = (ref["logits_lora"] - ref["logits_base"]).abs().max().item()
    res["logit_scale"] = ref["logits_lora"].abs().max().item()
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
              f"(lora vs base in logits.pt: {r['lora_vs_base_ref']:.3f}; max|logit| {r['logit_scale']:.1f})  "
              f"{'OK' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
