"""gpt-oss (gpt_oss) in Megatron-Core's form: each routed expert's parameters apart
(`mlp.experts.local_experts.{k}.linear_fc1.weight` [gate; up] [2F, H] …) become one row of the HF tensor that
stacks every expert's (`mlp.experts.gate_up_proj` [E, H, 2F] in → out, gate and up columns interleaved), and back
(layout.ExpertSlab); attention sinks are `softmax_offset`; the args record its mechanics (quick-GeGLU with its
offset and clamp, sinks, windows, YaRN) and are checked against the config.

HF → Megatron (legacy at TP2 EP2 ETP1, torch_dist) → HF gives every tensor back bit for bit; an HF base with a
PEFT adapter merged into Megatron equals the same merge written as HF; what the layout cannot hold (expert TP,
GroupedMLP) and args that describe another model are refused by name. The real Megatron forward's proof is in
test_gpt_oss_megatron_fixture.py."""

from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_merge
from helpers import quiet, random_hf_model, trained_peft_adapter

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}


def gpt_oss_config(**changes):
    from transformers import GptOssConfig

    settings = dict(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=131072, rope_parameters=YARN, architectures=["GptOssForCausalLM"],
                    bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16")
    return GptOssConfig(**(settings | changes))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    return random_hf_model(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss") / "base")


def tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("layout", [dict(tp=2, ep=2, etp=1), dict(tp=1, pp=2, ep=4, etp=1),
                                    dict(ckpt_format="torch_dist")])
def test_hf_to_megatron_to_hf_gives_every_tensor_back(hf_base, tmp_path, layout):
    lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", warn=quiet, **layout)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=hf_base, out=tmp_path / "back", warn=quiet)
    assert_same_tensors(tensors(hf_base), tensors(tmp_path / "back"))


def test_each_expert_is_its_row_of_the_stacked_tensor_in_megatrons_order(hf_base, tmp_path):
    """linear_fc1 = [gate; up] with gate the stacked tensor's even columns transposed, fc2 its row transposed."""
    lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", ep=2, warn=quiet)
    hf = tensors(hf_base)
    model = torch.load(tmp_path / "mg/release/mp_rank_00_001/model_optim_rng.pt", weights_only=False)["model"]
    e, k = 3, 1  # EP rank 1 holds experts 2 and 3
    stacked = hf["model.layers.2.mlp.experts.gate_up_proj"][e]
    fc1 = model[f"decoder.layers.2.mlp.experts.local_experts.{k}.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat((stacked[:, 0::2].t(), stacked[:, 1::2].t())))
    bias = hf["model.layers.2.mlp.experts.gate_up_proj_bias"][e]
    assert torch.equal(model[f"decoder.layers.2.mlp.experts.local_experts.{k}.linear_fc1.bias"],
                       torch.cat((bias[0::2], bias[1::2])))
    assert torch.equal(model[f"decoder.layers.2.mlp.experts.local_experts.{k}.linear_fc2.weight"],
                       hf["model.layers.2.mlp.experts.down_proj"][e].t())
    assert torch.equal(model["decoder.layers.2.self_attention.core_attention.softmax_offset"],
                       hf["model.layers.2.self_attn.sinks"])


def test_the_args_record_its_mechanics(hf_base, tmp_path):
    lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", warn=quiet)
    args = torch.load(tmp_path / "mg/release/mp_rank_00/model_optim_rng.pt", weights_only=False)["args"]
    assert (args.quick_geglu, args.swiglu, args.glu_linear_offset, args.activation_func_clamp_value) == (True, False, 1.0, 7.0)
    assert (args.softmax_type, args.window_size, args.window_attn_skip_freq) == ("learnable", (7, 0), 2)
    assert (args.add_bias_linear, args.position_embedding_type, args.rotary_scaling_factor,
            args.yarn_correction_range_round_to_int) == (True, "yarn", 32.0, False)


def adapter(hf_base: Path, out: Path) -> Path:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    trained_peft_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                         5, out)
    return out


def test_an_hf_base_with_a_peft_adapter_merges_into_megatron_as_into_hf(hf_base, tmp_path):
    adapter(hf_base, tmp_path / "adapter")
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "direct", warn=quiet)
    lora_merge.to_megatron(base=hf_base, lora=tmp_path / "adapter", out=tmp_path / "mg", tp=2, ep=2, etp=1,
                           warn=quiet)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=hf_base, out=tmp_path / "back", warn=quiet)
    direct, back = tensors(tmp_path / "direct"), tensors(tmp_path / "back")
    assert_same_tensors(direct, back)
    assert not torch.equal(direct["model.layers.1.mlp.experts.gate_up_proj"],
                           tensors(hf_base)["model.layers.1.mlp.experts.gate_up_proj"])


def test_mxfp4_output_from_a_megatron_checkpoint_is_the_hf_routes(hf_base, tmp_path):
    """Each expert's task quantized where it is computed, the scales written once the last expert's blocks are: the
    same bytes as the HF route quantizing the same float32 merge."""
    adapter(hf_base, tmp_path / "adapter")
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=tmp_path / "direct", dtype="mxfp4",
                     warn=quiet)
    lora_merge.to_megatron(base=hf_base, lora=tmp_path / "adapter", out=tmp_path / "mg", ep=2, dtype="float32",
                           warn=quiet)
    lora_merge.merge(base=tmp_path / "mg", hf_ref=hf_base, out=tmp_path / "back", dtype="mxfp4", warn=quiet)
    direct = tensors(tmp_path / "direct")
    assert_same_tensors(direct, tensors(tmp_path / "back"))
    assert direct["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8


@pytest.mark.parametrize("layout,expected", [
    (dict(tp=2, ep=2), "--etp 2 (as --tp 2: expert TP is TP unless --etp says otherwise): megatron-core builds "
                       "gpt-oss's experts (biases on every linear) at expert TP 1 only"),
    (dict(tp=2, ep=2, etp=2), "--etp 2 (as --tp 2"),
    (dict(ep=2, expert_layout="grouped"), "gpt-oss's experts have biases, which Megatron-Core's local GroupedMLP has not"),
])
def test_layouts_megatron_cannot_build_it_at_are_refused(hf_base, tmp_path, layout, expected):
    """megatron-core 0.16.1 asserts "Bias in Moe is only supported when ETP==1" (the oracle ran into it)."""
    with pytest.raises(lora_merge.MergeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", warn=quiet, **layout)
    assert not (tmp_path / "mg").exists()


def written_args(hf_base, tmp_path) -> Namespace:
    lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", warn=quiet)
    return torch.load(tmp_path / "mg/release/mp_rank_00/model_optim_rng.pt", weights_only=False)["args"]


@pytest.mark.parametrize("change,expected", [
    (dict(quick_geglu=False, swiglu=True), "gpt-oss's MLP is the clamped quick-GeGLU"),
    (dict(activation_func_clamp_value=10.0), "args.activation_func_clamp_value=10.0; expected 7"),
    (dict(glu_linear_offset=0.0), "args.glu_linear_offset=0.0; expected 1"),
    (dict(softmax_type="vanilla"), "args.softmax_type='vanilla'"),
    (dict(window_size=(16, 0)), "args.window_size=(16, 0); the HF config's sliding_window 8 is Megatron's (7, 0)"),
    (dict(window_attn_skip_freq=4), "windows layers 0, 1, 2"),
    (dict(window_size=None), "the args record no window_size"),
    (dict(position_embedding_type="rope"), "args.position_embedding_type='rope', but the HF config's RoPE is YaRN"),
    (dict(rotary_scaling_factor=8.0), "args.rotary_scaling_factor=8.0, but the HF config's YaRN has 32"),
    (dict(yarn_rotary_scaling_factor=8.0), "args.yarn_rotary_scaling_factor=8.0, but the HF config's YaRN has 32"),
    (dict(rotary_scaling_factor=None), "the args record no rotary_scaling_factor or yarn_rotary_scaling_factor"),
    (dict(yarn_beta_fast=16.0), "args.yarn_beta_fast=16.0, but the HF config's YaRN has 32"),
    (dict(mscale=0.707), "args.mscale=0.707, but the HF config's YaRN has 1 (HF's attention factor"),
    (dict(yarn_correction_range_round_to_int=True), "YaRN truncate is false"),
    (dict(use_rope_scaling=True), "args.use_rope_scaling=True: RoPE scaling on top"),
])
def test_args_of_another_model_are_refused(hf_base, tmp_path, change, expected):
    from lora_merge.model.hf_config import read_hf_config
    from lora_merge.model.megatron_args import check_against_args

    args = written_args(hf_base, tmp_path)
    shape, _ = read_hf_config(hf_base, [])
    assert check_against_args(shape, args, "ckpt") == []
    with pytest.raises(lora_merge.MergeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_against_args(shape, Namespace(**(vars(args) | change)), "ckpt")


def test_the_recipes_window_one_token_wider_is_merged_with_a_warning(hf_base, tmp_path):
    """Megatron-LM's and NeMo's gpt-oss recipes train --window-size 128,0 against HF's sliding_window 128."""
    from lora_merge.model.hf_config import read_hf_config
    from lora_merge.model.megatron_args import check_against_args

    args = written_args(hf_base, tmp_path)
    shape, _ = read_hf_config(hf_base, [])
    notes = check_against_args(shape, Namespace(**(vars(args) | dict(window_size=(8, 0)))), "ckpt")
    assert len(notes) == 1 and "attended 9 tokens" in notes[0] and "one token narrower" in notes[0]


def test_verify_reads_each_expert_of_a_megatron_base_as_its_row(hf_base, tmp_path):
    """With a reference that has no weights, the baseline is the Megatron base itself, expert by expert: a merge
    verifies, and an output whose one expert was swapped does not."""
    import json
    import shutil

    lora_merge.to_megatron(base=hf_base, out=tmp_path / "mg", ep=2, warn=quiet)
    (tmp_path / "ref").mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(hf_base / name, tmp_path / "ref" / name)
    result = lora_merge.merge(base=tmp_path / "mg", hf_ref=tmp_path / "ref", out=tmp_path / "out", verify=True,
                              warn=quiet)
    assert result.verified and result.verify_report.statuses["model.layers.1.mlp.experts.gate_up_proj"] == \
        "identical to baseline"
    from safetensors.torch import save_file

    merged = tensors(tmp_path / "out")
    merged["model.layers.1.mlp.experts.gate_up_proj"] = merged["model.layers.1.mlp.experts.gate_up_proj"][[0, 2, 1, 3]]
    save_file(merged, tmp_path / "out/model.safetensors", metadata={"format": "pt"})
    report = lora_merge.verify(tmp_path / "out", base=tmp_path / "mg", hf_ref=tmp_path / "ref", warn=quiet)
    assert not report.ok
    assert any(p.startswith("model.layers.1.mlp.experts.gate_up_proj: LoRA does not touch it, but it differs")
               for p in report.problems), report.problems
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == "gpt_oss"


GPT_OSS = Path(__file__).parent / "fixtures_moe/gptoss_tp2etp1_ep2"  # the real Megatron run (tests/fixtures_moe)


def test_a_megatron_lora_merges_onto_the_hf_form_of_its_base_as_onto_the_base(tmp_path):
    """Every expert's Megatron LoRA as one change to the stacked tensor an HF base holds (ExpertLoras): the same
    bytes as merging each expert into its row from the Megatron base."""
    lora_merge.merge(base=GPT_OSS / "base", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "base_hf", warn=quiet)
    from_hf = lora_merge.merge(base=tmp_path / "base_hf", lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref",
                               out=tmp_path / "from_hf", report=tmp_path / "report.json", warn=quiet)
    import json

    entry = json.loads((tmp_path / "report.json").read_text())["tensors"]["model.layers.1.mlp.experts.down_proj"]
    assert entry["source"] == "decoder.layers.1.mlp.experts.{0..3}.linear_fc2.weight"  # every expert's LoRA
    assert entry["status"] == "merged with LoRA"
    from_mg = lora_merge.merge(base=GPT_OSS / "base", lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref",
                               out=tmp_path / "from_mg", warn=quiet)
    assert from_hf.lora_modules == from_mg.lora_modules == 4 * (2 + 2 * 4)  # qkv, proj; fc1, fc2 of 4 experts
    assert_same_tensors(tensors(tmp_path / "from_hf"), tensors(tmp_path / "from_mg"))


def test_the_dry_run_names_its_mechanics_and_the_report_every_experts_source(tmp_path, capsys):
    import json

    from lora_merge.cli import main

    assert main(["--base", str(GPT_OSS / "base"), "--lora", str(GPT_OSS / "lora"), "--hf-ref", str(GPT_OSS / "hf_ref"),
                 "--out", str(tmp_path / "out"), "--report", str(tmp_path / "report.json"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())["tensors"]["model.layers.2.mlp.experts.gate_up_proj"]
    assert report["source"] == "decoder.layers.2.mlp.experts.{0..3}.linear_fc1.weight"
    assert report["status"] == "merged with LoRA" and report["shape"] == [4, 64, 64]
    capsys.readouterr()
    assert main(["--base", str(GPT_OSS / "base"), "--lora", str(GPT_OSS / "lora"), "--hf-ref", str(GPT_OSS / "hf_ref"),
                 "--out", str(tmp_path / "dry"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "attention sinks, a 4-token window in 2 layers, clamped quick-GeGLU (limit 7), YaRN RoPE (factor 32)" in out


def unfiltered_lora(tmp_path: Path) -> Path:
    """The fixture's LoRA with its base's weights in every rank file, as a run without --lora-ckpt-filter saves."""
    import shutil

    out = tmp_path / "unfiltered"
    shutil.copytree(GPT_OSS / "lora", out)
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):
        path = out / "iter_0000010" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        base = torch.load(GPT_OSS / "base/iter_0000001" / rank / "model_optim_rng.pt", weights_only=False)["model"]
        state["model"] = {**base, **state["model"]}
        torch.save(state, path)
    return out


def test_an_unfiltered_lora_checks_each_experts_base_against_its_row_of_an_hf_base(tmp_path):
    """Its own base parameters, expert by expert, against their rows of the stacked tensor: the right base merges as
    the Megatron route does, another is refused by name."""
    lora = unfiltered_lora(tmp_path)
    lora_merge.merge(base=GPT_OSS / "base", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "base_hf", warn=quiet)
    lora_merge.merge(base=tmp_path / "base_hf", lora=lora, hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "from_hf",
                     warn=quiet)
    lora_merge.merge(base=GPT_OSS / "base", lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "from_mg",
                     warn=quiet)
    assert_same_tensors(tensors(tmp_path / "from_hf"), tensors(tmp_path / "from_mg"))
    from safetensors.torch import save_file

    other = tensors(tmp_path / "base_hf")
    other["model.layers.3.mlp.experts.down_proj"][3, 5, 7] += 0.5  # the last expert, in the last layer
    save_file(other, tmp_path / "base_hf/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(lora_merge.MergeError, match=r"its own base weights differ from --base .*"
                                                    r"decoder\.layers\.3\.mlp\.experts\.3\.linear_fc2\.weight"):
        lora_merge.merge(base=tmp_path / "base_hf", lora=lora, hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "bad",
                         warn=quiet)


def test_singleton_torch_dist_experts_with_their_fc1_bias_in_halves(tmp_path):
    """megatron-core's MLP applies the swiglu factory to fc1's bias as to its weight, so singleton_local_shards saves
    `experts.{e}.linear_fc1.bias_w` / `bias_v` (gate / up halves) beside `weight_w` / `weight_v`: read joined."""
    import pickle
    import shutil

    import torch.distributed.checkpoint as dcp

    lora_merge.merge(base=GPT_OSS / "base", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "hf", warn=quiet)
    lora_merge.to_megatron(base=tmp_path / "hf", out=tmp_path / "dist", ckpt_format="torch_dist", warn=quiet)
    src, dst = tmp_path / "dist/release", tmp_path / "singleton/release"
    meta = pickle.loads((src / ".metadata").read_bytes())
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=str(src), no_dist=True)
    out = {}
    for key, t in state.items():  # (MoE layers keyed per layer: moe_layer_freq is a list)
        layer, sep, tail = key.removeprefix("decoder.layers.").partition(".mlp.experts.experts.")
        if not sep:
            out[key] = t
            continue
        for e in range(t.shape[0]):
            name = f"decoder.layers.{layer}.mlp.experts.experts.{e}.{tail}"
            if tail.startswith("linear_fc1."):
                gate, up = t[e].chunk(2)
                out[name + "_w"], out[name + "_v"] = gate.clone(), up.clone()
            else:
                out[name] = t[e].clone()
    assert "decoder.layers.1.mlp.experts.experts.2.linear_fc1.bias_w" in out
    dcp.save(out, checkpoint_id=str(dst), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(src / name, dst / name)
    (dst.parent / "latest_checkpointed_iteration.txt").write_text("release")
    lora_merge.merge(base=tmp_path / "singleton", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "back", warn=quiet)
    assert_same_tensors(tensors(tmp_path / "hf"), tensors(tmp_path / "back"))


def test_a_megatron_lora_on_an_mxfp4_release_gives_the_bytes_of_its_megatron_form(tmp_path):
    """The fixture's base as an MXFP4 release, merged with the Megatron LoRA (every expert's factors as one change to
    its blocks' experts), against the same release converted to Megatron and merged there: MXFP4 and bf16 alike."""
    lora_merge.merge(base=GPT_OSS / "base", hf_ref=GPT_OSS / "hf_ref", out=tmp_path / "mx", dtype="mxfp4", warn=quiet)
    lora_merge.to_megatron(base=tmp_path / "mx", out=tmp_path / "mg", tp=2, ep=2, etp=1, dtype="float32", warn=quiet)
    for dtype in ("mxfp4", "bfloat16"):
        lora_merge.merge(base=tmp_path / "mx", lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref",
                         out=tmp_path / f"hf_{dtype}", dtype=dtype, warn=quiet)
        lora_merge.merge(base=tmp_path / "mg", lora=GPT_OSS / "lora", hf_ref=GPT_OSS / "hf_ref",
                         out=tmp_path / f"mg_{dtype}", dtype=dtype, warn=quiet)
        assert_same_tensors(tensors(tmp_path / f"hf_{dtype}"), tensors(tmp_path / f"mg_{dtype}"))
