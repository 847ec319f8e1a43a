"""DoRA adapters from PEFT (use_dora: a lora_magnitude_vector beside each module's factors): merged as PEFT merges
them, W' = m / ‖W + s·B·A‖ · (W + s·B·A) with the norm per output row, against merge_and_unload on tiny models of
several families (dense with biases, MLA, Gated DeltaNet and gated attention, a multimodal release's towers), with
rsLoRA and per-module rank patterns. verify checks a DoRA merge and finds a wrong row; what PEFT itself cannot build
is refused."""

from pathlib import Path

import pytest
import torch

from helpers import assert_merges_as_peft, random_hf_model, run_failing, trained_peft_adapter
from test_multimodal import _image_text_to_text, gemma3  # noqa: F401  (the fixture, shared)
from test_qwen3_next import tiny_config as qwen3_next_config


def _qwen2(tmp_path_factory):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, architectures=["Qwen2ForCausalLM"],
                       dtype="bfloat16")


def _deepseek_v3(tmp_path_factory):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                            n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=32,
                            q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                            first_k_dense_replace=1, max_position_embeddings=64, architectures=["DeepseekV3ForCausalLM"],
                            dtype="bfloat16")


FAMILIES = {
    "qwen2": (_qwen2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # (in an MoE model PEFT 0.21 turns MLP names into its fused experts' parameters, which have no DoRA: attention)
    "deepseek_v3": (_deepseek_v3, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    "qwen3_next": (lambda f: qwen3_next_config(), ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj",
                                                  "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("variant", [dict(), dict(use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"q.*": 3})])
def test_dora_merges_as_peft_does(family, variant, tmp_path_factory, tmp_path):
    from peft import LoraConfig

    make, targets = FAMILIES[family]
    base = random_hf_model(make(tmp_path_factory), tmp_path_factory.mktemp(family) / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True, **variant)
    ours, base_sd = assert_merges_as_peft(base, lora, 11, tmp_path, verify=True)
    changed = [k for k in ours if not torch.equal(ours[k], base_sd[k])]
    assert changed and all(k.endswith(".weight") for k in changed)


def test_dora_on_a_multimodal_release_merges_its_towers_too(gemma3, tmp_path):  # noqa: F811
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], use_dora=True)
    assert_merges_as_peft(gemma3, lora, 12, tmp_path, auto=_image_text_to_text(), verify=True)


@pytest.fixture(scope="module")
def qwen2_base(tmp_path_factory) -> Path:
    return random_hf_model(_qwen2(tmp_path_factory), tmp_path_factory.mktemp("qwen2") / "base")


def test_verify_checks_a_dora_merge_and_finds_a_wrong_row(qwen2_base, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import lora_merge

    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(qwen2_base, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), 13, tmp_path / "adapter")
    out = tmp_path / "out"
    lora_merge.merge(base=qwen2_base, lora=tmp_path / "adapter", hf_ref=qwen2_base, out=out, warn=lambda m: None)
    args = dict(lora=tmp_path / "adapter", hf_ref=qwen2_base, warn=lambda m: None)
    report = lora_merge.verify(out, **args)
    assert report.ok, report.problems
    assert "DoRA, W' = m / ‖W + (alpha/r)·B·A‖" in (out / "README.md").read_text()
    assert report.statuses["model.layers.1.self_attn.q_proj.weight"].startswith("merged: DoRA")
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][3] *= 1.01  # one row's magnitude off by 1 %
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    problems = lora_merge.verify(out, **args).problems
    assert any(p.startswith("model.layers.1.self_attn.q_proj.weight: differs") for p in problems), problems


def test_dora_into_fp8_output_verifies(qwen2_base, tmp_path):
    """verify compares a DoRA weight written as block-FP8 with the DoRA merge, within FP8's step."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    import lora_merge

    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(qwen2_base, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj", "down_proj"], use_dora=True), 15, tmp_path / "adapter")
    lora_merge.merge(base=qwen2_base, lora=tmp_path / "adapter", hf_ref=qwen2_base, out=tmp_path / "out", dtype="fp8",
                     verify=True, warn=lambda m: None)
    report = lora_merge.verify(tmp_path / "out", lora=tmp_path / "adapter", hf_ref=qwen2_base, warn=lambda m: None)
    assert report.ok and report.statuses["model.layers.0.mlp.down_proj.weight"].startswith("FP8: within")


def _edited_adapter(base: Path, tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    import json

    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), 14, adapter)
    if edit_config:
        config = json.loads((adapter / "adapter_config.json").read_text())
        edit_config(config)
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(adapter / "adapter_model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, adapter / "adapter_model.safetensors")
    return adapter


MAGNITUDE = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.mark.parametrize("edit_config, edit_tensors, message", [
    (lambda c: c.update(use_dora=False), None, "is DoRA's magnitude vector, but adapter_config.json does not say"),
    (None, lambda t: t.pop(MAGNITUDE), "has no lora_magnitude_vector, but adapter_config.json says use_dora"),
    (None, lambda t: t.update({MAGNITUDE: t[MAGNITUDE][:-1]}), "lora_magnitude_vector has shape [63]"),
    (lambda c: c.update(use_dora="yes"), None, "use_dora='yes'; expected true or false"),
    (lambda c: c.update(target_parameters=["mlp.down_proj.weight"]), None,
     "use_dora with target_parameters: PEFT has no DoRA on parameters"),
])
def test_dora_refusals(qwen2_base, tmp_path, capsys, edit_config, edit_tensors, message):
    adapter = _edited_adapter(qwen2_base, tmp_path, edit_config, edit_tensors)
    capsys.readouterr()
    run_failing(["--base", str(qwen2_base), "--lora", str(adapter), "--hf-ref", str(qwen2_base), "--out",
                 str(tmp_path / "out")], capsys, message)
