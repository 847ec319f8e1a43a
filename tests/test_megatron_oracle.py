"""The Megatron oracle (tests/megatron_oracle.py) against the committed fixtures: loading their base checkpoints
into the real megatron-core GPTModel at their own layout gives back the Megatron logits the generators
recorded (logits.pt 'logits_base'), and broken checkpoints fail loudly, naming the rank."""

import functools
import json
import shutil
import sys
from pathlib import Path

import psutil
import pytest
import torch

from megatron_oracle import (
    MegatronOracleError,
    MegatronOracleTimeout,
    legacy_rank_dirs,
    megatron_logits,
    model_spec,
    run_isolated,
    world_size,
)

TESTS = Path(__file__).parent
TOL = 1e-5  # fp32 logits, the same Megatron code: rounding only

# (fixture dir, layout, ckpt_format, expert_layout)
CASES = {
    "dense_tp2pp2": ("fixtures/tp2pp2_fp32_filtered", dict(tp=2, pp=2), "torch", "sequential"),
    "dense_bf16_tp2pp2": ("fixtures/tp2pp2_bf16_unfiltered", dict(tp=2, pp=2), "torch", "sequential"),
    "vpp2": ("fixtures/vpp2_fp32_filtered", dict(pp=2, vpp=2), "torch", "sequential"),
    "uneven_pp2": ("fixtures/uneven_pp2_fp32", dict(pp=2, first_stage_layers=1), "torch", "sequential"),
    "tied_pp2": ("fixtures/tied_pp2_llama_fp32", dict(pp=2), "torch", "sequential"),
    "qwen3_tp2": ("fixtures/qwen3_tp2_fp32", dict(tp=2), "torch", "sequential"),
    "dist_tp2pp2": ("fixtures/dist_tp2pp2_fp32", dict(tp=2, pp=2), "torch_dist", "sequential"),
    "dist_singleton_tp2": ("fixtures/dist_singleton_tp2_fp32", dict(tp=2), "torch_dist", "sequential"),
    "qwen2moe_tp2_ep2_etp2_shared": ("fixtures_moe/qwen2moe_tp2ep2", dict(tp=2, ep=2, etp=2), "torch", "sequential"),
    "qwen3moe_tp2_ep2_etp1": ("fixtures_moe/qwen3moe_tp2etp1_ep2", dict(tp=2, ep=2, etp=1), "torch", "sequential"),
    "mixtral_ep2": ("fixtures_moe/mixtral_ep2", dict(ep=2, etp=1), "torch", "sequential"),
    "qwen3moe_grouped_ep2": ("fixtures_moe/qwen3moe_grouped_ep2", dict(ep=2, etp=1), "torch", "grouped"),
    "qwen3moe_dist_ep2": ("fixtures_moe/qwen3moe_dist_ep2", dict(ep=2, etp=1), "torch_dist", "sequential"),
    "deepseek_v3_mla_ep2": ("fixtures_deepseek/deepseek_v3_ep2", dict(ep=2, etp=1), "torch", "sequential"),
    "deepseek_v3_mla_tp2_etp1": ("fixtures_deepseek/deepseek_v3_tp2etp1_ep2", dict(tp=2, ep=2, etp=1), "torch",
                                 "sequential"),
    "deepseek_v3_yarn_ep2": ("fixtures_deepseek/deepseek_v3_yarn_ep2", dict(ep=2, etp=1), "torch", "sequential"),
    "deepseek_v2_lite_ep2": ("fixtures_deepseek/deepseek_v2_lite_ep2", dict(ep=2, etp=1), "torch", "sequential"),
}


def iter_dir(base: Path) -> Path:
    it = (base / "latest_checkpointed_iteration.txt").read_text().strip()
    return base / ("release" if it == "release" else f"iter_{int(it):07d}")


def load_case(name: str):
    d = TESTS / CASES[name][0]
    hf = json.loads((d / "hf_ref" / "config.json").read_text())
    ref = torch.load(d / "logits.pt", weights_only=True)
    return d, hf, ref


def copy_base(name: str, tmp_path: Path) -> Path:
    """A writable copy of a case's base iteration dir."""
    src = iter_dir(TESTS / CASES[name][0] / "base")
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_rank_files(paths: list, edit):
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=False)
        edit(state)
        torch.save(state, path)


def edit_rank_files(paths, edit, *args):
    """edit(state, *args) on each Megatron rank file, in a child process: unpickling one imports megatron.core,
    which must stay out of this process (see run_isolated). edit must be a module-level function."""
    run_isolated(_edit_rank_files, [Path(p) for p in paths], functools.partial(edit, *args) if args else edit)


# edits (module-level: they run in the child process)

def drop_key(key, state):
    state["model"].pop(key)


def drop_extra_states(state):
    for k in [k for k in state["model"] if k.endswith("_extra_state")]:
        assert state["model"].pop(k) is None


def drop_last_column(key, state):
    state["model"][key] = state["model"][key][:, :-1].clone()


def scale(key, factor, state):
    state["model"][key] = state["model"][key] * factor


def set_version(version, state):
    state["checkpoint_version"] = version


def grouped_weight1_by_column_blocks(state):
    for k, w in state["model"].items():
        if k.endswith("mlp.experts.weight1"):
            H = w.shape[0]
            per_expert = w.view(2, H, -1)  # (E_loc, H, 2F): what GroupedMLP reads
            state["model"][k] = per_expert.permute(1, 0, 2).reshape(H, -1).contiguous()


@pytest.fixture(autouse=True)
def _megatron_stays_out_of_this_process():
    """Importing megatron.core widens torch's weights_only allow-list for the whole process (Namespace, numpy
    arrays, BytesIO, ...), which other tests of the suite check the loading without: the oracle and these
    tests never import it here (other test files may have done so already)."""
    before = "megatron" in sys.modules
    yield
    assert before or "megatron" not in sys.modules


@pytest.mark.parametrize("name", list(CASES))
def test_oracle_reproduces_megatron_logits(name):
    d, hf, ref = load_case(name)
    _, layout, fmt, experts = CASES[name]
    fx = json.loads((d / "fixture.json").read_text())
    # the layout written here is the fixture's own
    assert (layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)) == (fx["tp"], fx["pp"], fx.get("ep", 1))
    assert layout.get("vpp") == fx.get("vpp") and fmt == fx.get("base_format", "torch")
    logits = megatron_logits(iter_dir(d / "base"), hf, layout, ref["input_ids"], ckpt_format=fmt,
                             expert_layout=experts)
    assert logits.dtype == torch.float32 and logits.shape == ref["logits_base"].shape
    assert (logits - ref["logits_base"]).abs().max().item() <= TOL


def test_legacy_rank_dir_rule():
    """The rank dirs Megatron 0.16.1 writes (expert-data-parallel rank 0 of each (tp, pp, ep)) are exactly
    those of every committed legacy fixture, sparse grids included."""
    seen = 0
    for fx_file in sorted(TESTS.glob("fixtures*/*/fixture.json")):
        fx = json.loads(fx_file.read_text())
        base = iter_dir(fx_file.parent / "base")
        if (base / "metadata.json").exists():
            continue
        layout = dict(tp=fx["tp"], pp=fx["pp"], ep=fx.get("ep", 1), etp=fx.get("etp"))
        assert legacy_rank_dirs(layout) == sorted(p.name for p in base.iterdir()), fx_file
        if "world_size" in fx:
            assert world_size(layout) == fx["world_size"], fx_file
        seen += 1
    assert seen >= 15
    assert legacy_rank_dirs(dict(tp=2, ep=2, etp=1)) == ["mp_rank_00_000", "mp_rank_01_001"]
    assert legacy_rank_dirs(dict(tp=2, ep=2, etp=2)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                         "mp_rank_01_001"]
    assert legacy_rank_dirs(dict(tp=2, pp=2, ep=2, etp=1)) == ["mp_rank_00_000_000", "mp_rank_00_001_000",
                                                               "mp_rank_01_000_001", "mp_rank_01_001_001"]
    # TP > ETP*EP: 0.16.1 writes no file for TP ranks 2 and 3 (and cannot load its own checkpoint)
    assert legacy_rank_dirs(dict(tp=4, ep=2, etp=1)) == ["mp_rank_00_000", "mp_rank_01_001"]
    assert world_size(dict(tp=4, ep=2, etp=1)) == 4 and world_size(dict(tp=2, pp=3, ep=4, etp=1)) == 12
    # (checked against megatron-core's parallel_state in a 12-rank world: tp_rank r % 2, ep_rank r % 4)
    assert legacy_rank_dirs(dict(tp=2, pp=3, ep=4, etp=1)) == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(3) for e in range(4) if e % 2 == t]


def test_missing_key_names_the_rank(tmp_path):
    ck = copy_base("dense_tp2pp2", tmp_path)
    key = "decoder.layers.1.self_attention.linear_qkv.bias"
    edit_rank_files([ck / "mp_rank_01_000" / "model_optim_rng.pt"], drop_key, key)
    _, hf, ref = load_case("dense_tp2pp2")
    for exact in (True, False):
        with pytest.raises(MegatronOracleError) as e:
            megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"], exact_keys=exact)
        msg = str(e.value)
        assert "Megatron rank 1 failed" in msg and "rank 1 (tp 1, pp 0, ep 0): mp_rank_01_000" in msg and key in msg
        assert ("keys differ from what megatron-core's own save writes" if exact else "Missing key") in msg


def test_extra_state_is_written_by_megatron_but_not_needed_to_load(tmp_path):
    """Megatron's save writes '<linear>._extra_state' (None) for every local-spec linear; its load fills a
    missing one in (ColumnParallelLinear / RowParallelLinear load pre-hook)."""
    ck = copy_base("qwen3moe_tp2_ep2_etp1", tmp_path)
    edit_rank_files([ck / "mp_rank_00_000" / "model_optim_rng.pt"], drop_extra_states)
    _, hf, ref = load_case("qwen3moe_tp2_ep2_etp1")
    with pytest.raises(MegatronOracleError, match=r"rank 0 .*missing \['decoder.layers.0.mlp.experts.local_experts"
                                                  r".0.linear_fc1._extra_state'.*pass exact_keys=False"):
        megatron_logits(ck, hf, dict(tp=2, ep=2, etp=1), ref["input_ids"])
    logits = megatron_logits(ck, hf, dict(tp=2, ep=2, etp=1), ref["input_ids"], exact_keys=False)
    assert (logits - ref["logits_base"]).abs().max().item() <= TOL


def test_shape_mismatch_names_the_rank(tmp_path):
    ck = copy_base("qwen3moe_tp2_ep2_etp1", tmp_path)
    key = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
    edit_rank_files([ck / "mp_rank_01_001" / "model_optim_rng.pt"], drop_last_column, key)
    _, hf, ref = load_case("qwen3moe_tp2_ep2_etp1")
    with pytest.raises(MegatronOracleError) as e:
        megatron_logits(ck, hf, dict(tp=2, ep=2, etp=1), ref["input_ids"])
    msg = str(e.value)
    assert "Megatron rank 1 failed" in msg and "mp_rank_01_001" in msg and "size mismatch" in msg and key in msg


def test_missing_rank_file(tmp_path):
    ck = copy_base("qwen3moe_tp2_ep2_etp1", tmp_path)
    shutil.rmtree(ck / "mp_rank_01_001")
    _, hf, ref = load_case("qwen3moe_tp2_ep2_etp1")
    with pytest.raises(MegatronOracleError, match=r"rank 1 .*no mp_rank_01_001/model_optim_rng.pt.*"
                                                  r"writes \['mp_rank_00_000', 'mp_rank_01_001'\]"):
        megatron_logits(ck, hf, dict(tp=2, ep=2, etp=1), ref["input_ids"])


def test_replicas_that_disagree_are_an_error(tmp_path):
    """EP ranks are data-parallel replicas of the non-expert model, each loading its own file's copy."""
    ck = copy_base("qwen3moe_grouped_ep2", tmp_path)
    edit_rank_files([ck / "mp_rank_00_001" / "model_optim_rng.pt"], scale, "decoder.final_layernorm.weight", 1.01)
    _, hf, ref = load_case("qwen3moe_grouped_ep2")
    with pytest.raises(MegatronOracleError, match="computed different logits"):
        megatron_logits(ck, hf, dict(ep=2, etp=1), ref["input_ids"], expert_layout="grouped")


def test_args_must_agree_with_the_model(tmp_path):
    _, hf, ref = load_case("qwen3moe_grouped_ep2")
    ck = iter_dir(TESTS / CASES["qwen3moe_grouped_ep2"][0] / "base")
    with pytest.raises(MegatronOracleError, match=r"args.moe_grouped_gemm = True, expected False"):
        megatron_logits(ck, hf, dict(ep=2, etp=1), ref["input_ids"])
    ck = copy_base("dense_tp2pp2", tmp_path)
    edit_rank_files([d / "model_optim_rng.pt" for d in ck.iterdir()], set_version, 2.0)
    _, hf, ref = load_case("dense_tp2pp2")
    with pytest.raises(MegatronOracleError, match="checkpoint_version 2.0"):
        megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"])


def test_grouped_weights_are_read_by_megatrons_own_view(tmp_path):
    """weight1 laid out by column blocks ([H, E_loc, 2F] instead of GroupedMLP's (E_loc, H, 2F) view) loads
    (same shape) but computes other logits: the oracle runs GroupedMLP's own forward."""
    ck = copy_base("qwen3moe_grouped_ep2", tmp_path)
    edit_rank_files([d / "model_optim_rng.pt" for d in ck.iterdir()], grouped_weight1_by_column_blocks)
    _, hf, ref = load_case("qwen3moe_grouped_ep2")
    logits = megatron_logits(ck, hf, dict(ep=2, etp=1), ref["input_ids"], expert_layout="grouped")
    assert (logits - ref["logits_base"]).abs().max().item() > 1e-2


def test_timeout_kills_every_rank():
    _, hf, ref = load_case("dense_tp2pp2")
    ck = iter_dir(TESTS / CASES["dense_tp2pp2"][0] / "base")
    megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"])  # (the rank start-up is warm)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with pytest.raises(MegatronOracleTimeout, match=r"ranks \[0, 1, 2, 3\] still running after 0 s"):
        megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"], timeout=0.01)
    assert {p.pid for p in me.children(recursive=True)} <= before


def test_refuses_what_it_cannot_translate():
    _, hf, ref = load_case("dense_tp2pp2")
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        model_spec(dict(hf, model_type="gpt2"))
    with pytest.raises(NotImplementedError, match="rope scaling 'linear'"):
        model_spec(dict(hf, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)))
    with pytest.raises(NotImplementedError, match="hidden_act"):
        model_spec(dict(hf, hidden_act="gelu"))
    ck = iter_dir(TESTS / CASES["dense_tp2pp2"][0] / "base")
    with pytest.raises(ValueError, match="torch_dist"):
        megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"], ckpt_format="torch_dist")
    with pytest.raises(ValueError, match="vocabulary"):
        megatron_logits(ck, hf, dict(tp=2, pp=2), ref["input_ids"] + hf["vocab_size"])


def test_run_isolated():
    assert run_isolated(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(MegatronOracleError, match=r"isolated call 0 failed: ValueError: invalid literal"):
        run_isolated(int, "x")


@pytest.mark.parametrize("name,layout,experts", [
    ("dist_tp2pp2", dict(tp=1, pp=2, vpp=2), "sequential"),
    ("dist_singleton_tp2", dict(pp=2, first_stage_layers=1), "sequential"),
    ("qwen3moe_dist_ep2", dict(tp=2, ep=4, etp=1), "grouped"),
])
def test_torch_dist_loads_at_another_layout(name, layout, experts):
    """torch_dist holds global tensors: Megatron reshards them for any layout and expert implementation."""
    d, hf, ref = load_case(name)
    logits = megatron_logits(iter_dir(d / "base"), hf, layout, ref["input_ids"], ckpt_format="torch_dist",
                             expert_layout=experts)
    assert (logits - ref["logits_base"]).abs().max().item() <= TOL
