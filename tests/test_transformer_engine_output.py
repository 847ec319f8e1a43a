"""`--to megatron --transformer-impl transformer_engine`: what Megatron-LM builds by default loads what we write.

TransformerEngine needs CUDA to build, so the model is megatron-core 0.16.1's own TransformerEngine spec
(`get_gpt_decoder_block_spec(use_transformer_engine=True)`: its TE wrappers, their sharded state dicts, its
loaders) over tests/te_standin, TE's leaf modules re-created for CPU with TE's parameter names and extra state
(see its README). Each checkpoint must hold exactly the keys that model's own save writes (legacy), or every key
its sharded state dict asks for and no other (torch_dist), load strictly, and compute the logits the real Megatron
forward computed with the LoRA unmerged (the fixtures' logits.pt). Dense (TP, PP, qkv biases), MoE (EP with ETP 1,
a gated shared expert, TEGroupedMLP, q/k norms), DeepSeek MLA (q/kv norms fused into the up-projections; MoE
layers keep their pre-MLP norm) and MTP layers."""

from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import quiet
from megatron_oracle import megatron_logits
from test_megatron_loads_ours import close, hf_config, layout_of, recorded

TESTS = Path(__file__).parent
TE = "transformer_engine"

# (fixture, target layout, expert layout, format)
CASES = {
    "dense_tp2_pp2_legacy": ("fixtures/tp2pp2_fp32_filtered", dict(tp=2, pp=2), "sequential", "torch"),
    "dense_torch_dist_at_tp2": ("fixtures/tp2pp2_fp32_filtered", dict(tp=2), "sequential", "torch_dist"),
    "qwen2moe_shared_gate_tp2_ep2_etp1_legacy": ("fixtures_moe/qwen2moe_tp2ep2", dict(tp=2, ep=2, etp=1),
                                                 "sequential", "torch"),
    "qwen3moe_grouped_ep2_legacy": ("fixtures_moe/qwen3moe_ep2", dict(ep=2), "grouped", "torch"),
    "qwen3moe_torch_dist_at_ep2": ("fixtures_moe/qwen3moe_ep2", dict(ep=2), "sequential", "torch_dist"),
    # loaded by TEGroupedMLP (--moe-grouped-gemm), which shards each expert's weight and extra state itself
    "qwen3moe_torch_dist_at_ep2_grouped": ("fixtures_moe/qwen3moe_ep2", dict(ep=2), "grouped", "torch_dist"),
    "deepseek_mla_tp2_ep2_etp1_legacy": ("fixtures_deepseek/deepseek_v3_ep2", dict(tp=2, ep=2, etp=1), "sequential",
                                         "torch"),
    "deepseek_mla_torch_dist_at_pp2": ("fixtures_deepseek/deepseek_v3_ep2", dict(pp=2, decoder_first_pipeline_num_layers=1),
                                       "sequential", "torch_dist"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_transformer_engine_spec_loads_what_we_write_and_computes_the_trained_logits(tmp_path, name):
    fixture, target, experts, fmt = CASES[name]
    fixture = TESTS / fixture
    input_ids, logits = recorded(fixture)
    written = dict(target) if fmt == "torch" else {}  # torch_dist: written once, loaded at any layout
    lora_merge.to_megatron(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                           out=tmp_path / "mg", expert_layout=experts, ckpt_format=fmt, transformer_impl=TE,
                           warn=quiet, **written)
    got = megatron_logits(tmp_path / "mg/release", hf_config(fixture), layout_of(target), input_ids,
                          expert_layout=experts, ckpt_format=fmt, transformer_impl=TE)
    close(got, logits["logits_lora"])


@pytest.mark.parametrize("name", ["glm4moe_mtp_tp2etp1_ep2", "deepseek_v3_mtp_tp2etp1_ep2"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mtp_layers_in_transformer_engine_names_load_and_read_back_byte_for_byte(name, fmt, merged_fixture, tmp_path):
    """The merged model with its MTP layer (GQA with partial RoPE and biases; MLA) written with TE's names at TP2 PP2
    EP2: the TE spec's MTP block (TENorm enorm / hnorm / final norm, TE eh_proj) loads it, main and MTP logits are
    the trained model's; read back to HF, every file is byte for byte the merged one."""
    from helpers import fixture_root

    merged = merged_fixture(name)
    layout = dict(tp=2, pp=2, ep=2, etp=1)
    out = tmp_path / "mg"
    lora_merge.to_megatron(base=merged, out=out, ckpt_format=fmt, transformer_impl=TE, warn=quiet, **layout)
    ref = torch.load(fixture_root(name) / "logits.pt", weights_only=True)
    config = __import__("json").loads((merged / "config.json").read_text())
    mtp = {}
    logits = megatron_logits(out / "release", config, layout, ref["input_ids"], ckpt_format=fmt, mtp_out=mtp,
                             transformer_impl=TE)
    assert (logits - ref["logits_lora"]).abs().max() <= 1e-4
    assert (mtp["logits"] - ref["mtp_logits_lora"]).abs().max() <= 1e-4
    back = tmp_path / "back"
    lora_merge.merge(base=out, hf_ref=merged, out=back, warn=quiet)
    for shard in merged.glob("*.safetensors"):
        assert (back / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_what_the_transformer_engine_spec_does_differently_is_refused_by_name(tmp_path, capsys):
    from helpers import run_failing

    fixture = TESTS / "fixtures_moe/gptoss_tp2etp1_ep2"
    run_failing(["--base", str(fixture / "base"), "--hf-ref", str(fixture / "hf_ref"), "--to", "megatron", "--etp", "1",
                 "--transformer-impl", TE, "--out", str(tmp_path / "o"), "--no-progress"], capsys,
                "--transformer-impl transformer_engine: gpt-oss's sinks")
    fixture = TESTS / "fixtures_deepseek/deepseek_v3_ep2"
    run_failing(["--base", str(fixture / "base"), "--hf-ref", str(fixture / "hf_ref"), "--to", "megatron",
                 "--mla-naming", "mindspeed", "--transformer-impl", TE, "--out", str(tmp_path / "o"), "--no-progress"],
                capsys, "--mla-naming mindspeed with --transformer-impl transformer_engine")
    assert not (tmp_path / "o").exists()
    with pytest.raises(lora_merge.MergeError, match="--transformer-impl 'te': expected one of local, transformer_engine"):
        lora_merge.to_megatron(base=fixture / "base", hf_ref=fixture / "hf_ref", out=tmp_path / "o",
                               transformer_impl="te", warn=quiet)


def test_a_source_trained_with_the_other_spec_is_named_and_the_args_say_what_was_written(tmp_path):
    """A Megatron-LM run with TransformerEngine (its default) converted without the option: local names are
    written, as asked, and a warning names the option that writes what that run's model loads."""
    from helpers import copy_fixture, rank_files, rewrite

    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "base"):
        rewrite(f, lambda state: setattr(state["args"], "transformer_impl", TE))
    said = []
    for impl, out in (("local", tmp_path / "local"), (TE, tmp_path / "te")):
        lora_merge.to_megatron(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=out,
                               transformer_impl=impl, warn=said.append)
        args = torch.load(out / "release/mp_rank_00/model_optim_rng.pt", weights_only=False)["args"]
        assert args.transformer_impl == impl
    notes = [s for s in said if "--transformer-impl" in s]
    assert notes == ["the source's args say --transformer-impl transformer_engine; writing local's names, as asked "
                     "(--transformer-impl transformer_engine writes what that run's model loads)"]
