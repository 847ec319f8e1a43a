"""Megatron-Bridge checkpoints (tests/fixtures/bridge_tp2_fp32 at TP=2 and tests/fixtures_moe/bridge_qwen3moe_ep2 at
EP=2, written by scripts/make_bridge_fixture.py: the real megatron-core 0.16.1 saving Bridge's adapter structures,
with its run_config.yaml instead of Megatron args).

The generic fixture tests (test_end_to_end, test_peft_oracle, test_export_adapter, test_inspect) already run the
dense one against the Megatron logits and PEFT. Here: each Bridge LoRA holds the same factors as a MindSpeed
fixture (tp2_fp32_filtered, qwen3moe_ep2), so on any form of the same base (Bridge's torch_dist, Megatron-LM's files,
HF safetensors) it must give that fixture's bytes; CanonicalLoRA and DoRA against their own Megatron forward and
PEFT; the args in run_config.yaml checked against the HF config like Megatron-LM's; what is not read refused by
name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import lora_merge
from helpers import FIXTURES, quiet, run_failing
from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.readers import bridge

BRIDGE = FIXTURES / "bridge_tp2_fp32"
MINDSPEED = FIXTURES / "tp2_fp32_filtered"  # the same model and LoRA values, saved by MindSpeed-LLM's PEFT path


def files_of(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The bytes of the MindSpeed fixture holding the same LoRA factors, merged once per fixture."""
    cache = {}

    def get(mindspeed: Path) -> dict:
        if mindspeed not in cache:
            out = tmp_path_factory.mktemp("ref") / "out"
            lora_merge.merge(base=mindspeed / "base", lora=mindspeed / "lora", hf_ref=mindspeed / "hf_ref", out=out,
                             warn=quiet)
            cache[mindspeed] = files_of(out)
        return cache[mindspeed]
    return get


def merged_on(base: str, bridge: Path, mindspeed: Path, tmp_path: Path):
    """The Bridge LoRA merged on its base in one of three forms: Bridge's own, Megatron-LM's, HF."""
    if base == "hf":
        lora_merge.merge(base=bridge / "base", hf_ref=bridge / "hf_ref", out=tmp_path / "hf", warn=quiet)
    base_dir = {"bridge": bridge / "base", "megatron-lm": mindspeed / "base", "hf": tmp_path / "hf"}[base]
    return lora_merge.merge(base=base_dir, lora=bridge / "lora", hf_ref=bridge / "hf_ref", out=tmp_path / "out",
                            warn=quiet)


@pytest.mark.parametrize("base", ["bridge", "megatron-lm", "hf"])
def test_a_bridge_lora_gives_the_mindspeed_lora_s_bytes_on_every_form_of_the_base(base, reference, tmp_path):
    result = merged_on(base, BRIDGE, MINDSPEED, tmp_path)
    assert result.lora_modules == 16
    assert files_of(tmp_path / "out") == reference(MINDSPEED)


def test_the_bridge_base_converts_to_the_megatron_lm_base_s_bytes(tmp_path):
    for name, base in (("bridge", BRIDGE / "base"), ("mlm", MINDSPEED / "base")):
        lora_merge.merge(base=base, hf_ref=BRIDGE / "hf_ref", out=tmp_path / name, warn=quiet)
    assert files_of(tmp_path / "bridge") == files_of(tmp_path / "mlm")


def copy_with_config(tmp_path: Path, edit, which: str = "lora") -> Path:
    root = tmp_path / "bridge"
    shutil.copytree(BRIDGE, root)
    tracker = (root / which / "latest_checkpointed_iteration.txt").read_text().strip()
    path = root / which / f"iter_{int(tracker):07d}" / "run_config.yaml"
    config = yaml.safe_load(path.read_text())
    edit(config)
    path.write_text(yaml.safe_dump(config))
    return root


def args_of(root: Path, out: Path) -> list[str]:
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out)]


@pytest.mark.parametrize("target, named", [
    ("megatron.bridge.peft.dora.DoRA", "DoRA"),
    ("megatron.bridge.peft.lora.VLMLoRA", "VLMLoRA"),
    ("mypackage.MyAdapter", "not Megatron-Bridge's LoRA"),
])
def test_bridge_s_other_peft_methods_are_refused_by_name(target, named, tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["peft"].update(_target_=target))
    run_failing(args_of(root, tmp_path / "out"), capsys, "run_config.yaml", named)


def test_shared_outer_expert_lora_is_refused(tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["peft"].update(experts_shared_outer_loras=True))
    run_failing(args_of(root, tmp_path / "out"), capsys, "experts_shared_outer_loras")


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
    ("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight", "not CanonicalLoRA"),
    ("decoder.layers.0.self_attention.linear_qkv.adapter.something.weight", "no kind this tool reads"),
    ("decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight", "expert adapter under a name not read"),
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
        inner["activation_func"] = "silu"  # BridgeGPTModelConfig.as_dict writes the short name
        model["transformer"] = inner
    root = copy_with_config(tmp_path, nest)
    args = bridge.bridge_args(root / "lora" / "iter_0000010")
    assert (args.num_layers, args.num_query_groups, args.swiglu, args.group_query_attention) == (4, 4, True, True)
    assert (args.lora_r, args.lora_alpha, args.lora_target_modules) == (
        4, 12, ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"])


# ---- CanonicalLoRA: q and v (no k) of linear_qkv, gate and up of linear_fc1, plus proj and fc2, saved at TP=2 ----

CANONICAL = BRIDGE / "lora_canonical"


def hf_logits(out: Path, input_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


@pytest.fixture(scope="module")
def canonical_merge(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("canonical") / "out"
    lora_merge.merge(base=BRIDGE / "base", lora=CANONICAL, hf_ref=BRIDGE / "hf_ref", out=out, warn=quiet)
    return out


def test_canonical_lora_computes_what_megatron_with_it_computes(canonical_merge):
    ref = torch.load(BRIDGE / "logits_canonical.pt", weights_only=True)
    logits = hf_logits(canonical_merge, ref["input_ids"])
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.5


def test_canonical_lora_leaves_the_projection_it_did_not_train_as_the_base_has_it(canonical_merge, tmp_path):
    lora_merge.merge(base=BRIDGE / "base", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "base", warn=quiet)
    ours, base = load_file(next(canonical_merge.glob("*.safetensors"))), load_file(next((tmp_path / "base").glob(
        "*.safetensors")))
    for layer in range(4):
        p = f"model.layers.{layer}."
        assert torch.equal(ours[p + "self_attn.k_proj.weight"], base[p + "self_attn.k_proj.weight"])
        for trained in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert not torch.equal(ours[p + trained + ".weight"], base[p + trained + ".weight"])


def test_canonical_lora_exported_is_each_projection_s_own_adapter(canonical_merge, tmp_path):
    """Each HF projection gets its adapter's factors at rank r (not the fused rank-3r module); PEFT with the exported
    adapter computes Megatron's logits, and its merge_and_unload gives our merge."""
    lora_merge.merge(base=BRIDGE / "base", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "base", warn=quiet)
    lora_merge.export_adapter(lora=CANONICAL, hf_ref=BRIDGE / "hf_ref", out=tmp_path / "adapter", warn=quiet)
    factors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {t.shape[0] for k, t in factors.items() if k.endswith("lora_A.weight")} == {4}
    k_b = factors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert not k_b.any()  # k was not trained
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 12)
    peft_computes_megatron_and_merges_as_ours(tmp_path, BRIDGE / "logits_canonical.pt", canonical_merge)


def peft_computes_megatron_and_merges_as_ours(tmp_path: Path, logits: Path, ours: Path) -> None:
    """PEFT with the adapter exported to tmp_path/adapter, on the HF base in tmp_path/base: Megatron's logits
    unmerged, and our merge (in `ours`) from its merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = torch.load(logits, weights_only=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (model(ref["input_ids"]).logits - ref["logits_lora"]).abs().max() <= 1e-4
    merged = model.merge_and_unload().state_dict()
    for name, tensor in load_file(next(ours.glob("*.safetensors"))).items():
        assert (tensor - merged[name]).abs().max() <= 1e-6 * max(1.0, merged[name].abs().max().item()), name


def test_canonical_lora_on_the_megatron_lm_base_and_to_megatron(canonical_merge, tmp_path):
    lora_merge.merge(base=MINDSPEED / "base", lora=CANONICAL, hf_ref=BRIDGE / "hf_ref", out=tmp_path / "mlm",
                     warn=quiet)
    assert files_of(tmp_path / "mlm") == files_of(canonical_merge)
    lora_merge.to_megatron(base=BRIDGE / "base", lora=CANONICAL, hf_ref=BRIDGE / "hf_ref", out=tmp_path / "mg",
                           tp=2, warn=quiet)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "back", warn=quiet)
    assert files_of(tmp_path / "back") == files_of(canonical_merge)


def test_canonical_lora_verify_passes_and_finds_a_changed_weight(canonical_merge, tmp_path):
    report = lora_merge.verify(canonical_merge, base=BRIDGE / "base", lora=CANONICAL, hf_ref=BRIDGE / "hf_ref")
    assert report.ok
    out = tmp_path / "changed"
    shutil.copytree(canonical_merge, out)
    path = next(out.glob("*.safetensors"))
    tensors = load_file(path)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 0.01
    from safetensors.torch import save_file
    save_file(tensors, path, metadata={"format": "pt"})
    report = lora_merge.verify(out, base=BRIDGE / "base", lora=CANONICAL, hf_ref=BRIDGE / "hf_ref")
    assert not report.ok


def test_a_canonical_adapter_without_its_other_factor_is_named(tmp_path):
    from lora_merge.readers.bridge import CanonicalParts
    from lora_merge.readers.checkpoint import TensorRef

    parts = CanonicalParts(None, "here")
    ref = TensorRef("x", (4, 64), torch.float32, lambda: torch.zeros(4, 64))
    assert parts.take("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight", [ref], None)

    class Ckpt:
        lora = {}
    from lora_merge.errors import MergeError
    with pytest.raises(MergeError, match="adapter_q has linear_in but not linear_out"):
        parts.finish(Ckpt())


# ---- LoRA on every routed expert (SequentialMLP at EP=2), the same factors as the MindSpeed fixture qwen3moe_ep2 ----

MOE = FIXTURES.parent / "fixtures_moe"
BRIDGE_MOE, MINDSPEED_MOE = MOE / "bridge_qwen3moe_ep2", MOE / "qwen3moe_ep2"


@pytest.mark.parametrize("base", ["bridge", "megatron-lm", "hf"])
def test_a_bridge_expert_lora_gives_the_mindspeed_lora_s_bytes(base, reference, tmp_path):
    result = merged_on(base, BRIDGE_MOE, MINDSPEED_MOE, tmp_path)
    assert result.lora_modules == 4 * (2 + 2 * 4)  # qkv, proj and every expert's fc1, fc2 in 4 layers
    assert files_of(tmp_path / "out") == reference(MINDSPEED_MOE)


def test_a_bridge_expert_lora_computes_megatron_s_logits_merged_and_exported(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = torch.load(BRIDGE_MOE / "logits.pt", weights_only=True)
    lora_merge.merge(base=BRIDGE_MOE / "base", lora=BRIDGE_MOE / "lora", hf_ref=BRIDGE_MOE / "hf_ref",
                     out=tmp_path / "out", warn=quiet)
    assert (hf_logits(tmp_path / "out", ref["input_ids"]) - ref["logits_lora"]).abs().max() <= 1e-4
    lora_merge.merge(base=BRIDGE_MOE / "base", hf_ref=BRIDGE_MOE / "hf_ref", out=tmp_path / "base", warn=quiet)
    lora_merge.export_adapter(lora=BRIDGE_MOE / "lora", hf_ref=BRIDGE_MOE / "hf_ref", out=tmp_path / "adapter",
                              warn=quiet)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (model(ref["input_ids"]).logits - ref["logits_lora"]).abs().max() <= 1e-4


# ---- DoRA: the LoRA's factors with magnitudes of their own (fc1 at TP=2; every linear and expert at TP=1 EP=2) ----

@pytest.mark.parametrize("root", [BRIDGE, BRIDGE_MOE], ids=["fc1_tp2", "moe_all_tp1_ep2"])
def test_bridge_dora_computes_what_megatron_with_it_computes(root, tmp_path):
    ref = torch.load(root / "logits_dora.pt", weights_only=True)
    lora_merge.merge(base=root / "base", lora=root / "lora_dora", hf_ref=root / "hf_ref", out=tmp_path / "out",
                     warn=quiet)
    logits = hf_logits(tmp_path / "out", ref["input_ids"])
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.5
    # the magnitudes matter: the same factors as plain LoRA give other logits
    assert (torch.load(root / "logits.pt", weights_only=True)["logits_lora"] - ref["logits_lora"]).abs().max() > 0.1
    assert lora_merge.verify(tmp_path / "out", base=root / "base", lora=root / "lora_dora",
                             hf_ref=root / "hf_ref").ok


def test_bridge_dora_exported_is_peft_s_dora(tmp_path):
    """PEFT (use_dora, lora_magnitude_vector) with the exported adapter computes Megatron's DoRA logits, and its
    merge_and_unload equals ours."""
    lora_merge.merge(base=BRIDGE / "base", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "base", warn=quiet)
    lora_merge.merge(base=BRIDGE / "base", lora=BRIDGE / "lora_dora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "ours",
                     warn=quiet)
    lora_merge.export_adapter(lora=BRIDGE / "lora_dora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "adapter",
                              warn=quiet)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and sorted(config["target_modules"]) == ["gate_proj", "up_proj"]
    peft_computes_megatron_and_merges_as_ours(tmp_path, BRIDGE / "logits_dora.pt", tmp_path / "ours")


def test_bridge_dora_on_experts_is_not_exported(tmp_path, capsys):
    run_failing(["export-adapter", "--lora", str(BRIDGE_MOE / "lora_dora"), "--hf-ref", str(BRIDGE_MOE / "hf_ref"),
                 "--out", str(tmp_path / "adapter")], capsys, "DoRA", "routed experts", "merge it instead")


def copy_moe_dora(tmp_path: Path, edit) -> Path:
    root = tmp_path / "moe"
    shutil.copytree(BRIDGE_MOE, root)
    path = root / "lora_dora" / "iter_0000010" / "run_config.yaml"
    config = yaml.safe_load(path.read_text())
    edit(config)
    path.write_text(yaml.safe_dump(config))
    return root


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["model"].update(tensor_model_parallel_size=2), "saved at TP=2"),
    (lambda c: c["model"].update(add_qkv_bias=True), "linear_qkv with a qkv bias"),
    (lambda c: c["peft"].update(_target_="megatron.bridge.peft.lora.LoRA"), "peft is not DoRA"),
])
def test_bridge_dora_with_no_single_merged_model_is_refused(edit, named, tmp_path, capsys):
    root = copy_moe_dora(tmp_path, edit)
    run_failing(["--base", str(root / "base"), "--lora", str(root / "lora_dora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(tmp_path / "out")], capsys, named)


def test_bridge_dora_on_a_row_parallel_linear_at_tp2_is_refused():
    from argparse import Namespace

    from lora_merge.readers.bridge import DoraMagnitudes
    from lora_merge.readers.checkpoint import GLOBAL, LoraModule, Pieces, TensorRef

    def ref(*shape):
        return TensorRef("here", shape, torch.float32, lambda: torch.zeros(shape))

    module = "decoder.layers.0.self_attention.linear_proj"
    ckpt = type("Ckpt", (), {"lora": {module: LoraModule(Pieces((ref(4, 64),), GLOBAL), Pieces((ref(64, 4),), GLOBAL))}})
    dora = DoraMagnitudes(Namespace(tensor_model_parallel_size=2), "here")
    assert dora.take(module + ".dora_magnitude", [ref(64)], None)
    with pytest.raises(UnsupportedInput, match="row-parallel linear_proj saved at TP=2"):
        dora.finish(ckpt)


@pytest.mark.parametrize("value", ["2", 2.5, True, -1, [2]])
def test_a_size_in_the_run_config_that_is_not_one_is_named(value, tmp_path, capsys):
    root = copy_with_config(tmp_path, lambda c: c["model"].update(tensor_model_parallel_size=value))
    run_failing(args_of(root, tmp_path / "out"), capsys, "model.tensor_model_parallel_size=", "positive integer")



@pytest.mark.parametrize("field, value, named", [
    ("rope_scaling", True, "use_rope_scaling"),
    ("layernorm_zero_centered_gamma", True, "apply_layernorm_1p"),
    ("qk_l2_norm", True, "args.qk_l2_norm=True"),
    ("attention_output_gate", True, "args.attention_output_gate=True"),
    ("softmax_scale", 0.5, "args.softmax_scale=0.5"),
])
def test_mechanics_the_hf_model_lacks_are_refused(field, value, named, tmp_path, capsys):
    """Bridge's own names for Megatron-LM's rope scaling and (1 + w) norms are read as those args, and mechanics no
    HF family here computes are refused rather than dropped."""
    root = copy_with_config(tmp_path, lambda c: c["model"].update({field: value}))
    run_failing(args_of(root, tmp_path / "out"), capsys, named)


def test_a_padded_vocabulary_that_would_cut_trained_rows_is_refused(tmp_path, capsys):
    """With should_pad_vocab the provider's vocab_size is the tokenizer's: 256 trained ids do not fit an HF vocab of
    250 (without it, vocab_size is the embedding's rows, padding included, as the fixture's)."""
    root = copy_with_config(tmp_path, lambda c: c["model"].update(should_pad_vocab=True, vocab_size=256))
    run_failing(args_of(root, tmp_path / "out"), capsys, "args.vocab_size=256 is larger")


@pytest.mark.parametrize("lora, named", [("lora_canonical", "saved in 4 pieces"), ("lora_dora", "saved in 2 piece(s)")])
def test_factors_saved_at_another_tp_than_their_config_says_are_refused(lora, named, tmp_path, capsys):
    """CanonicalLoRA's gate/up B (2·TP swiglu-factory pieces) and DoRA's fc1 magnitude (TP pieces, each rank's
    [gate; up]) are put back with the TP: the metadata must show the one run_config.yaml gives, or rows scramble."""
    root = copy_with_config(tmp_path, lambda c: c["model"].update(tensor_model_parallel_size=1), which=lora)
    run_failing(["--base", str(root / "base"), "--lora", str(root / lora), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(tmp_path / "out")], capsys, named, "TP=1")


@pytest.mark.parametrize("text, named", [
    ("model: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    # a billion laughs: nothing may turn these into text
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
     for p, c in zip("abcdefgh", "bcdefghi")) + "model: {num_layers: 4, hidden_size: 64, num_attention_heads: 8, "
     "params_dtype: *i}\npeft: {_target_: *i, dim: 4, alpha: 12}\n", "not Megatron-Bridge's LoRA"),
])
def test_hostile_yaml_is_refused_in_one_line(text, named, tmp_path, capsys):
    root = tmp_path / "bridge"
    shutil.copytree(BRIDGE, root)
    (root / "lora" / "iter_0000010" / "run_config.yaml").write_text(text)
    run_failing(args_of(root, tmp_path / "out"), capsys, named)


def test_a_run_config_that_is_a_directory_is_named(tmp_path, capsys):
    root = tmp_path / "bridge"
    shutil.copytree(BRIDGE, root)
    path = root / "lora" / "iter_0000010" / "run_config.yaml"
    path.unlink()
    path.mkdir()
    run_failing(args_of(root, tmp_path / "out"), capsys, "run_config.yaml", "Megatron-Bridge's run configuration")


def test_canonical_lora_on_routed_experts_is_refused_by_name():
    with pytest.raises(UnsupportedInput, match="CanonicalLoRA on routed experts"):
        bridge.lora_name("decoder.layers.0.mlp.experts.experts.linear_fc1.adapter.adapter_gate.linear_in.weight", "w",
                         canonical=True)


def test_to_megatron_from_a_bridge_base_writes_megatron_s_own_args(tmp_path):
    """Bridge's configuration is read as args, never copied: the written args are derived from the HF config."""
    from lora_merge.files.safe_load import load_pt

    lora_merge.to_megatron(base=BRIDGE / "base", lora=BRIDGE / "lora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "mg",
                           tp=2, warn=quiet)
    args = load_pt(next((tmp_path / "mg").rglob("model_optim_rng.pt")))["args"]
    assert not any(k.startswith("bridge_") or k in ("hf_model_id", "attention_backend", "should_pad_vocab")
                   for k in vars(args))
    lora_merge.merge(base=tmp_path / "mg", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "back", warn=quiet)
    assert files_of(tmp_path / "back") == files_of_merge(tmp_path)


def files_of_merge(tmp_path: Path) -> dict:
    lora_merge.merge(base=BRIDGE / "base", lora=BRIDGE / "lora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "direct",
                     warn=quiet)
    return files_of(tmp_path / "direct")


def test_an_older_save_of_the_adapter_grouped_experts_share_is_every_expert_s(tmp_path):
    """TEGroupedMLP's shared adapter: newer Bridge saves repeat it along the experts' axis (read like per-expert
    adapters), older ones stored one 2-D tensor. Both written here by torch's own DCP writer from the MoE fixture
    (expert 0's factors for every expert) give the same bytes."""
    import torch.distributed.checkpoint as dcp

    source = BRIDGE_MOE / "lora" / "iter_0000010"
    reader = dcp.FileSystemReader(str(source))
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in reader.read_metadata().state_dict_metadata.items()
          if ".adapter." in k}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    experts = [k for k in sd if ".mlp.experts.experts." in k]
    assert len(experts) == 4
    outs = {}
    for form in ("axis", "2-D"):
        tensors = dict(sd)
        for key in experts:  # [L, E, …]: expert 0's adapter for all
            shared = sd[key][:, 0]
            tensors[key] = shared.unsqueeze(1).expand(-1, sd[key].shape[1], *shared.shape[1:]).contiguous() \
                if form == "axis" else shared.contiguous()
        root = tmp_path / form / "lora"
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(root / "iter_0000010")), no_dist=True)
        config = yaml.safe_load((source / "run_config.yaml").read_text())
        config["model"]["expert_model_parallel_size"] = 1  # (the older 2-D save is one model at EP=1 only)
        (root / "iter_0000010" / "run_config.yaml").write_text(yaml.safe_dump(config))
        (root / "latest_checkpointed_iteration.txt").write_text("10")
        outs[form] = tmp_path / form / "out"
        lora_merge.merge(base=BRIDGE_MOE / "base", lora=root, hf_ref=BRIDGE_MOE / "hf_ref", out=outs[form],
                         warn=quiet)
    assert files_of(outs["axis"]) == files_of(outs["2-D"])
    config["model"]["expert_model_parallel_size"] = 2  # before Bridge synced it over EP: only EP rank 0's was saved
    (tmp_path / "2-D" / "lora" / "iter_0000010" / "run_config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UnsupportedInput, match="at EP=2: each expert-parallel rank trained its own"):
        lora_merge.merge(base=BRIDGE_MOE / "base", lora=tmp_path / "2-D" / "lora", hf_ref=BRIDGE_MOE / "hf_ref",
                         out=tmp_path / "refused", warn=quiet)
    merged = load_file(next(outs["2-D"].glob("*.safetensors")))
    gate = [merged[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(4)]
    lora_merge.merge(base=BRIDGE_MOE / "base", hf_ref=BRIDGE_MOE / "hf_ref", out=tmp_path / "base", warn=quiet)
    base = load_file(next((tmp_path / "base").glob("*.safetensors")))
    deltas = [g - base[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e, g in enumerate(gate)]
    for delta in deltas[1:]:  # one adapter: the same change to every expert
        torch.testing.assert_close(delta, deltas[0], rtol=0, atol=1e-6)
    assert deltas[0].abs().max() > 0.01


def test_normalize_moe_lora_scales_each_expert_by_its_own_rank(tmp_path, capsys):
    """normalize_moe_lora: the routed experts' adapters at rank dim / topk (2 of 4), scaled by alpha / 2; attention's
    at dim 4, alpha / 4. Merged, the Megatron forward; verify agrees; export is refused by name."""
    ref = torch.load(BRIDGE_MOE / "logits_normalized.pt", weights_only=True)
    lora = BRIDGE_MOE / "lora_normalized"
    lora_merge.merge(base=BRIDGE_MOE / "base", lora=lora, hf_ref=BRIDGE_MOE / "hf_ref", out=tmp_path / "out",
                     warn=quiet)
    logits = hf_logits(tmp_path / "out", ref["input_ids"])
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.5
    assert lora_merge.verify(tmp_path / "out", base=BRIDGE_MOE / "base", lora=lora, hf_ref=BRIDGE_MOE / "hf_ref").ok
    capsys.readouterr()  # transformers' loading bars
    run_failing(["export-adapter", "--lora", str(lora), "--hf-ref", str(BRIDGE_MOE / "hf_ref"), "--out",
                 str(tmp_path / "adapter")], capsys, "normalize_moe_lora", "merge it instead")


def test_normalize_moe_lora_with_experts_at_the_full_rank_is_refused(tmp_path, capsys):
    root = copy_moe_dora(tmp_path, lambda c: c["peft"].update(_target_="megatron.bridge.peft.lora.LoRA",
                                                               normalize_moe_lora=True))
    shutil.rmtree(root / "lora_dora")
    shutil.copytree(BRIDGE_MOE / "lora", root / "lora_dora")  # the plain LoRA: experts at rank 4
    path = root / "lora_dora" / "iter_0000010" / "run_config.yaml"
    config = yaml.safe_load(path.read_text())
    config["peft"]["normalize_moe_lora"] = True
    path.write_text(yaml.safe_dump(config))
    run_failing(["--base", str(root / "base"), "--lora", str(root / "lora_dora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(tmp_path / "out")], capsys, "with normalize_moe_lora", "Bridge gives it 2")

def test_the_card_and_summary_say_dora_and_normalized_ranks(tmp_path):
    lora_merge.merge(base=BRIDGE / "base", lora=BRIDGE / "lora_dora", hf_ref=BRIDGE / "hf_ref", out=tmp_path / "dora",
                     warn=quiet)
    assert "DoRA, W' = m / ‖W + (alpha/r)·B·A‖" in (tmp_path / "dora" / "README.md").read_text()
    result = lora_merge.merge(base=BRIDGE_MOE / "base", lora=BRIDGE_MOE / "lora_normalized",
                              hf_ref=BRIDGE_MOE / "hf_ref", out=tmp_path / "norm", warn=quiet)
    assert "normalize_moe_lora" in result.settings_source
    assert "normalize_moe_lora" in (tmp_path / "norm" / "README.md").read_text()


def test_stacked_experts_take_their_own_scale(monkeypatch):
    """gpt-oss-like stacked experts with normalize_moe_lora: every expert's change at alpha over its own rank."""
    from lora_merge.lora import ExpertLoras
    from lora_merge.readers.checkpoint import GLOBAL, LoraModule, Pieces, TensorRef

    def module(factor):
        ref = TensorRef("x", (2, 8), torch.float32, lambda: torch.zeros(2, 8))
        return LoraModule(Pieces((ref,), GLOBAL), Pieces((ref,), GLOBAL), rank=2, scale_factor=factor)

    class Rule:
        megatron = "decoder.layers.0.mlp.experts.0.linear_fc2.weight"

    monkeypatch.setattr(ExpertLoras, "stacked_factors", lambda self: (torch.zeros(6, 2 * len(self.modules)),
                                                                      torch.zeros(2 * len(self.modules), 8)))
    assert ExpertLoras((Rule(),), (module(2.0),)).stacked_delta(3.0).scale == 6.0
    with pytest.raises(MergeError, match="different ranks"):
        ExpertLoras((Rule(), Rule()), (module(2.0), module(1.0))).stacked_delta(3.0)


@pytest.mark.parametrize("name", ["apply_layernorm_1p", "layernorm_zero_centered_gamma"])
def test_megatron_lm_s_one_plus_w_norms_are_refused_by_either_name(name, tmp_path, capsys):
    """--apply-layernorm-1p: recorded as apply_layernorm_1p up to Megatron-LM 0.15, as the TransformerConfig field
    layernorm_zero_centered_gamma from 0.16 (its args are built from the dataclass fields)."""
    from helpers import copied_args, copy_fixture, rank_files, rewrite

    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for path in rank_files(root / "lora"):
        rewrite(path, lambda state: setattr(state["args"], name, True))
    run_failing(copied_args(root, tmp_path / "out"), capsys, f"args.{name}=True")


@pytest.mark.parametrize("lora, named", [
    (BRIDGE / "lora", "Megatron-Bridge: LoRA; settings from"),
    (BRIDGE / "lora_canonical", "CanonicalLoRA (8 modules of separate q/k/v or gate/up adapters)"),
    (BRIDGE / "lora_dora", "DoRA (a magnitude on 4 modules)"),
    (BRIDGE_MOE / "lora_normalized", "32 routed-expert modules at rank 2, scale 2× the run's (normalize_moe_lora)"),
])
def test_inspect_names_bridge_s_method(lora, named, capsys):
    from lora_merge.cli import main

    assert main(["inspect", str(lora)]) == 0
    out = capsys.readouterr().out
    assert named in out
    # each canonical adapter's rank, not the fused module's; normalized experts at their own
    assert ("rank in the tensors [2, 4]" if "normalized" in lora.name else "rank in the tensors [4]") in out


@pytest.mark.parametrize("edit, expected", [
    (lambda c: None, "Qwen/Qwen2-tiny-fixture"),  # the provider's hf_model_id
    (lambda c: c["model"].update(hf_model_id=None, extra_checkpoint_metadata={"hf_model_id": "Org/Builder-7B"}),
     "Org/Builder-7B"),  # the builder config keeps it in its checkpoint metadata
    (lambda c: c["model"].update(hf_model_id="/data/models/local"), None),  # a local path names no Hub model
])
def test_the_card_names_the_hf_model_the_bridge_run_imported(edit, expected, tmp_path):
    root = copy_with_config(tmp_path, edit, which="base")
    warnings = []
    lora_merge.merge(base=root / "base", hf_ref=root / "hf_ref", out=tmp_path / "out", warn=warnings.append)
    card = (tmp_path / "out" / "README.md").read_text()
    assert (f"base_model: {expected}" in card) if expected else ("base_model:" not in card and any(
        "names no Hub model" in w for w in warnings))
