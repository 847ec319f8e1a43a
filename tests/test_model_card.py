"""The model cards (merged model and exported adapter) as the Hub reads them: parsed with huggingface_hub's
ModelCard, base_model a Hub id (from --base-model-id, an HF cache snapshot path, or a Hub-id
_name_or_path) or absent with one warning, no local path in a card or in adapter_config.json, tags naming
the inputs actually merged; the adapter dir's files have the merged output's modes."""

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from helpers import BASE_ONLY, FIXTURES, copied_args, copy_fixture, merge_args
from lora_merge.cli import main

NAME = "tp2_fp32_filtered"


def hf_cache_snapshot(hf_ref: Path, cache: Path, repo_id: str) -> Path:
    """huggingface_hub's cache layout: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/SHA."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "5b8a0e7d1f0c2a9e4c6d8b0a1e3f5a7c9e1b3d5f"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, src in enumerate(sorted(hf_ref.iterdir())):
        shutil.copyfile(src, repo / "blobs" / f"blob{i}")
        (snapshot / src.name).symlink_to(f"../../blobs/blob{i}")
    return snapshot


def card(out: Path):
    return ModelCard.load(out / "README.md")


def run(args, capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


def test_an_hf_cache_reference_gives_the_hub_id_and_base_model_id_wins(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    snapshot = hf_cache_snapshot(root / "hf_ref", tmp_path / "hub", "Qwen/Qwen2.5-0.5B")
    args = copied_args(root, tmp_path / "out") + ["--no-progress"]
    args[args.index("--hf-ref") + 1] = str(snapshot)
    code, err = run(args, capsys)
    assert code == 0 and "--base-model-id" not in err, err
    data = card(tmp_path / "out").data
    assert data.base_model == "Qwen/Qwen2.5-0.5B" and data.library_name == "transformers"

    args[args.index("--out") + 1] = str(tmp_path / "named")
    code, err = run(args + ["--base-model-id", "my-org/my-base"], capsys)
    assert code == 0 and card(tmp_path / "named").data.base_model == "my-org/my-base"

    # A link to the snapshot counts as the snapshot.
    (tmp_path / "model").symlink_to(snapshot)
    args[args.index("--hf-ref") + 1] = str(tmp_path / "model")
    args[args.index("--out") + 1] = str(tmp_path / "linked")
    assert run(args, capsys)[0] == 0 and card(tmp_path / "linked").data.base_model == "Qwen/Qwen2.5-0.5B"


def test_a_hub_id_in_name_or_path_is_the_base_model(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    (root / "hf_ref" / "config.json").write_text(json.dumps({**config, "_name_or_path": "Qwen/Qwen2-1.5B"}))
    code, err = run(copied_args(root, tmp_path / "out") + ["--no-progress"], capsys)
    assert code == 0 and "--base-model-id" not in err
    assert card(tmp_path / "out").data.base_model == "Qwen/Qwen2-1.5B"


def test_local_only_inputs_give_no_base_model_one_warning_and_no_local_path(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    # A local path in _name_or_path (as older transformers saved it) is no Hub id either.
    (root / "hf_ref" / "config.json").write_text(json.dumps({**config, "_name_or_path": str(root / "hf_ref")}))
    code, err = run(copied_args(root, tmp_path / "out") + ["--no-progress"], capsys)
    warnings = [line for line in err.splitlines() if "--base-model-id" in line]
    assert code == 0 and len(warnings) == 1 and warnings[0].startswith("lora-merge: warning: "), err
    text = (tmp_path / "out" / "README.md").read_text()
    assert card(tmp_path / "out").data.base_model is None and "base_model" not in text.split("---")[1]
    assert str(tmp_path) not in text and str(FIXTURES) not in text
    assert "| base | legacy checkpoint base (iteration 1" in text  # the directory's name, not its path

    adapter = tmp_path / "adapter"
    code, err = run(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                     str(adapter)], capsys)
    assert code == 0 and len([line for line in err.splitlines() if "--base-model-id" in line]) == 1, err
    config_text = (adapter / "adapter_config.json").read_text()
    assert json.loads(config_text)["base_model_name_or_path"] is None
    for name in ("README.md", "adapter_config.json"):
        assert str(tmp_path) not in (adapter / name).read_text(), name
    assert card(adapter).data.base_model is None


def test_the_adapter_card_and_config_name_the_hub_id_and_peft_loads_it(tmp_path, capsys):
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    root = FIXTURES / NAME
    adapter = tmp_path / "adapter"
    code, err = run(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                     str(adapter), "--base-model-id", "Qwen/Qwen2.5-0.5B"], capsys)
    assert code == 0 and "--base-model-id" not in err
    data = card(adapter).data
    assert data.library_name == "peft" and data.base_model == "Qwen/Qwen2.5-0.5B"
    assert "megatron" in data.tags and "lora" in data.tags
    assert PeftConfig.from_pretrained(adapter).base_model_name_or_path == "Qwen/Qwen2.5-0.5B"
    listed = (adapter / "README.md").read_text()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert f"| {name} | `{hashlib.sha256((adapter / name).read_bytes()).hexdigest()}` |" in listed

    base = tmp_path / "base"
    assert main(merge_args(NAME, base) + BASE_ONLY) == 0
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    assert model.peft_config["default"].r == 4  # loaded onto the model given, whatever the id names


def test_tags_name_the_inputs_megatron_or_hf_weights_with_a_peft_adapter(tmp_path, capsys):
    from test_peft_input import make_adapter

    megatron = tmp_path / "megatron"
    assert main(merge_args(NAME, megatron)) == 0
    tags = card(megatron).data.tags
    assert "megatron" in tags and "peft" not in tags

    base = tmp_path / "base"
    assert main(merge_args(NAME, base) + BASE_ONLY) == 0
    make_adapter(base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    out = tmp_path / "out"
    assert main(["--base", str(base), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(FIXTURES / NAME / "hf_ref"),
                 "--out", str(out), "--no-progress"]) == 0
    tags = card(out).data.tags
    assert "peft" in tags and "megatron" not in tags
    text = (out / "README.md").read_text()
    assert "| LoRA | PEFT adapter adapter (" in text and str(tmp_path) not in text


def test_the_adapter_dir_has_the_merged_outputs_file_modes(tmp_path):
    root = FIXTURES / NAME
    old = os.umask(0o002)  # not the usual 022, so that a fixed mode cannot pass by chance
    try:
        assert main(merge_args(NAME, tmp_path / "merged")) == 0
        assert main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                     str(tmp_path / "adapter")]) == 0
    finally:
        os.umask(old)
    merged = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "merged").iterdir()}
    adapter = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "adapter").iterdir()}
    assert merged == {0o664}
    assert adapter == dict.fromkeys(["README.md", "adapter_config.json", "adapter_model.safetensors"], 0o664)
    assert stat.S_IMODE((tmp_path / "adapter").stat().st_mode) == stat.S_IMODE((tmp_path / "merged").stat().st_mode)


@pytest.mark.parametrize("value", ["/abs/path", "org/name/extra", "org--x/name", "a b/c"])
def test_a_base_model_id_that_is_no_hub_id_is_one_line(tmp_path, capsys, value):
    from test_damaged_inputs import fails

    out = tmp_path / "out"
    fails(merge_args(NAME, out) + ["--base-model-id", value], capsys, f"base model id {value!r}",
          "expected a Hugging Face Hub model id ORG/NAME")
    assert not out.exists()


def test_api_takes_base_model_id(tmp_path):
    import lora_merge

    root = FIXTURES / NAME
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "out",
                     base_model_id="org/base", warn=lambda message: None)
    assert card(tmp_path / "out").data.base_model == "org/base"
    with pytest.raises(lora_merge.MergeError, match="expected a Hugging Face Hub model id"):
        lora_merge.export_adapter(lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "a", base_model_id="x/")
