"""`lora-merge inspect` describes every fixture, base and LoRA, in both formats."""

import pytest

from helpers import FIXTURE_NAMES, FIXTURES, fixture_info
from lora_merge.cli import main


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_every_fixture(name, capsys):
    info = fixture_info(name)
    assert main(["inspect", str(FIXTURES / name / "base")]) == 0
    base = capsys.readouterr().out
    base_format = info.get("base_format", "torch")
    assert ("torch_dist Megatron checkpoint" if base_format == "torch_dist" else "legacy Megatron checkpoint") in base
    assert "iteration 1" in base and f"num_layers={info.get('num_layers', 4)}" in base
    assert "LoRA: none" in base

    assert main(["inspect", str(FIXTURES / name / "lora")]) == 0
    lora = capsys.readouterr().out
    lora_format = "torch_dist" if info.get("lora_format") == "torch_dist" else "legacy"
    assert f"{lora_format} Megatron checkpoint, iteration 10" in lora
    if info.get("megatron_bridge"):
        assert "Megatron-Bridge" in base and "Megatron-Bridge" in lora
    assert "iter_0000005" in lora  # the leftover iteration is named as not used
    assert f"lora_r={info['r']} lora_alpha={info['alpha']}" in lora
    assert f"TP={info['tp']} PP={info['pp']}" in lora
    modules = 4 * len(info["targets"])
    assert f"LoRA: {modules} modules" in lora


def test_inspect_names_a_broken_checkpoint(tmp_path, capsys):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "expected an iteration number" in capsys.readouterr().err
