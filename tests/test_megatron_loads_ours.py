"""Proof by Megatron itself: what `--to megatron` writes loads strictly into the real megatron-core 0.16.1
GPTModel at the target layout (tests/megatron_oracle.py: gloo ranks on CPU, exact key sets) and computes
the logits it should:
- a LoRA merged on the way: the logits the real Megatron forward computed with the LoRA unmerged (each
  fixture's logits.pt, recorded by the generator with Megatron + PEFT 0.7.1);
- a conversion of an HF model: transformers' logits on that HF model.
Dense (TP, PP, VPP, tied embeddings), MoE (EP with ETP 1 and TP, a gated shared expert, GroupedMLP),
DeepSeek MLA (column-parallel down-projections at TP 2, an uneven PP split) and GLM-4.5 (partial RoPE, q/k/v
biases and norms at TP 4, sigmoid routing with the expert bias) and gpt-oss (sinks, windows, clamped quick-GeGLU,
YaRN, expert biases; its stacked HF experts apart again), legacy and torch_dist."""

import json
from pathlib import Path

import pytest
import torch

import lora_merge
from megatron_oracle import megatron_logits
from helpers import quiet

TESTS = Path(__file__).parent
TOL = 1e-5  # fp32



def recorded(fixture: Path):
    logits = torch.load(fixture / "logits.pt")
    return logits["input_ids"], logits


def hf_config(fixture: Path) -> dict:
    return json.loads((fixture / "hf_ref/config.json").read_text())


def transformers_logits(model_dir: Path, input_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def close(a, b, tol=TOL):
    assert a.shape == b.shape
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max |difference| {diff:.3g} > {tol:g}"


def layout_of(kw: dict) -> dict:
    return dict(tp=kw.get("tp", 1), pp=kw.get("pp", 1), vpp=kw.get("vpp"), ep=kw.get("ep", 1),
                etp=kw.get("etp", kw.get("tp", 1)), first_stage_layers=kw.get("decoder_first_pipeline_num_layers"))


# (fixture, target layout, expert layout): a Megatron base + Megatron LoRA merged into the target
MERGED = {
    "dense_tp2pp2_to_tp2": ("fixtures/tp2pp2_fp32_filtered", dict(tp=2), "sequential"),
    "dense_to_pp2_vpp2": ("fixtures/tp2_fp32_filtered", dict(pp=2, vpp=2), "sequential"),
    "tied_llama_to_pp2": ("fixtures/tied_pp2_llama_fp32", dict(pp=2), "sequential"),
    # tied at PP 1: the output layer has no weight but Megatron saves (and a strict load wants) its _extra_state
    "tied_llama_to_tp2": ("fixtures/tied_pp2_llama_fp32", dict(tp=2), "sequential"),
    "qwen2moe_shared_gate_to_tp2_ep2_etp1": ("fixtures_moe/qwen2moe_tp2ep2", dict(tp=2, ep=2, etp=1), "sequential"),
    "qwen3moe_to_ep2_grouped": ("fixtures_moe/qwen3moe_ep2", dict(ep=2), "grouped"),
    "deepseek_v3_mla_to_tp2_ep2_etp1": ("fixtures_deepseek/deepseek_v3_ep2", dict(tp=2, ep=2, etp=1), "sequential"),
    "qwen2moe_to_tp2_ep2_etp2": ("fixtures_moe/qwen2moe_tp2ep2", dict(tp=2, ep=2, etp=2), "sequential"),
    # a padded vocabulary given by hand (250 rows padded to 264, not the rule's 256): loaded with the args' divisor
    "dense_to_tp2_hand_padded_vocab": ("fixtures/tp2pp2_fp32_filtered", dict(tp=2, padded_vocab_size=264), "sequential"),
    "deepseek_v3_mla_to_uneven_pp2_ep2": ("fixtures_deepseek/deepseek_v3_ep2",
                                          dict(pp=2, decoder_first_pipeline_num_layers=1, ep=2), "sequential"),
    # partial RoPE, q/k/v biases and q/k norms split over TP 4 (2 query groups a rank), sigmoid routing
    "glm4_moe_to_tp4_ep2_grouped": ("fixtures_moe/glm4moe_tp2etp1_ep2", dict(tp=4, ep=2, etp=1), "grouped"),
    # sinks split over TP 2, expert biases, each expert's row of the stacked HF tensor back to its own parameters at
    # EP 4; the windows, clamped quick-GeGLU and YaRN as the args say
    "gpt_oss_to_tp2_ep4_etp1": ("fixtures_moe/gptoss_tp2etp1_ep2", dict(tp=2, ep=4, etp=1), "sequential"),
}


@pytest.mark.parametrize("name", list(MERGED))
def test_a_lora_merged_into_megatron_computes_the_trained_logits(tmp_path, name):
    fixture, target, experts = MERGED[name]
    fixture = TESTS / fixture
    input_ids, logits = recorded(fixture)
    lora_merge.to_megatron(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                           out=tmp_path / "mg", expert_layout=experts, warn=quiet, **target)
    got = megatron_logits(tmp_path / "mg/release", hf_config(fixture), layout_of(target), input_ids,
                          expert_layout=experts)
    close(got, logits["logits_lora"])


# (fixture, target layout, format): the fixture's base merged with its LoRA into HF first; that HF model
# converted to Megatron must compute what transformers computes on it
CONVERTED = {
    "dense_hf_to_tp2_pp2": ("fixtures/qwen3_tp2_fp32", dict(tp=2, pp=2), "torch"),
    "mixtral_hf_to_ep2_etp1": ("fixtures_moe/mixtral_ep2", dict(ep=2, etp=1), "torch"),
    "deepseek_hf_to_torch_dist_at_tp2": ("fixtures_deepseek/deepseek_v3_ep2", dict(tp=2), "torch_dist"),
    "glm4_moe_hf_to_torch_dist_at_pp2": ("fixtures_moe/glm4moe_tp2etp1_ep2", dict(pp=2), "torch_dist"),
    "tied_llama_hf_to_torch_dist_at_tp2": ("fixtures/tied_pp2_llama_fp32", dict(tp=2), "torch_dist"),
    "gpt_oss_hf_to_torch_dist_at_tp2_ep2": ("fixtures_moe/gptoss_tp2etp1_ep2", dict(tp=2, ep=2, etp=1), "torch_dist"),
    "gpt_oss_hf_to_pp2_ep2": ("fixtures_moe/gptoss_tp2etp1_ep2", dict(pp=2, ep=2, etp=1), "torch"),
}


@pytest.mark.parametrize("name", list(CONVERTED))
def test_an_hf_model_converted_to_megatron_computes_what_transformers_computes(tmp_path, name):
    fixture, target, fmt = CONVERTED[name]
    fixture = TESTS / fixture
    input_ids, _ = recorded(fixture)
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=tmp_path / "hf",
                     warn=quiet)
    expected = transformers_logits(tmp_path / "hf", input_ids)
    written = dict(target) if fmt == "torch" else {}  # torch_dist: written once, loaded at any layout
    lora_merge.to_megatron(base=tmp_path / "hf", out=tmp_path / "mg", ckpt_format=fmt, warn=quiet, **written)
    got = megatron_logits(tmp_path / "mg/release", hf_config(fixture), layout_of(target), input_ids, ckpt_format=fmt)
    close(got, expected)


def test_mindspeed_dense_first_layers_in_torch_dist_load_into_megatron(tmp_path):
    """A MindSpeed DeepSeek checkpoint records its dense first layer as first_k_dense_replace on top of
    moe_layer_freq 1, which Megatron-LM does not know: written as torch_dist (refused before: "MoE layer 0 has
    experts' nothing"), the args say moe_layer_freq as Megatron's per-layer list, the layers are keyed per
    layer as Megatron keys such a model, and Megatron loads it and computes the trained logits."""
    fixture = TESTS / "fixtures_deepseek/deepseek_v3_mindspeed_fused_qkv_ep2"
    input_ids, logits = recorded(fixture)
    lora_merge.to_megatron(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                           out=tmp_path / "mg", ckpt_format="torch_dist", warn=quiet)
    common = torch.load(tmp_path / "mg/release/common.pt", weights_only=False)
    assert common["args"].moe_layer_freq == [0, 1, 1] and common["args"].first_k_dense_replace == 1
    got = megatron_logits(tmp_path / "mg/release", hf_config(fixture), layout_of({}), input_ids,
                          ckpt_format="torch_dist")
    close(got, logits["logits_lora"])
