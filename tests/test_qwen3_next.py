"""Qwen3-Next (qwen3_next): an HF base with a PEFT adapter on the Gated DeltaNet projections, the gated attention,
the shared expert and the routed experts (target_parameters) merges as PEFT's merge_and_unload, into a model
transformers' Qwen3NextForCausalLM loads whole; the MTP layer (`mtp.*`) is copied as stored. Megatron checkpoints
of it are refused by name: megatron-core builds Gated DeltaNet only with GPU kernels, so no Megatron checkpoint
of it could be made here to prove a layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_merges_as_peft, quiet, run_failing

TESTS = Path(__file__).parent
TOKENIZER = TESTS / "fixtures_moe/qwen3moe_ep2/hf_ref"
PUBLISHED = TESTS / "data/published_configs/Qwen__Qwen3-Next-80B-A3B-Instruct.json"



def tiny_config(**changes):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**{**dict(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, mlp_only_layers=[1],
        max_position_embeddings=64, architectures=["Qwen3NextForCausalLM"], bos_token_id=0, eos_token_id=1,
        dtype="bfloat16"), **changes})


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny Qwen3-Next in bf16 (layers: linear, linear with a dense MLP, linear, full attention), random values
    everywhere (norms, A_log, dt_bias, conv1d included), with an MTP layer under mtp.* as the release stores it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1))
    out = tmp_path_factory.mktemp("qwen3_next") / "base"
    model.save_pretrained(out)
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(shard)
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64),
           "mtp.pre_fc_norm_embedding.weight": torch.randn(64), "mtp.pre_fc_norm_hidden.weight": torch.randn(64),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 64)}
    # (the release's config.json does not count its MTP layer: transformers ignores mtp.* as it loads)
    save_file({**tensors, **{k: v.to(torch.bfloat16) for k, v in mtp.items()}}, shard, metadata={"format": "pt"})
    for f in TOKENIZER.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def test_a_peft_adapter_on_every_kind_of_layer_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import load_file

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj",
                                                         "v_proj", "o_proj", "shared_expert_gate", "gate_proj",
                                                         "up_proj", "down_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ours, base_sd = assert_merges_as_peft(hf_base, lora, 1, tmp_path)
    adapted = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight", "linear_attn.out_proj.weight",
               "self_attn.q_proj.weight", "mlp.shared_expert_gate.weight", "mlp.experts.gate_up_proj")
    for name in adapted:  # the LoRA of each kind is in
        keys = [k for k in ours if k.endswith(name)]
        assert keys and all(not torch.equal(ours[k], base_sd[k]) for k in keys), name
    kept = ("conv1d.weight", "A_log", "dt_bias", "linear_attn.norm.weight", "layernorm.weight")
    assert all(torch.equal(ours[k], base_sd[k]) for k in ours if k.endswith(kept))
    stored = load_file(next(hf_base.glob("*.safetensors")))
    written = load_file(next((tmp_path / "out").glob("*.safetensors")))
    mtp = [k for k in stored if k.startswith("mtp.")]
    assert mtp and all(torch.equal(written[k], stored[k]) and written[k].dtype == stored[k].dtype for k in mtp)


def test_a_qwen3_next_reference_is_refused_for_megatron_checkpoints(hf_base, tmp_path, capsys):
    fixture = TESTS / "fixtures_moe/qwen3moe_ep2"
    run_failing(["--base", str(fixture / "base"), "--lora", str(fixture / "lora"), "--hf-ref", str(hf_base), "--out",
                 str(tmp_path / "out")], capsys, "qwen3_next is merged from HF bases (with PEFT adapters) only",
                "Gated DeltaNet")
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: qwen3_next is merged from HF bases (with PEFT adapters) only")


def test_the_layer_kinds_are_read_from_layer_types(hf_base):
    from lora_merge.model.hf_config import read_hf_config

    shape, _ = read_hf_config(hf_base, [])
    assert sorted(shape.linear_attention.layers) == [0, 1, 2] and shape.mixer(3) == "attention"
    assert sorted(shape.moe.layers) == [0, 2, 3]
    assert "Gated DeltaNet in 3 of 4 layers" in shape.mechanics() and "partial RoPE 0.25" in shape.mechanics()
    assert shape.mtp_layers == 0 and shape.mtp_prefixes == ("mtp.",)


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="published config not recorded")
def test_the_published_config_reads_as_transformers_reads_it(tmp_path):
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json as published."""
    import transformers

    from lora_merge.model.hf_config import read_hf_config

    published = json.loads(PUBLISHED.read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, raw = read_hf_config(tmp_path, [])
    hf = transformers.Qwen3NextConfig.from_dict(json.loads(json.dumps(published)))
    assert raw == published and shape.model_type == "qwen3_next"
    assert sorted(shape.linear_attention.layers) == [i for i, t in enumerate(hf.layer_types) if t == "linear_attention"]
    assert shape.moe.num_experts == hf.num_experts and shape.moe.shared_gate
    assert shape.rotary_percent == 0.25 and shape.mtp_layers == published.get("mtp_num_hidden_layers", 0)
