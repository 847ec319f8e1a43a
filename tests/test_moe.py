"""Mixture-of-Experts merges against the real Megatron forward pass (tests/fixtures_moe, made by
scripts/make_fixtures.py --family moe with megatron-core 0.16.1 and PEFT 0.7.1 as MindSpeed-LLM calls it)."""

import json
from pathlib import Path

import pytest
import torch

import mtp_oracle
from helpers import peft_model_loading_every_key
from lora_merge.cli import main

MOE = Path(__file__).parent / "fixtures_moe"
NAMES = sorted(p.name for p in MOE.iterdir() if (p / "fixture.json").is_file())


def moe_args(name: str, out: Path) -> list[str]:
    root = MOE / name
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]


@pytest.fixture
def merged(merged_fixture):
    return merged_fixture


@pytest.mark.parametrize("name", NAMES)
def test_moe_merge_computes_what_megatron_with_lora_computes(name, merged):
    from transformers import AutoModelForCausalLM

    out = merged(name)
    ref = torch.load(MOE / name / "logits.pt", weights_only=True)
    model, info = mtp_oracle.from_pretrained(out, dtype=torch.float32)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        logits = model.eval()(ref["input_ids"]).logits
    print(f"\n{name}: max |logits - Megatron+LoRA| = {(logits - ref['logits_lora']).abs().max():.2e}")
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1  # the LoRA (experts included) changed the model
    if "mtp_logits_lora" in ref:  # the MTP layers, LoRA merged: transformers' MtpModel against Megatron's MTP block
        mtp = mtp_oracle.mtp_logits(model, ref["input_ids"])
        print(f"{name}: max |MTP logits - Megatron+LoRA| = {(mtp - ref['mtp_logits_lora']).abs().max():.2e}")
        assert (mtp - ref["mtp_logits_lora"]).abs().max() <= 1e-4
        assert (mtp - ref["mtp_logits_base"]).abs().max() > 0.1  # its LoRA changed it


@pytest.mark.parametrize("name", ["qwen3moe_ep2", "qwen2moe_tp2ep2"])
def test_every_expert_is_written_once_per_projection(name, merged):
    info = json.loads((MOE / name / "fixture.json").read_text())
    index = {}
    for shard in merged(name).glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(shard, "pt") as f:
            index.update({k: shard.name for k in f.keys()})
    experts = info.get("num_experts", 4)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        found = {k.split(".experts.")[1].split(".")[0] for k in index if f".{proj}." in k and ".experts." in k
                 and ".layers.1." in k}
        assert found == {str(e) for e in range(experts)}, (proj, found)


def _copy(name: str, tmp_path: Path) -> Path:
    import shutil
    shutil.copytree(MOE / name, tmp_path / name)
    return tmp_path / name


def _failing(args, capsys, *expected):
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    for text in expected:
        assert text in err[0], err[0]
    print(f"\n{err[0]}")


def test_missing_expert_parallel_rank_is_an_error(tmp_path, capsys):
    import shutil
    root = _copy("qwen3moe_ep2", tmp_path)
    shutil.rmtree(root / "base" / "iter_0000001" / "mp_rank_00_001")
    _failing(moe_args("qwen3moe_ep2", tmp_path / "out")[:1] + [str(root / "base")] + moe_args("qwen3moe_ep2", tmp_path / "out")[2:],
             capsys, "missing mp_rank_00_001", "EP=2")
    assert not (tmp_path / "out").exists()


def test_sparse_rank_grid_must_still_cover_every_rank(tmp_path, capsys):
    """ETP=1 under TP=2: only mp_rank_00_000 and mp_rank_01_001 exist; losing one loses a TP shard and
    two experts, and is named."""
    import shutil
    root = _copy("qwen3moe_tp2etp1_ep2", tmp_path)
    shutil.rmtree(root / "base" / "iter_0000001" / "mp_rank_01_001")
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, "rank directories do not match TP=2 PP=1 EP=2 ETP=1", "a mp_rank_01_EEE dir",
             "an mp_rank_TT_001 dir (experts of EP rank 1)")
    assert not (tmp_path / "out").exists()


def test_dense_copies_that_differ_between_expert_parallel_files_are_an_error(tmp_path, capsys):
    from helpers import rewrite
    root = _copy("qwen3moe_ep2", tmp_path)
    key = "decoder.layers.2.self_attention.linear_proj.weight"
    rewrite(root / "base" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt",
            lambda s: s["model"].__setitem__(key, s["model"][key] + 1e-3))
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, key, "differs from its copy")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,expected", [("num_local_experts", 8, "args.num_experts=4"),
                                                  ("norm_topk_prob", False, "moe_router_pre_softmax=False"),
                                                  ("num_experts_per_tok", 4, "moe_router_topk=2"),
                                                  ("mlp_only_layers", [0], "layers [0, 1, 2, 3]")])
def test_moe_config_must_match_the_args(tmp_path, capsys, field, value, expected):
    root = _copy("qwen3moe_ep2", tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    config[field] = value
    (root / "hf_ref" / "config.json").write_text(json.dumps(config))
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, expected)


@pytest.fixture
def base_model_dirs(base_model):
    """Each fixture's base model in HF form (LoRA scaled to nothing; the merge tests check it)."""
    return base_model


# Per-expert adapters PEFT does not load whole: Qwen2-MoE's it drops (test below), GLM-4.5's dense-layer and
# shared-expert LoRA it drops as DeepSeek's (test_deepseek.py, with the warning that counts them).
ADAPTER_CASES = [(name, "fused") for name in NAMES] + \
    [(name, "per-expert") for name in NAMES if not name.startswith(("qwen2moe", "glm4moe"))]


@pytest.mark.parametrize("name,expert_format", ADAPTER_CASES)
def test_peft_loads_the_expert_adapter_and_merges_it_as_we_do(name, expert_format, tmp_path, merged, base_model_dirs,
                                                              capsys):
    """PEFT's own loading and merge_and_unload on the exported adapter: the adapted model computes what
    Megatron+LoRA computed, and PEFT's merged weights equal ours (transformers 5 fused experts included)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    root, adapter = MOE / name, tmp_path / "adapter"
    assert main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(adapter),
                 "--expert-format", expert_format]) == 0
    # No warning but the one saying the card has no base_model (the fixture is a local dir, no Hub id), and where the
    # LoRA trained MTP layers, the one saying their factors are not in the adapter (transformers builds no MTP)
    err = capsys.readouterr().err
    assert ("multi-token-prediction layers (20 modules) is not in the adapter" in err) == ("mtp" in name)
    assert "warning" not in "".join(line for line in err.splitlines()
                                    if "--base-model-id" not in line and "multi-token-prediction" not in line)

    def base():
        return AutoModelForCausalLM.from_pretrained(base_model_dirs(name), dtype=torch.float32).eval()

    probe = PeftModel(base(), PeftConfig.from_pretrained(adapter))
    loaded = probe.load_adapter(adapter, adapter_name="probe")
    assert not loaded.unexpected_keys, loaded.unexpected_keys[:4]  # PEFT drops unexpected keys silently
    assert not [k for k in loaded.missing_keys if ".probe." in k or k.endswith(".probe")], loaded.missing_keys[:4]

    model = PeftModel.from_pretrained(base(), adapter).eval()
    ref = torch.load(root / "logits.pt", weights_only=True)
    with torch.no_grad():
        adapted = model(ref["input_ids"]).logits
    assert (adapted - ref["logits_lora"]).abs().max() <= 1e-4
    assert (adapted - ref["logits_base"]).abs().max() > 0.1

    theirs = model.merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(merged(name), dtype=torch.float32).state_dict()
    assert theirs.keys() == ours.keys()
    worst = max((theirs[k] - ours[k]).abs().max().item() for k in ours)
    print(f"\n{name} ({expert_format}): max |PEFT merge_and_unload - ours| = {worst:.2e}, "
          f"max |PEFT adapted logits - Megatron+LoRA| = {(adapted - ref['logits_lora']).abs().max():.2e}")
    assert worst <= 1e-5


def test_per_expert_qwen2_moe_adapter_warns_that_peft_drops_it(tmp_path, capsys):
    root = MOE / "qwen2moe_tp2ep2"
    assert main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(tmp_path / "adapter")]) == 0
    err = capsys.readouterr().err
    assert "warning: PEFT (0.20 and later) does not convert per-expert qwen2_moe adapters" in err and "--expert-format fused" in err


def test_every_parameter_says_how_it_was_split():
    """Both formats describe a parameter's pieces alike: the group that split them and, for torch_dist's
    global slices, the dimension; LoRA factors too."""
    from lora_merge.readers.detect import open_checkpoint as read_checkpoint
    from lora_merge.readers.checkpoint import EXPERT_TP, GLOBAL, TP

    legacy = read_checkpoint(MOE / "qwen2moe_tp2ep2" / "base")
    expert = legacy.params["decoder.layers.1.mlp.experts.3.linear_fc2.weight"]
    dense = legacy.params["decoder.layers.0.self_attention.linear_proj.weight"]
    assert (expert.group, len(expert)) == (EXPERT_TP, legacy.experts.etp)
    assert (dense.group, len(dense)) == (TP, 2) and dense.dim is None
    adapters = read_checkpoint(MOE / "qwen2moe_tp2ep2" / "lora").lora
    assert {(m.a.group, len(m.b)) for name, m in adapters.items() if ".experts." in name} == {(EXPERT_TP, 2)}

    dist = read_checkpoint(MOE / "qwen3moe_dist_ep2" / "base")
    assert {p.group for p in dist.params.values()} == {GLOBAL}
    fc2 = dist.params["decoder.layers.0.mlp.experts.1.linear_fc2.weight"]
    assert fc2.dim in (None, 0, 1)
    # a rule splitting along another dimension gets one joined piece, never mislabelled slices
    for pieces in dist.params.values():
        if len(pieces) > 1:
            other = 1 - pieces.dim
            joined = pieces.fitted(other)
            assert len(joined) == 1 and torch.equal(joined[0].load(), torch.cat([r.load() for r in pieces], pieces.dim))
            assert pieces.fitted(pieces.dim) is pieces


def test_one_expert_without_its_lora_is_an_error(tmp_path, capsys):
    """PEFT adapts every expert; a checkpoint missing one expert's factors lost them on the way (global
    expert 3 is EP rank 1's local expert 1)."""
    from helpers import rewrite
    root = _copy("qwen3moe_ep2", tmp_path)
    prefix = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.lora_"
    rewrite(root / "lora" / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt",
            lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items() if not k.startswith(prefix)}))
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, "LoRA weights missing for 1 of", "layer 1 mlp.experts.3.linear_fc2")
    assert not (tmp_path / "out").exists()
    assert main(args + ["--allow-partial-lora"]) == 0


def test_per_expert_adapter_has_every_expert_projection_as_vllm_packs_them(tmp_path):
    """vLLM's MoE LoRA packs each expert's gate/up/down from the per-expert HF names and needs all three."""
    from safetensors import safe_open
    root, adapter = MOE / "qwen3moe_ep2", tmp_path / "adapter"
    assert main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(adapter)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "target_parameters" not in config
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    for layer in range(4):
        for expert in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for factor in ("lora_A", "lora_B"):
                    assert f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}.{factor}.weight" in keys


def test_an_unused_identical_copy_is_not_read(tmp_path, merged):
    """EP rank 1's copy of the embedding has the same stored CRC32 as rank 0's, so it is identical as
    written and only rank 0's (CRC-checked as it is read) is used: damage to the unused copy cannot reach
    the output, and the output is byte for byte the same."""
    from test_trust import _flip_in_member
    from lora_merge.files.safe_load import load_archive
    from lora_merge.files.torch_archive import MappedFile, TorchArchive

    root = _copy("qwen3moe_ep2", tmp_path)
    victim = root / "base" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
    archive = TorchArchive(MappedFile(victim))
    member = archive.record_of(load_archive(archive)["model"]["embedding.word_embeddings.weight"]).name
    del archive
    _flip_in_member(victim, member)
    out = tmp_path / "out"
    assert main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(out), "--no-progress"]) == 0
    for shard in merged("qwen3moe_ep2").glob("*.safetensors"):
        assert (out / shard.name).read_bytes() == shard.read_bytes()


def test_inspect_and_dry_run_show_the_experts(capsys, tmp_path):
    root = MOE / "qwen2moe_tp2ep2"
    assert main(["inspect", str(root / "base")]) == 0
    assert "experts: 4 experts, EP=2 ETP=2, SequentialMLP; MoE layers [1, 2, 3]" in capsys.readouterr().out
    assert main(["inspect", str(MOE / "qwen3moe_mindspeed_grouped_lora_ep2" / "lora")]) == 0
    assert "MindSpeed grouped LoRA" in capsys.readouterr().out
    assert main(moe_args("qwen2moe_tp2ep2", tmp_path / "out") + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "experts: 4 experts, top-2, expert ffn 32, shared expert ffn 48 in layers [1, 2, 3]" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["qwen2moe_tp2ep2", "qwen3moe_dist_singleton_ep2", "mixtral_ep2", "glm4moe_tp2etp1_ep2",
                                  "gptoss_tp2etp1_ep2"])
def test_verify_checks_every_expert_against_the_megatron_base(name, merged, tmp_path, capsys):
    import shutil
    from safetensors.torch import load_file, save_file

    root = MOE / name
    check = ["verify", None, "--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
             str(root / "hf_ref")]
    check[1] = str(merged(name))
    assert main(check) == 0, capsys.readouterr()
    capsys.readouterr()

    out = tmp_path / "out"
    shutil.copytree(merged(name), out)
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(shard)
    victim = next((k for k in sorted(tensors) if ".layers.1." in k and ".experts.2." in k), None)
    where = (0, 0)
    if victim is None:  # gpt-oss stacks its experts: expert 2's row of the stacked tensor
        victim, where = "model.layers.1.mlp.experts.gate_up_proj", (2, 0, 0)
    tensors[victim] = tensors[victim].clone()
    tensors[victim][where] += 1e-3
    save_file(tensors, shard, metadata={"format": "pt"})
    check[1] = str(out)
    assert main(check) == 1
    assert victim in capsys.readouterr().out


@pytest.mark.parametrize("arg,value,expected", [
    ("moe_router_score_function", "sigmoid", "args.moe_router_score_function='sigmoid' but the HF model scores experts with softmax"),
    ("moe_router_enable_expert_bias", True, "args.moe_router_enable_expert_bias=True but the HF model has no router expert bias"),
    ("moe_router_num_groups", 2, "moe_router_num_groups/moe_router_group_topk=(2, 1)"),
    ("moe_router_topk_scaling_factor", 2.5, "args.moe_router_topk_scaling_factor=2.5 but the HF config's routed_scaling_factor is 1"),
    ("moe_expert_capacity_factor", 1.0, "token dropping"),
])
def test_routing_the_hf_model_does_not_do_is_refused(tmp_path, capsys, arg, value, expected):
    from helpers import rank_files, rewrite
    root = _copy("qwen3moe_ep2", tmp_path)
    for part in ("base", "lora"):
        for f in rank_files(root / part):
            rewrite(f, lambda s: setattr(s["args"], arg, value))
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, expected)


def _drop_lora(root: Path, prefix: str, infix: str, rank_dir: str = "mp_rank_") -> None:
    """Remove from the LoRA rank files (those of `rank_dir`) the factors of the modules under `prefix` whose
    name holds `infix`."""
    from helpers import rank_files, rewrite
    for rank_file in (f for f in rank_files(root / "lora") if f.parent.name.startswith(rank_dir)):
        rewrite(rank_file, lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items()
                                                            if not (k.startswith(prefix) and infix in k)}))


def _peft_matches_the_partial_merge(root: Path, adapter: Path, base_dir: Path, tmp_path: Path) -> None:
    """PEFT finds every key the adapter's config makes it expect, and computes what our merge of the same
    partial checkpoint (--allow-partial-lora) computes; its merge_and_unload gives our weights."""
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    assert main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(merged), "--no-progress", "--allow-partial-lora"]) == 0

    model = peft_model_loading_every_key(base_dir, adapter)
    ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.load(root / "logits.pt", weights_only=True)["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - ours(ids).logits).abs().max() <= 1e-4
    theirs, mine = model.merge_and_unload().state_dict(), ours.state_dict()
    assert theirs.keys() == mine.keys()
    assert max((theirs[k] - mine[k]).abs().max().item() for k in mine) <= 1e-5


@pytest.mark.parametrize("expert_format", ["fused", "per-expert"])
def test_a_layer_without_expert_down_proj_lora_is_refused_though_its_shared_expert_has_one(tmp_path, expert_format):
    """PEFT's target `down_proj` covers every routed expert's down_proj too; the shared expert's must not hide
    that layer 2's routed experts have none."""
    from types import SimpleNamespace
    from lora_merge.runs.inputs import open_inputs
    from lora_merge.errors import MergeError
    from lora_merge.peft_adapter import plan_adapter

    root = _copy("qwen2moe_tp2ep2", tmp_path)
    _drop_lora(root, "decoder.layers.2.mlp.experts.", ".linear_fc2.lora_")
    opts = SimpleNamespace(lora_r=None, lora_alpha=None, allow_partial_lora=True, warn=lambda message: None)
    inp = open_inputs(root / "hf_ref", None, root / "lora", opts, need_base=False)
    with pytest.raises(MergeError, match=r"no LoRA for 4 of the \d+ modules the adapter targets "
                                         r"\(layer 2 mlp\.experts\.0\.down_proj, .*--allow-partial-lora"):
        plan_adapter(inp.lora, inp.shape, inp.arch, inp.settings, None, expert_format)


def test_fused_adapter_of_a_layer_without_expert_down_proj_lora_loads_whole_in_peft(tmp_path, capsys,
                                                                                    base_model_dirs):
    """With --allow-partial-lora, layer 2's routed experts (no down_proj LoRA, though its shared expert has one)
    get zero factors: target_parameters lists down_proj for every layer, so PEFT nests each layer's gate_up
    LoRA under base_layer alike and finds each layer's down_proj LoRA."""
    from safetensors import safe_open
    root, adapter = _copy("qwen2moe_tp2ep2", tmp_path), tmp_path / "adapter"
    _drop_lora(root, "decoder.layers.2.mlp.experts.", ".linear_fc2.lora_")
    args = ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(adapter),
            "--expert-format", "fused"]
    _failing(args, capsys, "LoRA weights missing for 4 of", "--allow-partial-lora")
    assert main(args + ["--allow-partial-lora"]) == 0
    err = capsys.readouterr().err
    assert "4 of the" in err and "(layer 2 mlp.experts.0.down_proj, layer 2 mlp.experts.1.down_proj" in err
    assert "written with zero factors" in err
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        for layer in (1, 2, 3):
            owner = f"base_model.model.model.layers.{layer}.mlp.experts"
            assert {f"{owner}.base_layer.lora_A.weight", f"{owner}.lora_A.weight"} <= set(f.keys())
        assert not f.get_tensor("base_model.model.model.layers.2.mlp.experts.lora_B.weight").any()
        assert f.get_tensor("base_model.model.model.layers.1.mlp.experts.lora_B.weight").any()
    _peft_matches_the_partial_merge(root, adapter, base_model_dirs("qwen2moe_tp2ep2"), tmp_path)


def test_per_expert_adapter_gives_an_expert_without_lora_zero_factors(tmp_path, capsys, base_model_dirs):
    """vLLM packs every expert's gate/up/down: expert 3 of layer 1 (EP rank 1's local expert 1, its fc2 LoRA
    lost) keeps a down_proj, of zeros, with a warning; without --allow-partial-lora the export stops as the
    merge does."""
    from safetensors import safe_open
    root, adapter = _copy("qwen3moe_ep2", tmp_path), tmp_path / "adapter"
    _drop_lora(root, "decoder.layers.1.mlp.experts.local_experts.1.", ".linear_fc2.lora_", "mp_rank_00_001")
    args = ["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(adapter)]
    _failing(args, capsys, "LoRA weights missing for 1 of", "layer 1 mlp.experts.3.linear_fc2", "--allow-partial-lora")
    assert main(args + ["--allow-partial-lora"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "--base-model-id" not in line]
    assert len(err) == 1 and "1 of the 64 modules the adapter targets" in err[0], err
    assert "(layer 1 mlp.experts.3.down_proj); written with zero factors" in err[0]
    key = "base_model.model.model.layers.1.mlp.experts.3.down_proj"
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        a, b = f.get_tensor(f"{key}.lora_A.weight"), f.get_tensor(f"{key}.lora_B.weight")
        assert a.shape == (4, 32) and b.shape == (64, 4) and not a.any() and not b.any()
        assert f.get_tensor("base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_B.weight").any()
    _peft_matches_the_partial_merge(root, adapter, base_model_dirs("qwen3moe_ep2"), tmp_path)


@pytest.mark.parametrize("arg,value,expected", [
    ("rotary_percent", 1.0, "args.rotary_percent=1.0 but the HF config's partial_rotary_factor is 0.5"),
    ("rotary_percent", 0.25, "args.rotary_percent=0.25"),
    ("use_partial_rope", True, "args.use_partial_rope=True: MindSpeed's GLM rotary (ChatGLM's, interleaved pairs)"),
    # MindSpeed-LLM's GLM-4 scripts: --use-glm-rope --rotary-percent 0.5
    ("use_glm_rope", True, "args.use_glm_rope=True: MindSpeed's GLM rotary (ChatGLM's, interleaved pairs)"),
    ("rotary_percent", None, "the args record no rotary_percent (Megatron's default 1.0) but the HF config's "
                             "partial_rotary_factor is 0.5"),
])
def test_partial_rope_must_be_what_the_args_trained(tmp_path, capsys, arg, value, expected):
    """GLM-4.5 rotates half of each head's dims: Megatron args that rotate another share (or rotate them as
    ChatGLM does) trained another function."""
    from helpers import rank_files, rewrite, run_failing

    root = _copy("glm4moe_tp2etp1_ep2", tmp_path)
    for path in rank_files(root / "base"):
        rewrite(path, lambda state: delattr(state["args"], arg) if value is None else setattr(state["args"], arg, value))
    run_failing(moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out")[:1] + [str(root / "base")]
                + moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out")[2:], capsys, expected)
    assert not (tmp_path / "out").exists()


def test_the_dry_run_names_glm_mechanics(capsys, tmp_path):
    assert main(moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out") + ["--dry-run"]) == 0
    model = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("model:"))
    assert model.endswith("untied embeddings, qkv bias, q/k norms, partial RoPE 0.5"), model


def _glm_with_config(tmp_path, **changes) -> Path:
    root = _copy("glm4moe_tp2etp1_ep2", tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    (root / "hf_ref" / "config.json").write_text(json.dumps({**config, **changes}))
    return root


def test_glm_without_mtp_layers_the_output_config_says_so(tmp_path, capsys):
    """GLM-4.5's releases say num_nextn_predict_layers=1; a Megatron run without MTP has no such layer."""
    root = _glm_with_config(tmp_path, num_nextn_predict_layers=1)
    out = tmp_path / "out"
    assert main(moe_args("glm4moe_tp2etp1_ep2", out)[:4] + ["--hf-ref", str(root / "hf_ref"), "--out", str(out),
                                                           "--no-progress"]) == 0
    assert "num_nextn_predict_layers=0 instead of 1" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("changes,expected", [
    ({"use_qk_norm": False}, "args.qk_layernorm=True but the HF config (glm4_moe) has no q/k norms"),  # as GLM-4.5-Air
    ({"attention_bias": False}, "args.add_qkv_bias=True but the HF config (glm4_moe) has no q/k/v biases"),
    ({"routed_scaling_factor": 1.0}, "routed_scaling_factor is 1"),
    ({"first_k_dense_replace": 0}, "layers"),
])
def test_glm_config_must_be_what_the_args_trained(tmp_path, capsys, changes, expected):
    root = _glm_with_config(tmp_path, **changes)
    _failing(moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out")[:4] + ["--hf-ref", str(root / "hf_ref"), "--out",
                                                                     str(tmp_path / "out"), "--no-progress"],
             capsys, expected)
    assert not (tmp_path / "out").exists()


def test_glm_partial_rope_left_to_the_class_default_is_said_so(tmp_path, capsys):
    """transformers' glm4_moe rotates half of each head when config.json says nothing: a mismatch with args
    that rotate whole heads names that default."""
    from helpers import rank_files, rewrite

    root = _copy("glm4moe_tp2etp1_ep2", tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    config["rope_parameters"].pop("partial_rotary_factor")
    (root / "hf_ref" / "config.json").write_text(json.dumps(config))
    for path in rank_files(root / "base"):
        rewrite(path, lambda state: setattr(state["args"], "rotary_percent", 1.0))
    _failing(moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out")[:1] + [str(root / "base")] + ["--lora", str(root / "lora"),
             "--hf-ref", str(root / "hf_ref"), "--out", str(tmp_path / "out"), "--no-progress"], capsys,
             "partial_rotary_factor is 0.5 (absent from config.json, so transformers' glm4_moe default)")


def test_a_glm_hf_base_keeps_its_mtp_layer_as_it_is(tmp_path, merged, base_model_dirs, capsys):
    """GLM-4.5's releases store their MTP layer as model.layers.{num_hidden_layers}.* (with copies of the
    embedding and lm_head): with a LoRA trained without MTP, an HF base's is written byte for byte; the rest
    merges as onto the Megatron base."""
    import shutil

    from safetensors.torch import load_file

    from helpers import with_mtp_layer

    name = "glm4moe_tp2etp1_ep2"
    root, hf_base = MOE / name, tmp_path / "hf_base"
    shutil.copytree(base_model_dirs(name), hf_base)
    mtp = with_mtp_layer(hf_base, 4)
    out = tmp_path / "out"
    assert main(["--base", str(hf_base), "--lora", str(root / "lora"), "--hf-ref", str(hf_base),
                 "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    ours = load_file(next(out.glob("*.safetensors")))
    assert all(torch.equal(ours[k], v) and ours[k].dtype == v.dtype for k, v in mtp.items())
    reference = load_file(next(merged(name).glob("*.safetensors")))
    assert set(ours) - set(mtp) == set(reference) and all(torch.equal(ours[k], reference[k]) for k in reference)


MINDSPEED_GLM_ARGS = dict(moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=True, n_shared_experts=1,
                          moe_router_num_groups=1, moe_router_group_topk=1, moe_router_load_balancing_type="none",
                          moe_token_dispatcher_type="alltoall_seq")


def test_glm_args_as_mindspeed_records_them_merge_the_same(tmp_path, merged, capsys):
    """MindSpeed-LLM's GLM-4.5 scripts: --first-k-dense-replace 1 --moe-layer-freq 1 --norm-topk-prob, groups 1/1,
    load balancing none, the alltoall_seq dispatcher: the same model, so the same bytes. Its 355B LoRA script sets
    no --moe-router-topk-scaling-factor: a model that does not scale its experts, refused against the release's 2.5."""
    from helpers import rank_files, rewrite, run_failing

    root = _copy("glm4moe_tp2etp1_ep2", tmp_path)
    for kind in ("base", "lora"):
        for path in rank_files(root / kind):
            rewrite(path, lambda state: vars(state["args"]).update(MINDSPEED_GLM_ARGS))
    args = moe_args("glm4moe_tp2etp1_ep2", tmp_path / "out")[:1] + [str(root / "base"), "--lora", str(root / "lora"),
                                                                  "--hf-ref", str(root / "hf_ref"), "--out"]
    assert main(args + [str(tmp_path / "out"), "--no-progress"]) == 0
    assert (tmp_path / "out/model.safetensors").read_bytes() == \
        (merged("glm4moe_tp2etp1_ep2") / "model.safetensors").read_bytes()
    for kind in ("base", "lora"):
        for path in rank_files(root / kind):
            rewrite(path, lambda state: setattr(state["args"], "moe_router_topk_scaling_factor", None))
    run_failing(args + [str(tmp_path / "out2")], capsys, "args.moe_router_topk_scaling_factor=1 but the HF config's "
                                                         "routed_scaling_factor is 2.5")
