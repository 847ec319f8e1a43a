"""A torch distributed checkpoint (DCP) of HF-named tensors as an HF base: what FSDP2 training saves
(scripts/fsdp2_save.py runs torch's own `fully_shard` and `torch.distributed.checkpoint.save` on 2 gloo ranks: every
parameter in two dim-0 pieces, one per rank file, under the app-state key `model.`). Merged with a PEFT adapter or a
Megatron LoRA it gives the bytes of the same model's safetensors as the base, each piece read where it is stored; a
tied model's saved output layer is checked to be the embedding's copy; `--to megatron` reads it; inspect names it."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_merge
from helpers import quiet, random_hf_model, trained_peft_adapter

TESTS = Path(__file__).parent
GPT_OSS = TESTS / "fixtures_moe/gptoss_tp2etp1_ep2"


def fsdp2_dcp(model_dir: Path, out: Path, *options: str) -> Path:
    """The DCP torch saves on 2 gloo ranks. Making it is not what is tested: a try that fails is made again, twice
    at most, and the last failure shows what the ranks printed. (It failed once in CI, its output not kept; it
    passes alone. The script picks a free port and lets it go before its ranks bind it, which another process can
    take meanwhile.)"""
    for attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run([sys.executable, str(TESTS.parent / "scripts/fsdp2_save.py"), str(model_dir), str(out),
                               *options], capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return out
    raise AssertionError(f"scripts/fsdp2_save.py failed 3 times (exit {done.returncode}):\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny tied Qwen3 (its safetensors have no lm_head; FSDP2's state dict has both names) and its DCP."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("tied")
    hf = random_hf_model(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                     max_position_embeddings=128, architectures=["Qwen3ForCausalLM"]), root / "hf")
    return hf, fsdp2_dcp(hf, root / "dcp")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, Path]:
    """The real Megatron gpt-oss fixture's base in HF form (stacked experts, sinks, biases) and its DCP."""
    root = tmp_path_factory.mktemp("gpt_oss")
    lora_merge.merge(base=GPT_OSS / "base", hf_ref=GPT_OSS / "hf_ref", out=root / "hf", dtype="bfloat16", warn=quiet)
    return root / "hf", fsdp2_dcp(root / "hf", root / "dcp")


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("*.safetensors"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_peft_adapter_on_an_fsdp2_dcp_merges_as_on_its_safetensors(tied, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    hf, dcp = tied
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), 3, tmp_path / "adapter")
    for base, out in ((hf, "from_hf"), (dcp, "from_dcp")):
        result = lora_merge.merge(base=base, lora=tmp_path / "adapter", hf_ref=hf, out=tmp_path / out, warn=quiet)
    assert result.skipped.get("copy of the tied embedding") == 1
    same_files(tmp_path / "from_hf", tmp_path / "from_dcp")


def test_a_megatron_lora_on_an_fsdp2_dcp_merges_as_on_its_safetensors(gpt_oss, tmp_path):
    """gpt-oss's stacked experts split by rank along the experts: every expert's Megatron LoRA still lands on its row."""
    hf, dcp = gpt_oss
    for base, out in ((hf, "from_hf"), (dcp, "from_dcp")):
        lora_merge.merge(base=base, lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / out, warn=quiet)
    same_files(tmp_path / "from_hf", tmp_path / "from_dcp")


def test_to_megatron_from_an_fsdp2_dcp(gpt_oss, tmp_path):
    hf, dcp = gpt_oss
    lora_merge.to_megatron(base=dcp, hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "mg", tp=2, ep=2, etp=1, warn=quiet)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "back", warn=quiet)
    ours, theirs = load_file(tmp_path / "back/model.safetensors"), load_file(hf / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_inspect_names_it_and_its_pieces(tied, capsys):
    from lora_merge.cli import main

    assert main(["inspect", str(tied[1])]) == 0
    out = capsys.readouterr().out
    assert "torch distributed checkpoint of HF-named tensors (FSDP), 2 .distcp file(s)" in out
    assert "25 stored in pieces (up to 2, along dim 0)" in out


def test_a_saved_output_layer_that_is_not_the_embeddings_copy_is_refused(tied, tmp_path):
    """The config ties them, the checkpoint's output layer says the run trained it apart: refused by name."""
    import json

    from transformers import Qwen3Config

    hf, _ = tied
    config = json.loads((hf / "config.json").read_text()) | {"tie_word_embeddings": False}
    untied = random_hf_model(Qwen3Config(**{k: v for k, v in config.items() if k not in ("model_type",
                                                                                          "transformers_version")}),
                             tmp_path / "untied")
    dcp = fsdp2_dcp(untied, tmp_path / "dcp")
    with pytest.raises(lora_merge.MergeError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight \(row 0\)"):
        lora_merge.to_megatron(base=dcp, hf_ref=hf, out=tmp_path / "mg", warn=quiet)
    assert not (tmp_path / "mg").exists()


def test_converted_without_a_lora_it_is_its_safetensors(gpt_oss, tmp_path):
    hf, dcp = gpt_oss
    lora_merge.merge(base=dcp, hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "out", dtype="bfloat16", warn=quiet)
    same_files(hf, tmp_path / "out")


@pytest.mark.parametrize("state,first", [
    # torchtitan's own names
    ({"model": {"layers.0.attention.wq.weight": torch.ones(4, 4), "tok_embeddings.weight": torch.ones(8, 4)}},
     "model.layers.0.attention.wq.weight"),
    # a wrapped model's (DDP's module., torch.compile's _orig_mod.): not unwrapped
    ({"model": {"module.model.embed_tokens.weight": torch.ones(8, 4), "module.lm_head.weight": torch.ones(8, 4)}},
     "model.module.lm_head.weight"),
])
def test_a_dcp_named_neither_as_megatron_nor_as_hf_is_refused_by_name(tied, tmp_path, state, first):
    """Not read as a Megatron checkpoint either."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    with pytest.raises(lora_merge.MergeError, match=r"named neither as Megatron's \(decoder\.layers\.…\) nor as an HF "
                                                    rf"model's .*: {re.escape(first)}"):
        lora_merge.merge(base=tmp_path / "other", hf_ref=tied[0], out=tmp_path / "out", warn=quiet)


def test_verify_takes_the_dcp_itself_as_the_baseline(tied, tmp_path):
    """Not a downgrade to structure only: every tensor against the DCP's own, and a changed one found."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf, dcp = tied
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]), 4,
                         tmp_path / "adapter")
    result = lora_merge.merge(base=dcp, lora=tmp_path / "adapter", hf_ref=hf, out=tmp_path / "out", verify=True,
                              warn=quiet)
    assert result.verify_report.baseline == f"reference weights in {dcp}"
    assert result.verify_report.statuses["model.norm.weight"] == "identical to baseline"
    weights = load_file(tmp_path / "out/model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"] * 3
    save_file(weights, tmp_path / "out/model.safetensors", metadata={"format": "pt"})
    report = lora_merge.verify(tmp_path / "out", base=dcp, lora=tmp_path / "adapter", hf_ref=hf, warn=quiet)
    assert any(p.startswith("model.layers.1.mlp.down_proj.weight") for p in report.problems), report.problems


def test_more_ranks_than_rows_leaves_empty_pieces_that_are_passed_over(gpt_oss, tmp_path):
    """5 ranks, 4 experts: FSDP2 gives the last rank an empty piece of every stacked experts tensor."""
    import pickle

    hf, _ = gpt_oss
    dcp = fsdp2_dcp(hf, tmp_path / "dcp", "--ranks", "5")
    meta = pickle.loads((dcp / ".metadata").read_bytes()).state_dict_metadata
    assert any(c.sizes[0] == 0 for c in meta["model.model.layers.0.mlp.experts.gate_up_proj"].chunks)
    for base, out in ((hf, "from_hf"), (dcp, "from_dcp")):
        lora_merge.merge(base=base, lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / out, warn=quiet)
    same_files(tmp_path / "from_hf", tmp_path / "from_dcp")


def test_a_safetensors_base_that_stores_its_tied_output_layer_is_checked_row_by_row(tied, tmp_path):
    """Any HF base: a stored copy of the tied embedding is skipped (the bytes of the base without it); one whose
    middle rows alone differ is another model, refused, however few rows differ."""
    import shutil

    from safetensors.torch import save_file

    hf, _ = tied
    weights = load_file(hf / "model.safetensors")
    for name, change in (("same", None), ("rows", slice(100, 120))):
        base = tmp_path / name
        shutil.copytree(hf, base)
        head = weights["model.embed_tokens.weight"].clone()
        if change is not None:
            head[change] *= 2
        save_file(weights | {"lm_head.weight": head}, base / "model.safetensors", metadata={"format": "pt"})
    lora_merge.to_megatron(base=hf, out=tmp_path / "mg_plain", warn=quiet)
    lora_merge.to_megatron(base=tmp_path / "same", out=tmp_path / "mg_same", warn=quiet)
    assert (tmp_path / "mg_plain/release/mp_rank_00/model_optim_rng.pt").read_bytes() == \
        (tmp_path / "mg_same/release/mp_rank_00/model_optim_rng.pt").read_bytes()
    with pytest.raises(lora_merge.MergeError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight \(row 100\)"):
        lora_merge.to_megatron(base=tmp_path / "rows", out=tmp_path / "mg_rows", warn=quiet)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_peft_model_s_dcp_is_its_adapter(dora, tied, tmp_path):
    """FSDP2 training of a PeftModel saves its state dict (base weights and factors, PEFT's in-memory names with the
    adapter's name) as a DCP; with its adapter_config.json beside it, it is the adapter: the same merge as the one
    PEFT's save_pretrained wrote, and the base's weights in it skipped."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    hf, _ = tied
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora), 5,
                         tmp_path / "adapter")
    dcp = fsdp2_dcp(hf, tmp_path / "peft_dcp", "--peft", str(tmp_path / "adapter"))
    for lora, out in ((tmp_path / "adapter", "from_adapter"), (dcp, "from_dcp")):
        result = lora_merge.merge(base=hf, lora=lora, hf_ref=hf, out=tmp_path / out, warn=quiet)
    same_files(tmp_path / "from_adapter", tmp_path / "from_dcp")
    assert result.lora_modules == 2 * 7
    assert load_file(next((tmp_path / "from_dcp").glob("*.safetensors")))["model.layers.0.mlp.up_proj.weight"].ne(
        load_file(next(hf.glob("*.safetensors")))["model.layers.0.mlp.up_proj.weight"]).any()


def test_a_model_dcp_with_an_adapter_config_but_no_factors_is_named(tied, tmp_path):
    import json
    import shutil

    _, dcp = tied
    shutil.copytree(dcp, tmp_path / "dcp")
    (tmp_path / "dcp" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(lora_merge.MergeError, match="without a PEFT model's LoRA factors"):
        lora_merge.merge(base=tied[0], lora=tmp_path / "dcp", hf_ref=tied[0], out=tmp_path / "out", warn=quiet)
