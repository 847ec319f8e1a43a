"""gpt-oss (gpt_oss) on the HF routes, from a bf16 base: q/k/v/o biases and attention sinks, a router with a bias,
experts stored stacked ([E, hidden, 2·ffn] with interleaved gate/up columns, [E, ffn, hidden]) and adapted by PEFT's
target_parameters expert by expert. Our merge equals PEFT's merge_and_unload, loads whole in transformers'
GptOssForCausalLM, and verify checks the stacked experts against the factors. Megatron checkpoints of it are refused
by name."""

from pathlib import Path

import pytest

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


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: gpt_oss is merged from HF bases (with PEFT adapters) only")


def test_the_published_config_reads_and_its_mxfp4_weights_are_refused_by_name(tmp_path):
    """openai/gpt-oss-20b's config.json as published: the model reads as transformers reads it; its MXFP4
    quantization_config is refused in one line until the MXFP4 reader exists."""
    import json

    from lora_merge.errors import MergeError
    from lora_merge.model.hf_config import read_hf_config

    published = json.loads((Path(__file__).parent / "data/published_configs/openai__gpt-oss-20b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    with pytest.raises(MergeError, match="quantization_config \\(mxfp4\\)"):
        read_hf_config(tmp_path, [])
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in published.items() if k != "quantization_config"}))
    shape, _ = read_hf_config(tmp_path, [])
    assert shape.model_type == "gpt_oss" and shape.moe.num_experts == 32 and shape.qkv_bias
