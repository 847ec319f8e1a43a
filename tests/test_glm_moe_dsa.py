"""GLM-5 (glm_moe_dsa) on the HF routes: DeepSeek-V3.2's layer with an indexer in the "full" layers only, attention
biases and an fp32 router. An HF base with a PEFT adapter (MLA projections and their biases' layers, the indexers,
the experts through target_parameters) merges as PEFT's merge_and_unload, into a model transformers'
GlmMoeDsaForCausalLM loads whole, the router and weights_proj kept fp32. Megatron checkpoints of it are refused by
name."""

from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import assert_merges_as_peft, random_hf_model, run_failing

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import GlmMoeDsaConfig

    def bias(model):
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)

    return random_hf_model(GlmMoeDsaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=4,
        indexer_types=["full", "shared", "full", "shared"], attention_bias=True, max_position_embeddings=64,
        architectures=["GlmMoeDsaForCausalLM"], bos_token_id=0, eos_token_id=1, dtype="bfloat16"),
        tmp_path_factory.mktemp("glm5") / "base", bias)


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors import safe_open

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                         "o_proj", "wq_b", "wk", "weights_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ours, _ = assert_merges_as_peft(hf_base, lora, 1, tmp_path)
    assert "model.layers.0.self_attn.q_a_proj.bias" in ours
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in ours and not [k for k in ours if ".layers.1.self_attn.indexer" in k]
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "bf16",
                     warn=lambda m: None)
    with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith(("weights_proj.weight", "mlp.gate.weight",
                                                        "e_score_correction_bias"))} == {"F32"}
    assert dtypes["model.layers.2.self_attn.indexer.wq_b.weight"] == "BF16"


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: glm_moe_dsa is merged from HF bases (with PEFT adapters) only")
