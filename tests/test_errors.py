"""Bad input: one clear line on stderr, a non-zero exit, and nothing written."""

import json
import shutil

import pytest
import torch

from helpers import (FIXTURES, assert_nothing_written, copied_args, copy_fixture, merge_args, rank_files, rewrite,
                     run_failing, set_value)
from lora_merge.cli import main


def test_missing_lora_alpha_and_r_is_an_error_not_a_default(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "lora"):
        rewrite(f, lambda s: (delattr(s["args"], "lora_alpha"), delattr(s["args"], "lora_r")))
    out = tmp_path / "out"
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out), "--no-progress"]
    run_failing(args, capsys, "no lora_r and lora_alpha", "--lora-r/--lora-alpha")
    assert_nothing_written(out)
    assert main(args + ["--lora-r", "4", "--lora-alpha", "12"]) == 0


def test_wrong_rank_override_is_caught(tmp_path, capsys):
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--lora-r", "8"], capsys, "LoRA rank 4", "r=8")
    assert_nothing_written(out)


def test_hf_config_disagreeing_with_args(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    config["num_key_value_heads"] = 2
    (root / "hf_ref" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "num_query_groups=4", "num_key_value_heads")
    assert_nothing_written(out)


def test_filtered_lora_needs_a_base(tmp_path, capsys):
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out, with_base=False), capsys, "pass --base")
    assert_nothing_written(out)


def test_missing_rank_directory(tmp_path, capsys):
    root = copy_fixture("tp2pp2_fp32_filtered", tmp_path)
    shutil.rmtree(rank_files(root / "base")[-1].parent)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "missing mp_rank_01_001", "TP=2 PP=2")
    assert_nothing_written(out)


def test_existing_output_needs_force(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(merge_args("tp2_fp32_filtered", out)) == 0  # an earlier output
    (out / "keep.json").write_text("x")  # e.g. an old report
    run_failing(merge_args("tp2_fp32_filtered", out), capsys, "already exists", "--force")
    assert (out / "keep.json").exists()
    assert main(merge_args("tp2_fp32_filtered", out) + ["--force"]) == 0
    assert not (out / "keep.json").exists() and (out / "model.safetensors").exists()


def test_malicious_rank_file_is_refused_before_anything_runs(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    target = rank_files(root / "lora")[1]
    rewrite(target, lambda s: s.__setitem__("rng_state", [Payload()]))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "refusing to load", "system", "mp_rank_01")
    assert not marker.exists()
    assert_nothing_written(out)


def test_unknown_parameter_is_an_error_not_dropped(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "base"):
        rewrite(f, lambda s: s["model"].__setitem__("decoder.layers.1.mlp.router.weight", torch.zeros(4, 64)))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "does not know", "decoder.layers.1.mlp.router.weight")
    assert_nothing_written(out)


def test_lora_b_missing(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.2.mlp.linear_fc2.lora_B.default.weight"
    for f in rank_files(root / "lora"):
        rewrite(f, lambda s: s["model"].pop(key))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "decoder.layers.2.mlp.linear_fc2 has lora_A but no lora_B")
    assert_nothing_written(out)


def test_replicated_norm_differing_between_ranks(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.3.input_layernorm.weight"
    rewrite(rank_files(root / "base")[1], lambda s: s["model"].__setitem__(key, s["model"][key] + 1e-3))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, key, "differs between TP rank 0 and TP rank 1")
    assert_nothing_written(out)


def test_shards_with_wrong_shape(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    rewrite(rank_files(root / "base")[1], lambda s: s["model"].__setitem__(key, s["model"][key][:-2]))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, key, "TP rank 1 shard has shape [94, 64], expected [96, 64]")
    assert_nothing_written(out)


def test_lora_target_without_weights(tmp_path, capsys):
    root = copy_fixture("tp2_llama_fp32_partial", tmp_path)
    for f in rank_files(root / "lora"):
        rewrite(f, lambda s: s["args"].lora_target_modules.append("linear_proj"))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "lists 'linear_proj'", "no LoRA weights")
    assert_nothing_written(out)


def test_lora_from_another_model_size(tmp_path, capsys):
    # LoRA trained for the Llama fixture (no qkv bias) applied to the Qwen2 base of another run: the
    # architectures differ in args, and the tool says so instead of merging.
    out = tmp_path / "out"
    run_failing(["--base", str(FIXTURES / "tp2_fp32_filtered" / "base"),
                 "--lora", str(FIXTURES / "tp2_llama_fp32_partial" / "lora"),
                 "--hf-ref", str(FIXTURES / "tp2_fp32_filtered" / "hf_ref"), "--out", str(out)], capsys,
                "add_qkv_bias")
    assert_nothing_written(out)


def test_stale_iteration_is_not_used_and_a_missing_one_is_an_error(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    (root / "lora" / "latest_checkpointed_iteration.txt").write_text("20")
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "iteration 20", "iter_0000020")
    assert_nothing_written(out)


def test_not_enough_disk_space_stops_before_writing(tmp_path, capsys, monkeypatch):
    import collections

    from lora_merge.files import staged_dir

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(staged_dir.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "out"
    # What is needed, and of what: a 0.6 MB output must not read as "needs 0.07 GB" with the margin unexplained.
    expected = (f"{tmp_path}: not enough disk space for out: the output needs 64.6 MB (623.9 kB of tensors + "
                "6.5 kB of reference files + 64.0 MB margin for config, card and report), 1.0 kB are free")
    for dry_run in ([], ["--dry-run"]):  # a dry run says the run would not fit, the same way, and exits 2
        line = run_failing(merge_args("tp2_fp32_filtered", out) + dry_run, capsys, expected)
        assert line == f"lora-merge: error: {expected}"
        assert_nothing_written(out)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(merge_args("tp2pp2_fp32_filtered", out) + ["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "TP=2 PP=2" in text and "r=4 alpha=12" in text and "51 tensors" in text and "16 modules" in text
    assert_nothing_written(out)


def test_truncated_rank_file(tmp_path, capsys):
    root = copy_fixture("tp2pp2_fp32_filtered", tmp_path)
    victim = rank_files(root / "base")[2]
    victim.write_bytes(victim.read_bytes()[:5000])
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, str(victim))
    assert_nothing_written(out)


def test_non_finite_merge_result(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.1.self_attention.linear_proj.lora_B.default.weight"

    for f in rank_files(root / "lora"):  # lora_B of a row layer is replicated: poison every copy
        set_value(f, key, (3, 1), float("inf"))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "model.layers.1.self_attn.o_proj.weight", "non-finite")
    assert_nothing_written(out)


def test_write_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    from lora_merge.writers import safetensors_stream

    calls = {"n": 0}
    real_write = safetensors_stream.ShardedSafetensorsWriter.write

    def failing(self, name, piece, then=None):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(28, "No space left on device", str(self.directory / self.file_names[0]))
        return real_write(self, name, piece, then)

    monkeypatch.setattr(safetensors_stream.ShardedSafetensorsWriter, "write", failing)
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out), capsys, "No space left on device", "no output was written")
    assert_nothing_written(out)


def test_output_overlapping_an_input_is_refused_even_with_force(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--force"]
    run_failing(args + ["--out", str(root)], capsys, "the input", "--force never overrides")
    run_failing(args + ["--out", str(root / "lora")], capsys, "the input", "--force never overrides")
    assert (root / "base").is_dir() and (root / "lora").is_dir() and (root / "hf_ref" / "config.json").is_file()


def test_dora_or_stray_tensors_in_the_lora_checkpoint_are_errors_with_a_base(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    files = rank_files(root / "lora")
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "out")]
    key = "decoder.layers.0.self_attention.linear_qkv.lora_magnitude_vector.default.weight"
    for f in files:
        rewrite(f, lambda s: s["model"].__setitem__(key, torch.ones(64)))
    run_failing(args, capsys, "DoRA", "not supported")
    for f in files:
        rewrite(f, lambda s: (s["model"].pop(key), s["model"].__setitem__("decoder.layers.0.mlp.router.weight",
                                                                         torch.zeros(2, 64))))
    run_failing(args, capsys, "neither LoRA weights nor base weights", "decoder.layers.0.mlp.router.weight")
    assert_nothing_written(tmp_path / "out")


def test_lora_missing_in_some_layers(tmp_path, capsys):
    root = copy_fixture("tp2pp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "lora"):
        if f.parent.name.endswith("_001"):  # drop every adapter of the second pipeline stage
            rewrite(f, lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items() if "lora" not in k}))
    out = tmp_path / "out"
    args = copied_args(root, out)
    run_failing(args, capsys, "missing for 8 of 16 adapted modules", "layer 2 self_attention.linear_qkv",
                "--allow-partial-lora")
    assert_nothing_written(out)
    assert main(args + ["--allow-partial-lora", "--no-progress"]) == 0


@pytest.mark.parametrize("arg,value,expected", [("rotary_interleaved", True, "rotary_interleaved=True"),
                                                ("rotary_base", 1000000, "rope_theta"),
                                                ("norm_epsilon", 1e-5, "rms_norm_eps"),
                                                ("normalization", "LayerNorm", "'RMSNorm'"),
                                                ("mtp_num_layers", 1, "multi-token-prediction layers"),
                                                ("multi_latent_attention", True, "ordinary attention")])
def test_args_that_change_the_function_must_match_the_config(tmp_path, capsys, arg, value, expected):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for f in rank_files(root / "base"):
        rewrite(f, lambda s: setattr(s["args"], arg, value))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, f"args.{arg}", expected)
    assert_nothing_written(out)


def test_tied_copy_that_differs_is_an_error(tmp_path, capsys):
    root = copy_fixture("tied_pp2_llama_fp32", tmp_path)
    last = [f for f in rank_files(root / "lora") if f.parent.name.endswith("_001")]

    def untie(state):
        state["model"]["output_layer.weight"] = state["model"]["output_layer.weight"] + 1

    for f in last:
        rewrite(f, untie)
    out = tmp_path / "out"
    run_failing(["--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out)], capsys,
                "output_layer.weight differs from embedding.word_embeddings.weight")
    assert_nothing_written(out)


def test_llama_attention_bias_is_refused(tmp_path, capsys):
    root = copy_fixture("tp2_llama_fp32_partial", tmp_path)
    config = json.loads((root / "hf_ref" / "config.json").read_text())
    config["attention_bias"] = True
    (root / "hf_ref" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "attention_bias=true for llama")
    assert_nothing_written(out)
