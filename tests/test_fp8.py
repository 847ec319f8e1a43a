"""Block-FP8 bases (DeepSeek-V3's and Qwen3-FP8's release format), read directly.

The FP8 models here are made by the test itself, the way the releases are: every linear weight of attention
and the MLP/experts quantized per 128×128 block (s = amax / 448, q = float8_e4m3fn(W / s), weight_scale_inv
= s), embeddings, norms, router and lm_head left as they are, and quantization_config in config.json. The
fixtures' dimensions (64, 96, 250 …) are not multiples of 128, so partial edge blocks are everywhere, and the
Qwen3-MoE attention (256 rows) has two row blocks. The reference dequantization below is written from
DeepSeek's definition, block by block, and shares no code with lora_merge.fp8."""

import filecmp
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_merge
from lora_merge.errors import MergeError
from helpers import quiet

TESTS = Path(__file__).parent
FIXTURES = {"deepseek_v3": TESTS / "fixtures_deepseek/deepseek_v3_ep2", "qwen3_moe": TESTS / "fixtures_moe/qwen3moe_ep2"}
BLOCK = 128
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # Mixtral's experts: w1 gate, w3 up, w2 down
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}



def is_quantized(name: str, tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def reference_quantize(w: torch.Tensor, pow2: bool = False):
    """Per block: s = amax / 448, at least the smallest normal float32 (1 for an all-zero block),
    q = e4m3(W / s); `pow2` (scale_fmt ue8m0, DeepSeek-V3.1/V3.2): s = 2^ceil(log2(amax / 448))."""
    rows, cols = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            amax = block.abs().max().item()
            s[i, j] = max(amax / 448.0, 2.0 ** -126) if amax > 0 else 1.0
            if pow2:
                s[i, j] = 2.0 ** math.ceil(math.log2(float(s[i, j])))
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def reference_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant: each block of q times its scale, in float32."""
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = block * s[i, j]
    return w


def hf_base(fixture: Path, out: Path) -> Path:
    lora_merge.merge(base=fixture / "base", hf_ref=fixture / "hf_ref", out=out, warn=quiet)
    return out


UE8M0 = {**CONFIG, "scale_fmt": "ue8m0"}  # DeepSeek-V3.1's and V3.2's quantization_config


def fp8_release(hf: Path, out: Path, scales_apart: bool = True, config: dict = CONFIG) -> tuple[Path, Path]:
    """The FP8 release of an HF model, and its bf16-free twin: the same values dequantized (float32)."""
    tensors = load_file(hf / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, s = reference_quantize(t, pow2=config.get("scale_fmt") == "ue8m0")
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dequantized[name] = reference_dequantize(q, s)
        else:
            fp8[name] = dequantized[name] = t
    quantization = config
    for directory, weights, quantized in ((out / "fp8", fp8, True), (out / "dequantized", dequantized, False)):
        shutil.copytree(hf, directory, ignore=shutil.ignore_patterns("*.safetensors", "README.md"))
        config = json.loads((hf / "config.json").read_text())
        if quantized:
            config["quantization_config"] = quantization
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        if quantized and scales_apart:  # the scales in a shard of their own, as an index lays them out
            scales = {k: v for k, v in weights.items() if k.endswith("_scale_inv")}
            rest = {k: v for k, v in weights.items() if k not in scales}
            save_file(rest, directory / "model-00001-of-00002.safetensors")
            save_file(scales, directory / "model-00002-of-00002.safetensors")
            index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in rest},
                                                   **{k: "model-00002-of-00002.safetensors" for k in scales}}}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            save_file(weights, directory / "model.safetensors")
    return out / "fp8", out / "dequantized"


def test_dequantization_is_deepseeks_definition_on_every_block_shape():
    from lora_merge.fp8 import dequantize_rows

    g = torch.Generator().manual_seed(0)
    for rows, cols in ((64, 96), (128, 128), (300, 200), (129, 1), (1, 257)):
        w = torch.randn(rows, cols, generator=g) * 3
        q, s = reference_quantize(w)
        expected = reference_dequantize(q, s)
        assert torch.equal(dequantize_rows(q, s, 0, (BLOCK, BLOCK)), expected)
        for start, stop in ((0, 1), (5, 131), (127, 129), (rows - 1, rows)):  # any row range, across blocks
            if stop <= rows:
                got = dequantize_rows(q[start:stop], s, start, (BLOCK, BLOCK))
                assert torch.equal(got, expected[start:stop]), (rows, cols, start, stop)


def test_quantization_is_within_half_an_e4m3_step_per_block():
    from lora_merge.fp8 import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 2, 200)  # blocks of very different ranges
    q, s = quantize_rows(w, (BLOCK, BLOCK))
    rq, rs = reference_quantize(w)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    back = dequantize_rows(q, s, 0, (BLOCK, BLOCK))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            sl = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            # e4m3 has 3 mantissa bits: a value rounds to within 2^-4 of itself, relative, above the
            # subnormals (below 2^-6 the spacing is 2^-9, in units of the block's scale)
            err = (back[sl] - w[sl]).abs()
            bound = torch.maximum(w[sl].abs() * 2.0 ** -4, torch.full_like(w[sl], 2.0 ** -10 * s[i, j].item()))
            assert bool((err <= bound * (1 + 1e-6)).all()), (i, j)


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_an_fp8_base_merges_bit_for_bit_as_its_dequantized_values(tmp_path, family):
    """FP8 base + the fixture's Megatron LoRA, merged to float32 and bfloat16, equals the same merge onto
    the dequantized base (an ordinary float32 HF model), bit for bit; and converts to Megatron alike."""
    fixture = FIXTURES[family]
    fp8, dequantized = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path)
    for dtype in ("float32", "bfloat16"):
        for base, out in ((fp8, tmp_path / f"from-fp8-{dtype}"), (dequantized, tmp_path / f"from-deq-{dtype}")):
            lora_merge.merge(base=base, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=out, dtype=dtype,
                             warn=quiet)
        a, b = (load_file(tmp_path / f"{d}-{dtype}/model.safetensors") for d in ("from-fp8", "from-deq"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), dtype
        assert not any(k.endswith("_scale_inv") for k in a) and all(v.dtype != torch.float8_e4m3fn for v in a.values())
    config = json.loads((tmp_path / "from-fp8-bfloat16/config.json").read_text())
    assert "quantization_config" not in config  # the output is not quantized
    for base, out in ((fp8, tmp_path / "mg-fp8"), (dequantized, tmp_path / "mg-deq")):
        lora_merge.to_megatron(base=base, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=out, ep=2,
                               dtype="bfloat16", warn=quiet)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        assert filecmp.cmp(tmp_path / "mg-fp8/release" / rank / "model_optim_rng.pt",
                           tmp_path / "mg-deq/release" / rank / "model_optim_rng.pt", shallow=False)


def test_broken_fp8_releases_are_refused_in_one_line(tmp_path):
    fixture = FIXTURES["qwen3_moe"]
    fp8, _ = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path, scales_apart=False)
    tensors = load_file(fp8 / "model.safetensors")
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    cases = {
        "missing scale": ({k: v for k, v in tensors.items() if k != scale}, None,
                          "an FP8 weight without its model.layers.0.self_attn.q_proj.weight_scale_inv"),
        "wrong shape": ({**tensors, scale: torch.ones(3, 1)}, None, "scales of shape [3, 1]"),
        "block size": (tensors, {**CONFIG, "weight_block_size": [64, 64]}, "in 64x64 blocks (the config's weight_block_size)"),
        "per-tensor": (tensors, {"quant_method": "fp8", "activation_scheme": "dynamic"}, "no weight_block_size"),
        "e5m2": ({**tensors, "model.layers.0.self_attn.o_proj.weight":
                  tensors["model.layers.0.self_attn.o_proj.weight"].to(torch.float8_e5m2)}, None, "dtype F8_E5M2"),
    }
    for label, (weights, quantization, expected) in cases.items():
        broken = tmp_path / label.replace(" ", "_")
        shutil.copytree(fp8, broken)
        save_file(weights, broken / "model.safetensors")
        if quantization is not None:
            config = json.loads((broken / "config.json").read_text())
            config["quantization_config"] = quantization
            (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(MergeError, match=re.escape(expected)):
            lora_merge.merge(base=broken, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "out",
                             warn=quiet)
        assert not (tmp_path / "out").exists(), label


def without_skips(quantization: dict) -> dict:
    """An FP8 output's quantization_config less the modules it names as not FP8 (their list is tested in
    test_fp8_trust.py against transformers' own reading)."""
    return {k: v for k, v in quantization.items() if k != "modules_to_not_convert"}


def within_half_step(deq: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> bool:
    """|dequantized - exact| within half an e4m3 step of each block (relative 2^-4, or 2^-10 of the block's
    scale among the subnormals)."""
    s = scale.repeat_interleave(BLOCK, 0)[:exact.shape[0]].repeat_interleave(BLOCK, 1)[:, :exact.shape[1]]
    bound = torch.maximum(exact.abs() * 2.0 ** -4, 2.0 ** -10 * s) * (1 + 1e-6)
    return bool(((deq - exact).abs() <= bound).all())


@pytest.mark.parametrize("family", sorted(FIXTURES) + ["mixtral"])
def test_an_fp8_output_is_the_release_format_transformers_loads(tmp_path, family):
    """--dtype fp8 from an unquantized base: the attention and MLP/expert weights block-FP8 with their scales,
    every one within half an e4m3 step of the float32 merge; embeddings, norms, router and lm_head bfloat16;
    quantization_config in config.json. transformers (FineGrainedFP8Config(dequantize=True), on CPU) loads it
    and computes exactly what the dequantized weights compute."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    fixture = {**FIXTURES, "mixtral": TESTS / "fixtures_moe/mixtral_ep2"}[family]
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "fp8",
                     dtype="fp8", warn=quiet)
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "fp32",
                     dtype="float32", warn=quiet)
    fp8, exact = load_file(tmp_path / "fp8/model.safetensors"), load_file(tmp_path / "fp32/model.safetensors")
    assert set(fp8) == set(exact) | {k + "_scale_inv" for k in exact if is_quantized(k, exact[k])}
    dequantized = {}
    for name, value in exact.items():
        got = fp8[name]
        if is_quantized(name, value):
            assert got.dtype == torch.float8_e4m3fn and fp8[name + "_scale_inv"].dtype == torch.float32
            dequantized[name] = reference_dequantize(got, fp8[name + "_scale_inv"])
            assert within_half_step(dequantized[name], value, fp8[name + "_scale_inv"]), name
        else:
            assert got.dtype == (torch.float32 if "e_score_correction_bias" in name else torch.bfloat16), name
            dequantized[name] = got
    config = json.loads((tmp_path / "fp8/config.json").read_text())
    assert without_skips(config["quantization_config"]) == CONFIG and config["dtype"] == "bfloat16"
    shutil.copytree(tmp_path / "fp8", tmp_path / "dequantized", ignore=shutil.ignore_patterns("*.safetensors"))
    config.pop("quantization_config")
    (tmp_path / "dequantized/config.json").write_text(json.dumps(config))
    save_file(dequantized, tmp_path / "dequantized/model.safetensors")
    input_ids = torch.load(fixture / "logits.pt")["input_ids"]
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32,
                                                      quantization_config=FineGrainedFP8Config(dequantize=True))
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32)
        got, expected = loaded(input_ids).logits, reference(input_ids).logits
        exact_model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
        unquantized = exact_model(input_ids).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    # against the unquantized merge: FP8 noise, which in these tiny random MoE models also flips some routing
    assert (got - unquantized).abs().mean() < 0.05 * unquantized.abs().max()


def test_an_fp8_base_to_fp8_keeps_what_the_lora_did_not_touch_as_stored(tmp_path):
    """FP8 base + a LoRA on q/k/v and down_proj only (the llama fixture's): the untouched o_proj, gate and up
    weights and their scales are the base's bytes; the touched ones re-quantized from the float32 merge; the
    output's quantization_config is the base's."""
    fixture = TESTS / "fixtures/tp2_llama_fp32_partial"
    fp8, dequantized = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path)
    lora_merge.merge(base=fp8, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "out", dtype="fp8",
                     warn=quiet)
    lora_merge.merge(base=dequantized, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "exact",
                     dtype="float32", warn=quiet)
    base = {}
    for shard in fp8.glob("*.safetensors"):
        base.update(load_file(shard))
    out, exact = load_file(tmp_path / "out/model.safetensors"), load_file(tmp_path / "exact/model.safetensors")
    for name in (n for n in base if base[n].dtype == torch.float8_e4m3fn):
        touched = name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "down_proj")
        same = torch.equal(out[name].view(torch.uint8), base[name].view(torch.uint8)) and \
            torch.equal(out[name + "_scale_inv"], base[name + "_scale_inv"])
        assert same != touched, name
        if touched:
            assert within_half_step(reference_dequantize(out[name], out[name + "_scale_inv"]), exact[name],
                                    out[name + "_scale_inv"]), name
    assert without_skips(json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]) == CONFIG


def test_verify_reads_fp8_outputs_and_fp8_references(tmp_path):
    """verify checks an FP8 output's dequantized values (within half an e4m3 step of baseline + LoRA) and takes
    an FP8 release as its baseline; a changed byte of an FP8 weight is found."""
    fixture = FIXTURES["deepseek_v3"]
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "out",
                     dtype="fp8", verify=True, warn=quiet)
    report = lora_merge.verify(tmp_path / "out", lora=fixture / "lora", base=fixture / "base", warn=quiet)
    assert report.ok and sum(s.startswith("FP8: within half an e4m3 step") for s in report.statuses.values()) > 50
    fp8, _ = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path)
    assert "120 block-FP8 e4m3 with 128x128 scales" in lora_merge.inspect(fp8)
    lora_merge.merge(base=fp8, lora=fixture / "lora", hf_ref=fp8, out=tmp_path / "bf16", dtype="bfloat16",
                     verify=True, warn=quiet)  # the FP8 release itself is the baseline
    tensors = load_file(tmp_path / "out/model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight"
    flipped = tensors[name].view(torch.uint8).clone()
    flipped[3, 5] ^= 0x40
    tensors[name] = flipped.view(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "out/model.safetensors")
    report = lora_merge.verify(tmp_path / "out", lora=fixture / "lora", base=fixture / "base", warn=quiet)
    assert any(p.startswith(f"{name}: its FP8 values differ") for p in report.problems)


def test_an_fp8_output_is_the_same_bytes_for_any_worker_count(tmp_path):
    fixture = FIXTURES["qwen3_moe"]  # its QKV comes in per-group rows: quantized in order; the rest on workers
    for workers in (1, 3):
        lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                         out=tmp_path / str(workers), dtype="fp8", workers=workers, sha256=False, warn=quiet)
    assert filecmp.cmp(tmp_path / "1/model.safetensors", tmp_path / "3/model.safetensors", shallow=False)


def test_a_peft_adapter_on_an_fp8_base_merges_as_on_its_dequantized_values(tmp_path):
    fixture = TESTS / "fixtures/tp2_fp32_filtered"
    fp8, dequantized = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path)
    lora_merge.export_adapter(lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "adapter", warn=quiet)
    for base, out in ((fp8, tmp_path / "a"), (dequantized, tmp_path / "b")):
        lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=base, out=out, dtype="float32", warn=quiet)
    a, b = load_file(tmp_path / "a/model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def is_power_of_two(s: torch.Tensor) -> bool:
    return bool((torch.frexp(s.float()).mantissa == 0.5).all())


def test_a_ue8m0_release_merges_as_its_dequantized_values_and_stays_ue8m0_as_fp8(tmp_path):
    """DeepSeek-V3.1/V3.2's FP8 (scale_fmt ue8m0: every scale a power of two): merged as its dequantized
    values, bit for bit; --dtype fp8 from it keeps the format: the config says ue8m0 and every scale the merge
    computes is a power of two, the weights within half an e4m3 step of the float32 merge; transformers loads
    it and computes what the dequantized weights compute."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    fixture = FIXTURES["deepseek_v3"]
    fp8, dequantized = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path, config=UE8M0)
    scales = {k: v for f in fp8.glob("*.safetensors") for k, v in load_file(f).items() if k.endswith("_scale_inv")}
    assert scales and all(is_power_of_two(v) for v in scales.values())
    for base, out in ((fp8, tmp_path / "from-fp8"), (dequantized, tmp_path / "from-deq")):
        lora_merge.merge(base=base, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=out, dtype="float32",
                         warn=quiet)
    a, b = (load_file(tmp_path / f"{d}/model.safetensors") for d in ("from-fp8", "from-deq"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    lora_merge.merge(base=fp8, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "out", dtype="fp8",
                     warn=quiet)
    out = load_file(tmp_path / "out/model.safetensors")
    assert json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    touched = [k for k in out if k.endswith("_scale_inv") and not torch.equal(out[k], scales[k])]
    assert touched and all(is_power_of_two(out[k]) for k in out if k.endswith("_scale_inv"))
    for name in (k.removesuffix("_scale_inv") for k in touched):
        assert within_half_step(reference_dequantize(out[name], out[name + "_scale_inv"]), a[name],
                                out[name + "_scale_inv"]), name
    input_ids = torch.load(fixture / "logits.pt")["input_ids"]
    deq = {k: (reference_dequantize(v, out[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v)
           for k, v in out.items() if not k.endswith("_scale_inv")}
    shutil.copytree(tmp_path / "out", tmp_path / "deq", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((tmp_path / "out/config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "deq/config.json").write_text(json.dumps(config))
    save_file(deq, tmp_path / "deq/model.safetensors")
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                   quantization_config=FineGrainedFP8Config(dequantize=True))(input_ids).logits
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32)(input_ids).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)


def test_a_ue8m0_release_with_a_scale_that_is_not_a_power_of_two_is_refused(tmp_path, capsys):
    fixture = FIXTURES["deepseek_v3"]
    fp8, _ = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path, config=UE8M0, scales_apart=False)
    tensors = load_file(fp8 / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("q_b_proj.weight_scale_inv"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, fp8 / "model.safetensors")
    from helpers import run_failing

    run_failing(["--base", str(fp8), "--lora", str(fixture / "lora"), "--hf-ref", str(fixture / "hf_ref"), "--out",
                 str(tmp_path / "out")], capsys, name, "not a power of two", "scale_fmt ue8m0")


def test_an_fp8_release_with_its_mtp_layer_merges_as_its_dequantized_values_and_back_to_fp8(tmp_path):
    """DeepSeek-V3's FP8 release quantizes its MTP layer (model.layers.{L}) as every layer: with a LoRA that
    trained the MTP layer too, the merge equals the one onto the dequantized base bit for bit, and an FP8 output
    quantizes the MTP layer's linears as the base had them."""
    fixture = TESTS / "fixtures_deepseek/deepseek_v3_mtp_tp2etp1_ep2"
    fp8, dequantized = fp8_release(hf_base(fixture, tmp_path / "hf"), tmp_path)
    assert "model.layers.2.self_attn.kv_b_proj.weight_scale_inv" in load_file(fp8 / "model-00002-of-00002.safetensors")
    for base, out in ((fp8, tmp_path / "from-fp8"), (dequantized, tmp_path / "from-deq")):
        lora_merge.merge(base=base, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=out, dtype="float32",
                         warn=quiet)
    a, b = (load_file(tmp_path / f"{d}/model.safetensors") for d in ("from-fp8", "from-deq"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.2.eh_proj.weight" in a
    lora_merge.merge(base=fp8, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "fp8-out", dtype="fp8",
                     warn=quiet)
    out = {}
    for shard in (tmp_path / "fp8-out").glob("*.safetensors"):
        out.update(load_file(shard))
    quantized = {k for k, v in out.items() if v.dtype == torch.float8_e4m3fn}
    assert "model.layers.2.self_attn.kv_b_proj.weight" in quantized and "model.layers.2.mlp.experts.3.up_proj.weight" in quantized
    assert "model.layers.2.eh_proj.weight" not in quantized
