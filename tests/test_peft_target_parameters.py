"""PEFT adapters with LoRA on parameters (`target_parameters`), as PEFT (0.21) writes them for transformers 5's
fused experts (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]), merged onto an HF
base that stores one tensor per expert as published checkpoints do.

The oracle is PEFT itself: each adapter is made by `get_peft_model` on a transformers 5 model (random
weights, fixed seed, its LoRA factors randomised so that every delta is non-zero) and saved with
`save_pretrained`; PEFT's `merge_and_unload()` of the same adapter on the same model, saved by transformers
(which writes the experts one tensor each again), must equal our merge tensor by tensor and name by name,
and our merged model must compute what PEFT's unmerged model computes."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import peft_model_loading_every_key
from lora_merge.cli import main

peft = pytest.importorskip("peft")

TESTS = Path(__file__).parent
REFS = {  # model type -> an HF config of tiny size (from the Megatron fixtures)
    "qwen3_moe": TESTS / "fixtures_moe" / "qwen3moe_ep2" / "hf_ref",
    "mixtral": TESTS / "fixtures_moe" / "mixtral_ep2" / "hf_ref",
    "qwen2_moe": TESTS / "fixtures_moe" / "qwen2moe_tp2ep2" / "hf_ref",
    "deepseek_v3": TESTS / "fixtures_deepseek" / "deepseek_v3_ep2" / "hf_ref",
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = {"qwen3_moe": ["q_proj", "o_proj"], "mixtral": ["k_proj", "v_proj"], "qwen2_moe": ["q_proj"],
             "deepseek_v3": ["q_b_proj", "kv_a_proj_with_mqa", "o_proj"]}
# target_modules PEFT itself turns into target_parameters on transformers 5 (gate_up_proj at rank 2r, alpha 2α);
# qwen2_moe has no such conversion: there gate_proj/up_proj/down_proj are its shared expert's modules.
EXPERT_MODULES = {"qwen3_moe": ["gate_proj", "up_proj", "down_proj"], "mixtral": ["w1", "w3", "w2"],
                  "qwen2_moe": ["gate_proj", "up_proj", "down_proj"],
                  "deepseek_v3": ["gate_proj", "up_proj", "down_proj"]}


def configs(model_type: str) -> dict:
    attention = ATTENTION[model_type]
    cases = {
        # the experts' parameters named as PEFT's docs do, beside ordinary module targets
        "experts_and_attention": dict(r=4, lora_alpha=8, target_modules=attention, target_parameters=EXPERTS),
        # only one expert parameter (no nesting), rsLoRA, a rank and an alpha of its own
        "down_proj_only_rslora_patterns": dict(r=2, lora_alpha=6, use_rslora=True, target_modules=attention[:1],
                                               target_parameters=["mlp.experts.down_proj"],
                                               rank_pattern={r"experts\.down_proj": 3},
                                               alpha_pattern={r"layers\.1\.mlp\.experts\.down_proj": 5}),
        # expert projections as target_modules: PEFT's transformers-5 conversion (rank 2r for gate_up_proj)
        "expert_modules_converted": dict(r=2, lora_alpha=4, target_modules=attention + EXPERT_MODULES[model_type]),
        # the router's weight, a 2-D parameter, with gate_up_proj alone
        "router_and_gate_up": dict(r=3, lora_alpha=3, target_modules=[],
                                   target_parameters=["mlp.gate.weight", "mlp.experts.gate_up_proj"]),
    }
    if model_type == "qwen2_moe":  # its shared expert's modules and the routed experts' parameters together
        cases["expert_modules_converted"]["target_parameters"] = EXPERTS
    else:  # "all-linear", which PEFT resolves on transformers 5 to the attention, experts and router
        cases["all_linear"] = dict(r=2, lora_alpha=5, target_modules="all-linear")
    return cases


CASES = [(t, c) for t in REFS for c in configs(t)]


def hf_config(model_type: str):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(REFS[model_type])
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """model type -> an HF base dir: a transformers 5 model with random weights, saved by transformers."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(model_type: str, dtype=torch.float32) -> Path:
        if (model_type, dtype) not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(hf_config(model_type), dtype=torch.float32)
            with torch.no_grad():  # routers with enough scale that no top-k choice sits on a tie
                for name, p in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.normal_(0, 1)
            out = tmp_path_factory.mktemp("base") / f"{model_type}_{str(dtype)[6:]}"
            model.to(dtype).save_pretrained(out)
            cache[(model_type, dtype)] = out
        return cache[(model_type, dtype)]

    return get


def make_adapter(base: Path, out: Path, dtype=torch.float32, **config):
    """An adapter made and saved by PEFT, every factor random (PEFT starts lora_B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), LoraConfig(**config))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return model


def peft_merged(base: Path, adapter: Path, out: Path, dtype=torch.float32):
    """PEFT's merge_and_unload of the saved adapter on the saved base, saved by transformers; and PEFT's
    unmerged logits on some input."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter).eval()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        with model.disable_adapter():
            assert (model(ids).logits - logits).abs().max() > 1e-3  # the adapter moves these logits
    model.merge_and_unload().save_pretrained(out)
    return ids, logits


def ours(base: Path, adapter: Path, out: Path, model_type: str, *more) -> int:
    return main(["--base", str(base), "--lora", str(adapter), "--hf-ref", str(REFS[model_type]), "--out", str(out),
                 "--no-progress", *more])


def read_dir(path: Path) -> dict:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("model_type,case", CASES)
def test_target_parameters_adapter_merges_as_peft_does(model_type, case, bases, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base, adapter = bases(model_type), tmp_path / "adapter"
    make_adapter(base, adapter, **configs(model_type)[case])
    config = hf_config(model_type)
    count = (getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None)
             or config.num_experts)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["target_parameters"], saved  # what this test is about: LoRA on parameters
    ids, unmerged = peft_merged(base, adapter, tmp_path / "peft")
    capsys.readouterr()
    assert ours(base, adapter, tmp_path / "ours", model_type) == 0, capsys.readouterr().err

    theirs, mine, before = read_dir(tmp_path / "peft"), read_dir(tmp_path / "ours"), read_dir(base)
    assert set(mine) == set(theirs), set(mine) ^ set(theirs)
    changed, worst = [], 0.0
    for key in sorted(theirs):
        assert mine[key].dtype == theirs[key].dtype == torch.float32, key
        if torch.equal(theirs[key], before[key]):  # PEFT left it: so must we, bit for bit
            assert torch.equal(mine[key], before[key]), key
            continue
        changed.append(key)
        err = (mine[key] - theirs[key]).abs().max().item()
        worst = max(worst, err)
        assert err <= 1e-6 * max(1.0, theirs[key].abs().max().item()), (key, err)
    experts = [k for k in changed if ".experts." in k]
    moe_layers = {k.split(".")[2] for k in before if ".experts.0." in k}
    projections = {"down_proj_only_rslora_patterns": 1, "router_and_gate_up": 2}.get(case, 3)
    if case == "down_proj_only_rslora_patterns":  # rank_pattern gave the parameter r=3: PEFT's factors have it
        factors = load_file(adapter / "adapter_model.safetensors")
        assert {t.shape[0] for k, t in factors.items() if k.endswith("experts.lora_A.weight")} == {3 * count}
    assert len(experts) == len(moe_layers) * count * projections, (len(experts), len(moe_layers), count)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()(ids).logits
    print(f"\n{model_type} {case}: {len(changed)} tensors changed ({len(experts)} expert tensors), max |ours - PEFT "
          f"merge_and_unload| = {worst:.1e}, max |logits - PEFT unmerged| = {(logits - unmerged).abs().max():.1e}")
    assert (logits - unmerged).abs().max() <= 1e-4


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance between consecutive bf16 numbers at |x|: 2**(floor(log2|x|) - 7)."""
    _, exponent = torch.frexp(x.abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_bf16_expert_parameters_are_rounded_once(model_type, bases, tmp_path, capsys):
    """A bf16 base and adapter: ours is PEFT's float32 merge of the same bf16 values rounded once, i.e. within
    half a bf16 spacing (plus float32 round-off) of it; PEFT in bf16 rounds the delta before adding."""
    base, adapter = bases(model_type, torch.bfloat16), tmp_path / "adapter"
    make_adapter(base, adapter, dtype=torch.bfloat16, **configs(model_type)["experts_and_attention"])
    peft_merged(base, adapter, tmp_path / "peft", dtype=torch.float32)  # bf16 values, merged in float32
    capsys.readouterr()
    assert ours(base, adapter, tmp_path / "ours", model_type, "--dtype", "bfloat16") == 0, capsys.readouterr().err
    theirs, mine, before = read_dir(tmp_path / "peft"), read_dir(tmp_path / "ours"), read_dir(base)
    assert set(mine) == set(theirs)
    changed, off = 0, 0
    for key in sorted(theirs):
        assert mine[key].dtype == before[key].dtype, key
        if torch.equal(theirs[key], before[key].float()):
            assert torch.equal(mine[key], before[key]), key
            continue
        changed += ".experts." in key
        err = (mine[key].float() - theirs[key]).abs()
        assert (err <= 0.5 * bf16_spacing(theirs[key]) + 1e-6 * max(1.0, theirs[key].abs().max().item())).all(), key
        off += int((mine[key] != theirs[key].to(torch.bfloat16)).sum())
    assert changed == sum(".experts." in k for k in before)
    print(f"\n{model_type} bf16: {changed} expert tensors within half a bf16 spacing of PEFT's float32 merge; "
          f"{off} elements differ from bf16(PEFT float32 merge)")


def _adapter(bases, tmp_path, model_type="qwen3_moe", case="experts_and_attention"):
    base, adapter = bases(model_type), tmp_path / "adapter"
    make_adapter(base, adapter, **configs(model_type)[case])
    return base, adapter


def _refused(base, adapter, tmp_path, capsys, *expected, model_type="qwen3_moe"):
    capsys.readouterr()
    code = ours(base, adapter, tmp_path / "out", model_type)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    for part in expected:
        assert part in err[0], err[0]
    assert not (tmp_path / "out").exists()
    return err[0]


def _edit_config(adapter: Path, **changes):
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def _edit_tensors(adapter: Path, edit):
    from safetensors.torch import save_file
    tensors = load_file(adapter / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})


def test_a_target_parameters_entry_that_selects_nothing_is_refused(bases, tmp_path, capsys):
    base, adapter = _adapter(bases, tmp_path)
    _edit_config(adapter, target_parameters=EXPERTS + ["mlp.experts.up_proj"])
    _refused(base, adapter, tmp_path, capsys, "target_parameters entry 'mlp.experts.up_proj' selects no parameter of "
             "this qwen3_moe model")


def test_a_selected_parameter_without_factors_is_refused(bases, tmp_path, capsys):
    base, adapter = _adapter(bases, tmp_path)
    _edit_tensors(adapter, lambda t: [t.pop(k) for k in list(t) if ".layers.2.mlp.experts.lora_" in k])
    _refused(base, adapter, tmp_path, capsys, "no LoRA factors for 1 of the 8 parameters target_parameters selects "
             "(model.layers.2.mlp.experts.down_proj;", "PEFT would load them with fresh factors")


def test_factors_of_a_parameter_not_in_target_parameters_are_refused(bases, tmp_path, capsys):
    """The adapter holds gate_up_proj's (nested, under base_layer) and down_proj's factors; a config naming
    only gate_up_proj would make PEFT read down_proj's factors as gate_up_proj's."""
    base, adapter = _adapter(bases, tmp_path)
    _edit_config(adapter, target_parameters=["mlp.experts.gate_up_proj"])
    _refused(base, adapter, tmp_path, capsys, "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A/lora_B "
             "belong to no parameter target_parameters=['mlp.experts.gate_up_proj'] selects")


def test_expert_factors_without_target_parameters_are_refused(bases, tmp_path, capsys):
    base, adapter = _adapter(bases, tmp_path, case="down_proj_only_rslora_patterns")
    config = json.loads((adapter / "adapter_config.json").read_text())
    _edit_config(adapter, target_parameters=None, rank_pattern={}, alpha_pattern={},
                 target_modules=config["target_modules"])
    _refused(base, adapter, tmp_path, capsys, "base_model.model.model.layers.0.mlp.experts.lora_A/lora_B belong to no "
             "parameter target_parameters=[] selects")


def test_factors_of_another_rank_are_refused(bases, tmp_path, capsys):
    base, adapter = _adapter(bases, tmp_path)
    _edit_config(adapter, rank_pattern={"gate_up_proj": 2})
    _refused(base, adapter, tmp_path, capsys, "model.layers.0.mlp.experts.gate_up_proj [4, 64, 64] has lora_A [16, 64] "
             "and lora_B [64, 16]; with r=2 (adapter_config.json) PEFT's are [8, 64] and [64, 8]")


def test_verify_checks_every_expert_of_a_target_parameters_merge(bases, tmp_path, capsys):
    from safetensors.torch import save_file
    base, adapter = _adapter(bases, tmp_path)
    out = tmp_path / "out"
    inputs = ["--base", str(base), "--lora", str(adapter), "--hf-ref", str(REFS["qwen3_moe"])]
    assert main(inputs + ["--out", str(out), "--no-progress", "--verify"]) == 0, capsys.readouterr().err
    assert main(["verify", str(out), *inputs]) == 0, capsys.readouterr()
    tensors = load_file(out / "model.safetensors")
    victim = "model.layers.3.mlp.experts.2.up_proj.weight"
    tensors[victim] = tensors[victim] + 1e-3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", str(out), *inputs]) == 1
    assert victim in capsys.readouterr().out


# --- the fused form written by export-adapter: PEFT loads it, and it reads back to the direct merge ---------

MEGATRON = {name: TESTS / group / name for group, name in [
    ("fixtures_moe", "qwen3moe_ep2"), ("fixtures_moe", "mixtral_ep2"), ("fixtures_moe", "qwen2moe_tp2ep2"),
    ("fixtures_moe", "qwen3moe_mindspeed_grouped_lora_ep2"), ("fixtures_deepseek", "deepseek_v3_ep2"),
    ("fixtures_deepseek", "deepseek_v2_lite_ep2")]}


@pytest.fixture
def megatron_merges(merged_fixture, base_model):
    """name -> (the direct merge of the Megatron base + LoRA, the Megatron base alone in HF form)."""
    return lambda name: (merged_fixture(MEGATRON[name]), base_model(MEGATRON[name]))


def export_fused(name: str, out: Path) -> int:
    root = MEGATRON[name]
    return main(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out),
                 "--expert-format", "fused"])


@pytest.mark.parametrize("name", list(MEGATRON))
def test_fused_export_reads_back_to_the_direct_merge(name, megatron_merges, tmp_path, capsys):
    """export-adapter --expert-format fused, then that adapter merged onto the Megatron base in HF form: the
    same tensors as merging the Megatron LoRA directly (same factors, same scale, one rounding)."""
    direct, base = megatron_merges(name)
    adapter = tmp_path / "adapter"
    assert export_fused(name, adapter) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"]
    capsys.readouterr()
    root = MEGATRON[name]
    assert main(["--base", str(base), "--lora", str(adapter), "--hf-ref", str(root / "hf_ref"), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 0, capsys.readouterr().err
    want, got, before = read_dir(direct), read_dir(tmp_path / "out"), read_dir(base)
    assert set(got) == set(want)
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    experts = [k for k in want if ".experts." in k]
    assert experts and all(not torch.equal(want[k], before[k]) for k in experts)  # every expert was adapted
    print(f"\n{name}: fused export read back, max |round trip - direct merge| = {worst:.1e} "
          f"({sum(not torch.equal(got[k], want[k]) for k in want)} of {len(want)} tensors not bit-identical)")
    assert all((got[k].float() - want[k].float()).abs().max() <= 1e-6 * max(1.0, want[k].float().abs().max().item())
               for k in want)


@pytest.mark.parametrize("name", ["deepseek_v3_ep2", "deepseek_v2_lite_ep2"])
def test_peft_loads_the_fused_deepseek_adapter_whole(name, megatron_merges, tmp_path, capsys):
    """DeepSeek: PEFT (0.21) rewrites gate_proj/up_proj/down_proj target_modules into fused-expert parameters
    (at rank 2r), dropping the dense layers' and shared experts' MLP LoRA; the fused export names those as
    LoRA on their 2-D weights instead. PEFT loads every key, computes what Megatron+LoRA computed, and its
    merge_and_unload equals our direct merge, dense MLPs and shared experts included."""
    from transformers import AutoModelForCausalLM

    direct, base_dir = megatron_merges(name)
    adapter = tmp_path / "adapter"
    assert export_fused(name, adapter) == 0
    assert [line for line in capsys.readouterr().err.splitlines()
            if "warning" in line and "names no Hub model" not in line] == []
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert not {"gate_proj", "up_proj", "down_proj"} & set(config["target_modules"])
    assert {"gate_proj.weight", "up_proj.weight", "down_proj.weight"} <= set(config["target_parameters"])

    model = peft_model_loading_every_key(base_dir, adapter)
    ref = torch.load(MEGATRON[name] / "logits.pt", weights_only=True)
    with torch.no_grad():
        adapted = model(ref["input_ids"]).logits
    assert (adapted - ref["logits_lora"]).abs().max() <= 1e-4
    theirs = model.merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(direct, dtype=torch.float32).state_dict()
    untouched = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    assert theirs.keys() == ours.keys()
    worst = max((theirs[k] - ours[k]).abs().max().item() for k in ours)
    dense = [k for k in ours if re.search(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$", k)]
    assert dense and all(not torch.equal(theirs[k], untouched[k]) for k in dense)  # PEFT adapted them too
    print(f"\n{name} (fused): max |PEFT merge_and_unload - ours| = {worst:.1e}, max |PEFT adapted logits - "
          f"Megatron+LoRA| = {(adapted - ref['logits_lora']).abs().max():.1e}")
    assert worst <= 1e-5
