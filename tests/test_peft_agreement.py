"""A PEFT adapter's config and its saved factors must agree: we merge exactly the modules PEFT adapts under
the config, and refuse (one line, exit 2) factors the config does not select or selected modules without
factors. PEFT itself is the oracle: its selection function on every module name of the model, and adapters
it builds and saves, then tampered with."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import FIXTURES
from lora_merge.cli import main
from lora_merge.readers.peft import config_selects
from test_damaged_inputs import fails
from test_peft_input import NAME, hf_base, make_adapter  # noqa: F401 (hf_base: the fixture)

peft = pytest.importorskip("peft")
ROOT = FIXTURES / NAME

CONFIGS = {
    "list": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]),
    "regex": dict(r=2, lora_alpha=4, target_modules=r".*layers\.[13]\.self_attn\.(k|o)_proj"),
    "layers": dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj"], layers_to_transform=[0, 3]),
    "layers_pattern": dict(r=2, lora_alpha=4, target_modules=["o_proj"], layers_to_transform=2,
                           layers_pattern="layers"),
    "exclude": dict(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"],
                    exclude_modules=["model.layers.1.self_attn.q_proj"]),
    "exclude_regex": dict(r=2, lora_alpha=4, target_modules=["k_proj"], exclude_modules=r".*layers\.[02]\..*"),
    "all_linear": dict(r=2, lora_alpha=4, target_modules="all-linear"),
}


def run(adapter, out, hf_base):
    return ["--base", str(hf_base), "--lora", str(adapter), "--hf-ref", str(ROOT / "hf_ref"), "--out", str(out),
            "--no-progress"]


def adapted(peft_model) -> set[str]:
    return {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and "default" in m.lora_A}


@pytest.mark.parametrize("name", CONFIGS)
def test_selection_is_peft_own_for_every_module(name, hf_base, tmp_path):
    """config_selects gives PEFT's check_target_module_exists answer on every module name of the model."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoModelForCausalLM

    peft_model = make_adapter(hf_base, tmp_path / "adapter", **CONFIGS[name])
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(hf_base)
    names = [n for n, _ in model.named_modules() if n]
    if name == "all_linear":  # PEFT expands it to the model's Linear modules when it injects
        assert {n for n in names if config_selects(saved, n, {m for m in names if isinstance(
            model.get_submodule(m), torch.nn.Linear) and m != "lm_head"}) is True} == adapted(peft_model)
        return
    config = LoraConfig(**CONFIGS[name])
    for key in names:
        theirs = check_target_module_exists(config, key)
        ours = config_selects(saved, key)
        assert (ours is True) == bool(theirs), key  # PEFT's _ExcludedModule is falsy
        assert (ours == "excluded") == (type(theirs).__name__ == "_ExcludedModule"), key
    assert {n for n in names if config_selects(saved, n) is True} == adapted(peft_model)


@pytest.mark.parametrize("name", CONFIGS)
def test_an_untouched_adapter_merges_exactly_the_modules_peft_adapts(name, hf_base, tmp_path):
    peft_model = make_adapter(hf_base, tmp_path / "adapter", **CONFIGS[name])
    assert main(run(tmp_path / "adapter", tmp_path / "out", hf_base)) == 0
    ours, base = load_file(tmp_path / "out" / "model.safetensors"), load_file(hf_base / "model.safetensors")
    changed = {k.removesuffix(".weight") for k in ours if not torch.equal(ours[k], base[k])}
    assert changed == adapted(peft_model)


def tamper(adapter, config=None, tensors=None):
    if config is not None:
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        state = load_file(adapter / "adapter_model.safetensors")
        save_file(tensors(state), adapter / "adapter_model.safetensors")


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
K0 = "base_model.model.model.layers.0.self_attn.k_proj"


def _with_k0(state):
    state = dict(state)
    state[f"{K0}.lora_A.weight"] = state[f"{Q0}.lora_A.weight"].clone()
    state[f"{K0}.lora_B.weight"] = torch.zeros(state[f"{Q0}.lora_B.weight"].shape[0] // 4,  # k rows: 2 of 8 heads
                                               state[f"{Q0}.lora_B.weight"].shape[1])
    return state


def _without_q0(state):
    return {k: v for k, v in state.items() if not k.startswith(Q0 + ".")}


# (config the adapter is built with, change to its config, change to its factors, what the one line says)
TAMPERED = {
    "config_narrowed_to_q_proj": (CONFIGS["list"], {"target_modules": ["q_proj"]}, None,
                                  ["does not select", "v_proj"]),
    "config_narrowed_to_layer_0": (CONFIGS["list"], {"layers_to_transform": [0]}, None,
                                   ["does not select", "model.layers.1."]),
    "target_matching_nothing": (CONFIGS["list"], {"target_modules": ["no_such_module"]}, None,
                                ["does not select"]),
    "regex_matching_nothing": (CONFIGS["regex"], {"target_modules": r".*\.nothing"}, None, ["does not select"]),
    "exclude_added": (CONFIGS["list"], {"exclude_modules": [r"model.layers.2.mlp.down_proj"]}, None,
                      ["does not select", "exclude_modules", "model.layers.2.mlp.down_proj"]),
    "config_widened": (CONFIGS["list"], {"target_modules": ["q_proj", "v_proj", "down_proj", "o_proj"]}, None,
                       ["no LoRA factors for 4 of the 16", "o_proj"]),
    "layers_widened": (CONFIGS["layers"], {"layers_to_transform": [0, 1, 3]}, None,
                       ["no LoRA factors for 2 of the 6", "model.layers.1."]),
    "exclude_removed": (CONFIGS["exclude"], {"exclude_modules": None}, None,
                        ["no LoRA factors for 1 of the 8", "model.layers.1.self_attn.q_proj"]),
    "factor_added": (CONFIGS["list"], None, _with_k0, ["does not select", "model.layers.0.self_attn.k_proj"]),
    "factor_removed": (CONFIGS["list"], None, _without_q0, ["no LoRA factors", "model.layers.0.self_attn.q_proj"]),
    "all_linear_factor_removed": (CONFIGS["all_linear"], None, _without_q0, ["no LoRA factors", "q_proj"]),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_config_and_factors_that_disagree_are_refused(case, hf_base, tmp_path, capsys):
    built, config, tensors, expected = TAMPERED[case]
    make_adapter(hf_base, tmp_path / "adapter", **built)
    tamper(tmp_path / "adapter", config, tensors)
    capsys.readouterr()
    fails(run(tmp_path / "adapter", tmp_path / "out", hf_base), capsys, *expected)
    assert not (tmp_path / "out").exists()
