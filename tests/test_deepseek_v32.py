"""DeepSeek-V3.2 (deepseek_v32): an HF base with a PEFT adapter (MLA projections, the sparse-attention
indexer's projections, the routed experts through target_parameters) merges as PEFT's merge_and_unload, into a
model transformers' DeepseekV32ForCausalLM loads whole; the indexer's weights_proj stays fp32 as transformers
keeps it. Megatron checkpoints of it (in or out) are refused by name: megatron-core builds the indexer with
TransformerEngine only, so no Megatron checkpoint of it could be made here to prove a layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import quiet, run_failing, trained_peft_adapter

TESTS = Path(__file__).parent
TOKENIZER = TESTS / "fixtures_deepseek/deepseek_v3_ep2/hf_ref"



@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3.2 in bf16 (weights_proj fp32, as transformers keeps it), random values everywhere
    (biases and norms included), with the V3 fixture's tokenizer."""
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    config = DeepseekV32Config(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=4,
        max_position_embeddings=64, architectures=["DeepseekV32ForCausalLM"], bos_token_id=0, eos_token_id=1,
        dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1)
                    + (1.0 if "norm.weight" in name or "layernorm" in name else 0.0))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    out = tmp_path_factory.mktemp("v32") / "base"
    model.save_pretrained(out)
    for f in TOKENIZER.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def test_a_peft_adapter_on_the_indexer_and_experts_merges_as_peft_does(hf_base, tmp_path):
    from peft import LoraConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    assert model.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj", "wq_b", "wk", "weights_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = trained_peft_adapter(model, lora, 1, tmp_path / "adapter")
    expected = peft_model.merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32", warn=quiet)
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    indexer = [k for k in ours if ".indexer." in k and k.endswith(("wq_b.weight", "wk.weight", "weights_proj.weight"))]
    base_sd = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).state_dict()
    assert indexer and all(not torch.equal(ours[k], base_sd[k]) for k in indexer)  # the indexer's LoRA is in
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4

    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "bf16", warn=quiet)
    with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith("weights_proj.weight")} == {"F32"}
    assert dtypes["model.layers.1.self_attn.indexer.wq_b.weight"] == "BF16"


def test_megatron_checkpoints_of_it_are_refused_by_name(hf_base, tmp_path, capsys):
    fixture = TESTS / "fixtures_deepseek/deepseek_v3_ep2"
    hf_ref = tmp_path / "hf_ref"
    shutil.copytree(fixture / "hf_ref", hf_ref)
    v3 = json.loads((hf_ref / "config.json").read_text())
    (hf_ref / "config.json").write_text(json.dumps({**v3, "model_type": "deepseek_v32",
                                                    "architectures": ["DeepseekV32ForCausalLM"], "index_n_heads": 4,
                                                    "index_head_dim": 16, "index_topk": 4}))
    run_failing(["--base", str(fixture / "base"), "--lora", str(fixture / "lora"), "--hf-ref", str(hf_ref), "--out",
                 str(tmp_path / "out")], capsys, "deepseek_v32 is merged from HF bases (with PEFT adapters) only",
                "sparse-attention indexer (DSA)")
    run_failing(["--to", "megatron", "--base", str(hf_base), "--out", str(tmp_path / "mg")], capsys,
                "--to megatron: deepseek_v32 is merged from HF bases (with PEFT adapters) only")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mg").exists()


def test_the_published_config_reads_as_transformers_reads_it(tmp_path):
    """deepseek-ai/DeepSeek-V3.2's config.json as published (block-FP8 with scale_fmt ue8m0, YaRN, MTP)."""
    import transformers

    from lora_merge.fp8 import read_fp8_config
    from lora_merge.model.hf_config import read_hf_config

    published = json.loads((TESTS / "data/published_configs/deepseek-ai__DeepSeek-V3.2.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    shape, raw = read_hf_config(tmp_path, [])
    hf = transformers.DeepseekV32Config.from_dict(json.loads(json.dumps(published)))  # it edits the dict it gets
    assert raw == published and shape.model_type == "deepseek_v32"
    assert (shape.mla.index_heads, shape.mla.index_head_dim) == (hf.index_n_heads, hf.index_head_dim) == (64, 128)
    assert sorted(shape.moe.layers) == [i for i, kind in enumerate(hf.mlp_layer_types) if kind == "sparse"]
    assert shape.rope_scaling is None and shape.mtp_layers == 1  # (RoPE of an HF-only type: kept as published)
    assert read_fp8_config(published["quantization_config"], tmp_path).pow2
