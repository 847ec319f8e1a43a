"""Multi-token-prediction layers, both ways, against the real Megatron-Core MTP block and transformers' MtpModel.

The fixture glm4moe_mtp_tp2etp1_ep2 (megatron-core 0.16.1, PEFT 0.7.1) is GLM-4.5-shaped with one MTP layer that
the LoRA trains too; its logits.pt holds Megatron's main and MTP logits (test_moe.py checks our merge of it
against both, through transformers' Glm4MoeForCausalLM and MtpModel). Here: the same checkpoint written back
to Megatron at other layouts and loaded by megatron-core, the HF routes, and what is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import fixture_root, rank_files, rewrite, run_failing, with_mtp_layer
from lora_merge.cli import main

NAME = "glm4moe_mtp_tp2etp1_ep2"
ROOT = Path(__file__).parent / "fixtures_moe" / NAME
LAYOUT = dict(tp=2, pp=2, ep=2, etp=1)  # the MTP layer on the second stage, its experts over EP


def _convert(src: Path, out: Path, *layout: str) -> Path:
    assert main(["--base", str(src), "--to", "megatron", "--out", str(out), "--no-progress", *layout]) == 0
    return out


@pytest.mark.parametrize("name", [NAME, "deepseek_v3_mtp_tp2etp1_ep2"])
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_megatron_loads_our_mtp_layers_at_another_layout_and_computes_the_same(name, ckpt_format, merged_fixture,
                                                                                tmp_path):
    """The merged model (MTP layer included, its LoRA merged; GQA and MLA) written as a Megatron checkpoint at
    TP2 PP2 EP2: megatron-core with its MTP block loads it strictly (every key it saves, no other) and its main
    and MTP logits are the trained model's; converted back, the HF files are byte for byte the merged ones."""
    from megatron_oracle import megatron_logits

    merged = merged_fixture(name)
    layout = ["--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--ckpt-format", ckpt_format]
    out = _convert(merged, tmp_path / "megatron", *layout)
    ref = torch.load(fixture_root(name) / "logits.pt", weights_only=True)
    config = json.loads((merged / "config.json").read_text())
    mtp = {}
    logits = megatron_logits(out / "release", config, LAYOUT, ref["input_ids"], ckpt_format=ckpt_format, mtp_out=mtp)
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (mtp["logits"] - ref["mtp_logits_lora"]).abs().max() <= 1e-4
    assert (mtp["logits"] - ref["mtp_logits_base"]).abs().max() > 0.1  # the MTP layer's LoRA is in it

    back = tmp_path / "back"
    assert main(["--base", str(out), "--hf-ref", str(merged), "--out", str(back), "--no-progress"]) == 0
    for shard in merged.glob("*.safetensors"):
        assert (back / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_the_mtp_stage_holds_its_own_embedding_and_the_args_say_mtp(merged_fixture, tmp_path):
    """Megatron-Core builds an embedding on the stage of the MTP layers; the args record mtp_num_layers."""
    out = _convert(merged_fixture(NAME), tmp_path / "megatron", "--pp", "2")
    first, last = (torch.load(out / "release" / d / "model_optim_rng.pt", weights_only=False)
                   for d in ("mp_rank_00_000", "mp_rank_00_001"))
    assert torch.equal(first["model"]["embedding.word_embeddings.weight"],
                       last["model"]["embedding.word_embeddings.weight"])
    assert "mtp.layers.0.eh_proj.weight" in last["model"] and not any(k.startswith("mtp.") for k in first["model"])
    assert last["args"].mtp_num_layers == 1


def test_an_hf_base_with_mtp_and_a_lora_that_trained_it_merges_as_the_megatron_base(merged_fixture, base_model,
                                                                                    tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert main(["--base", str(base_model(NAME)), "--lora", str(ROOT / "lora"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(out), "--no-progress"]) == 0
    ours, theirs = (load_file(next(d.glob("*.safetensors"))) for d in (out, merged_fixture(NAME)))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert "model.layers.4.eh_proj.weight" in ours


def test_dry_run_names_the_mtp_layer(capsys, tmp_path):
    assert main(["--base", str(ROOT / "base"), "--lora", str(ROOT / "lora"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "MTP 1 layer" in capsys.readouterr().out


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(ROOT, root)
    return root


def _args(root: Path, out: Path) -> list[str]:
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out)]


def _edit_base(root: Path, edit) -> None:
    for f in rank_files(root / "base"):
        rewrite(f, edit)


def _rename(old: str, new: str):
    def edit(state):
        model = state["model"]
        for key in [k for k in model if k.startswith(old)]:
            model[new + key[len(old):]] = model.pop(key)
    return edit


@pytest.mark.parametrize("old,new,expected", [
    # MindSpeed-LLM's MTP reads the hidden state before the final norm: another function, refused by name
    ("mtp.layers.0.final_layernorm.", "mtp.final_layernorms.0.", "MindSpeed-LLM's MTP layout (mtp.final_layernorms.0"),
    ("mtp.layers.0.eh_proj.", "mtp.layers.0.fc.", "mtp.layers.0.fc.weight is no multi-token-prediction parameter"),
    ("mtp.layers.0.", "mtp.layers.1.", "MTP layer 1, but the args give mtp_num_layers=1"),
])
def test_mtp_names_the_tool_does_not_know_are_refused(old, new, expected, tmp_path, capsys):
    root = _copy(tmp_path)
    _edit_base(root, _rename(old, new))
    run_failing(_args(root, tmp_path / "out"), capsys, expected)


def test_mtp_layers_the_hf_config_does_not_have_are_refused(tmp_path, capsys):
    root = _copy(tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    (root / "hf_ref" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    run_failing(_args(root, tmp_path / "out"), capsys,
                "args.mtp_num_layers=1 but the HF config's num_nextn_predict_layers is 2")


def test_an_mtp_parameter_outside_the_last_stage_is_refused(merged_fixture, tmp_path, capsys):
    out = _convert(merged_fixture(NAME), tmp_path / "megatron", "--pp", "2")
    stages = [out / "release" / d / "model_optim_rng.pt" for d in ("mp_rank_00_000", "mp_rank_00_001")]
    moved = {}
    rewrite(stages[1], lambda state: moved.update(w=state["model"].pop("mtp.layers.0.enorm.weight")))
    rewrite(stages[0], lambda state: state["model"].update({"mtp.layers.0.enorm.weight": moved["w"]}))
    run_failing(["--base", str(out), "--hf-ref", str(ROOT / "hf_ref"), "--out", str(tmp_path / "hf")], capsys,
                "mtp.layers.0.enorm.weight]: multi-token-prediction parameter on pipeline stage 0, chunk 0; the args put "
                "them on stage 1, chunk 0")


def test_an_hf_base_whose_mtp_copy_of_the_head_differs_is_not_written_to_megatron(base_model_dirs, tmp_path,
                                                                                  capsys):
    """Megatron's MTP layers use the main output layer: a release whose copy differs has no Megatron form."""
    hf = tmp_path / "hf"
    shutil.copytree(base_model_dirs("glm4moe_tp2etp1_ep2"), hf)
    new = with_mtp_layer(hf, 4)
    from safetensors.torch import load_file, save_file

    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.layers.4.shared_head.head.weight"] = new["model.layers.4.shared_head.head.weight"] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    run_failing(["--base", str(hf), "--to", "megatron", "--out", str(tmp_path / "out")], capsys,
                "model.layers.4.shared_head.head.weight differs from lm_head.weight; Megatron's multi-token-prediction "
                "layers share the main model's")


@pytest.fixture
def base_model_dirs(base_model):
    return base_model


def test_an_hf_base_with_mtp_round_trips_through_megatron(base_model_dirs, tmp_path):
    """An HF release with its MTP layer (and no LoRA): to Megatron (the MTP layer as mtp.layers.0) and back, byte
    for byte."""
    hf = tmp_path / "hf"
    shutil.copytree(base_model_dirs("glm4moe_tp2etp1_ep2"), hf)
    with_mtp_layer(hf, 4)
    out = _convert(hf, tmp_path / "megatron", "--tp", "2", "--ep", "2", "--etp", "1")
    back = tmp_path / "back"
    assert main(["--base", str(out), "--hf-ref", str(hf), "--out", str(back), "--no-progress"]) == 0
    from safetensors.torch import load_file

    ours, theirs = (load_file(next(d.glob("*.safetensors"))) for d in (back, hf))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_export_adapter_leaves_out_the_mtp_lora_and_says_so(tmp_path, capsys):
    assert main(["export-adapter", "--lora", str(ROOT / "lora"), "--hf-ref", str(ROOT / "hf_ref"),
                 "--out", str(tmp_path / "adapter")]) == 0
    assert "multi-token-prediction layers (20 modules) is not in the adapter" in capsys.readouterr().err
    from safetensors import safe_open

    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if ".layers.4." in k]


def _without(hf_dir: Path, *names: str) -> None:
    from safetensors.torch import load_file, save_file

    (shard,) = hf_dir.glob("*.safetensors")
    save_file({k: v for k, v in load_file(shard).items() if k not in names}, shard, metadata={"format": "pt"})


def test_an_mtp_layer_stored_without_copies_of_the_shared_tensors_merges_without_them(base_model, tmp_path, capsys):
    """GLM-4.6's release stores its MTP layer without embed_tokens and shared_head.head: none is written, the
    rest merges as usual (the Megatron LoRA's MTP modules included), and verify accepts it."""
    from safetensors.torch import load_file

    hf = tmp_path / "glm46"
    shutil.copytree(base_model(NAME), hf)
    _without(hf, "model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight")
    out = tmp_path / "out"
    args = ["--base", str(hf), "--lora", str(ROOT / "lora"), "--hf-ref", str(ROOT / "hf_ref")]
    assert main(args + ["--out", str(out), "--no-progress", "--verify"]) == 0, capsys.readouterr().err
    written = load_file(next(out.glob("*.safetensors")))
    assert "model.layers.4.shared_head.head.weight" not in written and "model.layers.4.eh_proj.weight" in written


def test_a_lora_without_mtp_on_a_base_with_it_writes_megatron_args_that_say_mtp(base_model, tmp_path, capsys):
    """The args written come from the LoRA's run (trained without MTP), but the checkpoint holds the base's MTP
    layer: they say mtp_num_layers=1, and the checkpoint converts back."""
    def no_mtp(state):
        state["args"].mtp_num_layers = None
        for key in [k for k in state["model"] if k.startswith("mtp.")]:
            del state["model"][key]

    lora = tmp_path / "lora"
    shutil.copytree(ROOT / "lora", lora)
    for f in rank_files(lora):
        rewrite(f, no_mtp)
    out = tmp_path / "megatron"
    assert main(["--base", str(base_model(NAME)), "--lora", str(lora), "--hf-ref", str(ROOT / "hf_ref"), "--to",
                 "megatron", "--out", str(out), "--pp", "2", "--no-progress"]) == 0, capsys.readouterr().err
    last = torch.load(out / "release/mp_rank_00_001/model_optim_rng.pt", weights_only=False)
    assert last["args"].mtp_num_layers == 1 and "mtp.layers.0.eh_proj.weight" in last["model"]
    assert main(["--base", str(out), "--hf-ref", str(ROOT / "hf_ref"), "--out", str(tmp_path / "back"),
                 "--no-progress"]) == 0, capsys.readouterr().err


def test_a_lora_that_trained_mtp_onto_a_base_without_it_is_refused_by_name(base_model, tmp_path, capsys):
    hf = tmp_path / "no_mtp"
    shutil.copytree(base_model(NAME), hf)
    from safetensors.torch import load_file

    _without(hf, *[k for k in load_file(next(hf.glob("*.safetensors"))) if k.startswith("model.layers.4.")])
    run_failing(["--base", str(hf), "--lora", str(ROOT / "lora"), "--hf-ref", str(ROOT / "hf_ref"), "--out",
                 str(tmp_path / "out")], capsys, "the LoRA trained 1 multi-token-prediction layer(s)", "has none")


def test_a_peft_adapter_on_lm_head_reaches_the_mtp_copy_and_verify_agrees(base_model, tmp_path, capsys):
    """The MTP layer's shared_head.head is the model's lm_head: a PEFT adapter's change to lm_head is made to both,
    counted once, said, and verify checks the copy against the adapter's lm_head factors."""
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers import trained_peft_adapter

    hf = base_model(NAME)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]), 8,
                         tmp_path / "adapter", save_embedding_layers=False)
    out = tmp_path / "out"
    assert main(["--base", str(hf), "--lora", str(tmp_path / "adapter"), "--hf-ref", str(hf), "--out", str(out),
                 "--no-progress", "--verify"]) == 0
    printed = capsys.readouterr()
    assert "copy of lm_head.weight, carries the LoRA's change to it" in printed.err
    assert "merged 5 LoRA modules" in printed.out  # q_proj of 4 layers and lm_head
    written = load_file(next(out.glob("*.safetensors")))
    assert torch.equal(written["model.layers.4.shared_head.head.weight"], written["lm_head.weight"])
    assert not torch.equal(written["lm_head.weight"], load_file(next(hf.glob("*.safetensors")))["lm_head.weight"])


def test_with_tied_embeddings_the_mtp_stages_unused_output_layer_is_not_compared(merged_fixture, tmp_path, capsys):
    """Tied embeddings with MTP at PP>1: megatron-core takes the embedding for the output itself and never syncs the
    last stage's output_layer (shared_embedding_or_output_weight), so a real checkpoint holds other values there;
    they are skipped, not compared as a copy of the embedding."""
    from safetensors.torch import load_file, save_file

    source = merged_fixture("deepseek_v3_mtp_tp2etp1_ep2")
    tied = tmp_path / "tied"
    shutil.copytree(source, tied)
    (shard,) = tied.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["lm_head.weight"]
    tensors["model.layers.2.shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = _convert(tied, tmp_path / "megatron", "--pp", "2", "--ep", "2")
    for f in (out / "release").glob("mp_rank_*_001_*/model_optim_rng.pt"):  # (the same on every EP rank)
        rewrite(f, lambda state: state["model"]["output_layer.weight"].normal_(generator=torch.Generator().manual_seed(0)))
    back = tmp_path / "back"
    assert main(["--base", str(out), "--hf-ref", str(tied), "--out", str(back), "--no-progress"]) == 0, \
        capsys.readouterr().err
    ours, theirs = load_file(back / shard.name), load_file(shard)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_mindspeed_mla_naming_is_refused_with_mtp_layers(merged_fixture, tmp_path, capsys):
    run_failing(["--base", str(merged_fixture("deepseek_v3_mtp_tp2etp1_ep2")), "--to", "megatron", "--mla-naming",
                 "mindspeed", "--out", str(tmp_path / "out")], capsys,
                "--mla-naming mindspeed with multi-token-prediction layers")
