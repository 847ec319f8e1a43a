"""A Megatron LoRA merged straight onto HF weights (`--base HF_DIR`): byte for byte the model the same LoRA
gives merged onto the Megatron base the HF weights came from."""

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from helpers import FIXTURES, fixture_info
from lora_merge.cli import main

MOE = Path(__file__).parent / "fixtures_moe"
CASES = [FIXTURES / n for n in ("tp2pp2_bf16_unfiltered", "qwen3_tp2_fp32", "tied_pp2_llama_fp32", "vpp2_fp32_filtered")] \
    + [MOE / n for n in ("qwen2moe_tp2ep2", "mixtral_ep2")]


def _args(root: Path, out: Path, base: Path | None = None) -> list[str]:
    info = fixture_info(root.name) if root.parent == FIXTURES else {"lora": "filtered"}
    base = base or (root / "base" if info["lora"] == "filtered" else None)
    return (["--base", str(base)] if base else []) + ["--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                                                      "--out", str(out), "--no-progress"]


@pytest.fixture
def hf_bases(base_model):
    return base_model


@pytest.mark.parametrize("root", CASES, ids=lambda p: p.name)
def test_lora_onto_the_hf_base_is_the_merge_onto_the_megatron_base(root, tmp_path, hf_bases, capsys):
    megatron, onto_hf = tmp_path / "megatron", tmp_path / "onto_hf"
    assert main(_args(root, megatron)) == 0
    assert main(_args(root, onto_hf, base=hf_bases(root)) + ["--verify"]) == 0, capsys.readouterr().err
    shards = sorted(p.name for p in megatron.glob("*.safetensors"))
    assert shards == sorted(p.name for p in onto_hf.glob("*.safetensors"))
    for shard in shards:
        assert (onto_hf / shard).read_bytes() == (megatron / shard).read_bytes(), shard


def _failing(args, capsys, *expected):
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    for text in expected:
        assert text in err[0], err[0]


def _edited_base(hf_bases, tmp_path, root, edit) -> Path:
    base = tmp_path / "base"
    shutil.copytree(hf_bases(root), base)
    (shard,) = base.glob("*.safetensors")
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return base


def test_an_hf_base_missing_a_tensor_or_holding_an_unknown_one_is_refused(tmp_path, hf_bases, capsys):
    root = FIXTURES / "qwen3_tp2_fp32"
    base = _edited_base(hf_bases, tmp_path, root, lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"))
    _failing(_args(root, tmp_path / "out", base=base), capsys, "missing model.layers.1.self_attn.q_norm.weight")
    shutil.rmtree(base)
    base = _edited_base(hf_bases, tmp_path, root, lambda t: t.__setitem__("model.layers.1.extra.weight", t["model.norm.weight"].clone()))
    _failing(_args(root, tmp_path / "out", base=base), capsys, "tensors this qwen3 layout does not know",
             "model.layers.1.extra.weight")
    assert not (tmp_path / "out").exists()


def test_an_unfiltered_lora_trained_on_other_weights_than_the_hf_base_is_refused(tmp_path, hf_bases, capsys):
    root = FIXTURES / "tp2pp2_bf16_unfiltered"

    def other(t):
        t["model.layers.2.mlp.down_proj.weight"] = t["model.layers.2.mlp.down_proj.weight"] * 2
    base = _edited_base(hf_bases, tmp_path, root, other)
    _failing(_args(root, tmp_path / "out", base=base), capsys, "its own base weights differ from --base",
             "linear_fc2")


def test_verify_checks_a_merge_onto_an_hf_base_against_it(tmp_path, hf_bases, capsys):
    """`verify --base HF_DIR`: the HF weights are the baseline, as with merge --verify; a changed value in
    the output is found."""
    from safetensors.torch import load_file, save_file

    root = FIXTURES / "qwen3_tp2_fp32"
    out = tmp_path / "out"
    assert main(_args(root, out, base=hf_bases(root))) == 0
    check = ["verify", str(out), "--base", str(hf_bases(root)), "--lora", str(root / "lora"), "--hf-ref",
             str(root / "hf_ref")]
    assert main(check) == 0, capsys.readouterr()
    assert "reference weights in" in capsys.readouterr().out
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(check) == 1
    assert "model.norm.weight" in capsys.readouterr().out


@pytest.mark.parametrize("change,words", [
    ({"num_hidden_layers": 2, "layer_types": None}, ["the HF base's num_layers is 2 but --hf-ref's", "is 4"]),
    ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
     ["the HF base's rope_theta is 500000.0", "is 10000.0"]),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
     ["the HF base's model_type is 'qwen2' but --hf-ref's", "is 'qwen3'"]),
    ({"rms_norm_eps": 1e-5}, ["the HF base's norm_eps is 1e-05", "is 1e-06"]),
])
def test_an_hf_base_whose_config_describes_another_model_is_refused(change, words, tmp_path, hf_bases, capsys):
    """Its config.json is read as the reference's is; the first field that differs is named with both
    values (the output would get --hf-ref's config over another model's weights)."""
    import json

    root = FIXTURES / "qwen3_tp2_fp32"
    base = tmp_path / "base"
    shutil.copytree(hf_bases(root), base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({k: v for k, v in {**config, **change}.items() if v is not None}))
    capsys.readouterr()  # what making the HF base said
    _failing(_args(root, tmp_path / "out", base=base), capsys, f"{base / 'config.json'}: ", *words,
             "expected the base to be the model --hf-ref describes")
    assert not (tmp_path / "out").exists()


def test_an_hf_base_config_that_only_restates_the_reference_is_accepted(tmp_path, hf_bases, capsys):
    """Keys that change nothing computed (dtype, generation settings, _name_or_path) may differ."""
    import json

    root = FIXTURES / "qwen3_tp2_fp32"
    base = tmp_path / "base"
    shutil.copytree(hf_bases(root), base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "use_cache": False,
                                                  "_name_or_path": "elsewhere"}))
    assert main(_args(root, tmp_path / "out", base=base)) == 0, capsys.readouterr().err
