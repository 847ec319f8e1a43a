"""GLM-5 (glm_moe_dsa) on the HF routes: DeepSeek-V3.2's layer with an indexer in the "full" layers only, attention
biases and an fp32 router. An HF base with a PEFT adapter (MLA projections and their biases' layers, the indexers,
the experts through target_parameters) merges as PEFT's merge_and_unload, into a model transformers'
GlmMoeDsaForCausalLM loads whole, the router and weights_proj kept fp32. Megatron checkpoints of it are refused by
name."""

from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import run_failing, trained_peft_adapter

TESTS = Path(__file__).parent


def quiet(message):
    pass


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    config = GlmMoeDsaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=4,
        indexer_types=["full", "shared", "full", "shared"], attention_bias=True, max_position_embeddings=64,
        architectures=["GlmMoeDsaForCausalLM"], bos_token_id=0, eos_token_id=1, dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1)
                    + (1.0 if "norm.weight" in name or "layernorm" in name else 0.0))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    out = tmp_path_factory.mktemp("glm5") / "base"
    model.save_pretrained(out)
    return out


def test_a_peft_adapter_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    assert model.model.layers[1].self_attn.indexer is None and model.model.layers[2].self_attn.indexer is not None
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                         "o_proj", "wq_b", "wk", "weights_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    expected = trained_peft_adapter(model, lora, 1, tmp_path / "adapter").merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32", warn=quiet)
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys() and "model.layers.0.self_attn.q_a_proj.bias" in ours
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4

    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "bf16", warn=quiet)
    with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith(("weights_proj.weight", "mlp.gate.weight",
                                                        "e_score_correction_bias"))} == {"F32"}
    assert not [k for k in dtypes if k.startswith(("model.layers.1.self_attn.indexer", "model.layers.3.self_attn.indexer"))]
    assert dtypes["model.layers.2.self_attn.indexer.wq_b.weight"] == "BF16"


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: glm_moe_dsa is merged from HF bases (with PEFT adapters) only")
