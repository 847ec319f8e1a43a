"""Several PEFT adapters of one base merged in one run: W + Σ wᵢ·ΔWᵢ in float32, rounded once, each ΔWᵢ with its own
r, lora_alpha, rsLoRA, patterns and targets. The oracle is PEFT itself with every adapter loaded and active, each
LoRA layer's scale set to wᵢ (`set_scale`), and `merge_and_unload(adapter_names=…)` — not add_weighted_adapter, whose
"linear" combination mixes the adapters' factors (cross terms Bᵢ·Aⱼ) and refuses different ranks."""

from pathlib import Path

import pytest
import torch

from helpers import random_hf_model, run_failing, trained_peft_adapter


def peft_weighted_merge(base: Path, adapters: list[Path], weights: list[float]):
    """PEFT's own merge of the adapters at these weights (float32)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    names = [f"adapter{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters[0],
                                      adapter_name=names[0])
    for name, path in zip(names[1:], adapters[1:]):
        model.load_adapter(path, adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, w in zip(names, weights):
                module.set_scale(name, w)
    return model.merge_and_unload(adapter_names=names)


def assert_weighted_merge_as_peft(base: Path, configs: list, weights: list[float] | None, tmp_path: Path,
                                  **merge) -> dict:
    import lora_merge
    from transformers import AutoModelForCausalLM

    paths = []
    for i, config in enumerate(configs):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        trained_peft_adapter(model, config, 20 + i, tmp_path / f"adapter{i}")
        paths.append(tmp_path / f"adapter{i}")
    expected = peft_weighted_merge(base, paths, weights or [1.0] * len(paths))
    lora_merge.merge(base=base, lora=paths, lora_weights=weights, hf_ref=base, out=tmp_path / "out", dtype="float32",
                     warn=lambda m: None, **merge)
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4
    return ours


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    return random_hf_model(Qwen2Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       architectures=["Qwen2ForCausalLM"], dtype="bfloat16"),
                           tmp_path_factory.mktemp("qwen2") / "base")


def test_three_adapters_of_other_ranks_scales_and_targets_merge_as_peft_does(qwen2, tmp_path):
    from peft import LoraConfig

    configs = [LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
               LoraConfig(r=2, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj"],
                          rank_pattern={"o_proj": 6}),
               LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj"], layers_to_transform=[1],
                          alpha_pattern={"gate_proj": 32})]
    ours = assert_weighted_merge_as_peft(qwen2, configs, [0.7, 1.5, -0.4], tmp_path, verify=True)
    assert "model.layers.1.mlp.gate_proj.weight" in ours


def test_weights_default_to_one_and_one_weighted_adapter_is_scaled(qwen2, tmp_path):
    from peft import LoraConfig

    configs = [LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), LoraConfig(r=4, target_modules=["k_proj"])]
    assert_weighted_merge_as_peft(qwen2, configs, None, tmp_path / "two")
    assert_weighted_merge_as_peft(qwen2, configs[:1], [0.25], tmp_path / "one")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    from test_gpt_oss import hf_base

    return hf_base.__wrapped__(tmp_path_factory)


def test_adapters_on_stacked_experts_merge_as_peft_does(gpt_oss, tmp_path):
    """gpt-oss's stacked [E, in, out] experts (target_parameters), two adapters of different ranks on them."""
    from peft import LoraConfig

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # (PEFT: the same parameters in every adapter)
    configs = [LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=experts),
               LoraConfig(r=2, lora_alpha=2, target_modules=["o_proj"], target_parameters=experts)]
    assert_weighted_merge_as_peft(gpt_oss, configs, [0.5, 2.0], tmp_path, verify=True)


def _adapters(base: Path, tmp_path: Path, *configs) -> list[Path]:
    from transformers import AutoModelForCausalLM

    paths = []
    for i, config in enumerate(configs):
        trained_peft_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config, 30 + i,
                             tmp_path / f"a{i}")
        paths.append(tmp_path / f"a{i}")
    return paths


def test_verify_of_a_weighted_merge(qwen2, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    import lora_merge

    paths = _adapters(qwen2, tmp_path, LoraConfig(r=4, target_modules=["q_proj"]),
                      LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    out = tmp_path / "out"
    lora_merge.merge(base=qwen2, lora=paths, lora_weights=[0.5, 0.5], hf_ref=qwen2, out=out, warn=lambda m: None)
    args = dict(lora=paths, hf_ref=qwen2, warn=lambda m: None)
    assert lora_merge.verify(out, lora_weights=[0.5, 0.5], **args).ok
    problems = lora_merge.verify(out, lora_weights=[0.5, 0.6], **args).problems  # not the weights it was merged with
    assert any(p.startswith("model.layers.0.self_attn.q_proj.weight: differs") for p in problems), problems
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][0, 0] += 0.01
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert not lora_merge.verify(out, lora_weights=[0.5, 0.5], **args).ok


def test_several_adapters_on_the_command_line(qwen2, tmp_path, capsys):
    from peft import LoraConfig
    from safetensors.torch import load_file

    import lora_merge
    from lora_merge.cli import main

    paths = _adapters(qwen2, tmp_path, LoraConfig(r=4, target_modules=["q_proj"]), LoraConfig(r=2, target_modules=["v_proj"]))
    assert main(["--base", str(qwen2), "--lora", str(paths[0]), "--lora", str(paths[1]), "--lora-weight", "0.3", "0.7",
                 "--hf-ref", str(qwen2), "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    assert main(["--base", str(qwen2), "--lora", str(paths[0]), "--lora", str(paths[1]), "--lora-weight", "-3e-1",
                 "-.7E0", "--hf-ref", str(qwen2), "--out", str(tmp_path / "negative"), "--no-progress"]) == 0
    lora_merge.merge(base=qwen2, lora=paths, lora_weights=[0.3, 0.7], hf_ref=qwen2, out=tmp_path / "api",
                     warn=lambda m: None)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("cli", "api"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    card = (tmp_path / "cli" / "README.md").read_text()
    assert "2 PEFT adapters" in card and "W' = W + Σ wᵢ·(alpha/r)ᵢ·Bᵢ·Aᵢ over 2 adapters" in card
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "cli"), "--lora", str(paths[0]), "--lora", str(paths[1]), "--lora-weight",
                 "0.3", "--lora-weight", "0.7", "--hf-ref", str(qwen2)]) == 0


def test_several_adapters_refusals(qwen2, tmp_path, capsys):
    import json

    from peft import LoraConfig

    paths = _adapters(qwen2, tmp_path, LoraConfig(r=4, target_modules=["q_proj"]),
                      LoraConfig(r=2, target_modules=["q_proj"], use_dora=True),
                      LoraConfig(r=2, target_modules=["q_proj"], bias="all"))
    capsys.readouterr()

    def fails(loras, *extra, message):
        run_failing(["--base", str(qwen2), "--hf-ref", str(qwen2), "--out", str(tmp_path / "out"),
                     *[a for p in loras for a in ("--lora", str(p))], *extra], capsys, message)

    fails(paths[:2], message="a DoRA adapter merged with others")
    fails(paths[1:2], "--lora-weight", "0.5", message="a DoRA adapter weighted 0.5")
    fails([paths[0], paths[2]], message="holds tensors that replace the base's")
    fails(paths[:1] + paths[:1], message="an adapter given twice")
    fails(paths[:1], "--lora-weight", "1", "2", message="2 weight(s) for 1 adapter(s)")
    fails(paths[:1], "--lora-weight", "nan", message="expected a list of finite numbers")
    fixture = Path(__file__).parent / "fixtures" / "tp2_fp32_filtered"
    run_failing(["--lora", str(fixture / "lora"), "--lora", str(paths[0]), "--hf-ref", str(fixture / "hf_ref"),
                 "--out", str(tmp_path / "out")], capsys, "a Megatron LoRA checkpoint is merged alone")
    run_failing(["--base", str(qwen2), "--hf-ref", str(qwen2), "--lora", str(paths[0]), "--lora",
                 str(fixture / "lora"), "--out", str(tmp_path / "out")], capsys, "this is not one")
    other = tmp_path / "other"  # an adapter of another model: q_proj of another width
    config = json.loads((paths[0] / "adapter_config.json").read_text())
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(paths[0] / "adapter_model.safetensors")
    save_file({k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in tensors.items()},
              other / "adapter_model.safetensors")
    fails([paths[0], other], message="lora_A")
    assert not (tmp_path / "out").exists()
