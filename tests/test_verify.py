"""`lora-merge verify` passes on a good output and catches a flipped value, swapped projections and a
missing tensor. The baseline is an HF reference directory holding real weights."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import FIXTURES, merge_args
from lora_merge.cli import main

NAME = "tp2_fp32_filtered"


@pytest.fixture
def setup(merged_fixture, base_model):
    """(reference HF dir with the base weights, good merged output)."""
    # The base as an HF model: LoRA scaled to nothing. The e2e and PEFT tests check this equals Megatron's base.
    return base_model(NAME), merged_fixture(NAME)


def verify(out, reference, capsys, *extra):
    code = main(["verify", str(out), "--lora", str(FIXTURES / NAME / "lora"), "--hf-ref", str(reference), *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def corrupt(good, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def test_good_output_passes(setup, capsys, tmp_path):
    reference, good = setup
    report = tmp_path / "report.json"
    code, text = verify(good, reference, capsys, "--report", str(report))
    assert code == 0, text
    assert "23 identical to baseline" in text and "28 merged" in text
    data = json.loads(report.read_text())
    assert data["verify"]["ok"] and data["verify"]["baseline"].startswith("reference weights")
    assert len(data["files"]["model.safetensors"]["sha256"]) == 64


def test_merge_with_verify_and_report(setup, tmp_path, capsys):
    reference, _ = setup
    out, report = tmp_path / "out", tmp_path / "r.json"
    assert main(merge_args(NAME, out) + ["--verify", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["verify"]["ok"]
    assert data["inputs"]["lora"]["iteration"] == "10" and data["inputs"]["base"]["tp"] == 2
    assert data["lora_settings"] == {"r": 4, "alpha": 12.0, "scale": 3.0, "source": "checkpoint args"}
    assert data["tensors"]["model.layers.0.self_attn.q_proj.weight"]["status"] == "merged with LoRA"
    assert data["tensors"]["model.norm.weight"]["status"] == "converted"
    import hashlib
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert data["files"]["model.safetensors"]["sha256"] == digest


@pytest.mark.parametrize("tensor", ["model.layers.1.input_layernorm.weight",  # untouched: must be bit-identical
                                    "model.layers.2.mlp.down_proj.weight"])  # touched: base + delta
def test_single_flipped_value_fails(setup, tmp_path, capsys, tensor):
    reference, good = setup

    def flip(tensors):
        bits = tensors[tensor].view(torch.int32).clone()
        bits.view(-1)[7] ^= 1 << 20  # one mantissa bit of one element
        tensors[tensor] = bits.view(torch.float32)

    code, text = verify(corrupt(good, tmp_path, flip), reference, capsys)
    assert code == 1 and tensor in text, text


def test_swapped_q_and_k_fails(setup, tmp_path, capsys):
    reference, good = setup

    def swap(tensors):
        p = "model.layers.0.self_attn."
        tensors[p + "q_proj.weight"], tensors[p + "k_proj.weight"] = tensors[p + "k_proj.weight"], tensors[p + "q_proj.weight"]

    code, text = verify(corrupt(good, tmp_path, swap), reference, capsys)
    assert code == 1 and "q_proj.weight: shape [32, 64]" in text, text


def test_swapped_k_and_v_of_the_same_shape_fails(setup, tmp_path, capsys):
    reference, good = setup

    def swap(tensors):
        p = "model.layers.3.self_attn."
        tensors[p + "k_proj.bias"], tensors[p + "v_proj.bias"] = tensors[p + "v_proj.bias"], tensors[p + "k_proj.bias"]

    code, text = verify(corrupt(good, tmp_path, swap), reference, capsys)
    assert code == 1 and "k_proj.bias" in text and "differs from the baseline" in text, text


def test_missing_tensor_fails(setup, tmp_path, capsys):
    reference, good = setup
    code, text = verify(corrupt(good, tmp_path, lambda t: t.pop("lm_head.weight")), reference, capsys)
    assert code == 1 and "lm_head.weight: missing from the output" in text, text


def test_verify_against_megatron_base_without_reference_weights(setup, capsys):
    _, good = setup
    code = main(["verify", str(good), "--lora", str(FIXTURES / NAME / "lora"),
                 "--base", str(FIXTURES / NAME / "base")])
    text = capsys.readouterr().out
    assert code == 0 and "baseline: Megatron base" in text and "28 merged" in text, text


def test_no_sha256_writes_the_same_model_and_says_the_hashes_were_not_computed(tmp_path, capsys, merged_fixture):
    out, report = tmp_path / "out", tmp_path / "r.json"
    assert main(merge_args(NAME, out) + ["--no-sha256", "--report", str(report)]) == 0
    files = json.loads(report.read_text())["files"]
    assert files and all(entry == {"sha256": None} for entry in files.values())
    assert "model.safetensors" in files and "config.json" in files
    card = (out / "README.md").read_text()
    assert "| model.safetensors | not computed (--no-sha256) |" in card and "`" not in card.split("## Files")[1]
    assert (out / "model.safetensors").read_bytes() == (merged_fixture(NAME) / "model.safetensors").read_bytes()

    import lora_merge
    result = lora_merge.merge(base=FIXTURES / NAME / "base", lora=FIXTURES / NAME / "lora",
                              hf_ref=FIXTURES / NAME / "hf_ref", out=tmp_path / "api", sha256=False)
    assert result.sha256 == {} and "model.safetensors" in result.files


def test_verify_on_a_megatron_output_says_plainly_that_it_is_not_supported(tmp_path, capsys):
    """A Megatron checkpoint given to verify (what --to megatron writes, or any Megatron dir): one line saying
    verify checks HF outputs only and how to check one, not "no config.json"."""
    root = FIXTURES / "tp2_fp32_filtered"
    assert main(["--to", "megatron", "--base", str(root / "base"), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(tmp_path / "mg"), "--no-progress"]) == 0
    capsys.readouterr()
    for directory in (tmp_path / "mg", root / "base", tmp_path / "mg/release"):
        assert main(["verify", str(directory), "--lora", str(root / "lora")]) == 2
        err = capsys.readouterr().err
        assert "a Megatron checkpoint; verify checks HF outputs only (verifying a Megatron output is not supported" \
            in err and err.count("\n") == 1, err


def test_verify_of_a_peft_merge_onto_an_hf_deepseek_base(tmp_path, capsys):
    """An architecture with two Megatron namings of one projection (MLA: MindSpeed's fused linear_qkv) asks
    its inputs which naming they hold; an HF base and a PEFT adapter hold none, and say so (verify crashed with
    AttributeError here)."""
    import lora_merge

    root = FIXTURES.parent / "fixtures_deepseek/deepseek_v3_ep2"
    hf_base, adapter, out = tmp_path / "hf_base", tmp_path / "adapter", tmp_path / "out"
    lora_merge.merge(base=root / "base", hf_ref=root / "hf_ref", out=hf_base, warn=lambda m: None)
    lora_merge.export_adapter(lora=root / "lora", hf_ref=root / "hf_ref", out=adapter, warn=lambda m: None)
    lora_merge.merge(base=hf_base, lora=adapter, hf_ref=hf_base, out=out, warn=lambda m: None)
    report = lora_merge.verify(out, lora=adapter, base=hf_base, warn=lambda m: None)
    assert report.ok and any("baseline + " in status for status in report.statuses.values()), report.problems
    assert main(["verify", str(out), "--lora", str(adapter), "--base", str(hf_base)]) == 0
