"""MiniMax-M2 (minimax_m2) on the HF routes: q/k norms over the whole projection, partial RoPE from rotary_dim,
Mixtral-named experts with a sigmoid expert bias. An HF base with a PEFT adapter (attention and the experts through
target_parameters) merges as PEFT's merge_and_unload into a model transformers' MiniMaxM2ForCausalLM loads whole;
the published config (block-FP8 with modules_to_not_convert) reads. Megatron checkpoints of it are refused by name."""

import json
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import assert_merges_as_peft, quiet, random_hf_model, run_failing, trained_peft_adapter

TESTS = Path(__file__).parent
PUBLISHED = TESTS / "data/published_configs/MiniMaxAI__MiniMax-M2.json"



@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import MiniMaxM2Config

    def bias(model):
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(8) * 0.05)

    return random_hf_model(MiniMaxM2Config(
        vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=1, architectures=["MiniMaxM2ForCausalLM"],
        dtype="bfloat16"), tmp_path_factory.mktemp("minimax_m2") / "base", bias)


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig

    ours, _ = assert_merges_as_peft(hf_base, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), 3, tmp_path)
    assert ours["model.layers.0.self_attn.q_norm.weight"].shape == (64,)


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: minimax_m2 is merged from HF bases (with PEFT adapters) only")


def test_the_published_config_reads_as_transformers_reads_it(tmp_path):
    """MiniMaxAI/MiniMax-M2's config.json as published (block-FP8, rotary_dim, MTP modules)."""
    from lora_merge.fp8 import read_fp8_config
    from lora_merge.model.hf_config import read_hf_config

    published = json.loads(PUBLISHED.read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, raw = read_hf_config(tmp_path, [])
    assert raw == published and shape.model_type == "minimax_m2"
    assert shape.rotary_percent == 0.5 and shape.moe.num_experts == 256 and shape.moe.expert_bias
    read_fp8_config(published["quantization_config"], tmp_path)


def test_its_block_fp8_release_merges_as_its_dequantized_values(hf_base, tmp_path):
    """The release's FP8 form (fmt float8_e4m3fn, router, bias and lm_head left unquantized) with a PEFT adapter:
    the same bytes as the merge onto its dequantized values."""
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_fp8 import CONFIG, fp8_release

    quantization = {**CONFIG, "fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                                                  "lm_head"]}
    fp8, dequantized = fp8_release(hf_base, tmp_path / "releases", config=quantization)
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]), 4,
                         tmp_path / "adapter")
    for base, out in ((fp8, tmp_path / "from-fp8"), (dequantized, tmp_path / "from-deq")):
        lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=dequantized, out=out, dtype="bfloat16",
                         warn=quiet)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("from-fp8", "from-deq"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(next(fp8.glob("*00001*.safetensors"))).values())
