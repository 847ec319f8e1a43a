"""Multimodal releases whose language model is one of ours: Gemma 3 (4B-27B: Gemma3ForConditionalGeneration, a
SigLIP vision tower and a projector) and Llama 4 (Scout/Maverick: Llama4ForConditionalGeneration). Their language
model is merged under our names and written back under the release's (`language_model.model.*`); the towers are
carried, merged where a PEFT adapter adapts one of their linears (PEFT's module names are transformers' in-memory
ones, `model.language_model.*` and `model.vision_tower.*` for Gemma 3). Proven against PEFT's merge_and_unload on
tiny models of transformers' own classes, every tensor and the logits."""

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_merges_as_peft, random_hf_model, run_failing

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


def _image_text_to_text():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    from transformers import Gemma3Config

    return random_hf_model(Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8),
        vision_config=VISION, mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7,
        architectures=["Gemma3ForConditionalGeneration"]), tmp_path_factory.mktemp("gemma3") / "base",
        auto=_image_text_to_text())


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    from transformers import Llama4Config

    return random_hf_model(Llama4Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_local_experts=2, interleave_moe_layer_step=2, max_position_embeddings=64),
        vision_config={**VISION, "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32},
        architectures=["Llama4ForConditionalGeneration"]), tmp_path_factory.mktemp("llama4") / "base",
        auto=_image_text_to_text())


def _stored(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_gemma3_release_merges_as_peft_does_towers_included(gemma3, tmp_path):
    """Every linear of the language model and of the vision tower that the names select (q/k/v, o_proj and
    SigLIP's out_proj, fc1, down_proj): as PEFT merges them, written under the release's own names."""
    from peft import LoraConfig

    import lora_merge

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1",
                                                         "down_proj"])
    assert_merges_as_peft(gemma3, lora, 3, tmp_path, auto=_image_text_to_text(), verify=True)
    ours, base = _stored(tmp_path / "out"), _stored(gemma3)
    assert ours.keys() == base.keys() and any(k.startswith("language_model.model.") for k in ours)
    changed = {k for k in ours if not torch.equal(ours[k], base[k].float())}
    assert "vision_tower.encoder.layers.0.self_attn.out_proj.weight" in changed
    assert "language_model.model.layers.1.mlp.down_proj.weight" in changed
    report = lora_merge.verify(tmp_path / "out", lora=tmp_path / "adapter", hf_ref=gemma3, warn=lambda m: None)
    assert report.ok, report.problems
    assert report.statuses["vision_tower.encoder.layers.0.mlp.fc1.weight"].startswith("merged")
    assert report.statuses["vision_tower.encoder.layers.0.mlp.fc2.weight"] == "identical to baseline"
    assert report.statuses["model.layers.0.self_attn.q_proj.weight"].startswith("merged")


def test_llama4_release_merges_as_peft_does_experts_and_towers_included(llama4, tmp_path):
    """The language model's attention, dense MLP and stacked experts (target_parameters), the vision model's
    attention and MLP, and the projector."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "down_proj",
                                                         "linear_1"],
                      target_parameters=["feed_forward.experts.gate_up_proj"])
    assert_merges_as_peft(llama4, lora, 4, tmp_path, auto=_image_text_to_text(), verify=True)
    ours, base = _stored(tmp_path / "out"), _stored(llama4)
    assert ours.keys() == base.keys()
    changed = {k for k in ours if not torch.equal(ours[k], base[k].float())}
    assert {"multi_modal_projector.linear_1.weight", "vision_model.model.layers.0.self_attn.q_proj.weight",
            "language_model.model.layers.1.feed_forward.experts.gate_up_proj"} <= changed


def test_a_regex_on_the_language_model_leaves_the_towers_as_stored(gemma3, tmp_path):
    """A target_modules regex over transformers' own module names (the usual way to keep LoRA off the vision
    tower) selects as PEFT selects; the towers keep the base's bytes in the base's dtype."""
    from peft import LoraConfig

    import lora_merge

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    assert_merges_as_peft(gemma3, lora, 5, tmp_path, auto=_image_text_to_text())
    lora_merge.merge(base=gemma3, lora=tmp_path / "adapter", hf_ref=gemma3, out=tmp_path / "bf16", dtype="bfloat16",
                     warn=lambda m: None)
    ours, base = _stored(tmp_path / "bf16"), _stored(gemma3)
    towers = [k for k in base if not k.startswith("language_model.")]
    assert towers and all(torch.equal(ours[k], base[k]) for k in towers)


def test_a_base_saved_with_transformers_module_names_merges_to_the_same_bytes(gemma3, tmp_path):
    """A base saved under the in-memory names (model.language_model.*, model.vision_tower.*, lm_head) is read as the
    release; the output is written in the release's naming, the same bytes."""
    import shutil

    from peft import LoraConfig
    from safetensors.torch import save_file

    import lora_merge
    from helpers import trained_peft_adapter

    memory = tmp_path / "memory-names"
    shutil.copytree(gemma3, memory)
    renamed = {("model." + k.removeprefix("language_model.model.").join(["language_model.", ""])
                if k.startswith("language_model.model.") else "model." + k): v for k, v in _stored(gemma3).items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, memory / "model.safetensors", metadata={"format": "pt"})
    trained_peft_adapter(_image_text_to_text().from_pretrained(gemma3, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj", "fc1"]), 6, tmp_path / "adapter")
    for base, out in ((gemma3, "a"), (memory, "b")):
        lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=base, out=tmp_path / out, warn=lambda m: None)
    a, b = _stored(tmp_path / "a"), _stored(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_verify_finds_a_tower_tensor_changed_or_missing(gemma3, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import save_file

    import lora_merge
    from helpers import trained_peft_adapter

    trained_peft_adapter(_image_text_to_text().from_pretrained(gemma3, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj"]), 7, tmp_path / "adapter")
    out = tmp_path / "out"
    lora_merge.merge(base=gemma3, lora=tmp_path / "adapter", hf_ref=gemma3, out=out, warn=lambda m: None)
    args = dict(lora=tmp_path / "adapter", hf_ref=gemma3, warn=lambda m: None)
    tensors = _stored(out)
    tensors["vision_tower.encoder.layers.0.mlp.fc2.weight"][0, 0] += 1
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    problems = lora_merge.verify(out, **args).problems
    assert any(p.startswith("vision_tower.encoder.layers.0.mlp.fc2.weight: LoRA does not touch it, but it differs")
               for p in problems), problems
    del tensors["multi_modal_projector.mm_soft_emb_norm.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    problems = lora_merge.verify(out, **args).problems
    assert any(p.startswith("multi_modal_projector.mm_soft_emb_norm.weight: the reference's gemma3 release has it")
               for p in problems), problems


def test_the_published_gemma3_config_reads_as_its_language_model(tmp_path):
    """google/gemma-3-4b-it's config.json as published: its text_config states only what differs from
    Gemma3TextConfig's defaults; transformers fills in the rest, and the top level decides the tying."""
    from lora_merge.model.hf_config import read_hf_config

    published = json.loads((Path(__file__).parent / "data/published_configs/google__gemma-3-4b-it.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, raw = read_hf_config(tmp_path, [])
    assert (shape.model_type, shape.multimodal, shape.num_layers, shape.hidden, shape.tied) == \
        ("gemma3_text", "gemma3", 34, 2560, True)
    assert raw == published  # the output gets the release's config


def test_multimodal_refusals(gemma3, tmp_path, capsys):
    from peft import LoraConfig

    from helpers import trained_peft_adapter

    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"model_type": "llama"},
                                                   "vision_config": {"model_type": "clip_vision_model"}}))
    trained_peft_adapter(_image_text_to_text().from_pretrained(gemma3, dtype=torch.float32),
                         LoraConfig(r=2, target_modules=["q_proj"]), 8, tmp_path / "adapter")
    capsys.readouterr()
    run_failing(["--base", str(gemma3), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(llava), "--out",
                 str(tmp_path / "out")], capsys, "multimodal model type 'llava' is not supported")
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    config = json.loads((gemma3 / "config.json").read_text())
    (text_only / "config.json").write_text(json.dumps({**config["text_config"], "tie_word_embeddings": True,
                                                       "architectures": ["Gemma3ForCausalLM"]}))
    run_failing(["--base", str(gemma3), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(text_only), "--out",
                 str(tmp_path / "out")], capsys, "the HF base's multimodal is 'gemma3'")
    run_failing(["--to", "megatron", "--base", str(gemma3), "--out", str(tmp_path / "mg")], capsys,
                "gemma3_text is merged from HF bases (with PEFT adapters) only")
    assert not (tmp_path / "out").exists()


def test_rank_and_alpha_patterns_match_transformers_module_names(gemma3, tmp_path):
    """PEFT matches rank_pattern/alpha_pattern against the names the modules have in memory
    (model.language_model.layers.0…, model.vision_tower…), so patterns written for them apply as PEFT applies them."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                      alpha_pattern={"language_model.layers.0.self_attn.q_proj": 32},
                      rank_pattern={"vision_tower.encoder.layers.0.self_attn.k_proj": 2})
    assert_merges_as_peft(gemma3, lora, 9, tmp_path, auto=_image_text_to_text(), verify=True)


def test_an_fp8_release_of_it_merges_into_bf16_and_verifies(gemma3, tmp_path):
    """A block-FP8 form of the release (language and tower linears quantized, their weight_scale_inv beside them):
    merged into bf16 as the merge onto its dequantized twin, and verify does not miss the scales it dropped."""
    import json
    import shutil

    from peft import LoraConfig
    from safetensors.torch import save_file

    import lora_merge
    from helpers import trained_peft_adapter
    from lora_merge.fp8 import dequantize_rows, quantize_rows

    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    release, plain = {}, {}
    for name, t in _stored(gemma3).items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "fc1.weight")):
            q, scales = quantize_rows(t.float(), (128, 128))
            release[name], release[name.removesuffix("weight") + "weight_scale_inv"] = q, scales
            plain[name] = dequantize_rows(q, scales, 0, (128, 128))  # float32: the values the release holds
        else:
            release[name] = plain[name] = t
    config = json.loads((gemma3 / "config.json").read_text())
    for d, weights, q in ((fp8, release, True), (twin, plain, False)):
        shutil.copytree(gemma3, d, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
        if q:
            (d / "config.json").write_text(json.dumps({**config, "quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    trained_peft_adapter(_image_text_to_text().from_pretrained(twin, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj", "fc1"]), 10, tmp_path / "adapter")
    for base, out in ((fp8, "from-fp8"), (twin, "from-twin")):
        lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=base, out=tmp_path / out, dtype="bfloat16",
                         verify=True, warn=lambda m: None)
    a, b = _stored(tmp_path / "from-fp8"), _stored(tmp_path / "from-twin")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="--dtype fp8 with a gemma3 release"):
        lora_merge.merge(base=fp8, lora=tmp_path / "adapter", hf_ref=fp8, out=tmp_path / "fp8-out", dtype="fp8",
                         warn=lambda m: None)


def test_the_report_names_the_tensors_as_the_files_hold_them(gemma3, tmp_path):
    from peft import LoraConfig

    import lora_merge
    from helpers import trained_peft_adapter

    trained_peft_adapter(_image_text_to_text().from_pretrained(gemma3, dtype=torch.float32),
                         LoraConfig(r=4, target_modules=["q_proj"]), 16, tmp_path / "adapter")
    lora_merge.merge(base=gemma3, lora=tmp_path / "adapter", hf_ref=gemma3, out=tmp_path / "out", verify=True,
                     report=tmp_path / "report.json", warn=lambda m: None)
    tensors = json.loads((tmp_path / "report.json").read_text())["tensors"]
    assert tensors.keys() == _stored(tmp_path / "out").keys()
    assert all(t["file"] == "model.safetensors" and "verify" in t for t in tensors.values())
    assert tensors["language_model.model.layers.0.self_attn.q_proj.weight"]["status"] == "merged with LoRA"
