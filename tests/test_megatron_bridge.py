"""Megatron-Bridge checkpoints (tests/fixtures/bridge_tp2_fp32, written by scripts/make_bridge_fixture.py: the real
megatron-core 0.16.1 saving Bridge's adapter structure at TP=2, with its run_config.yaml instead of Megatron args).

The generic fixture tests (test_end_to_end, test_peft_oracle, test_export_adapter, test_inspect) already run it
against the Megatron logits and PEFT. Here: the Bridge LoRA holds the same factors as the MindSpeed fixture
tp2_fp32_filtered, so on any form of the same base (Bridge's torch_dist, Megatron-LM's legacy files, HF safetensors)
it must give that fixture's bytes; the args in run_config.yaml are checked against the HF config like Megatron-LM's;
Bridge's other PEFT methods are refused by name."""

import shutil
from pathlib import Path

import pytest
import yaml

import lora_merge
from helpers import FIXTURES, quiet, run_failing
from lora_merge.errors import UnsupportedInput
from lora_merge.readers import bridge

BRIDGE = FIXTURES / "bridge_tp2_fp32"
MINDSPEED = FIXTURES / "tp2_fp32_filtered"  # the same model and LoRA values, saved by MindSpeed-LLM's PEFT path


def files_of(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "out"
    lora_merge.merge(base=MINDSPEED / "base", lora=MINDSPEED / "lora", hf_ref=MINDSPEED / "hf_ref", out=out, warn=quiet)
    return files_of(out)


@pytest.mark.parametrize("base", ["bridge", "megatron-lm", "hf"])
def test_a_bridge_lora_gives_the_mindspeed_lora_s_bytes_on_every_form_of_the_base(base, reference, tmp_path):
    if base == "hf":
        lora_merge.merge(base=BRIDGE / "base", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "hf", warn=quiet)
    base_dir = {"bridge": BRIDGE / "base", "megatron-lm": MINDSPEED / "base", "hf": tmp_path / "hf"}[base]
    result = lora_merge.merge(base=base_dir, lora=BRIDGE / "lora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "out",
                              warn=quiet)
    assert result.lora_modules == 16
    assert files_of(tmp_path / "out") == reference


def test_the_bridge_base_converts_to_the_megatron_lm_base_s_bytes(tmp_path):
    for name, base in (("bridge", BRIDGE / "base"), ("mlm", MINDSPEED / "base")):
        lora_merge.merge(base=base, hf_ref=BRIDGE / "hf_ref", out=tmp_path / name, warn=quiet)
    assert files_of(tmp_path / "bridge") == files_of(tmp_path / "mlm")


def copy_with_config(tmp_path: Path, edit, which: str = "lora") -> Path:
    root = tmp_path / "bridge"
    shutil.copytree(BRIDGE, root)
    path = root / which / "iter_0000010" / "run_config.yaml" if which == "lora" else \
        root / which / "iter_0000001" / "run_config.yaml"
    config = yaml.safe_load(path.read_text())
    edit(config)
    path.write_text(yaml.safe_dump(config))
    return root


def args_of(root: Path, out: Path) -> list[str]:
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out)]


@pytest.mark.parametrize("target, named", [
    ("megatron.bridge.peft.canonical_lora.CanonicalLoRA", "CanonicalLoRA"),
    ("megatron.bridge.peft.dora.DoRA", "DoRA"),
    ("megatron.bridge.peft.lora.VLMLoRA", "VLMLoRA"),
    ("mypackage.MyAdapter", "not Megatron-Bridge's LoRA"),
])
def test_bridge_s_other_peft_methods_are_refused_by_name(target, named, tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["peft"].update(_target_=target))
    run_failing(args_of(root, tmp_path / "out"), capsys, "run_config.yaml", named)


@pytest.mark.parametrize("key, value, named", [
    ("normalize_moe_lora", True, "normalize_moe_lora"),
    ("experts_shared_outer_loras", True, "experts_shared_outer_loras"),
])
def test_expert_lora_options_not_read_yet_are_refused(key, value, named, tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["peft"].update({key: value}))
    run_failing(args_of(root, tmp_path / "out"), capsys, named)


def test_the_run_config_s_model_is_checked_against_the_hf_config(tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["model"].update(num_query_groups=2))
    run_failing(args_of(root, tmp_path / "out"), capsys, "args.num_query_groups=2", "num_key_value_heads")


def test_a_non_silu_gated_activation_is_refused(tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["model"].update(
        activation_func={"_target_": "torch.nn.functional.gelu", "_call_": False}))
    run_failing(args_of(root, tmp_path / "out"), capsys, "args.swiglu=False")


def test_bridge_s_dim_and_alpha_set_the_scale(tmp_path):
    root = copy_with_config(tmp_path, lambda c: c["peft"].update(alpha=24))
    result = lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "out",
                              warn=quiet)
    assert (result.r, result.alpha, result.scale) == (4, 24, 6)


@pytest.mark.parametrize("text, named", [
    ("model: [1, 2\n", "unreadable YAML"),
    ("peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n", "no 'model' mapping"),
])
def test_a_damaged_run_config_is_named(text, named, tmp_path, capsys):
    root = tmp_path / "bridge"
    shutil.copytree(BRIDGE, root)
    (root / "lora" / "iter_0000010" / "run_config.yaml").write_text(text)
    run_failing(args_of(root, tmp_path / "out"), capsys, "run_config.yaml", named)


@pytest.mark.parametrize("key, named", [
    ("decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude", "DoRA"),
    ("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight", "CanonicalLoRA"),
    ("decoder.layers.0.self_attention.linear_qkv.adapter.something.weight", "no kind this tool reads"),
    ("decoder.layers.0.mlp.experts.experts.linear_fc1.adapter.linear_in.weight", "routed experts"),
])
def test_adapter_entries_of_other_kinds_are_refused_by_name(key, named):
    with pytest.raises(UnsupportedInput, match=named):
        bridge.lora_name(key, "where")


def test_adapter_entries_read_as_peft_s_factors():
    assert bridge.lora_name("decoder.layers.mlp.linear_fc1.adapter.linear_in.weight", "w") == \
        "decoder.layers.mlp.linear_fc1.lora_A.default.weight"
    assert bridge.lora_name("decoder.layers.mlp.linear_fc1.adapter.linear_out.weight", "w") == \
        "decoder.layers.mlp.linear_fc1.lora_B.default.weight"
    assert bridge.lora_name("decoder.layers.mlp.linear_fc1.weight", "w") == "decoder.layers.mlp.linear_fc1.weight"


def test_the_builder_config_s_nested_transformer_fields_are_read(tmp_path):
    """Newer Bridge configs keep TransformerConfig's fields under model.transformer."""
    def nest(config):
        model = config["model"]
        inner = {k: model.pop(k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                           "kv_channels", "ffn_hidden_size", "gated_linear_unit", "activation_func")}
        model["transformer"] = inner
    root = copy_with_config(tmp_path, nest)
    args = bridge.bridge_args(root / "lora" / "iter_0000010")
    assert (args.num_layers, args.num_query_groups, args.swiglu, args.group_query_attention) == (4, 4, True, True)
    assert (args.lora_r, args.lora_alpha, args.lora_target_modules) == (
        4, 12, ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"])
