"""The config.json files publishers ship (tests/data/published_configs, sources in SOURCES.md), as a user
has them: every family is read, merged from a Megatron base against that config (logits against the real
Megatron forward of a fixture computing the same function), and merged from an HF base with a PEFT
adapter (tensors against PEFT's own merge_and_unload).

"Shrunk": the keys that size the model or define its function (dimensions, RoPE, norm epsilon, experts,
MLA ranks, dtype) take the fixture's values, and the token ids, which must lie inside the fixture's
250-token vocabulary, the fixture's too; every other key is kept verbatim, so each file's unknown,
renamed and legacy keys (use_mrope, max_window_layers, sliding_window with use_sliding_window false,
auto_map, scoring_func, ep_size, …) meet the reader exactly as published.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import trained_peft_adapter
from lora_merge.cli import main
from lora_merge.errors import MergeError
from lora_merge.model.hf_config import read_hf_config

PUBLISHED = Path(__file__).parent / "data" / "published_configs"
TESTS = Path(__file__).parent

# published file -> fixture computing the same function (Mistral's decoder is Llama's without biases)
FIXTURE_OF = {
    "deepseek-ai__DeepSeek-R1-Distill-Qwen-7B": "fixtures/tp2_fp32_filtered",
    "deepseek-ai__DeepSeek-R1-Distill-Qwen-32B": "fixtures/tp2_fp32_filtered",
    "Qwen__Qwen2.5-7B-Instruct": "fixtures/tp2_fp32_filtered",
    "Qwen__Qwen2.5-32B-Instruct": "fixtures/tp2_fp32_filtered",
    "Qwen__Qwen3-8B": "fixtures/qwen3_tp2_fp32",
    "Qwen__Qwen3-32B": "fixtures/qwen3_tp2_fp32",
    "Qwen__Qwen3-30B-A3B": "fixtures_moe/qwen3moe_ep2",
    "Qwen__Qwen3-235B-A22B": "fixtures_moe/qwen3moe_ep2",
    "Qwen__Qwen2-57B-A14B": "fixtures_moe/qwen2moe_tp2ep2",
    "mistralai__Mixtral-8x7B-v0.1": "fixtures_moe/mixtral_ep2",
    "meta-llama__Llama-3.1-8B": "fixtures/tp2_llama_fp32_partial",
    "meta-llama__Llama-3.1-8B-Instruct": "fixtures/tp2_llama_fp32_partial",
    "meta-llama__Llama-3.3-70B-Instruct": "fixtures/tp2_llama_fp32_partial",
    "mistralai__Mistral-7B-Instruct-v0.3": "fixtures/tp2_llama_fp32_partial",
    "deepseek-ai__DeepSeek-V3": "fixtures_deepseek/deepseek_v3_yarn_ep2",
    "deepseek-ai__DeepSeek-R1": "fixtures_deepseek/deepseek_v3_yarn_ep2",
    "moonshotai__Kimi-K2-Instruct": "fixtures_deepseek/deepseek_v3_yarn_ep2",
    "deepseek-ai__DeepSeek-V2-Lite": "fixtures_deepseek/deepseek_v2_lite_ep2",
    "zai-org__GLM-4.5-Air": "fixtures_moe/glm4moe_tp2etp1_ep2",
    "zai-org__GLM-4.7": "fixtures_moe/glm4moe_tp2etp1_ep2",
}
NAMES = sorted(FIXTURE_OF)
# Released in block-FP8 (quantization_config); the Megatron base was converted from the bf16 copy,
# whose config is the published one without it.
FP8_RELEASES = {"deepseek-ai__DeepSeek-V3", "deepseek-ai__DeepSeek-R1", "moonshotai__Kimi-K2-Instruct"}

FUNCTION_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "hidden_act",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
    "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
    "topk_method", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "num_nextn_predict_layers", "bos_token_id", "eos_token_id", "pad_token_id", "use_qk_norm", "attention_bias",
    "partial_rotary_factor",
}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def shrunk(name: str) -> dict:
    """The published config at the fixture's size and function, every other key verbatim."""
    config = published(name)
    fixture = json.loads((TESTS / FIXTURE_OF[name] / "hf_ref" / "config.json").read_text())
    config.pop("quantization_config", None)
    for key in FUNCTION_KEYS & fixture.keys():
        config[key] = fixture[key]
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the releases say num_experts
    if "num_local_experts" in fixture and "num_experts" in published(name):
        config["num_experts"] = config.pop("num_local_experts")
    for key in ROPE_KEYS:
        config.pop(key, None)
    # the fixture's RoPE in the published file's spelling (4.x: rope_theta + rope_scaling)
    rope = dict(fixture.get("rope_parameters") or {})
    config["rope_theta"] = rope.pop("rope_theta", fixture.get("rope_theta"))
    if fixture.get("rope_scaling"):
        config["rope_scaling"] = fixture["rope_scaling"]
    elif "rope_scaling" in published(name):
        config["rope_scaling"] = None
    dtype_key = "dtype" if "dtype" in published(name) else "torch_dtype"
    config.pop("dtype", None)
    config[dtype_key] = fixture["dtype"]
    return config


def reference_dir(name: str, dest: Path) -> Path:
    """The fixture's reference directory with the published config in place of its own."""
    hf = dest / "hf_ref"
    shutil.copytree(TESTS / FIXTURE_OF[name] / "hf_ref", hf)
    (hf / "config.json").write_text(json.dumps(shrunk(name), indent=2))
    return hf


def test_every_published_file_is_kept_verbatim_apart_from_size_and_function():
    for name in NAMES:
        config, original = shrunk(name), published(name)
        kept = set(original) - FUNCTION_KEYS - set(ROPE_KEYS) - {"quantization_config", "torch_dtype", "dtype"}
        assert kept and all(config[k] == original[k] for k in kept), name


@pytest.mark.parametrize("name", NAMES)
def test_published_config_reads_as_transformers_reads_it(name, tmp_path):
    """At full size, as published (the FP8 releases without their quantization_config, as their bf16 copy)."""
    import transformers

    config = published(name)
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    notes = []
    shape, raw = read_hf_config(tmp_path, notes)
    assert raw == config
    expected_type = "deepseek_v3" if config["model_type"] == "kimi_k2" else config["model_type"]
    hf = transformers.CONFIG_MAPPING[expected_type].from_dict(config)
    assert (shape.model_type, shape.num_layers, shape.hidden, shape.heads, shape.vocab) == (
        expected_type, hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.vocab_size)
    if shape.mla is None:
        assert shape.groups == hf.num_key_value_heads
    if shape.moe is not None:
        assert shape.moe.num_experts == getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) \
            or hf.n_routed_experts
    if config["model_type"] == "kimi_k2":
        assert any("read and merged as deepseek_v3" in note for note in notes), notes
    if "use_mrope" in config:  # R1-Distill-Qwen's and Qwen2.5's: Qwen2 never reads it
        assert any("use_mrope" in note and "does not read" in note for note in notes), notes
    scaled = config.get("rope_scaling")
    assert (shape.rope_scaling.type if shape.rope_scaling else None) == (
        (scaled.get("rope_type") or scaled.get("type")) if scaled else None)


@pytest.mark.parametrize("name", sorted(FP8_RELEASES))
def test_fp8_release_config_as_published_is_read(name, tmp_path):
    """Block-FP8 releases' configs are read as published (their weights are dequantized as they stream)."""
    (tmp_path / "config.json").write_text(json.dumps(published(name)))
    config = published(name)
    config.pop("quantization_config")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain/config.json").write_text(json.dumps(config))
    assert read_hf_config(tmp_path)[0] == read_hf_config(tmp_path / "plain")[0]


def fixture_args(name: str, hf: Path, out: Path) -> list[str]:
    root = TESTS / FIXTURE_OF[name]
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(hf), "--out", str(out),
            "--no-progress"]


def hf_logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(input_ids).logits


@pytest.mark.parametrize("name", NAMES)
def test_megatron_base_merged_against_the_published_config_computes_megatron_logits(name, tmp_path, capsys):
    hf = reference_dir(name, tmp_path)
    out = tmp_path / "out"
    assert main(fixture_args(name, hf, out)) == 0, capsys.readouterr().err
    written = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in shrunk(name).items() if k not in ("dtype", "torch_dtype")}  # as published
    ref = torch.load(TESTS / FIXTURE_OF[name] / "logits.pt", weights_only=True)
    logits = hf_logits(as_loadable(out, tmp_path / "loadable"), ref["input_ids"])
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4, name


# HF base + PEFT adapter: attention and dense-MLP modules of each family, and the routed experts as
# current PEFT adapts them on transformers 5 (target_parameters on the fused expert parameters)
PEFT_TARGETS = {"qwen2": ["q_proj", "v_proj", "down_proj"], "qwen3": ["q_proj", "o_proj", "gate_proj"],
                "llama": ["k_proj", "up_proj"], "mistral": ["k_proj", "up_proj"], "qwen3_moe": ["q_proj", "o_proj"],
                "qwen2_moe": ["q_proj", "v_proj"], "mixtral": ["q_proj", "o_proj"],
                "deepseek_v3": ["q_b_proj", "kv_b_proj", "o_proj"], "kimi_k2": ["q_b_proj", "kv_b_proj", "o_proj"],
                "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "o_proj"], "glm4_moe": ["q_proj", "k_proj", "o_proj"]}
PEFT_NAMES = ["deepseek-ai__DeepSeek-R1-Distill-Qwen-32B", "Qwen__Qwen3-8B", "meta-llama__Llama-3.1-8B-Instruct",
              "mistralai__Mistral-7B-Instruct-v0.3", "Qwen__Qwen3-30B-A3B", "Qwen__Qwen2-57B-A14B",
              "mistralai__Mixtral-8x7B-v0.1", "moonshotai__Kimi-K2-Instruct", "deepseek-ai__DeepSeek-V2-Lite",
              "zai-org__GLM-4.5-Air"]


@pytest.mark.parametrize("name", PEFT_NAMES)
def test_hf_base_with_peft_adapter_merges_as_peft_does_with_the_published_config(name, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    hf = reference_dir(name, tmp_path)
    # the HF base: the fixture's Megatron base written as HF, carrying the published config
    base = tmp_path / "base"
    root = TESTS / FIXTURE_OF[name]
    assert main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(hf), "--out", str(base),
                 "--no-progress", "--lora-alpha", "1e-30"]) == 0
    config = json.loads((base / "config.json").read_text())
    loadable = as_loadable(base, tmp_path / "base_loadable")  # PEFT loads the class the config names
    model = AutoModelForCausalLM.from_pretrained(loadable, dtype=torch.float32)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if hasattr(model.config, "num_experts_per_tok") else []
    peft_model = trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS[config["model_type"]],
                                                        target_parameters=experts), 3, tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    out = tmp_path / "out"
    assert main(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(hf), "--out", str(out),
                 "--no-progress"]) == 0
    # transformers loads our per-expert tensors into its fused experts, as it loads the releases
    merged = AutoModelForCausalLM.from_pretrained(as_loadable(out, tmp_path / "out_loadable"), dtype=torch.float32)
    base_sd = model_state(loadable)
    changed = set()
    for key, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, expected[key], rtol=0, atol=1e-6), key
        if not torch.equal(tensor, base_sd[key]):
            changed.add(key)
    assert changed and (not experts or any(".mlp.experts." in key for key in changed)), changed


def as_loadable(model_dir: Path, dest: Path) -> Path:
    """The model dir, or for a remote-code model_type a copy naming the class it is (no remote code runs)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] != "kimi_k2":
        return model_dir
    shutil.copytree(model_dir, dest)
    (dest / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "auto_map"},
                                                  "model_type": "deepseek_v3"}))
    return dest


def model_state(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
