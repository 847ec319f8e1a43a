"""Block-FP8, trust round four: the values are what a quantizer could have produced, in and out; an FP8
output's config says which modules are FP8 the way transformers and vLLM read it; verify checks the config
against the tensors both ways; partial blocks that transformers' CPU loader misreads are warned about.

The oracles are transformers' own code (5.x): `should_convert_module` for modules_to_not_convert, its FP8
quantizer's module replacement for which modules a loader treats as FP8, and its FP8 dequantization
(FineGrainedFP8Config(dequantize=True)) for partial blocks."""

import io
import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_merge
from lora_merge.errors import MergeError
from test_fp8 import (BLOCK, CONFIG, FIXTURES, TESTS, fp8_release, hf_base, quiet, reference_dequantize,
                      reference_quantize)

F32_MAX = torch.finfo(torch.float32).max
NORMAL_MIN = 2.0 ** -126  # the smallest normal float32
SCALE_MAX = 65504 / 448  # the largest scale an FP8 input may have: a block's values within float16's range


def merge_fp8(fixture: Path, out: Path, hf_ref: Path | None = None, **kw) -> Path:
    lora_merge.merge(base=kw.pop("base", fixture / "base"), lora=fixture / "lora", hf_ref=hf_ref or fixture / "hf_ref",
                     out=out, dtype=kw.pop("dtype", "fp8"), warn=kw.pop("warn", quiet), **kw)
    return out


def weights(directory: Path) -> dict:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def set_config(directory: Path, **changes) -> dict:
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config


# --- quantization: the whole float32 range -----------------------------------------------------------------

AMAXES = {
    "zero": 0.0,
    "smallest subnormal": 2.0 ** -149,
    "a subnormal": 3e-43,  # the case
    "largest subnormal": 2.0 ** -126 - 2.0 ** -149,
    "smallest normal": NORMAL_MIN,
    "below 448 x smallest normal": 448 * NORMAL_MIN * (1 - 2 ** -20),
    "448 x smallest normal": 448 * NORMAL_MIN,
    "tiny normal": 1e-36,
    "small": 1e-20,
    "one": 1.0,
    "e4m3 max": 448.0,
    "float16 max": 65504.0,
    "huge": 1e30,
    "float32 max": F32_MAX,
}


def block_with_amax(amax: float, rows: int = 200, cols: int = 300) -> torch.Tensor:
    """Values in [-amax, amax] (float32, some zero, some far below amax), every 128x128 block holding ±amax."""
    g = torch.Generator().manual_seed(7)
    w = (torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2 - 1) * torch.logspace(0, -9, cols,
                                                                                          dtype=torch.float64)
    w = (w * amax).float()
    w[::5, ::3] = 0
    for i in range(0, rows, BLOCK):
        for j in range(0, cols, BLOCK):
            w[i, j] = amax if (i + j) % 256 else -amax
    return w


def half_step(deq, exact, scale):
    """|dequantized - exact| within half an e4m3 step of the block (relative 2^-4, or 2^-10 of the block's scale
    among the e4m3 subnormals), plus float32's own resolution (2^-149) where q·s is a float32 subnormal."""
    s = scale.repeat_interleave(BLOCK, 0)[:exact.shape[0]].repeat_interleave(BLOCK, 1)[:, :exact.shape[1]]
    bound = torch.maximum(exact.abs().double() * 2.0 ** -4, 2.0 ** -10 * s.double()) * (1 + 1e-6) + 2.0 ** -149
    return bool(((deq.double() - exact.double()).abs() <= bound).all())


@pytest.mark.parametrize("amax", AMAXES.values(), ids=AMAXES.keys())
def test_quantization_is_sound_over_the_whole_float32_range(amax):
    """No NaN code and no zero, subnormal or non-finite scale for any block maximum from 0 through the
    subnormals to float32's largest; the dequantized values within half an e4m3 step; and bit for bit the
    test's own implementation (s = max(amax / 448, 2^-126), 1 for an all-zero block)."""
    from lora_merge.fp8 import dequantize_rows, quantize_rows

    w = block_with_amax(amax)
    q, s = quantize_rows(w, (BLOCK, BLOCK))
    assert not (q.view(torch.uint8) & 0x7F == 0x7F).any(), "NaN codes"
    assert torch.isfinite(s).all() and (s >= NORMAL_MIN).all(), s
    back = dequantize_rows(q, s, 0, (BLOCK, BLOCK))
    assert torch.isfinite(back).all() and half_step(back, w, s)
    rq, rs = reference_quantize(w)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_a_block_of_subnormals_merges_to_fp8_without_nan(tmp_path):
    """The issue's instance: a weight the LoRA does not touch whose values are all float32 subnormals
    (amax 3e-43) becomes FP8 codes and a positive normal scale, not NaN bytes and a zero scale, and verify
    finds it within half an e4m3 step of the base."""
    fixture = TESTS / "fixtures/tp2_llama_fp32_partial"  # its LoRA adapts q/k/v and down_proj only
    base = hf_base(fixture, tmp_path / "hf")
    tensors = load_file(base / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = block_with_amax(3e-43, *tensors[name].shape)
    save_file(tensors, base / "model.safetensors")
    out = merge_fp8(fixture, tmp_path / "out", base=base, sha256=False)
    got = load_file(out / "model.safetensors")
    assert not (got[name].view(torch.uint8) & 0x7F == 0x7F).any(), "NaN codes"
    assert (got[name + "_scale_inv"] >= NORMAL_MIN).all()
    report = lora_merge.verify(out, lora=fixture / "lora", base=base, warn=quiet)
    assert report.ok, report.problems
    assert report.statuses[name].startswith("FP8: within half an e4m3 step")


# --- the scales of an FP8 input -----------------------------------------------------------------------------

SCALE = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
SCALES_FILE = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The Qwen3-MoE fixture as an FP8 release (scales in a shard of their own), and its bf16 merge."""
    root = tmp_path_factory.mktemp("release")
    fixture = FIXTURES["qwen3_moe"]
    fp8, _ = fp8_release(hf_base(fixture, root / "hf"), root)
    lora_merge.merge(base=fp8, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=root / "bf16", dtype="bfloat16",
                     sha256=False, warn=quiet)
    return fixture, fp8, root / "bf16"


def with_scale(release_dir: Path, out: Path, value: float, name: str = SCALE) -> Path:
    shutil.copytree(release_dir, out)
    scales = load_file(out / SCALES_FILE)
    scales[name] = scales[name].clone()
    scales[name][0, 0] = value
    save_file(scales, out / SCALES_FILE)
    return out


BAD_SCALES = {"zero": 0.0, "negative": -0.01, "subnormal": 1e-40, "just above the bound": 146.25, "absurd": 1e30,
              "NaN": math.nan, "infinite": math.inf}


@pytest.mark.parametrize("value", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_an_fp8_base_with_a_scale_no_quantizer_writes_is_refused(release, tmp_path, value):
    """A weight_scale_inv that is 0 (zeroed weights), negative (negated), subnormal, above the bound (x1e30) or
    not finite is refused where the scales are read, before anything is written, in one line naming the
    tensor, the file and the bound; as a merge's base (to any dtype) and as verify's baseline alike."""
    fixture, fp8, good_output = release
    broken = with_scale(fp8, tmp_path / "broken", value)
    expected = re.escape(f"{broken / SCALES_FILE}[{SCALE}]") + r".*block \[0, 0\].*2\^-126.*65504/448 = 146\.2"
    for dtype in ("bfloat16", "fp8"):
        with pytest.raises(MergeError, match=expected):
            lora_merge.merge(base=broken, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "out",
                             dtype=dtype, warn=quiet)
        assert not (tmp_path / "out").exists()
    with pytest.raises(MergeError, match=expected):  # the broken release as the baseline of verify
        lora_merge.verify(good_output, lora=fixture / "lora", hf_ref=broken, warn=quiet)


def test_the_scale_bounds_themselves_are_accepted(release, tmp_path):
    fixture, fp8, _ = release
    for value in (NORMAL_MIN, SCALE_MAX):
        base = with_scale(fp8, tmp_path / f"base-{value}", value)
        lora_merge.merge(base=base, lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / f"out-{value}",
                         dtype="fp8", sha256=False, warn=quiet)


def test_an_fp8_output_with_a_scale_no_quantizer_writes_fails_verify(release, tmp_path):
    """In an output being verified a bad scale is a finding (a problem naming the tensor), not an error."""
    fixture, fp8, _ = release
    out = merge_fp8(fixture, tmp_path / "out", sha256=False)
    scales = load_file(out / "model.safetensors")
    for value in (0.0, -1.0, 1e-40, math.nan):
        scales[SCALE] = scales[SCALE].clone()
        scales[SCALE][0, 0] = value
        save_file(scales, out / "model.safetensors")
        report = lora_merge.verify(out, lora=fixture / "lora", base=fixture / "base", warn=quiet)
        name = SCALE.removesuffix("_scale_inv")
        assert any(p.startswith(f"{out / 'model.safetensors'}[{SCALE}]") and "block [0, 0]" in p
                   for p in report.problems), (value, report.problems)
        assert report.statuses[name] == "unreadable"


# --- modules_to_not_convert: transformers' matching ---------------------------------------------------------

PATTERNS = [
    ["model.layers.1"],  # a prefix at a module boundary (not model.layers.10 …)
    ["model.layers.1.self_attn"],
    ["layers.1"],  # not a prefix of the full name, not a suffix
    ["k_proj"],  # a suffix
    ["proj"], ["_proj"], ["mlp.gate"], ["gate"],
    ["lm_head"], ["embed_tokens"], ["self_attn"],
    ["model.layers.*.mlp"], [r"model\.layers\.\d+\.mlp\.gate"], [r".*experts"],
    [r"model.layers.(0|2).self_attn.q_proj"],
    ["model.layers.1.mlp.experts"], ["model.layers.1.mlp.experts.0"], ["experts.0.gate_proj"],
    ["q_proj", "v_proj"], ["model.layers.1|model.layers.2"], ["model"], ["."], [""], [],
    ["model.layers.1."], [r"model\.layers\.\d+\."],  # a match ending just after a dot
    ["model$"], ["lm_head$"], [r"model\.layers\.1(?=\.)"], [r"model.layers.1\b"], [r"model\.layers\.\d"],
]


def module_names() -> set[str]:
    """Every module of every fixture: the HF tensor names the tool writes (less '.weight'/'.bias'), each prefix
    of them, and the modules of transformers' own model built from the fixture's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_merge.model.architectures import architecture_for, iter_rules
    from lora_merge.model.hf_config import read_hf_config
    from lora_merge.model.layout import Skip

    names, built = set(), set()
    refs = [p for root in ("fixtures", "fixtures_moe", "fixtures_deepseek") for p in (TESTS / root).glob("*/hf_ref")]
    for ref in sorted(refs):
        shape, _ = read_hf_config(ref)
        for rule, _, prefix in iter_rules(architecture_for(shape), shape):
            if not isinstance(rule, Skip):
                for tensor in rule.hf_shapes(shape):
                    parts = (prefix + tensor).split(".")
                    names.update(".".join(parts[:i]) for i in range(1, len(parts)))
        if shape.model_type not in built:  # transformers' module tree, once per model type
            built.add(shape.model_type)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ref))
            names.update(name for name, _ in model.named_modules() if name)
    return names


def test_modules_to_not_convert_is_matched_as_transformers_matches_it():
    """Our decision equals transformers' `should_convert_module` for every module name of every fixture under
    prefixes, suffixes and regexes (and the corner cases: an empty pattern, no patterns)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from lora_merge.fp8 import not_converted

    names = module_names()
    assert len(names) > 300
    for patterns in PATTERNS:
        for name in names:
            assert not_converted(name, patterns) == (not should_convert_module(name, patterns)), (name, patterns)


def transformers_fp8_modules(out: Path) -> set[str]:
    """The modules transformers makes FP8 when it loads `out` on a GPU (FineGrainedFP8Config without
    dequantize): its own quantizer's module replacement, on a model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.auto import AutoHfQuantizer

    config = AutoConfig.from_pretrained(out)
    quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config.from_dict(config.quantization_config),
                                            pre_quantized=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    quantizer._process_model_before_weight_loading(model)
    return {name for name, module in model.named_modules() if type(module).__name__.startswith("FP8")}


def fp8_modules(out: Path) -> set[str]:
    """The modules whose weights the output stores in FP8, named as transformers 5 names them: one module for
    a layer's experts (`mlp.experts`; Mixtral's `block_sparse_moe` is `mlp` there)."""
    tensors = weights(out)
    names = set()
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            assert name + "_scale_inv" in tensors
            module = re.sub(r"\.experts\.\d+\.[^.]+$", ".experts", name.removesuffix(".weight"))
            names.add(module.replace(".block_sparse_moe.", ".mlp."))
    return names


ORACLE_FIXTURES = {**FIXTURES, "mixtral": TESTS / "fixtures_moe/mixtral_ep2",
                   "qwen2_moe": TESTS / "fixtures_moe/qwen2moe_tp2ep2",
                   "tied llama": TESTS / "fixtures/tied_pp2_llama_fp32"}


@pytest.mark.parametrize("family", sorted(ORACLE_FIXTURES))
def test_an_fp8_outputs_config_names_exactly_its_fp8_modules(tmp_path, family):
    """transformers, reading the output's quantization_config, makes FP8 exactly the modules whose weights are
    FP8: none of them loaded as raw e4m3 codes, no bf16 weight expected to have scales (Mixtral's experts,
    Qwen2-MoE's shared_expert_gate, a tied lm_head)."""
    out = merge_fp8(ORACLE_FIXTURES[family], tmp_path / "out", sha256=False)
    assert fp8_modules(out) == transformers_fp8_modules(out)
    assert fp8_modules(out)


def test_the_references_modules_to_not_convert_is_honoured_as_transformers_matches_it(tmp_path):
    """An unquantized base, a reference whose quantization_config skips `k_proj` (a suffix) and layer 1's
    experts (a regex): those stay bfloat16, everything else of attention and the experts is FP8, and the
    output's config says so to transformers."""
    fixture = FIXTURES["qwen3_moe"]
    ref = tmp_path / "ref"
    shutil.copytree(fixture / "hf_ref", ref)
    set_config(ref, quantization_config={**CONFIG, "modules_to_not_convert": ["k_proj", r"model\.layers\.1\.mlp\.e.*"]})
    out = merge_fp8(fixture, tmp_path / "out", hf_ref=ref, sha256=False)
    tensors = weights(out)
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            skipped = ".k_proj." in name or name.startswith("model.layers.1.mlp.experts.")
            assert (t.dtype == torch.bfloat16) == skipped and (t.dtype == torch.float8_e4m3fn) != skipped, name
    assert fp8_modules(out) == transformers_fp8_modules(out)


def test_an_fp8_bases_contradicting_modules_to_not_convert_is_not_copied(release, tmp_path):
    """An FP8 base whose config says q_proj of layer 0 is not converted though it is FP8, and which holds layer
    1's o_proj in bfloat16 without saying so: the output keeps exactly the base's FP8 tensors, and its config
    describes them (transformers makes exactly those modules FP8)."""
    fixture, fp8, _ = release
    base = unquantized(fp8, tmp_path / "base", "model.layers.1.self_attn.o_proj.weight")
    set_config(base, quantization_config={**CONFIG, "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]})
    out = merge_fp8(fixture, tmp_path / "out", base=base, sha256=False)
    modules = fp8_modules(out)
    assert "model.layers.0.self_attn.q_proj" in modules and "model.layers.1.self_attn.o_proj" not in modules
    assert modules == transformers_fp8_modules(out)


def unquantized(release_dir: Path, out: Path, name: str) -> Path:
    """A copy of an FP8 release with weight `name` stored dequantized in bfloat16, without scales."""
    shutil.copytree(release_dir, out)
    weights_file, scales = out / "model-00001-of-00002.safetensors", load_file(out / SCALES_FILE)
    tensors = load_file(weights_file)
    tensors[name] = reference_dequantize(tensors[name], scales.pop(name + "_scale_inv")).bfloat16()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"][name + "_scale_inv"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, weights_file)
    save_file(scales, out / SCALES_FILE)
    return out


def test_an_fp8_base_with_a_layers_experts_partly_fp8_is_refused_as_fp8_output(release, tmp_path):
    """transformers and vLLM load a layer's experts as one module, all FP8 or none: no config can describe
    an output with one expert weight in bf16, so --dtype fp8 refuses it (any other dtype merges it)."""
    fixture, fp8, _ = release
    base = unquantized(fp8, tmp_path / "base", "model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(MergeError, match=re.escape(f"{base}: model.layers.1.mlp.experts.0.gate_proj.weight is "
                                                   "block-FP8 but model.layers.1.mlp.experts.3.up_proj.weight is not")
                       + ".*all FP8 or none"):
        merge_fp8(fixture, tmp_path / "out", base=base)
    merge_fp8(fixture, tmp_path / "bf16", base=base, dtype="bfloat16", sha256=False)


def test_a_modules_to_not_convert_that_is_not_a_list_of_regexes_is_refused(tmp_path):
    fixture = FIXTURES["qwen3_moe"]
    for value, expected in ((["model.layers.["], "not a regular expression"), ("k_proj", "expected a list"),
                            ([3], "expected a list")):
        ref = tmp_path / f"ref{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fixture / "hf_ref", ref)
        set_config(ref, quantization_config={**CONFIG, "modules_to_not_convert": value})
        where = re.escape(f"{ref / 'config.json'}: quantization_config modules_to_not_convert")
        with pytest.raises(MergeError, match=f"{where}.*{expected}"):
            merge_fp8(fixture, tmp_path / "out", hf_ref=ref)


# --- verify: the config against the tensors, both ways --------------------------------------------------------

def test_verify_checks_the_quantization_config_against_the_tensors_both_ways(tmp_path):
    """FP8 tensors without a quantization_config (transformers would load the e4m3 codes as the weights), a
    quantization_config without FP8 tensors, an FP8 module the config excludes, and an unquantized linear it
    does not exclude are problems."""
    fixture = FIXTURES["qwen3_moe"]
    fp8 = merge_fp8(fixture, tmp_path / "fp8", sha256=False)
    bf16 = merge_fp8(fixture, tmp_path / "bf16", dtype="bfloat16", sha256=False)
    config = tmp_path / "fp8/config.json"

    def problems(out):
        return lora_merge.verify(out, lora=fixture / "lora", base=fixture / "base", warn=quiet).problems

    assert problems(fp8) == [] and problems(bf16) == []
    quantization = json.loads(config.read_text())["quantization_config"]
    set_config(fp8, quantization_config=None)
    assert any(p.startswith(f"{config}: no quantization_config, but 64 weights are block-FP8") for p in problems(fp8))
    set_config(bf16, quantization_config=CONFIG)
    assert any(p.startswith(f"{tmp_path / 'bf16/config.json'}: quantization_config says block-FP8, but no weight is")
               for p in problems(bf16))
    excluded = quantization["modules_to_not_convert"]
    set_config(fp8, quantization_config={**quantization, "modules_to_not_convert": excluded + ["q_proj"]})
    assert any(p.startswith(f"{config}: 4 block-FP8 weights (model.layers.0.self_attn.q_proj.weight")
               and "modules_to_not_convert excludes" in p for p in problems(fp8))
    set_config(fp8, quantization_config={**quantization, "modules_to_not_convert": []})
    assert any(p.startswith(f"{config}: 1 weight not in block-FP8 (lm_head.weight)") for p in problems(fp8))


# --- partial blocks: what transformers' CPU loader does with them --------------------------------------------

SHAPES = [1, 64, 127, 128, 129, 200, 255, 256, 257, 260, 300, 384, 576]


def test_the_partial_block_condition_is_transformers_own():
    """For every weight shape, `transformers_cpu_reading` says exactly what transformers' FP8 dequantization
    (the op FineGrainedFP8Config(dequantize=True) loads with) does: reads it as we do, refuses it, or reads
    it wrongly without an error (it infers the block size from the scale grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from lora_merge.fp8 import dequantize_rows, quantize_rows, transformers_cpu_reading

    theirs = Fp8Dequantize(None)
    g = torch.Generator().manual_seed(3)
    seen = set()
    for rows in SHAPES:
        for cols in SHAPES:
            w = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols)  # every block its own scale
            q, s = quantize_rows(w, (BLOCK, BLOCK))
            try:
                got = theirs._dequantize_one(q, s, output_dtype=torch.float32)
                outcome = None if torch.equal(got, dequantize_rows(q, s, 0, (BLOCK, BLOCK))) else "misreads"
            except ValueError as exc:
                assert "not divisible by scale grid" in str(exc)
                outcome = "refuses"
            assert transformers_cpu_reading((rows, cols), (BLOCK, BLOCK)) == outcome, (rows, cols)
            seen.add(outcome)
    assert seen == {None, "misreads", "refuses"}
    assert transformers_cpu_reading((576, 7168), (BLOCK, BLOCK)) == "refuses"  # DeepSeek-V3's kv_a_proj_with_mqa


def tiny_llama(directory: Path, intermediate: int) -> tuple[Path, Path]:
    """A one-layer Llama (hidden 256) with the given MLP width, saved by transformers, and a PEFT adapter on
    q_proj made by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=intermediate, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         tie_word_embeddings=False))
    model.save_pretrained(directory / "hf")
    adapter = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    adapter.save_pretrained(directory / "adapter")
    return directory / "hf", directory / "adapter"


def test_partial_blocks_transformers_reads_wrongly_are_warned_about_by_the_merge_and_verify(tmp_path):
    """gate/up_proj [200, 256] and down_proj [256, 200]: one partial block after the first, which transformers'
    CPU loader reads with 100-row (100-column) blocks and no error. The merge warns before writing and verify
    notes it, naming exactly the weights transformers then loads differently from the values written."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from lora_merge.fp8 import dequantize_rows

    hf, adapter = tiny_llama(tmp_path, 200)
    notes = []
    lora_merge.merge(base=hf, lora=adapter, hf_ref=hf, out=tmp_path / "out", dtype="fp8", sha256=False,
                     warn=notes.append)
    partial = [n for n in notes if "partial 128x128 block" in n]
    wrong = ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
             "model.layers.0.mlp.up_proj.weight"]
    assert len(partial) == 1 and "3 block-FP8 weights" in partial[0] and wrong[0] in partial[0]
    assert "reads 3 of them wrongly without an error" in partial[0] and "refuses" not in partial[0]
    warned = []
    report = lora_merge.verify(tmp_path / "out", lora=adapter, base=hf, warn=warned.append)
    assert report.ok and report.notes == partial and [w for w in warned if w in partial] == partial  # said, too
    ours = load_file(tmp_path / "out/model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True))
    written = {name: dequantize_rows(ours[name], ours[name + "_scale_inv"], 0, (BLOCK, BLOCK))
               for name in ours if name + "_scale_inv" in ours}
    differ = sorted(name for name, value in loaded.state_dict().items()
                    if name in written and not torch.equal(value, written[name]))
    assert differ == wrong


def test_partial_blocks_transformers_refuses_are_warned_about(tmp_path):
    """MLP width 260: a grid of 3 blocks that does not divide 260, which transformers' CPU loader refuses."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    hf, adapter = tiny_llama(tmp_path, 260)
    notes = []
    lora_merge.merge(base=hf, lora=adapter, hf_ref=hf, out=tmp_path / "out", dtype="fp8", sha256=False,
                     warn=notes.append)
    partial = [n for n in notes if "partial 128x128 block" in n]
    assert len(partial) == 1 and "refuses 3 of them" in partial[0] and "wrongly" not in partial[0]
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    logging.getLogger("transformers").addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="issues during automatic conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    printed = logged.getvalue()
    for name, shape, grid in (("gate_proj", (260, 256), (3, 2)), ("up_proj", (260, 256), (3, 2)),
                              ("down_proj", (256, 260), (2, 3))):
        assert f"Weight shape {shape} not divisible by scale grid {grid}" in printed, name


def test_no_partial_block_note_where_transformers_reads_every_block(tmp_path):
    notes = []
    out = merge_fp8(FIXTURES["qwen3_moe"], tmp_path / "out", sha256=False, warn=notes.append)
    assert not [n for n in notes if "partial 128x128 block" in n]
    assert lora_merge.verify(out, lora=FIXTURES["qwen3_moe"] / "lora", base=FIXTURES["qwen3_moe"] / "base",
                             warn=quiet).notes == []


@pytest.mark.parametrize("amax", AMAXES.values(), ids=AMAXES.keys())
def test_power_of_two_scales_are_sound_over_the_whole_float32_range(amax):
    """scale_fmt ue8m0 (DeepSeek-V3.1/V3.2): every scale the smallest power of two at least max(amax / 448,
    2^-126) (computed here with Python's exact math), no NaN code, the values within half an e4m3 step."""
    import math

    from lora_merge.errors import MergeError
    from lora_merge.fp8 import dequantize_rows, quantize_rows

    w = block_with_amax(amax)
    if amax > 448 * 2.0 ** 119:  # 2^120 scales: q rounded up to 256 would dequantize to 2^128
        with pytest.raises(MergeError, match="cannot be stored with power-of-two scales"):
            quantize_rows(w, (BLOCK, BLOCK), pow2=True)
        return
    q, s = quantize_rows(w, (BLOCK, BLOCK), pow2=True)
    assert not (q.view(torch.uint8) & 0x7F == 0x7F).any(), "NaN codes"
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            m = float(w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max())
            want = 1.0 if m == 0 else 2.0 ** math.ceil(math.log2(max(m / 448.0, 2.0 ** -126)))
            if m and 2.0 ** math.floor(math.log2(max(m / 448.0, 2.0 ** -126))) >= max(m / 448.0, 2.0 ** -126):
                want = 2.0 ** math.floor(math.log2(max(m / 448.0, 2.0 ** -126)))  # already a power of two
            assert float(s[i, j]) == want, (i, j, float(s[i, j]), want)
    back = dequantize_rows(q, s, 0, (BLOCK, BLOCK))
    assert torch.isfinite(back).all() and half_step(back, w, s)


def test_a_ue8m0_block_near_float16s_limit_gets_scale_256_and_reads_back():
    """A block of 60000 (within float16's range) takes the power of two above 65504/448, 256: a ue8m0 base may
    hold it, and a block past 448·2^119 is refused naming its tensor."""
    from lora_merge.errors import MergeError
    from lora_merge.fp8 import BlockQuantizer, check_scales, quantize_rows

    w = block_with_amax(60000.0)
    q, s = quantize_rows(w, (BLOCK, BLOCK), pow2=True)
    assert float(s.max()) == 256.0
    check_scales(s, "release", pow2=True)  # read back as a base
    with pytest.raises(MergeError, match="scale 512"):
        check_scales(s * 2, "release", pow2=True)
    with pytest.raises(MergeError, match="^model.layers.0.mlp.down_proj.weight: a block of"):
        BlockQuantizer(tuple(w.shape), (BLOCK, BLOCK), True, "model.layers.0.mlp.down_proj.weight").add(
            block_with_amax(3.2e38))
