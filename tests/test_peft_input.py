"""A PEFT adapter as --lora, merged onto HF weights at constant memory: the tensors equal PEFT's own
merge_and_unload, and the merged model computes what PEFT's unmerged model computes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import BASE_ONLY, FIXTURES, merge_args
from lora_merge.cli import main

NAME = "tp2pp2_fp32_filtered"  # Qwen2: q/k/v biases, 4 layers
ROOT = FIXTURES / NAME


@pytest.fixture
def hf_base(base_model):
    return base_model(NAME)


def make_adapter(base, out, dtype=torch.float32, **config):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    peft_model = get_peft_model(model, LoraConfig(**config))
    torch.manual_seed(7)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name or (config.get("bias") == "all" and name.endswith(".bias")):
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.1)  # a trained adapter (PEFT starts B at zero)
    peft_model.save_pretrained(out)
    return peft_model


CONFIGS = {
    "rslora_patterns_biases": dict(r=4, lora_alpha=8, use_rslora=True, bias="all",
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"],
                                   rank_pattern={"o_proj": 2, r"layers\.1\.mlp\.up_proj": 6}, alpha_pattern={"down_proj": 3}),
    "regex_layers": dict(r=8, lora_alpha=16, target_modules=r".*\.(q_proj|v_proj|down_proj)$"),
    "layers_to_transform": dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj"], layers_to_transform=[0, 2]),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_peft_adapter_merges_as_peft_does(name, hf_base, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    peft_model = make_adapter(hf_base, tmp_path / "adapter", **CONFIGS[name])
    out = tmp_path / "out"
    assert main(["--base", str(hf_base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "PEFT adapter" in printed
    config = CONFIGS[name]  # the scale the summary states is the one the adapter's modules get by default
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    assert f"scale {scale:g}" in printed and f"scale {scale:g}" in (out / "README.md").read_text()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged = peft_model(ids).logits
        theirs = peft_model.merge_and_unload().state_dict()
    ours = load_file(out / "model.safetensors")
    base = load_file(hf_base / "model.safetensors")
    assert set(ours) == set(theirs)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    changed = sum(not torch.equal(ours[k], base[k]) for k in ours)
    assert worst <= 1e-6 and changed > 0, (worst, changed)
    with torch.no_grad():
        mine = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert (mine - unmerged).abs().max() <= 1e-4
    print(f"\n{name}: {changed} tensors changed, max |ours - PEFT merge_and_unload| = {worst:.1e}, "
          f"max |logits - PEFT unmerged| = {(mine - unmerged).abs().max():.1e}")


def test_bf16_is_rounded_once(hf_base, tmp_path):
    """bf16 weights: W + s·B·A computed in float32 and rounded once (PEFT rounds the delta first)."""
    bf16 = tmp_path / "bf16"
    assert main(merge_args(NAME, bf16) + BASE_ONLY + ["--dtype", "bfloat16"]) == 0
    make_adapter(bf16, tmp_path / "adapter", dtype=torch.bfloat16, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    out = tmp_path / "out"
    assert main(["--base", str(bf16), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(bf16),
                 "--out", str(out), "--no-progress"]) == 0
    ours, base = load_file(out / "model.safetensors"), load_file(bf16 / "model.safetensors")
    factors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    key = "model.layers.1.mlp.down_proj"
    a = factors[f"base_model.model.{key}.lora_A.weight"].float()
    b = factors[f"base_model.model.{key}.lora_B.weight"].float()
    exact = (base[f"{key}.weight"].float() + 2.0 * b @ a).to(torch.bfloat16)
    assert ours[f"{key}.weight"].dtype == torch.bfloat16 and torch.equal(ours[f"{key}.weight"], exact)


@pytest.mark.parametrize("change,expected", [({"use_dora": True}, "has no lora_magnitude_vector"),
                                             ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                                             ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
                                             ({"peft_type": "IA3"}, "peft_type 'IA3'"),
                                             ({"layer_replication": [[0, 2]]}, "layer_replication")])
def test_what_peft_adds_beyond_plain_lora_is_refused(change, expected, hf_base, tmp_path, capsys):
    make_adapter(hf_base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    capsys.readouterr()  # transformers' loading bar
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    code = main(["--base", str(hf_base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out").exists()


def test_megatron_lora_options_are_refused_for_a_peft_adapter(hf_base, tmp_path, capsys):
    make_adapter(hf_base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    code = main(["--base", str(hf_base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(tmp_path / "out"), "--no-progress", "--lora-alpha", "8"])
    assert code == 2 and "adapter_config.json" in capsys.readouterr().err


def test_verify_checks_a_peft_merge(hf_base, tmp_path, capsys):
    make_adapter(hf_base, tmp_path / "adapter", **CONFIGS["rslora_patterns_biases"])
    out = tmp_path / "out"
    inputs = ["--base", str(hf_base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(ROOT / "hf_ref")]
    assert main(inputs + ["--out", str(out), "--no-progress", "--verify"]) == 0, capsys.readouterr().err
    code = main(["verify", str(out), *inputs])
    result = capsys.readouterr()
    assert code == 0, result
    from safetensors.torch import save_file
    tensors = load_file(out / "model.safetensors")
    for victim in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.bias"):
        changed = dict(tensors)
        changed[victim] = changed[victim] + 1e-3
        save_file(changed, out / "model.safetensors", metadata={"format": "pt"})
        assert main(["verify", str(out), *inputs]) == 1
        assert victim in capsys.readouterr().out


def test_a_peft_adapter_onto_an_hf_base_of_another_model_is_refused(hf_base, tmp_path, capsys):
    """--base's own config.json must describe the model --hf-ref does (here: another RoPE base)."""
    make_adapter(hf_base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    capsys.readouterr()
    base = tmp_path / "base"
    shutil.copytree(hf_base, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}))
    capsys.readouterr()
    code = main(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "the HF base's rope_theta is 500000.0 but --hf-ref's" in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_adapter_on_lm_head_with_its_saved_layer_merges_as_peft(tmp_path):
    """PEFT saves a targeted lm_head whole beside its factors (save_embedding_layers, on by default then) and loads it
    over the base's: read as the weight the change goes onto, against merge_and_unload, also when it differs."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config

    import lora_merge
    from helpers import assert_merges_as_peft, random_hf_model

    base = random_hf_model(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                                       architectures=["Qwen2ForCausalLM"]), tmp_path / "base")
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    assert_merges_as_peft(base, lora, 3, tmp_path / "same", verify=True)
    adapter = tmp_path / "same" / "adapter"
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.lm_head.base_layer.weight" in tensors
    tensors["base_model.model.lm_head.base_layer.weight"] += 0.5  # the layer as the adapter was trained with it
    save_file(tensors, adapter / "adapter_model.safetensors")
    lora_merge.merge(base=base, lora=adapter, hf_ref=base, out=tmp_path / "out", dtype="float32", warn=lambda m: None)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                         adapter).merge_and_unload().state_dict()
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert (ours["lm_head.weight"] - expected["lm_head.weight"]).abs().max() <= 1e-6


def test_an_adapter_on_the_lm_head_of_a_tied_model_is_refused_saying_so(tmp_path, capsys):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen2Config

    from helpers import random_hf_model, run_failing, trained_peft_adapter

    base = random_hf_model(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                                       architectures=["Qwen2ForCausalLM"]), tmp_path / "base")
    trained_peft_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         LoraConfig(r=2, target_modules=["q_proj", "lm_head"]), 4, tmp_path / "adapter")
    capsys.readouterr()
    run_failing(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(base), "--out",
                 str(tmp_path / "out")], capsys, "lm_head.weight (its lm_head is the embedding: tie_word_embeddings")
