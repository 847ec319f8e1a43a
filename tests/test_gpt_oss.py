"""gpt-oss (gpt_oss) on the HF routes: q/k/v/o biases and attention sinks, a router with a bias, experts stored
stacked ([E, hidden, 2·ffn] with interleaved gate/up columns, [E, ffn, hidden]) and adapted by PEFT's
target_parameters expert by expert. From a bf16 base our merge equals PEFT's merge_and_unload, loads whole in
transformers' GptOssForCausalLM, and verify checks the stacked experts against the factors. The MXFP4 release is read
dequantized as transformers dequantizes it. Its Megatron form: test_gpt_oss_megatron.py."""

from pathlib import Path

import pytest
import torch

from helpers import assert_merges_as_peft, random_hf_model, run_failing


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import GptOssConfig

    return random_hf_model(GptOssConfig(
        vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        architectures=["GptOssForCausalLM"], bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16"),
        tmp_path_factory.mktemp("gpt_oss") / "base")


def test_a_peft_adapter_on_the_stacked_experts_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ours, base = assert_merges_as_peft(hf_base, lora, 9, tmp_path, verify=True)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert all((ours[name][e] - base[name][e]).abs().max() > 0 for e in range(4)), name  # each expert's own


def test_the_published_config_reads_as_transformers_reads_it(tmp_path):
    """openai/gpt-oss-20b's config.json as published (its MXFP4 quantization_config included)."""
    import json

    from lora_merge.model.hf_config import read_hf_config

    published = json.loads((Path(__file__).parent / "data/published_configs/openai__gpt-oss-20b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, _ = read_hf_config(tmp_path, [])
    assert shape.model_type == "gpt_oss" and shape.moe.num_experts == 32 and shape.qkv_bias


def test_dequantization_is_transformers_own_block_by_block():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lora_merge.mxfp4 import Mxfp4Weight

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 8, 2), dtype=torch.uint8, generator=g)
    weight = Mxfp4Weight(blocks, scales)
    assert weight.shape == (3, 64, 8)
    assert torch.equal(weight.rows(0, 3), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(weight.rows(1, 2), convert_moe_packed_tensors(blocks[1:2], scales[1:2], dtype=torch.float32))


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_mxfp4(w: torch.Tensor):
    """OCP MX quantization of a stacked [E, in, out] parameter, written from the spec: per 32 consecutive input
    values of each output row, the shared exponent floor(log2(amax)) - 2 (E2M1's largest exponent), stored as
    E8M0 (+127); each value the nearest E2M1 code of w / 2^exponent (clamped to ±6); two codes a byte, low first."""
    t = w.transpose(1, 2).float()  # [E, out, in]: the blocks run along the input
    x = t.reshape(*t.shape[:2], -1, 32)
    amax = x.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2, torch.full_like(amax, -127))
    scales = (exponent + 127).clamp(0, 254).to(torch.uint8)
    v = x / torch.exp2(scales.float() - 127).unsqueeze(-1)
    magnitude = (v.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest (the first of two at a tie)
    codes = (magnitude | ((v < 0).to(torch.int64) << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), scales.contiguous()


@pytest.fixture(scope="module")
def mxfp4_release(hf_base, tmp_path_factory):
    """The MXFP4 release of hf_base (experts quantized as OpenAI's release is, the rest as it was), and its twin
    holding the same values dequantized by transformers' own convert_moe_packed_tensors, in bf16 (exact: E2M1
    values times powers of two)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    tensors = load_file(hf_base / "model.safetensors")
    release, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = reference_mxfp4(t)
            release[name + "_blocks"], release[name + "_scales"] = blocks, scales
            twin[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).to(torch.bfloat16)
        else:
            release[name] = twin[name] = t
    config = json.loads((hf_base / "config.json").read_text())
    for d, weights, quantized in ((root / "mxfp4", release, True), (root / "dequantized", twin, False)):
        shutil.copytree(hf_base, d, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
        if quantized:
            (d / "config.json").write_text(json.dumps({**config, "quantization_config": {
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}))
    return root / "mxfp4", root / "dequantized"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_mxfp4_release_merges_as_its_dequantized_values(mxfp4_release, tmp_path, dtype):
    """Its experts read dequantized expert by expert: the merge with a PEFT adapter on the experts is the same
    bytes as the merge onto transformers' own dequantization of them; the output is unquantized."""
    import json

    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import lora_merge
    from helpers import trained_peft_adapter

    mxfp4, dequantized = mxfp4_release
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                         11, tmp_path / "adapter")
    for base, out in ((mxfp4, tmp_path / "from-mxfp4"), (dequantized, tmp_path / "from-deq")):
        lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=base, out=out, dtype=dtype,
                         warn=lambda m: None)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("from-mxfp4", "from-deq"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "quantization_config" not in json.loads((tmp_path / "from-mxfp4/config.json").read_text())


def test_inspect_names_mxfp4_and_fp8_output_of_it_is_refused(mxfp4_release, tmp_path, capsys):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from helpers import trained_peft_adapter
    from lora_merge.cli import main

    mxfp4, dequantized = mxfp4_release
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), 12, tmp_path / "adapter")
    capsys.readouterr()  # (transformers' loading messages)
    run_failing(["--base", str(mxfp4), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(mxfp4), "--out",
                 str(tmp_path / "fp8"), "--dtype", "fp8"], capsys, "--dtype fp8 with the MXFP4 base")
    assert main(["inspect", str(mxfp4)]) == 0
    assert "MXFP4 experts read dequantized" in capsys.readouterr().out


def test_verify_reads_an_mxfp4_baseline_dequantized(mxfp4_release, tmp_path):
    """verify compares the stacked experts with the MXFP4 base's dequantized values plus each expert's change, and
    finds a changed expert."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import lora_merge
    from helpers import trained_peft_adapter

    mxfp4, dequantized = mxfp4_release
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                         13, tmp_path / "adapter")
    out = tmp_path / "out"
    lora_merge.merge(base=mxfp4, lora=tmp_path / "adapter", hf_ref=mxfp4, out=out, dtype="float32",
                     warn=lambda m: None)
    args = dict(lora=tmp_path / "adapter", base=mxfp4, hf_ref=mxfp4, warn=lambda m: None)
    report = lora_merge.verify(out, **args)
    assert not report.problems, report.problems
    status = report.statuses["model.layers.0.mlp.experts.gate_up_proj"]
    assert status.startswith("merged") and "no baseline" not in status, status
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj"][2, 5, 7] += 0.5
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    problems = lora_merge.verify(out, **args).problems
    assert any(p.startswith("model.layers.1.mlp.experts.down_proj") for p in problems), problems


def round_up_mxfp4(w: torch.Tensor):
    """MXFP4 as transformers quantizes gpt-oss (triton_kernels' downcast_to_mxfp, ROUND_UP scales), written from
    its definition: per 32 consecutive input values of each output row, the scale is the smallest power of two at
    or above the float32 amax / 6 (from 2^-126 up, as its float32 bit rounding gives for a subnormal quotient; 0 for
    an all-zero group), each value the nearest E2M1 value of w / scale, ties to the larger magnitude, the sign
    kept; two codes a byte, low first."""
    t = w.transpose(1, 2).float()
    x = t.reshape(*t.shape[:2], -1, 32)
    quotient = x.abs().amax(-1) / 6
    mantissa, exponent = torch.frexp(quotient)  # quotient = mantissa · 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # a power of two is its own scale
    exponent = torch.where(quotient < 2.0 ** -126, -126, exponent)
    exponent = torch.where(quotient == 0, -127, exponent)
    v = torch.where((quotient == 0).unsqueeze(-1), x * 0, x / torch.exp2(exponent.float()).unsqueeze(-1))
    flipped = E2M1.flip(0)  # argmin takes the first of two at a tie: the larger magnitude
    magnitude = 7 - (v.abs().unsqueeze(-1) - flipped).abs().argmin(-1)
    codes = (magnitude | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8)


def test_mxfp4_quantization_is_transformers_definition(monkeypatch):
    """Random values and the edges: every midpoint between two E2M1 values (a tie), ±, amax an exact 6·2^k,
    zero groups, groups of subnormal size, values far apart within a group; in the parameter's layout and in the
    blocks' own (an MXFP4 base's experts are merged and quantized in it), a few groups at a time."""
    import lora_merge.mxfp4 as mxfp4
    from lora_merge.mxfp4 import quantize, quantize_rows

    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 128, 24, generator=g) * torch.logspace(-3, 3, 24)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    w[0, :32, 0] = torch.cat([midpoints, -midpoints, midpoints * 4, -midpoints / 8])
    w[0, :32, 1] = 0.0
    w[0, :32, 2] = 1e-40
    w[0, :32, 3] = torch.linspace(-3e-38, 3e-38, 32)
    w[1, 32:64, 4] = torch.tensor([6.0 * 2 ** 5] + [1e-3] * 31)
    w[2, 64:96, 5] = -0.0
    want_blocks, want_scales = round_up_mxfp4(w)
    for values in (mxfp4.QUANTIZE_VALUES, 32 * 24 * 3, 1):  # whole, three groups of every output, one by one
        monkeypatch.setattr(mxfp4, "QUANTIZE_VALUES", values)
        for blocks, scales in (quantize(w), quantize_rows(w.transpose(1, 2).contiguous())):
            assert torch.equal(scales, want_scales)
            assert torch.equal(blocks.view(*blocks.shape[:2], -1), want_blocks.view(*blocks.shape[:2], -1))


def _merged(base, adapter, out, dtype):
    import lora_merge

    lora_merge.merge(base=base, lora=adapter, hf_ref=base, out=out, dtype=dtype, warn=lambda m: None)
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


EXPERTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
           "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")


def test_mxfp4_output_is_the_float32_merge_quantized_once_and_loads_in_transformers(hf_base, tmp_path):
    """From the bf16 base, --dtype mxfp4 writes every stacked experts parameter as gpt-oss's release does
    (_blocks/_scales, its quantization_config): the float32 merge quantized by the definition above, the rest the
    bytes of the bfloat16 merge. transformers loads it (dequantizing on CPU) to exactly those values, and verify
    passes it."""
    import json

    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    import lora_merge
    from helpers import trained_peft_adapter
    from lora_merge.mxfp4 import Mxfp4Weight

    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj"]), 21, tmp_path / "adapter")
    exact = _merged(hf_base, tmp_path / "adapter", tmp_path / "f32", "float32")
    bf16 = _merged(hf_base, tmp_path / "adapter", tmp_path / "bf16", "bfloat16")
    ours = _merged(hf_base, tmp_path / "adapter", tmp_path / "mx", "mxfp4")
    for name in EXPERTS:
        blocks, scales = round_up_mxfp4(exact[name])
        assert torch.equal(ours.pop(name + "_scales"), scales), name
        assert torch.equal(ours.pop(name + "_blocks"), blocks), name
        del bf16[name]
    assert ours.keys() == bf16.keys() and all(torch.equal(ours[k], bf16[k]) for k in ours)
    config = json.loads((tmp_path / "mx/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32)
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "mx/model.safetensors")
    for name in EXPERTS:
        module, _, param = name.removeprefix("model.").rpartition(".")
        loaded = getattr(model.model.get_submodule(module), param)
        deq = Mxfp4Weight(stored[name + "_blocks"], stored[name + "_scales"]).rows(0, 4)
        assert torch.equal(loaded.float(), deq), name
        assert not torch.equal(deq, exact[name])  # (quantized, not passed through)
    report = lora_merge.verify(tmp_path / "mx", lora=tmp_path / "adapter", hf_ref=hf_base, warn=lambda m: None)
    assert report.ok, report.problems
    assert report.statuses[EXPERTS[0]].startswith("MXFP4: within half an E2M1 step of baseline + ")


def test_an_mxfp4_release_written_back_keeps_its_untouched_experts_as_stored(mxfp4_release, tmp_path):
    """From the MXFP4 release (its scales the OCP floor rule's, not transformers'), an adapter on gate_up_proj
    only: down_proj's blocks and scales are the release's bytes, gate_up_proj the float32 merge quantized;
    a damaged scale in the output is found by verify."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import lora_merge
    from helpers import trained_peft_adapter

    mxfp4, dequantized = mxfp4_release
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj"]), 22, tmp_path / "adapter")
    exact = _merged(mxfp4, tmp_path / "adapter", tmp_path / "f32", "float32")
    ours = _merged(mxfp4, tmp_path / "adapter", tmp_path / "mx", "mxfp4")
    release = load_file(mxfp4 / "model.safetensors")
    for name in EXPERTS:
        if name.endswith("down_proj"):
            for part in ("_blocks", "_scales"):
                assert torch.equal(ours[name + part], release[name + part]), name + part
        else:
            blocks, scales = round_up_mxfp4(exact[name])
            assert torch.equal(ours[name + "_blocks"], blocks) and torch.equal(ours[name + "_scales"], scales)
            assert not torch.equal(ours[name + "_scales"], release[name + "_scales"])
    args = dict(lora=tmp_path / "adapter", hf_ref=mxfp4, warn=lambda m: None)
    assert lora_merge.verify(tmp_path / "mx", **args).ok
    damaged = dict(ours)
    damaged["model.layers.1.mlp.experts.down_proj_scales"] = ours["model.layers.1.mlp.experts.down_proj_scales"].clone()
    damaged["model.layers.1.mlp.experts.down_proj_scales"][1, 3, 0] += 1  # twice the values of one group
    save_file(damaged, tmp_path / "mx/model.safetensors", metadata={"format": "pt"})
    problems = lora_merge.verify(tmp_path / "mx", **args).problems
    assert any(p.startswith("model.layers.1.mlp.experts.down_proj: its MXFP4 values differ") for p in problems), problems
    for name in ("model.layers.1.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"):  # an expert
        damaged = dict(ours)  # zeroed under the largest scale: its values within half a step of *that* scale
        damaged[name + "_blocks"] = ours[name + "_blocks"].clone()
        damaged[name + "_scales"] = ours[name + "_scales"].clone()
        damaged[name + "_blocks"][0], damaged[name + "_scales"][0] = 0, 254
        save_file(damaged, tmp_path / "mx/model.safetensors", metadata={"format": "pt"})
        problems = lora_merge.verify(tmp_path / "mx", **args).problems
        assert any(p.startswith(f"{name}: its MXFP4 values differ") for p in problems), problems


def test_mxfp4_output_is_refused_where_there_is_no_mxfp4_release(tmp_path, capsys):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers import trained_peft_adapter

    base = random_hf_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                       architectures=["LlamaForCausalLM"]), tmp_path / "llama")
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         LoraConfig(r=2, target_modules=["q_proj"]), 1, tmp_path / "adapter")
    capsys.readouterr()
    run_failing(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(base), "--out",
                 str(tmp_path / "out"), "--dtype", "mxfp4"], capsys, "--dtype mxfp4 writes gpt-oss's MXFP4 release "
                "form; llama has no MXFP4 release")
    assert not (tmp_path / "out").exists()
