"""Mixture-of-Experts merges against the real Megatron forward pass (tests/fixtures_moe, made by
scripts/make_moe_fixtures.py with megatron-core 0.16.1 and PEFT 0.7.1 as MindSpeed-LLM calls it)."""

import json
from pathlib import Path

import pytest
import torch

from lora_merge.cli import main

MOE = Path(__file__).parent / "fixtures_moe"
NAMES = sorted(p.name for p in MOE.iterdir() if (p / "fixture.json").is_file())


def moe_args(name: str, out: Path) -> list[str]:
    root = MOE / name
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp("moe") / name
            assert main(moe_args(name, out)) == 0
            cache[name] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_moe_merge_computes_what_megatron_with_lora_computes(name, merged):
    from transformers import AutoModelForCausalLM

    out = merged(name)
    ref = torch.load(MOE / name / "logits.pt", weights_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        logits = model.eval()(ref["input_ids"]).logits
    print(f"\n{name}: max |logits - Megatron+LoRA| = {(logits - ref['logits_lora']).abs().max():.2e}")
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1  # the LoRA (experts included) changed the model


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


def test_dense_copies_that_differ_between_expert_parallel_files_are_an_error(tmp_path, capsys):
    from test_errors import rewrite
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


def test_export_adapter_refuses_expert_lora(tmp_path, capsys):
    root = MOE / "qwen3moe_ep2"
    _failing(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
              str(tmp_path / "adapter")], capsys, "routed experts", "merge it instead")


def test_every_parameter_says_how_it_was_split():
    """Both formats describe a parameter's pieces alike: the group that split them and, for torch_dist's
    global slices, the dimension; LoRA factors too."""
    from lora_merge.readers import open_checkpoint as read_checkpoint
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
    from test_errors import rewrite
    root = _copy("qwen3moe_ep2", tmp_path)
    prefix = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.lora_"
    rewrite(root / "lora" / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt",
            lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items() if not k.startswith(prefix)}))
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out"), "--no-progress"]
    _failing(args, capsys, "LoRA weights missing for 1 of", "layer 1 mlp.experts.3.linear_fc2")
    assert not (tmp_path / "out").exists()
    assert main(args + ["--allow-partial-lora"]) == 0
