"""PEFT as an independent oracle for the merge.

For every fixture:
  * the HF base model is `AutoModelForCausalLM.from_config(hf_ref/config.json)` in float32 (eager attention)
    holding the weights our CLI writes with `BASE_ONLY` (scale 0, i.e. the base). That base is trusted
    on its own: its logits must match the real Megatron base logits (`logits_base` in logits.pt) to 1e-4;
  * the HF adapter is built here, straight from the LoRA checkpoint's rank files, with explicit loops over
    TP ranks / query groups / heads written in this file (no lora_merge.model.layout / lora_merge.lora code; only
    lora_merge.files.safe_load.load_pt to read the pickles). It is trusted on its own: PEFT with the adapter
    *unmerged* must reproduce the real Megatron LoRA logits (`logits_lora`) to 1e-4, and those must differ
    from the base logits by > 0.5, so the comparison below cannot pass vacuously;
  * PEFT's `merge_and_unload()` of that model + adapter is the oracle: every tensor of our default merge (not
    only the LoRA-touched ones) must equal it, see `test_merged_weights_equal_peft_merge_and_unload`.

PEFT's tensor-parallel LoRA layout (tuners/lora/tp_layer.py, as MindSpeed-LLM saves it):
  column layers (linear_qkv, linear_fc1): lora_A replicated [r, in], lora_B sharded on dim 0 [out/TP, r]
  row layers (linear_proj, linear_fc2):   lora_A sharded on dim 1 [r, in/TP], lora_B replicated [out, r]
linear_qkv's lora_B rows are group-interleaved like the weight: per query group g, [q rows of the heads
of g; k rows of g; v rows of g]; each TP rank holds NG/TP whole groups. linear_fc1's lora_B on each rank is
[gate shard; up shard]. q/k/v_proj (gate/up_proj) all get the same A, each its own rows of B.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import FIXTURE_NAMES, FIXTURES, fixture_info
from lora_merge.files.safe_load import load_pt

peft = pytest.importorskip("peft")

LOGITS_TOL = 1e-4
FP32_REL_TOL = 1e-6  # fp32 fixtures: |ours - peft| <= 1e-6 * max(1, max|peft tensor|)

# Megatron LoRA target -> (module path inside decoder.layers.{i}, HF module names inside model.layers.{i})
TARGETS = {
    "linear_qkv": ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "linear_proj": ("self_attention.linear_proj", ("self_attn.o_proj",)),
    "linear_fc1": ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
    "linear_fc2": ("mlp.linear_fc2", ("mlp.down_proj",)),
}
LORA_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|"
                      r"mlp\.linear_fc1|mlp\.linear_fc2)\.lora_([AB])\.default\.weight$")


# ----------------------------------------------------------------------------------------------- adapter

def read_lora_ranks(root: Path, tp: int, pp: int) -> dict:
    """{(tp_rank, pp_rank): checkpoint dict} of the iteration named by latest_checkpointed_iteration.txt."""
    it = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    d = root / ("release" if it == "release" else f"iter_{int(it):07d}")
    out = {}
    for p in range(pp):
        for t in range(tp):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            out[(t, p)] = load_pt(d / name / "model_optim_rng.pt")
    return out


def read_bridge_lora(root: Path) -> tuple[dict, object]:
    """A Megatron-Bridge LoRA (torch_dist, global tensors stacked over layers) read with torch's own DCP reader, as
    the one TP=1 "rank" {(0, 0): {"model": {decoder.layers.{i}.<linear>.lora_A/B.default.weight: …}}}, and the
    args its run_config.yaml amounts to (read here with yaml: r = peft.dim, alpha = peft.alpha)."""
    import torch.distributed.checkpoint as dcp
    import yaml
    from argparse import Namespace

    it = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    d = root / f"iter_{int(it):07d}"
    reader = dcp.FileSystemReader(str(d))
    md = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if ".adapter." in k}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    model = {}
    for key, stacked in sd.items():
        module, ab = key.split(".adapter.")
        rest = module.removeprefix("decoder.layers.")
        for layer in range(stacked.shape[0]):
            model[f"decoder.layers.{layer}.{rest}.lora_{'A' if ab == 'linear_in.weight' else 'B'}.default.weight"] = \
                stacked[layer]
    config = yaml.safe_load((d / "run_config.yaml").read_text())
    m, peft = config["model"], config["peft"]
    args = Namespace(num_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                     num_query_groups=m["num_query_groups"], kv_channels=m["kv_channels"],
                     ffn_hidden_size=m["ffn_hidden_size"], lora_r=peft["dim"], lora_alpha=peft["alpha"],
                     lora_target_modules=peft["target_modules"], tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1)
    return {(0, 0): {"model": model}}, args


def replicated(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    for t, x in enumerate(tensors[1:], 1):
        assert torch.equal(x, tensors[0]), f"{what}: TP rank {t} differs from rank 0 (should be replicated)"
    return tensors[0]


def split_qkv_lora_B(b_ranks: list[torch.Tensor], nh: int, ng: int, d: int):
    """Per-rank group-interleaved qkv lora_B -> HF (q, k, v) lora_B, one head / group at a time."""
    tp = len(b_ranks)
    heads_per_group, groups_per_rank = nh // ng, ng // tp
    rows_per_group = (heads_per_group + 2) * d
    q, k, v = [], [], []
    for t in range(tp):  # global group g = t * groups_per_rank + gl, global head = g * heads_per_group + h
        b = b_ranks[t]
        assert b.shape[0] == groups_per_rank * rows_per_group, (t, tuple(b.shape))
        for gl in range(groups_per_rank):
            start = gl * rows_per_group
            for h in range(heads_per_group):
                q.append(b[start + h * d: start + (h + 1) * d])
            k.append(b[start + heads_per_group * d: start + (heads_per_group + 1) * d])
            v.append(b[start + (heads_per_group + 1) * d: start + (heads_per_group + 2) * d])
    assert len(q) == nh and len(k) == len(v) == ng
    return torch.cat(q), torch.cat(k), torch.cat(v)


def build_adapter(name: str) -> tuple[dict, object]:
    """{HF module name (model.layers.{i}.self_attn.q_proj ...): (A [r, in], B [out, r]) in float32}, args."""
    info = fixture_info(name)
    tp, pp = info["tp"], info["pp"]
    if info.get("megatron_bridge"):  # global tensors: the TP=1 layout
        tp = pp = 1
        ranks, args = read_bridge_lora(FIXTURES / name / "lora")
        info = {**info, "layer_layout": []}
    else:
        ranks = read_lora_ranks(FIXTURES / name / "lora", tp, pp)
        args = ranks[(0, 0)]["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    nl, nh, ng, d, f = args.num_layers, args.num_attention_heads, args.num_query_groups, args.kv_channels, \
        args.ffn_hidden_size
    # Which global layers each (pipeline stage, virtual chunk) holds, as the fixture generator recorded it
    # from Megatron itself; without a record, an even split (stage p holds layers p*L/PP ... ).
    layout = {(e["pp_rank"], e["vp_stage"]): e["global_layers"] for e in info.get("layer_layout", [])} or \
        {(p, 0): list(range(p * nl // pp, (p + 1) * nl // pp)) for p in range(pp)}
    targets = list(args.lora_target_modules)
    assert sorted(targets) == sorted(info["targets"])

    # collect every factor by (global layer, target) -> {"A": [per tp rank], "B": [per tp rank]}
    factors: dict = {}
    for (t, p), ck in ranks.items():
        for chunk_key, sd in ck.items():
            chunk = re.fullmatch(r"model(\d*)", str(chunk_key))
            if not chunk:
                continue
            v = int(chunk.group(1) or 0)
            layers = layout[(p, v)]
            seen = set()
            for key, value in sd.items():
                m = LORA_KEY.match(key)
                if not m:
                    assert ".lora_" not in key or key.endswith("._extra_state"), key
                    continue
                local, module, ab = int(m.group(1)), m.group(2), m.group(3)
                target = module.rsplit(".", 1)[1]
                assert target in targets, key
                layer = layers[local]
                factors.setdefault((layer, target), {"A": [None] * tp, "B": [None] * tp})[ab][t] = \
                    value.to(torch.float32)
                seen.add((local, target, ab))
            assert seen == {(j, tg, ab) for j in range(len(layers)) for tg in targets for ab in "AB"}, (t, p, v)

    adapter = {}
    for (layer, target), ab in factors.items():
        a_ranks, b_ranks = ab["A"], ab["B"]
        assert all(x is not None for x in a_ranks + b_ranks)
        hp = f"model.layers.{layer}."
        what = f"layer {layer} {target}"
        if target == "linear_qkv":  # column: A replicated, B sharded on dim 0, group-interleaved
            a = replicated(a_ranks, what + " lora_A")
            q, k, v = split_qkv_lora_B(b_ranks, nh, ng, d)
            adapter[hp + "self_attn.q_proj"] = (a, q)
            adapter[hp + "self_attn.k_proj"] = (a, k)
            adapter[hp + "self_attn.v_proj"] = (a, v)
        elif target == "linear_fc1":  # column: A replicated, each rank's B = [gate shard; up shard]
            a = replicated(a_ranks, what + " lora_A")
            gates, ups = [], []
            for b in b_ranks:
                assert b.shape[0] == 2 * (f // tp), tuple(b.shape)
                gates.append(b[: f // tp])
                ups.append(b[f // tp:])
            adapter[hp + "mlp.gate_proj"] = (a, torch.cat(gates))
            adapter[hp + "mlp.up_proj"] = (a, torch.cat(ups))
        else:  # row: A sharded on dim 1, B replicated
            a = torch.cat(a_ranks, dim=1)
            b = replicated(b_ranks, what + " lora_B")
            adapter[hp + TARGETS[target][1][0]] = (a, b)
    assert len(adapter) == nl * sum(len(TARGETS[tg][1]) for tg in targets)
    return adapter, args


# ------------------------------------------------------------------------------------------- models

def read_safetensors_dir(out: Path) -> dict:
    files = sorted(out.glob("*.safetensors"))
    assert files, out
    sd = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                assert key not in sd, key
                sd[key] = f.get_tensor(key)
    return sd


def hf_model(name: str, state_dict: dict):
    cfg = AutoConfig.from_pretrained(FIXTURES / name / "hf_ref")
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert expected == set(state_dict), expected ^ set(state_dict)
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in state_dict.items()}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def oracle_inputs(base_model):
    """name -> (base state dict from `BASE_ONLY`, adapter, LoRA args); each built once."""
    @functools.cache
    def get(name: str):
        return (read_safetensors_dir(base_model(name)), *build_adapter(name))

    return get


def peft_model(name: str, base_sd: dict, adapter: dict, args):
    """A fresh PEFT model: HF base (float32) + our test-built adapter loaded into every LoRA module."""
    from peft import LoraConfig, get_peft_model

    targets = sorted({m.rsplit(".", 1)[1] for m in adapter})
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets,
                        lora_dropout=0.0, bias="none", use_rslora=False, use_dora=False)
    model = get_peft_model(hf_model(name, base_sd), config).eval()
    inner = model.base_model.model
    lora_modules = {n for n, m in inner.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert lora_modules == set(adapter), lora_modules ^ set(adapter)
    for module_name, (a, b) in adapter.items():
        module = inner.get_submodule(module_name)
        assert module.scaling["default"] == args.lora_alpha / args.lora_r
        for param, value in ((module.lora_A["default"].weight, a), (module.lora_B["default"].weight, b)):
            assert param.shape == value.shape and param.dtype == torch.float32, (module_name, param.shape, value.shape)
            with torch.no_grad():
                param.copy_(value)
    return model


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def reference_logits(name: str) -> dict:
    return torch.load(FIXTURES / name / "logits.pt", weights_only=True)


# -------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_alpha0_base_computes_megatron_base_logits(name, oracle_inputs):
    base_sd, _, _ = oracle_inputs(name)
    ref = reference_logits(name)
    diff = (logits_of(hf_model(name, base_sd), ref["input_ids"]) - ref["logits_base"]).abs().max().item()
    print(f"{name}: max |HF(alpha-0 base) - megatron base| = {diff:.3g}")
    assert diff <= LOGITS_TOL


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_test_adapter_unmerged_computes_megatron_lora_logits(name, oracle_inputs):
    base_sd, adapter, args = oracle_inputs(name)
    ref = reference_logits(name)
    model = peft_model(name, base_sd, adapter, args)
    diff = (logits_of(model, ref["input_ids"]) - ref["logits_lora"]).abs().max().item()
    gap = (ref["logits_lora"] - ref["logits_base"]).abs().max().item()
    print(f"{name}: max |PEFT unmerged - megatron lora| = {diff:.3g} (lora vs base {gap:.3g})")
    assert diff <= LOGITS_TOL
    assert gap > 0.5  # the LoRA moves these logits: matching logits_lora is not matching the base
    with model.disable_adapter():  # and the adapter really is what moves them
        assert (logits_of(model, ref["input_ids"]) - ref["logits_base"]).abs().max().item() <= LOGITS_TOL


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance between consecutive bf16 numbers at |x| (8 significant bits): 2**(floor(log2|x|) - 7)."""
    _, exponent = torch.frexp(x.abs().clamp_min(2.0 ** -126))  # |x| = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - 8)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_merged_weights_equal_peft_merge_and_unload(name, oracle_inputs, merged_fixture):
    """Every tensor of our default merge against PEFT's merge_and_unload (float32) of base + test adapter.

    - same tensor names (all of them), shapes; dtype = the fixture dtype;
    - tensors no LoRA touches (embeddings, norms, biases, lm_head, and modules outside the LoRA targets):
      bit-identical to PEFT's (which are the BASE_ONLY tensors);
    - LoRA-touched weights, float32 fixtures: |ours - peft| <= 1e-6 * max(1, max|peft|) elementwise;
    - LoRA-touched weights, bf16 fixture (PEFT merges in float32 the exact bf16 values of W, A, B):
      ours is PEFT's float32 result rounded once to bf16, up to float32 round-off, i.e. elementwise
      |ours - peft| <= 0.5 * bf16_spacing(peft) + 1e-6 * max(1, max|peft|) — which implies ours is at most
      1 bf16 ulp from bf16(peft); a double rounding (bf16(W + bf16(s·B·A))) breaks this bound.
    """
    info = fixture_info(name)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[info["dtype"]]
    base_sd, adapter, args = oracle_inputs(name)
    model = peft_model(name, base_sd, adapter, args)
    merged = model.merge_and_unload()
    oracle = {k: v.detach() for k, v in merged.state_dict().items()}
    if merged.config.tie_word_embeddings:  # HF writes a tied lm_head as nothing; it is the embedding
        assert oracle.pop("lm_head.weight").data_ptr() == oracle["model.embed_tokens.weight"].data_ptr()
    ours = read_safetensors_dir(merged_fixture(name))
    assert set(ours) == set(oracle), set(ours) ^ set(oracle)

    touched = {m + ".weight" for m in adapter}
    assert touched <= set(oracle)
    worst, worst_ulps, off_by_one = 0.0, 0.0, 0
    for key in sorted(oracle):
        mine, ref = ours[key], oracle[key]
        assert mine.dtype == dtype and mine.shape == ref.shape and ref.dtype == torch.float32, key
        if key not in touched:
            assert torch.equal(mine.to(torch.float32), ref), f"{key}: not touched by LoRA, yet differs"
            continue
        assert not torch.equal(ref, base_sd[key].to(torch.float32)), f"{key}: PEFT did not change it"
        err = (mine.to(torch.float32) - ref).abs()
        slack = FP32_REL_TOL * max(1.0, ref.abs().max().item())
        if dtype == torch.float32:
            bad = err > slack
        else:
            spacing = bf16_spacing(ref)
            bad = err > 0.5 * spacing + slack
            worst_ulps = max(worst_ulps, (err / spacing).max().item())
            off_by_one += int((mine != ref.to(torch.bfloat16)).sum())
        worst = max(worst, err.max().item())
        assert not bad.any(), (f"{key}: {int(bad.sum())} elements beyond round-off, max |ours - peft| = "
                               f"{err.max().item():.3g} (slack {slack:.3g})")
    summary = {"fixture": name, "tensors": len(oracle), "lora_touched": len(touched), "max_abs_diff": worst}
    if dtype == torch.bfloat16:
        summary.update(max_diff_in_bf16_spacings=worst_ulps, elements_not_equal_to_bf16_of_peft=off_by_one)
    print(json.dumps(summary))
