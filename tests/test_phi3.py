"""Phi-3 / Phi-4 (phi3): HF fuses q/k/v into qkv_proj and gate/up into gate_up_proj. The Llama-like Megatron
fixture (no biases) computes the same function, so merged against a Phi-3 config it must give the real
Megatron forward's logits under transformers' Phi3ForCausalLM; the fused tensors must split back into
Megatron's layout exactly (HF -> Megatron -> HF byte-identical, and Megatron itself loading it); an HF Phi-3
base with a PEFT adapter on the fused modules merges as PEFT's merge_and_unload; the exported adapter (one
LoRA per fused module: Megatron's fused LoRA is exactly that) loads in PEFT and computes Megatron's logits.
(No published config.json is used: transformers' own Phi3Config at the fixture's size.)"""

import json
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import quiet, reference_beside, run_failing, trained_peft_adapter

TESTS = Path(__file__).parent
# untied at TP 2 with LoRA on linear_qkv and linear_fc2; tied at PP 2 with LoRA on all four linears
FIXTURES = [TESTS / "fixtures/tp2_llama_fp32_partial", TESTS / "fixtures/tied_pp2_llama_fp32"]
FIXTURE = FIXTURES[0]
HF_MODULE = {"linear_qkv": "qkv_proj", "linear_proj": "o_proj", "linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}



def phi3_reference(dest: Path, fixture: Path = FIXTURE, **changes) -> Path:
    from transformers import Phi3Config

    llama = json.loads((fixture / "hf_ref/config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    config = Phi3Config(**{k: llama[k] for k in keys if k in llama}, architectures=["Phi3ForCausalLM"],
                        original_max_position_embeddings=llama["max_position_embeddings"],
                        rope_parameters=llama.get("rope_parameters"), resid_pdrop=0.1, embd_pdrop=0.1,
                        dtype="float32")
    return reference_beside(fixture / "hf_ref", dest / "hf_ref", config, **changes)


def logits_of(model_dir: Path, input_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Phi3ForCausalLM" and not any(info.values()), info
    with torch.no_grad():
        return model.eval()(input_ids).logits


@pytest.fixture(scope="module", params=FIXTURES, ids=lambda f: f.name)
def merged(request, tmp_path_factory):
    fixture = request.param
    root = tmp_path_factory.mktemp("phi3")
    hf = phi3_reference(root, fixture)
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=hf, out=root / "merged", warn=quiet)
    return fixture, hf, root / "merged"


def test_a_megatron_lora_merged_as_phi3_computes_megatrons_logits(merged):
    fixture, _, out = merged
    ref = torch.load(fixture / "logits.pt", weights_only=True)
    logits = logits_of(out, ref["input_ids"])
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1


def test_fused_tensors_go_back_into_megatrons_layout_exactly(merged, tmp_path):
    """HF Phi-3 -> Megatron at TP 2 / PP 2 -> HF: the same bytes; and real Megatron loads the TP 2 checkpoint
    and computes what transformers computes on the HF model."""
    from megatron_oracle import megatron_logits

    fixture, hf, out = merged
    lora_merge.to_megatron(base=out, out=tmp_path / "mg", tp=2, pp=2, warn=quiet)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=hf, out=tmp_path / "back", warn=quiet)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (tmp_path / "back" / name).read_bytes(), name
    lora_merge.to_megatron(base=out, out=tmp_path / "mg_tp2", tp=2, warn=quiet)
    ids = torch.load(fixture / "logits.pt", weights_only=True)["input_ids"]
    got = megatron_logits(tmp_path / "mg_tp2/release", json.loads((hf / "config.json").read_text()),
                          dict(tp=2, pp=1, vpp=None, ep=1, etp=2, first_stage_layers=None), ids)
    assert (got - logits_of(out, ids)).abs().max() <= 1e-5


def test_an_hf_phi3_base_with_a_peft_adapter_on_the_fused_modules_merges_as_peft_does(merged, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    fixture, hf, _ = merged
    base = tmp_path / "base"
    lora_merge.merge(base=fixture / "base", hf_ref=hf, out=base, warn=quiet)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    peft_model = trained_peft_adapter(model, lora, 7, tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=hf, out=tmp_path / "out", warn=quiet)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert ours.keys() == expected.keys()
    assert max((ours[k] - expected[k]).abs().max().item() for k in ours) <= 1e-6


def test_the_exported_adapter_is_one_lora_per_fused_module_and_computes_megatrons_logits(merged, tmp_path):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    fixture, hf, _ = merged
    base = tmp_path / "base"
    lora_merge.merge(base=fixture / "base", hf_ref=hf, out=base, warn=quiet)
    adapter = tmp_path / "adapter"
    result = lora_merge.export_adapter(lora=fixture / "lora", hf_ref=hf, out=adapter, warn=quiet)
    targets = json.loads((fixture / "fixture.json").read_text())["targets"]
    assert sorted(result.target_modules) == sorted(HF_MODULE[t] for t in targets)
    probe = PeftModel(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), PeftConfig.from_pretrained(adapter))
    loaded = probe.load_adapter(adapter, adapter_name="probe")
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if ".probe." in k]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    ref = torch.load(fixture / "logits.pt", weights_only=True)
    with torch.no_grad():
        adapted = model(ref["input_ids"]).logits
    assert (adapted - ref["logits_lora"]).abs().max() <= 1e-4


def test_partial_rope_and_a_window_must_be_what_megatron_trained(tmp_path, capsys):
    hf = phi3_reference(tmp_path / "partial", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.75})
    args = ["--base", str(FIXTURE / "base"), "--lora", str(FIXTURE / "lora"), "--out", str(tmp_path / "out")]
    run_failing(args + ["--hf-ref", str(hf)], capsys,
                "args.rotary_percent=1.0 but the HF config's partial_rotary_factor is 0.75")
    hf = phi3_reference(tmp_path / "window", sliding_window=2047)
    run_failing(args + ["--hf-ref", str(hf)], capsys, "sliding_window=2047")
    assert not (tmp_path / "out").exists()
