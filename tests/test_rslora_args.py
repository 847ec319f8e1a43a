"""rsLoRA from a Megatron LoRA checkpoint's args: ms-swift's Megatron-SWIFT records it as `use_rslora` (its rank as
`lora_rank`) and scales by alpha / sqrt(r); MindSpeed-LLM has no such switch. A real Megatron LoRA fixture with
those args merges as PEFT merges the same LoRA exported with use_rslora (export-adapter writes it), and unknown
or malformed switches are refused."""

import torch

from helpers import copy_fixture, rank_files, rewrite, run_failing

NAME = "tp2_fp32_filtered"  # r 4, alpha 12: alpha/sqrt(r) is 6, alpha/r 3


def _set(root, **values):
    for f in rank_files(root / "lora"):
        rewrite(f, lambda state: [setattr(state["args"], k, v) for k, v in values.items()])


def test_rslora_args_merge_as_peft_merges_the_exported_rslora_adapter(tmp_path):
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import lora_merge

    root = copy_fixture(NAME, tmp_path / "src")
    quiet = dict(warn=lambda m: None)
    lora_merge.merge(base=root / "base", hf_ref=root / "hf_ref", out=tmp_path / "hf_base", dtype="float32", **quiet)
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "plain",
                     dtype="float32", **quiet)
    _set(root, use_rslora=True)
    result = lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "rslora",
                              dtype="float32", verify=True, **quiet)
    assert result.scale == 6 and "rsLoRA" in result.settings_source
    assert "W' = W + (alpha/√r)·B·A" in (tmp_path / "rslora" / "README.md").read_text()
    lora_merge.export_adapter(lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "adapter", **quiet)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_rslora"] is True

    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base", dtype=torch.float32),
                                         tmp_path / "adapter").merge_and_unload().state_dict()
    ours, plain, base = (load_file(tmp_path / d / "model.safetensors") for d in ("rslora", "plain", "hf_base"))
    assert max((ours[k] - expected[k]).abs().max().item() for k in ours) <= 1e-6
    key = "model.layers.0.self_attn.q_proj.weight"  # the change is twice the plain one (6 / 3)
    assert torch.allclose(ours[key] - base[key], 2 * (plain[key] - base[key]), atol=1e-6)

    _set(root, use_rslora=False, lora_r=None, lora_rank=4)  # ms-swift's name for the rank
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "rank",
                     dtype="float32", **quiet)
    rank = load_file(tmp_path / "rank" / "model.safetensors")
    assert all(torch.equal(rank[k], plain[k]) for k in plain)


def test_rslora_switches_no_known_trainer_writes_are_refused(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path / "src")
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
            str(tmp_path / "out")]
    _set(root, lora_use_rslora=True)
    run_failing(args, capsys, "args.lora_use_rslora: a switch of no trainer this tool knows")
    _set(root, lora_use_rslora=None, use_rslora="yes")
    run_failing(args, capsys, "args.use_rslora='yes'; expected true or false")
