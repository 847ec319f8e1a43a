"""Gemma 3 text (gemma3_text) on the HF routes: Gemma 2's layer with q/k norms; an HF base with a PEFT adapter
merges as PEFT's merge_and_unload into a model transformers' Gemma3ForCausalLM loads whole, with its per-layer-type
RoPE (rope_parameters keyed by full/sliding attention) and the config kept as published. Megatron checkpoints of
it are refused by name."""

import json
from pathlib import Path

import pytest

from helpers import assert_merges_as_peft, random_hf_model, run_failing

TESTS = Path(__file__).parent
PUBLISHED = TESTS / "data/published_configs/google__gemma-3-1b-it.json"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import Gemma3TextConfig

    # (norms random too: Gemma stores the w of (1 + w))
    return random_hf_model(Gemma3TextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=8, query_pre_attn_scalar=32,
        architectures=["Gemma3ForCausalLM"], bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16"),
        tmp_path_factory.mktemp("gemma3") / "base")


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig

    ours, _ = assert_merges_as_peft(hf_base, LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), 5, tmp_path)
    assert any(k.endswith("q_norm.weight") for k in ours)
    published = json.loads((hf_base / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_parameters"] == published["rope_parameters"]
    assert written["layer_types"] == published["layer_types"]


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: gemma3_text is merged from HF bases (with PEFT adapters) only")


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="published config not recorded")
def test_the_published_config_reads_as_transformers_reads_it(tmp_path):
    """google/gemma-3-1b-it's config.json as published."""
    from lora_merge.model.hf_config import read_hf_config

    published = json.loads(PUBLISHED.read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, raw = read_hf_config(tmp_path, [])
    assert raw == published and shape.model_type == "gemma3_text" and shape.qk_norm and shape.tied
    assert shape.head_dim == published["head_dim"]
