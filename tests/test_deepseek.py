"""DeepSeek-V3 / V2 (multi-latent attention, dense-then-MoE layers, shared experts, router expert bias)
against the real Megatron forward pass (tests/fixtures_deepseek, made by scripts/make_fixtures.py --family deepseek
with megatron-core 0.16.1 and PEFT 0.7.1) and transformers' own DeepseekV3/DeepseekV2 classes."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import mtp_oracle
from lora_merge.cli import main
from helpers import fixture_root

DEEPSEEK = Path(__file__).parent / "fixtures_deepseek"
NAMES = sorted(p.name for p in DEEPSEEK.iterdir() if (p / "fixture.json").is_file())


def cli_args(root: Path, out: Path) -> list[str]:
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]


@pytest.fixture
def merged(merged_fixture):
    return merged_fixture


def hf_model(model_dir: Path):
    model, info = mtp_oracle.from_pretrained(model_dir, dtype=torch.float32)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model.eval()


def hf_logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(input_ids).logits


def assert_computes_megatron_lora(out: Path, root: Path, label: str) -> None:
    ref = torch.load(root / "logits.pt", weights_only=True)
    model = hf_model(out)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    print(f"\n{label}: max |logits - Megatron+LoRA| = {(logits - ref['logits_lora']).abs().max():.2e}")
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (logits - ref["logits_base"]).abs().max() > 0.1  # the LoRA changed the model
    if "mtp_logits_lora" in ref:  # the MTP layer (MLA + MoE), LoRA merged: transformers' MtpModel against Megatron's
        mtp = mtp_oracle.mtp_logits(model, ref["input_ids"])
        print(f"{label}: max |MTP logits - Megatron+LoRA| = {(mtp - ref['mtp_logits_lora']).abs().max():.2e}")
        assert (mtp - ref["mtp_logits_lora"]).abs().max() <= 1e-4
        assert (mtp - ref["mtp_logits_base"]).abs().max() > 0.1


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_merge_computes_what_megatron_with_lora_computes(name, merged):
    assert_computes_megatron_lora(merged(name), DEEPSEEK / name, name)


def test_expert_bias_stays_fp32_in_a_bf16_merge(tmp_path):
    from safetensors import safe_open

    root, out = DEEPSEEK / "deepseek_v3_ep2", tmp_path / "out"
    assert main(cli_args(root, out) + ["--dtype", "bfloat16"]) == 0
    dtypes = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    bias = {k: v for k, v in dtypes.items() if k.endswith("e_score_correction_bias")}
    assert sorted(bias) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    assert set(bias.values()) == {"F32"}
    assert {v for k, v in dtypes.items() if k not in bias} == {"BF16"}


def _copy(name: str, tmp_path: Path) -> Path:
    shutil.copytree(DEEPSEEK / name, tmp_path / name)
    return tmp_path / name


def _all_rank_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def test_mindspeed_fused_qkv_without_q_lora_rank(tmp_path, merged):
    """V2-Lite in MindSpeed's naming: linear_qkv = [q_proj; kv_a_proj_with_mqa], built from the real fixture
    by the documented rule, with one LoRA: q_proj's A shared, B = [B_q; B_kv]. q_proj merges as before;
    kv_a_proj_with_mqa gets W_kv + (alpha/r)·B_kv·A_q, computed here from the fixture's own tensors."""
    from safetensors.torch import load_file
    from helpers import rewrite

    root = _copy("deepseek_v2_lite_ep2", tmp_path)
    attn, lora = "self_attention.", ".lora_{}.default.weight"
    expected_kv = {}

    def fuse_base(state):
        model = state["model"]
        for key in [k for k in model if k.endswith(attn + "linear_q_proj.weight")]:
            prefix = key[: -len("linear_q_proj.weight")]
            model[prefix + "linear_qkv.weight"] = torch.cat([model.pop(key), model.pop(prefix + "linear_kv_down_proj.weight")])

    def fuse_lora(state):
        model = state["model"]
        for key in [k for k in model if k.endswith(attn + "linear_q_proj" + lora.format("A"))]:
            prefix = key[: -len("linear_q_proj" + lora.format("A"))]
            q_a, q_b = model.pop(key), model.pop(prefix + "linear_q_proj" + lora.format("B"))
            model.pop(prefix + "linear_kv_down_proj" + lora.format("A"))
            kv_b = model.pop(prefix + "linear_kv_down_proj" + lora.format("B"))
            model[prefix + "linear_qkv" + lora.format("A")] = q_a
            model[prefix + "linear_qkv" + lora.format("B")] = torch.cat([q_b, kv_b])
            for k in [k for k in model if k.startswith((prefix + "linear_q_proj.", prefix + "linear_kv_down_proj."))]:
                del model[k]
            layer = prefix.split(".")[2]
            expected_kv[layer] = 3.0 * kv_b.double() @ q_a.double()  # alpha/r = 12/4; the latest iteration last
        state["args"].lora_target_modules = ["linear_qkv", "linear_kv_up_proj", "linear_proj", "linear_fc1",
                                             "linear_fc2"]

    source = load_file(next(merged("deepseek_v2_lite_ep2").glob("*.safetensors")))
    from lora_merge.files.safe_load import load_pt
    base = load_pt(DEEPSEEK / "deepseek_v2_lite_ep2" / "base" / "iter_0000001" / "mp_rank_00_000" /
                   "model_optim_rng.pt", mmap=False)["model"]
    for f in _all_rank_files(root / "base"):
        rewrite(f, fuse_base)
    for f in _all_rank_files(root / "lora"):
        rewrite(f, fuse_lora)
    out = tmp_path / "out"
    assert main(cli_args(root, out)) == 0
    ours = load_file(next(out.glob("*.safetensors")))
    assert ours.keys() == source.keys()
    for key in ours:
        if "kv_a_proj_with_mqa" in key:
            layer = key.split(".")[2]
            w = base[f"decoder.layers.{layer}.self_attention.linear_kv_down_proj.weight"].double()
            assert torch.allclose(ours[key].double(), w + expected_kv[layer], atol=1e-6), key
        else:
            assert torch.equal(ours[key], source[key]), key


@pytest.mark.parametrize("name", ["deepseek_v3_ep2", "deepseek_v3_mindspeed_fused_qkv_ep2", "deepseek_v2_lite_ep2"])
def test_verify_checks_mla_and_experts_against_the_megatron_base(name, merged, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    root = DEEPSEEK / name
    check = ["verify", str(merged(name)), "--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref",
             str(root / "hf_ref")]
    assert main(check) == 0, capsys.readouterr()
    capsys.readouterr()
    out = tmp_path / "out"
    shutil.copytree(merged(name), out)
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(shard)
    victim = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # half of the fused linear in MindSpeed's naming
    tensors[victim] = tensors[victim].clone()
    tensors[victim][-1, 0] += 1e-3
    save_file(tensors, shard, metadata={"format": "pt"})
    check[1] = str(out)
    assert main(check) == 1
    assert victim in capsys.readouterr().out


@pytest.fixture
def base_model_dirs(base_model):
    return base_model


def test_inspect_and_dry_run_describe_mla_and_dense_layers(capsys, tmp_path):
    root = DEEPSEEK / "deepseek_v3_ep2"
    assert main(cli_args(root, tmp_path / "out") + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("16 experts, top-4, expert ffn 16, shared expert ffn 16 (sigmoid scores, expert bias, best 2 of 4 "
            "groups, weights x2.5) in layers [1, 2]") in out
    assert "4 heads, MLA q_lora 48, kv_lora 32, qk 16+8 (rope), v 12" in out
    assert not (tmp_path / "out").exists()


def _failing(args, capsys, *expected):
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    for text in expected:
        assert text in err[0], err[0]
    print(f"\n{err[0]}")


def _with_args(name, tmp_path, **changes) -> Path:
    from helpers import rewrite

    root = _copy(name, tmp_path)
    for part in ("base", "lora"):
        for f in _all_rank_files(root / part):
            rewrite(f, lambda s: [setattr(s["args"], k, v) for k, v in changes.items()])
    return root


def _with_config(root: Path, **changes) -> None:
    path = root / "hf_ref" / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,expected", [
    ({"mtp_num_layers": 1}, "multi-token-prediction"),
    ({"mla_mm_split": True}, "mla_mm_split"),
    ({"topk_group": 1}, "args.n_group/topk_group=(4, 1) but the HF config's n_group/topk_group give (4, 2)"),
    ({"n_group": None}, "args.n_group/topk_group=(2, 2)"),  # MindSpeed: n_group defaults to the EP size
    ({"routed_scaling_factor": None}, "args.routed_scaling_factor=1 but the HF config's routed_scaling_factor is 2.5"),
    ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type='sinkhorn'"),
    ({"q_lora_rank": 32}, "args.q_lora_rank=32 but the HF config's q_lora_rank is 48"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    ({"first_k_dense_replace": 2}, "routed experts in layers [2], the HF config in [1, 2]"),
])
def test_deepseek_args_the_hf_model_cannot_compute_are_refused(tmp_path, capsys, changes, expected):
    root = _with_args("deepseek_v3_mindspeed_fused_qkv_ep2", tmp_path, **changes)
    _failing(cli_args(root, tmp_path / "out"), capsys, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,changes", [
    # MindSpeed-LLM on Megatron 0.8: its own noaux_tc router reads only its own names
    ("deepseek_v3_mindspeed_fused_qkv_ep2", {"moe_router_num_groups": None, "moe_router_group_topk": None,
                                             "moe_router_topk_scaling_factor": None, "norm_topk_prob": False}),
    # its DeepSeek-V2 routers: softmax, greedy top-k, scaled unless renormalised
    ("deepseek_v2_lite_ep2", {"moe_router_load_balancing_type": "group_limited_greedy", "routed_scaling_factor": 2.0,
                              "moe_router_topk_scaling_factor": None, "moe_router_pre_softmax": None}),
])
def test_mindspeed_routers_that_compute_the_hf_routing_are_accepted(tmp_path, name, changes):
    root = _with_args(name, tmp_path, **changes)
    assert main(cli_args(root, tmp_path / "out")) == 0
    assert_computes_megatron_lora(tmp_path / "out", root, f"{name} with {sorted(changes)}")


@pytest.mark.parametrize("name,changes,expected", [
    ("deepseek_v2_lite_ep2", {"moe_router_load_balancing_type": "pai_megatron_aux_loss"},
     "'pai_megatron_aux_loss' (never scaled) but the HF config's routed_scaling_factor is 2"),
    ("deepseek_v2_lite_ep2", {"moe_router_load_balancing_type": "group_limited_greedy", "topk_group": 1,
                              "routed_scaling_factor": 2.0}, "args.n_group/topk_group=(2, 1)"),
    ("deepseek_v2_lite_ep2", {"moe_router_load_balancing_type": "group_limited_greedy", "norm_topk_prob": True,
                              "routed_scaling_factor": 2.0}, "args.norm_topk_prob=True but the HF config has norm_topk_prob=False"),
    ("deepseek_v3_ep2", {"moe_router_group_topk": 1}, "moe_router_num_groups/moe_router_group_topk=(4, 1)"),
])
def test_mindspeed_and_megatron_routing_the_hf_model_does_not_do_is_refused(tmp_path, capsys, name, changes, expected):
    root = _with_args(name, tmp_path, **changes)
    _failing(cli_args(root, tmp_path / "out"), capsys, expected)


def test_group_scores_that_differ_from_the_hf_model_are_refused(tmp_path, capsys):
    """Megatron scores a group by its best topk // group_topk experts; DeepSeek-V3 by its best two."""
    root = _with_args("deepseek_v3_ep2", tmp_path, moe_router_topk=2)
    _with_config(root, num_experts_per_tok=2)
    _failing(cli_args(root, tmp_path / "out"), capsys, "best moe_router_topk // moe_router_group_topk = 1 experts",
             "by its best 2")


@pytest.mark.parametrize("name,changes,expected", [
    ("deepseek_v3_ep2", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3_ep2", {"rope_interleave": False}, "rope_interleave=False"),
    ("deepseek_v3_ep2", {"n_group": 1, "topk_group": 1}, "n_group/topk_group give None"),
    ("deepseek_v2_lite_ep2", {"norm_topk_prob": True}, "norm_topk_prob=true, which transformers' deepseek_v2 ignores"),
    ("deepseek_v2_lite_ep2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2_lite_ep2", {"q_lora_rank": 16}, "q_lora_rank is 16"),
    ("deepseek_v2_lite_ep2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
     "n_group/topk_group give (2, 1)"),
    ("deepseek_v3_ep2", {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "no weight_block_size"),
])
def test_deepseek_configs_that_differ_from_the_training_are_refused(tmp_path, capsys, name, changes, expected):
    root = _copy(name, tmp_path)
    _with_config(root, **changes)
    _failing(cli_args(root, tmp_path / "out"), capsys, expected)


MINDSPEED_YARN = {"rope_scaling_type": "yarn", "rope_scaling_factor": 40.0, "rope_scaling_mscale": 0.9,
                  "rope_scaling_mscale_all_dim": 0.7, "rope_scaling_original_max_position_embeddings": 4096,
                  "rope_scaling_beta_fast": 32, "rope_scaling_beta_slow": 1}


def test_mindspeed_yarn_args_for_mla_are_read(tmp_path):
    """MindSpeed-LLM records its own YaRN args (its DeepSeek recipes); its MLA computes what Megatron's does
    for the same values, so the real Megatron logits apply."""
    root = _with_args("deepseek_v3_yarn_ep2", tmp_path, **MINDSPEED_YARN)
    assert main(cli_args(root, tmp_path / "out")) == 0
    assert_computes_megatron_lora(tmp_path / "out", root, "deepseek_v3_yarn with MindSpeed's --rope-scaling-* args")


@pytest.mark.parametrize("changes,expected", [
    ({"mscale_all_dim": 1.0}, "args.mscale=0.9 and mscale_all_dim=1 give attention_factor=0.973052 but the HF "
                              "config's yarn attention_factor is 1.05864"),
    ({"mscale": 0.7}, "attention_factor"),
    ({"rotary_scaling_factor": 4.0}, "args.rotary_scaling_factor=4 but the HF config's yarn factor is 40"),
    ({"rope_type": "rope"}, "Megatron's MLA then scales its softmax"),
    ({"rope_type": "rope", "mscale_all_dim": 0.0}, "the HF config has RoPE scaling yarn"),
    ({**MINDSPEED_YARN, "rope_scaling_mscale_all_dim": 0.0}, "rope_scaling_mscale_all_dim=0 give attention_factor"),
])
def test_mla_yarn_that_differs_from_the_hf_config_is_refused(tmp_path, capsys, changes, expected):
    root = _with_args("deepseek_v3_yarn_ep2", tmp_path, **changes)
    _failing(cli_args(root, tmp_path / "out"), capsys, expected)


def test_without_mtp_layers_the_output_config_says_so(tmp_path, capsys):
    """The released DeepSeek-V3 config has num_nextn_predict_layers=1; a Megatron checkpoint trained
    without MTP has no such layer, so the output must not claim one that is not there."""
    root = _copy("deepseek_v3_ep2", tmp_path)
    _with_config(root, num_nextn_predict_layers=1)
    out = tmp_path / "out"
    assert main(cli_args(root, out)) == 0
    assert "num_nextn_predict_layers=0 instead of 1" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert_computes_megatron_lora(out, root, "deepseek_v3 without MTP layers")


def test_an_hf_base_keeps_its_mtp_layers_as_they_are(tmp_path, merged, base_model_dirs, capsys):
    """--base an HF DeepSeek model with its MTP layer (model.layers.{num_hidden_layers}.*) and a LoRA trained
    without MTP: the MTP layer is written byte for byte, the rest merges as onto the Megatron base, and verify
    accepts it."""
    from safetensors.torch import load_file

    from helpers import with_mtp_layer

    root = DEEPSEEK / "deepseek_v3_ep2"
    hf_base = tmp_path / "hf_base"
    shutil.copytree(base_model_dirs("deepseek_v3_ep2"), hf_base)
    mtp = with_mtp_layer(hf_base, 3)
    shutil.copytree(root / "hf_ref", tmp_path / "hf_ref")
    config = json.loads((tmp_path / "hf_ref" / "config.json").read_text())
    (tmp_path / "hf_ref" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    out = tmp_path / "out"
    args = ["--base", str(hf_base), "--lora", str(root / "lora"), "--hf-ref", str(tmp_path / "hf_ref")]
    assert main(args + ["--out", str(out), "--no-progress", "--verify"]) == 0, capsys.readouterr().err
    ours = load_file(next(out.glob("*.safetensors")))
    for name, tensor in mtp.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    reference = load_file(next(merged("deepseek_v3_ep2").glob("*.safetensors")))
    assert set(ours) - set(mtp) == set(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert main(["verify", str(out), *args]) == 0, capsys.readouterr()


def test_an_incomplete_mtp_layer_is_refused_naming_what_it_lacks(tmp_path, base_model_dirs, capsys):
    from safetensors.torch import load_file, save_file

    from helpers import run_failing, with_mtp_layer

    root = DEEPSEEK / "deepseek_v3_ep2"
    hf_base = tmp_path / "hf_base"
    shutil.copytree(base_model_dirs("deepseek_v3_ep2"), hf_base)
    with_mtp_layer(hf_base, 3)
    (shard,) = hf_base.glob("*.safetensors")
    save_file({k: v for k, v in load_file(shard).items() if k != "model.layers.3.eh_proj.weight"}, shard,
              metadata={"format": "pt"})
    run_failing(["--base", str(hf_base), "--lora", str(root / "lora"), "--hf-ref", str(hf_base),
                 "--out", str(tmp_path / "out")], capsys, "missing model.layers.3.eh_proj.weight")


MINDSPEED_NAMES = {"linear_q_up_proj": "linear_qb", "linear_kv_up_proj": "linear_kvb", "kv_layernorm": "k_layernorm"}


def test_mindspeed_deepseek_names_are_read(tmp_path):
    """MindSpeed-LLM's DeepSeek spec names the q and kv up-projections linear_qb / linear_kvb and the kv norm
    k_layernorm (its converter's keys), beside the fused linear_qkv; renamed from the fused fixture, the
    real Megatron logits still apply."""
    from helpers import rewrite

    root = _copy("deepseek_v3_mindspeed_fused_qkv_ep2", tmp_path)

    def rename(state):
        model = state["model"]
        for key in list(model):
            for old, new in MINDSPEED_NAMES.items():
                if f".self_attention.{old}." in key:
                    model[key.replace(f".self_attention.{old}.", f".self_attention.{new}.")] = model.pop(key)
        if getattr(state["args"], "lora_target_modules", None):
            state["args"].lora_target_modules = [MINDSPEED_NAMES.get(m, m) for m in state["args"].lora_target_modules]

    for f in _all_rank_files(root / "base") + _all_rank_files(root / "lora"):
        rewrite(f, rename)
    out = tmp_path / "out"
    assert main(cli_args(root, out)) == 0
    assert_computes_megatron_lora(out, root, "deepseek_v3 in MindSpeed's names (linear_qkv, linear_qb, linear_kvb, k_layernorm)")


# GLM-4.5 has DeepSeek's MoE layout and PEFT treats its adapters as DeepSeek's (transformers' qwen2_moe pattern).
@pytest.mark.parametrize("name", ["deepseek_v3_ep2", "deepseek_v2_lite_ep2", "deepseek_v3_tp2etp1_ep2",
                                  "glm4moe_tp2etp1_ep2"])
def test_peft_loads_the_exported_adapter_except_what_it_drops_and_we_warn_of(name, tmp_path, merged, base_model_dirs,
                                                                             capsys):
    """PEFT (0.21, transformers 5) on the per-expert adapter: MLA projections and routed experts merge to our
    weights; it drops the dense-layer and shared-expert MLP LoRA, and the export says so in a warning that
    counts exactly the modules PEFT reports as unexpected."""
    import re

    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    root, adapter = fixture_root(name), tmp_path / "adapter"
    assert main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(adapter)]) == 0
    warning = re.search(r"drops the LoRA of (\d+) dense-MLP and shared-expert modules", capsys.readouterr().err)
    assert warning

    def base():
        return AutoModelForCausalLM.from_pretrained(base_model_dirs(name), dtype=torch.float32).eval()

    probe = PeftModel(base(), PeftConfig.from_pretrained(adapter))
    loaded = probe.load_adapter(adapter, adapter_name="probe")
    assert not [k for k in loaded.missing_keys if ".probe." in k or k.endswith(".probe")], loaded.missing_keys[:4]
    dropped = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in loaded.unexpected_keys}
    assert len(dropped) == int(warning.group(1))
    assert all(re.search(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj$", m) for m in dropped), sorted(dropped)[:4]

    theirs = PeftModel.from_pretrained(base(), adapter).merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(merged(name), dtype=torch.float32).state_dict()
    untouched = base().state_dict()
    assert theirs.keys() == ours.keys()
    lost = {f"{m}.weight" for m in dropped}
    worst = max((theirs[k] - ours[k]).abs().max().item() for k in ours if k not in lost)
    assert worst <= 1e-5
    assert all(torch.equal(theirs[k], untouched[k]) and not torch.equal(ours[k], untouched[k]) for k in lost)
    attention = [k for k in ours if ".self_attn." in k and k.endswith("proj.weight")]
    experts = [k for k in ours if ".mlp.experts." in k]
    assert attention and experts and all(not torch.equal(theirs[k], untouched[k]) for k in attention + experts)


# The fused form for DeepSeek (which PEFT loads whole): tests/test_peft_target_parameters.py.


# --- MLA at TP=2 (Megatron-Core's local spec: the down-projections are column-parallel) -----------------

TP2 = "deepseek_v3_tp2etp1_ep2"
DOWN = ("linear_q_down_proj", "linear_kv_down_proj")


def _as_duplicated(root: Path, edit_rank1=None) -> None:
    """TransformerEngine's layout of the same model: the down-projections (and their LoRA B) whole on every
    TP rank (TELinear, parallel_mode="duplicated"), built from the local-spec fixture by joining the two
    ranks' row blocks, the only difference between the specs."""
    from lora_merge.files.safe_load import load_pt
    from helpers import rewrite

    for iteration in [*(root / "base").glob("iter_*"), *(root / "lora").glob("iter_*")]:
        files = sorted(iteration.glob("mp_rank_*/model_optim_rng.pt"))
        assert [f.parent.name for f in files] == ["mp_rank_00_000", "mp_rank_01_001"]  # TP rank 0, TP rank 1
        models = [load_pt(f, mmap=False)["model"] for f in files]
        whole = {k: torch.cat([models[0][k], models[1][k]]) for k in models[0]
                 if any(f".{d}." in k for d in DOWN) and k.endswith("weight") and "lora_A" not in k}
        assert len(whole) == 4  # 2 layers x (q_down, kv_down): weights in the base, B in the LoRA
        for rank, f in enumerate(files):
            def edit(state, rank=rank):
                state["model"].update({k: v.clone() for k, v in whole.items()})
                if rank == 1 and edit_rank1 is not None:
                    edit_rank1(state["model"])
            rewrite(f, edit)


def test_tp2_down_projections_duplicated_as_transformer_engine_saves_them(tmp_path, merged):
    from safetensors.torch import load_file

    root = _copy(TP2, tmp_path)
    _as_duplicated(root)
    out = tmp_path / "out"
    assert main(cli_args(root, out)) == 0
    ours, reference = load_file(next(out.glob("*.safetensors"))), load_file(next(merged(TP2).glob("*.safetensors")))
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def test_tp2_duplicated_down_projections_that_differ_between_ranks_are_refused(tmp_path, capsys):
    key = "decoder.layers.1.self_attention.linear_kv_down_proj.weight"
    root = _copy(TP2, tmp_path)
    _as_duplicated(root, lambda model: model[key].add_(1e-3) if key in model else None)
    _failing(cli_args(root, tmp_path / "out"), capsys, key, "differs between TP rank 0 and TP rank 1")


@pytest.mark.parametrize("name", [TP2, "deepseek_v3_dist_tp2etp1_ep2"])
def test_tp2_lora_onto_an_hf_base_equals_the_merge_onto_the_megatron_base(name, tmp_path, merged, base_model_dirs):
    """The HF base (the Megatron base written as HF, which computes Megatron's base logits) + the TP=2 LoRA,
    whose down-projection B is split over TP ranks: the same bytes as the merge onto the Megatron base."""
    from safetensors.torch import load_file

    ref = torch.load(DEEPSEEK / name / "logits.pt", weights_only=True)
    assert (hf_logits(base_model_dirs(name), ref["input_ids"]) - ref["logits_base"]).abs().max() <= 1e-4
    out = tmp_path / "out"
    assert main(["--base", str(base_model_dirs(name)), "--lora", str(DEEPSEEK / name / "lora"), "--hf-ref",
                 str(DEEPSEEK / name / "hf_ref"), "--out", str(out), "--no-progress"]) == 0
    ours, reference = load_file(next(out.glob("*.safetensors"))), load_file(next(merged(name).glob("*.safetensors")))
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
