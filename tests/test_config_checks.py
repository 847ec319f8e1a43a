"""The HF reference config.json: malformed files, fields that change what the model computes, defaults as
transformers applies them, and unknown fields are all one-line errors; what transformers writes is accepted."""

import json
import math
import os
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from helpers import assert_nothing_written, copied_args, copy_fixture, rank_files, rewrite
from lora_merge.cli import main
from lora_merge.errors import MergeError
from lora_merge.model.architectures import ARCHITECTURES
from lora_merge.model.hf_config import read_hf_config, tokenizer_vocab_size
from lora_merge.model.megatron_args import check_against_args

SMALL_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
               "vocab_size": 250, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32,
               "tie_word_embeddings": False, "hidden_act": "silu"}
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def write_config(tmp_path: Path, config, name: str = "hf") -> Path:
    if isinstance(config, dict) and config.get("architectures") == ["Qwen2ForCausalLM"] and \
            config.get("model_type") in ARCHITECTURES:  # tests that change model_type mean the matching class
        config = {**config, "architectures": [ARCHITECTURES[config["model_type"]].config.causal_lm]}
    hf = tmp_path / name
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return hf


def read(tmp_path: Path, config=None, **changes):
    config = dict(SMALL_QWEN2 if config is None else config)
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    return read_hf_config(write_config(tmp_path, config))[0]


DROP = object()


def refused(tmp_path: Path, *words, config=None, **changes) -> str:
    with pytest.raises(MergeError) as exc:
        read(tmp_path, config, **changes)
    message = str(exc.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def fails_in_cli(args: list[str], capsys, *words: str) -> str:
    code = main(args + ["--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lora-merge: error: "), (code, err)
    for word in words:
        assert word in lines[0], lines[0]
    print(f"\n{lines[0]}")  # `pytest -s` lists every message
    return lines[0]


def edit_config(root: Path, edit) -> None:
    path = root / "hf_ref" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def set_args(files, **values) -> None:
    for f in files:
        rewrite(f, lambda s: [setattr(s["args"], k, v) for k, v in values.items()])


# ------------------------------------------------------------------------------------------------------------
# Through the CLI: exit 2, one line, nothing written


def _not_utf8(hf: Path):
    (hf / "config.json").write_bytes(b'{"model_type": "qwen2\xff"}')


def _directory(hf: Path):
    (hf / "config.json").unlink()
    (hf / "config.json").mkdir()


def _broken_symlink(hf: Path):
    (hf / "config.json").unlink()
    os.symlink(hf / "gone.json", hf / "config.json")


@pytest.mark.parametrize("damage,words", [
    (_not_utf8, ["not UTF-8", "0xff"]),
    (lambda hf: (hf / "config.json").write_text('{"model_type": '), ["not valid JSON"]),
    (lambda hf: (hf / "config.json").write_text("[1, 2]"), ["top level is a JSON array", "expected an object"]),
    (_directory, ["is a directory"]),
    (_broken_symlink, ["broken symlink", "gone.json"]),
])
def test_malformed_config_file_in_cli(tmp_path, capsys, damage, words):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    damage(root / "hf_ref")
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, "config.json", *words)
    assert_nothing_written(out)


@pytest.mark.parametrize("key,value,words", [
    ("hidden_size", "4096", ["'hidden_size' must be a positive integer", "'4096'"]),
    ("num_key_value_heads", True, ["'num_key_value_heads' must be a positive integer", "True"]),
    ("intermediate_size", 96.0, ["'intermediate_size' must be a positive integer", "96.0"]),
    ("tie_word_embeddings", "yes", ["'tie_word_embeddings' must be true or false"]),
    ("rope_scaling", 5, ["'rope_scaling' must be an object or null", "5"]),
])
def test_wrong_field_type_in_cli(tmp_path, capsys, key, value, words):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    edit_config(root, lambda c: c.__setitem__(key, value))
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, "config.json", *words)
    assert_nothing_written(out)


@pytest.mark.parametrize("change,words", [
    ({"vocab_size": 249}, ["vocab_size=249 is smaller than the tokenizer's 250 token ids", "tokenizer.json"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "expected 'silu'"]),
    ({"use_sliding_window": True}, ["use_sliding_window=true", "sliding-window attention is not supported"]),
    ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, ["layer_types[3]='sliding_attention'"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5", "rotary_percent"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quantization_config (awq)", "quantized"]),
    ({"quantization_config": {"quant_method": "fp8"}}, ["no weight_block_size", "per-tensor or per-channel"]),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     ["fmt='e5m2'", "only e4m3"]),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, ["quantization_config (compressed-tensors)"]),
    ({"quantization_config": {"quant_method": "mxfp4"}}, ["quantization_config (mxfp4)"]),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, ["(bitsandbytes)"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_type 'dynamic'"]),
    ({"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0}}, ["RoPE scaling llama3", "args record none"]),
    ({"rope_scaling": LLAMA3_ROPE}, ["rope_scaling says llama3", "rope_parameters says no scaling"]),
    ({"num_key_value_heads": 2}, ["args.num_query_groups=4", "num_key_value_heads"]),
])
def test_config_that_changes_the_function_in_cli(tmp_path, capsys, change, words):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    edit_config(root, lambda c: c.update(change))
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, *words)
    assert_nothing_written(out)


def test_keys_transformers_does_not_read_are_kept_with_a_note_in_cli(tmp_path, capsys):
    """Qwen2.5 and DeepSeek-R1-Distill-Qwen publish "use_mrope": false, which transformers' Qwen2 never reads."""
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    edit_config(root, lambda c: c.update(use_mrope=False, foo={"bar": 1}, final_logit_softcapping=30.0))
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "does not read" in line]
    assert len(notes) == 1 and notes[0].endswith("final_logit_softcapping, foo, use_mrope"), notes
    written = json.loads((out / "config.json").read_text())
    assert (written["use_mrope"], written["foo"]) == (False, {"bar": 1})  # kept as published


def test_a_key_the_model_reads_that_lora_merge_does_not_know_is_refused_unless_default(tmp_path, monkeypatch):
    """A newer transformers adding a switch to a config class cannot slip past: its default is accepted,
    any other value refused with the key named."""
    import lora_merge.model.hf_config as hf_config

    real = hf_config._class_keys
    monkeypatch.setattr(hf_config, "_class_keys", lambda cls: {**real(cls), "new_switch": False})
    assert read(tmp_path, new_switch=False).hidden == 64
    refused(tmp_path, "new_switch=True", "Qwen2Config reads it", "expected new_switch=False", new_switch=True)


def test_absent_key_takes_the_transformers_default_in_cli(tmp_path, capsys):
    # Qwen3Config's head_dim is 128 when the key is absent, not hidden_size / num_attention_heads.
    root = copy_fixture("qwen3_tp2_fp32", tmp_path)
    edit_config(root, lambda c: c.pop("head_dim"))
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, "args.kv_channels=16", "head_dim implies 128",
                 "absent from config.json, so transformers' qwen3 default")
    assert_nothing_written(out)


def test_args_vocab_larger_than_the_config_in_cli(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    set_args(rank_files(root / "base"), vocab_size=251)
    out = tmp_path / "out"
    fails_in_cli(copied_args(root, out), capsys, "args.vocab_size=251", "vocab_size=250", "base")
    assert_nothing_written(out)


def test_llama3_rope_scaling_merges_only_with_matching_args(tmp_path, capsys):
    root = copy_fixture("tp2_llama_fp32_partial", tmp_path)
    rope = {**LLAMA3_ROPE, "rope_theta": 10000.0}
    edit_config(root, lambda c: c.update(rope_parameters=rope))
    files = rank_files(root / "base") + rank_files(root / "lora")
    out = tmp_path / "out"
    set_args(files, use_rope_scaling=True, rope_scaling_factor=4.0)
    fails_in_cli(copied_args(root, out), capsys, "args.rope_scaling_factor=4", "llama3 factor is 8")
    assert_nothing_written(out)
    set_args(files, rope_scaling_factor=8.0)
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == rope


# ------------------------------------------------------------------------------------------------------------
# read_hf_config directly


@pytest.mark.parametrize("key,value", [
    ("hidden_size", "4096"), ("hidden_size", True), ("hidden_size", 64.0), ("hidden_size", 0), ("hidden_size", None),
    ("num_key_value_heads", "8"), ("head_dim", 0), ("head_dim", None), ("vocab_size", -1),
    ("max_position_embeddings", 1.5), ("rope_theta", "x"), ("rope_theta", True), ("rope_theta", float("nan")), ("rope_theta", 10 ** 400),
    ("rms_norm_eps", -1e-6), ("tie_word_embeddings", "yes"), ("tie_word_embeddings", 1), ("use_sliding_window", 0),
    ("sliding_window", "4096"), ("hidden_act", 1), ("dtype", 5), ("rope_scaling", 5), ("rope_parameters", [1]),
    ("layer_types", "full_attention"), ("architectures", "Qwen2ForCausalLM"), ("partial_rotary_factor", "1"),
])
def test_wrong_types_are_refused(tmp_path, key, value):
    message = refused(tmp_path, repr(key), **{key: value})
    assert "must be" in message or "transformers" in message and "refuses" in message


def test_an_absent_key_is_transformers_default_and_marked_so(tmp_path):
    shape = read(tmp_path, intermediate_size=DROP)
    assert shape.ffn == transformers.Qwen2Config().intermediate_size and "intermediate_size" in shape.defaulted
    with pytest.raises(MergeError, match="absent from config.json, so transformers' qwen2 default"):
        check_against_args(shape, megatron_args(replace(shape, ffn=96)), "ckpt")


@pytest.mark.parametrize("content,words", [
    (b"\xef\xbb\xbf{}", ["not valid JSON", "BOM"]),
    (b"\xff\xfe{}", ["not UTF-8"]),
    (b"[" * 100000, ["not valid JSON"]),
    (b'"qwen2"', ["top level is a JSON string"]),
    (b"null", ["top level is a JSON null"]),
])
def test_malformed_files(tmp_path, content, words):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(content)
    with pytest.raises(MergeError) as exc:
        read_hf_config(hf)
    for word in words:
        assert word in str(exc.value)


def test_missing_config(tmp_path):
    with pytest.raises(MergeError, match="no config.json"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("model_type", [None, "falcon_h1", 7])
def test_unsupported_model_type(tmp_path, model_type):
    # every model type a module of the architectures package registers, by name
    supported = ("deepseek_v2, deepseek_v3, deepseek_v32, ernie4_5_moe, gemma2, gemma3_text, glm4_moe, glm_moe_dsa, "
                 "gpt_oss, llama, llama4_text, minimax_m2, mistral, mixtral, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next, seed_oss")
    refused(tmp_path, f"is not supported (expected one of {supported}, or a config whose architectures names one of",
            model_type=model_type, architectures=["FalconH1ForCausalLM"])
    refused(tmp_path, f"no model_type (expected one of {supported}", model_type=DROP)


@pytest.mark.parametrize("config,key", [
    (SMALL_QWEN2, "foo"),
    (SMALL_QWEN2, "use_mrope"),
    ({**SMALL_QWEN2, "model_type": "llama"}, "sliding_window"),  # neither LlamaConfig nor Llama's code reads it
    ({**SMALL_QWEN2, "model_type": "mistral", "sliding_window": None}, "use_sliding_window"),
    (SMALL_QWEN2, "num_experts"),
    (SMALL_QWEN2, "attn_logit_softcapping"),
])
def test_keys_transformers_does_not_read_are_a_note(tmp_path, config, key):
    notes = []
    read_hf_config(write_config(tmp_path, {**config, key: 1}), notes)
    assert len(notes) == 1 and "does not read (kept as published)" in notes[0] and notes[0].endswith(key), notes


def test_the_rope_transformers_applies_must_be_the_one_stated(tmp_path, monkeypatch):
    """transformers 5 can move a top-level original_max_position_embeddings into the scaled RoPE it
    applies; where what it applies differs from what config.json states, the merge stops."""
    import lora_merge.model.rope as rope

    real = rope.transformers_rope
    monkeypatch.setattr(rope, "transformers_rope", lambda config, path: {
        **real(config, path), "original_max_position_embeddings": 16})
    refused(tmp_path, "transformers applies RoPE scaling llama3", "original_max_position_embeddings=16",
            "config.json states llama3", rope_scaling=LLAMA3_ROPE)


def test_multimodal_config_is_refused(tmp_path):
    refused(tmp_path, "multimodal", text_config={}, num_hidden_layers=DROP)


@pytest.mark.parametrize("changes,words", [
    ({"hidden_act": "gelu_pytorch_tanh"}, ["hidden_act='gelu_pytorch_tanh'", "swiglu"]),
    ({"use_sliding_window": True}, ["use_sliding_window=true", "Megatron trained full attention"]),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
     ["layer_types[1]"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
     ["partial_rotary_factor=0.25"]),
    ({"quantization_config": {"quant_method": "gptq"}}, ["quantization_config (gptq)"]),
    ({"pruned_heads": {"0": [1]}}, ["pruned_heads"]),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, ["ForCausalLM"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
])
def test_fields_that_change_the_function_are_refused(tmp_path, changes, words):
    refused(tmp_path, "config.json", *words, **changes)


def test_harmless_values_of_function_fields_are_accepted(tmp_path):
    shape = read(tmp_path, sliding_window=131072, use_sliding_window=False, max_window_layers=2,
                 partial_rotary_factor=1.0, final_logit_softcapping=None, attn_logit_softcapping=None,
                 pruned_heads={}, architectures=None, layer_types=["full_attention"] * 4,
                 pad_token_id=None, dtype="bfloat16",
                 # transformers 4.x itself fails on "quantization_config": null (5.x accepts it)
                 **({"quantization_config": None} if int(transformers.__version__.split(".")[0]) >= 5 else {}))
    assert shape.rope_scaling is None


def test_mistral_sliding_window_default_is_refused(tmp_path):
    mistral = {**SMALL_QWEN2, "model_type": "mistral"}
    refused(tmp_path, "sliding_window=4096 (transformers' mistral default when the key is absent)",
            "sliding-window attention is not supported", config=mistral)
    refused(tmp_path, "sliding_window=1024:", config=mistral, sliding_window=1024)
    assert read(tmp_path, config=mistral, sliding_window=None).groups == 4


# --- defaults as transformers applies them


def test_absent_keys_take_transformers_defaults(tmp_path):
    minimal = {k: SMALL_QWEN2[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "vocab_size")}
    classes = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}
    for model_type, cls in classes.items():
        config = {**minimal, "model_type": model_type, "num_attention_heads": 4}
        if model_type == "mistral":
            config["sliding_window"] = None
        if model_type != "llama":
            config["num_key_value_heads"] = 4  # the class default (32 or 8) is not a divisor of 4 heads
        shape = read(tmp_path, config=config)
        hf = cls(**{k: v for k, v in config.items() if k != "model_type"})
        assert shape.groups == hf.num_key_value_heads
        # a class without head_dim, or (transformers 4.x) with head_dim None, uses hidden / heads
        assert shape.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads), model_type
        assert shape.rope_theta == _rope_theta(hf)
        assert shape.norm_eps == hf.rms_norm_eps
        assert shape.tied == hf.tie_word_embeddings
    # and without num_key_value_heads, what each class uses
    assert read(tmp_path, config={**minimal, "model_type": "mistral", "sliding_window": None,
                                  "num_attention_heads": 16}).groups == 8
    assert read(tmp_path, config={**minimal, "model_type": "llama", "num_attention_heads": 16}).groups == 16
    refused(tmp_path, "num_key_value_heads=32", config={**minimal, "model_type": "qwen2", "num_attention_heads": 8})


def _rope_theta(hf_config) -> float:
    # transformers 5.x keeps rope_theta only inside rope_parameters; 4.x as an attribute
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", None)))


# --- what transformers writes, and real configs


@pytest.mark.parametrize("cls", ["Qwen2Config", "Qwen3Config", "LlamaConfig", "MistralConfig"])
def test_configs_transformers_writes_are_accepted(tmp_path, cls):
    kwargs = {"sliding_window": None} if cls == "MistralConfig" else {}
    hf = getattr(transformers, cls)(**kwargs)
    shape = read_hf_config(write_config(tmp_path, hf.to_dict(), "full"))[0]
    assert (shape.hidden, shape.heads, shape.groups, shape.vocab) == (hf.hidden_size, hf.num_attention_heads,
                                                                      hf.num_key_value_heads, hf.vocab_size)
    hf.save_pretrained(tmp_path / "saved")  # 4.x writes only what differs from the class defaults
    assert replace(read_hf_config(tmp_path / "saved")[0], defaulted=frozenset()) == replace(shape, defaulted=frozenset())


QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 128256}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
R1_DISTILL_QWEN_32B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 27648, "max_position_embeddings": 131072, "max_window_layers": 64, "model_type": "qwen2",
    "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
MISTRAL_7B_INSTRUCT_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 32768}


def megatron_args(shape, **extra) -> Namespace:
    """Args as a run that trained `shape` records them."""
    args = {"num_layers": shape.num_layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
            "group_query_attention": True, "num_query_groups": shape.groups, "kv_channels": shape.head_dim,
            "ffn_hidden_size": shape.ffn, "padded_vocab_size": shape.vocab, "swiglu": True,
            "untie_embeddings_and_output_weights": not shape.tied, "add_qkv_bias": shape.qkv_bias,
            "rotary_base": shape.rope_theta, "norm_epsilon": shape.norm_eps, "position_embedding_type": "rope",
            "normalization": "RMSNorm", "rotary_percent": 1.0, "use_rope_scaling": False, "rope_scaling_type": None}
    return Namespace(**(args | extra))


@pytest.mark.parametrize("config,expected", [
    (QWEN25_7B_INSTRUCT, (28, 3584, 28, 4, 128, 152064, None)),
    (LLAMA31_8B, (32, 4096, 32, 8, 128, 128256, "llama3")),
    (QWEN3_8B, (36, 4096, 32, 8, 128, 151936, None)),
    (R1_DISTILL_QWEN_32B, (64, 5120, 40, 8, 128, 152064, None)),
    (MISTRAL_7B_INSTRUCT_V03, (32, 4096, 32, 8, 128, 32768, None)),
])
def test_real_configs_parse(tmp_path, config, expected):
    shape = read(tmp_path, config=config)
    scaling = shape.rope_scaling.type if shape.rope_scaling else None
    assert (shape.num_layers, shape.hidden, shape.heads, shape.groups, shape.head_dim, shape.vocab, scaling) == expected
    extra = {"use_rope_scaling": True, "rope_scaling_factor": 8.0} if scaling else {}
    check_against_args(shape, megatron_args(shape, **extra), "ckpt")


# --- RoPE scaling as the config states it


def test_rope_forms_of_transformers_4_and_5_are_the_same(tmp_path):
    v4 = read(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    v5 = read(tmp_path, rope_theta=DROP, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    legacy = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"} | {"type": "llama3"}
    both = read(tmp_path, rope_theta=500000.0, rope_scaling=legacy,
                rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    assert v4.rope_scaling == v5.rope_scaling == both.rope_scaling and v4.rope_theta == v5.rope_theta == 500000.0
    assert read(tmp_path, rope_scaling=None, rope_parameters={"rope_type": "default"}).rope_scaling is None
    assert read(tmp_path, rope_theta=DROP, rope_parameters={"rope_theta": 1e6}).rope_theta == 1e6


@pytest.mark.parametrize("changes,words", [
    ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     ["rope_theta=1000000.0 but rope_parameters.rope_theta=10000.0", "expected one rope_theta"]),
    ({"rope_scaling": LLAMA3_ROPE, "rope_parameters": {"rope_type": "default"}},
     ["rope_scaling says llama3", "rope_parameters says no scaling"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "type": "yarn"}}, ["rope_type 'llama3' and type 'yarn'"]),
    ({"rope_scaling": {"factor": 8.0}}, ["no rope_type"]),
    ({"rope_scaling": {"rope_type": 3}}, ["rope_type must be a string"]),
    ({"rope_scaling": {"rope_type": "linear"}}, ["rope_scaling.factor must be a positive number", "missing"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": "8"}}, ["rope_scaling.factor must be a positive number", "'8'"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": None}}, ["low_freq_factor must be a positive number"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_type 'dynamic'"]),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [2.0]}},
     ["rope_type 'longrope'"]),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, ["rope_type 'su'"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
      "max_position_embeddings": 32768}, ["yarn factor=4", "32768/32768", "expected max_position_embeddings = 131072"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, ["truncate=False"]),
])
def test_rope_descriptions_that_are_refused(tmp_path, changes, words):
    refused(tmp_path, *words, **changes)


def test_yarn_defaults_as_transformers_applies_them(tmp_path):
    qwen_yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    scaling = read(tmp_path, rope_scaling=qwen_yarn, max_position_embeddings=131072).rope_scaling
    assert scaling.type == "yarn" and scaling.get("beta_fast") == 32 and scaling.get("beta_slow") == 1
    assert scaling.get("attention_factor") == pytest.approx(0.1 * math.log(4.0) + 1)
    without_original = read(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0}).rope_scaling
    assert without_original.get("original_max_position_embeddings") == 32  # max_position_embeddings
    deepseek = read(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    assert deepseek.rope_scaling.get("attention_factor") == 1.0


# --- RoPE scaling against the args


def shape_with(tmp_path, **changes):
    return read(tmp_path, **changes)


YARN_HF = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
           "max_position_embeddings": 131072}
YARN_ARGS = {"rope_scaling_type": "yarn", "rope_scaling_factor": 4.0,
             "rope_scaling_original_max_position_embeddings": 32768, "rope_scaling_beta_fast": 32,
             "rope_scaling_beta_slow": 1, "rope_scaling_mscale": 1.0, "rope_scaling_mscale_all_dim": 0.0}
MINDSPEED_LLAMA3 = {"rope_scaling_type": "llama3", "rope_scaling_factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}


@pytest.mark.parametrize("hf,args", [
    ({}, {}),
    ({"rope_scaling": LLAMA3_ROPE}, {"use_rope_scaling": True, "rope_scaling_factor": 8.0}),
    ({"rope_scaling": LLAMA3_ROPE}, {"use_rope_scaling": True}),  # Megatron's default factor is 8
    ({"rope_scaling": LLAMA3_ROPE}, MINDSPEED_LLAMA3),
    (YARN_HF, YARN_ARGS),
    (YARN_HF, {**YARN_ARGS, "rope_scaling_beta_fast": None, "beta_fast": 32, "rope_scaling_factor": 8.0,
               "yarn_scaling_factor": 4.0}),  # older and newer MindSpeed names
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {"rotary_seq_len_interpolation_factor": 4}),
    ({}, {"rotary_seq_len_interpolation_factor": 1}),
])
def test_rope_scaling_that_matches_the_args(tmp_path, hf, args):
    shape = shape_with(tmp_path, **hf)
    check_against_args(shape, megatron_args(shape, **args), "ckpt")


@pytest.mark.parametrize("hf,args,words", [
    ({"rope_scaling": LLAMA3_ROPE}, {"use_rope_scaling": True, "rope_scaling_factor": 4.0},
     ["args.rope_scaling_factor=4", "llama3 factor is 8"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": 2.0}}, {"use_rope_scaling": True},
     ["use_rope_scaling=True fixes low_freq_factor=1", "is 2"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}}, {"use_rope_scaling": True},
     ["original_max_position_embeddings=8192", "is 4096"]),
    ({"rope_scaling": LLAMA3_ROPE}, {}, ["HF config has RoPE scaling llama3", "args record none"]),
    ({"rope_scaling": LLAMA3_ROPE}, {"use_rope_scaling": DROP, "rope_scaling_type": DROP},
     ["cannot confirm", "use_rope_scaling or rope_scaling_type"]),
    ({}, {"use_rope_scaling": True}, ["args.use_rope_scaling=True", "HF config has no RoPE scaling"]),
    ({}, {"rope_scaling_type": "llama3"}, ["args.rope_scaling_type='llama3'", "no RoPE scaling"]),
    ({"rope_scaling": LLAMA3_ROPE}, {**MINDSPEED_LLAMA3, "high_freq_factor": 2.0},
     ["args.high_freq_factor=2.0", "high_freq_factor is 4"]),
    ({"rope_scaling": LLAMA3_ROPE}, YARN_ARGS, ["rope_scaling_type='yarn'", "RoPE scaling is llama3"]),
    (YARN_HF, {**YARN_ARGS, "rope_scaling_factor": 2.0}, ["args.rope_scaling_factor=2.0", "yarn factor is 4"]),
    (YARN_HF, {**YARN_ARGS, "rope_scaling_mscale_all_dim": 1.0}, ["attention_factor=1", "attention_factor is 1.13"]),
    (YARN_HF, {**YARN_ARGS, "rope_scaling_beta_fast": 16}, ["rope_scaling_beta_fast=16", "beta_fast is 32"]),
    (YARN_HF, {**YARN_ARGS, "beta_fast": 16}, ["rope_scaling_beta_fast=32 and args.beta_fast=16 disagree"]),
    (YARN_HF, {**YARN_ARGS, "rope_scaling_original_max_position_embeddings": 4096},
     ["original_max_position_embeddings=4096", "is 32768"]),
    ({}, {"rope_scaling_type": "longrope"}, ["rope_scaling_type='longrope' is not supported"]),
    ({"rope_scaling": LLAMA3_ROPE}, {"use_rope_scaling": True, "rope_scaling_type": "llama3"},
     ["args.use_rope_scaling=True and args.rope_scaling_type='llama3'", "on top of each other"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {"rotary_seq_len_interpolation_factor": 2},
     ["rotary_seq_len_interpolation_factor=2", "linear factor is 4"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}, ["cannot confirm",
                                                                     "rotary_seq_len_interpolation_factor"]),
    ({}, {"rotary_seq_len_interpolation_factor": 4}, ["linear RoPE scaling", "no RoPE scaling"]),
    ({}, {"dynamic_factor": 2.0}, ["args.dynamic_factor=2.0"]),
])
def test_rope_scaling_that_differs_from_the_args(tmp_path, hf, args, words):
    shape = shape_with(tmp_path, **hf)
    namespace = megatron_args(shape, **{k: v for k, v in args.items() if v is not DROP})
    for key in [k for k, v in args.items() if v is DROP]:
        delattr(namespace, key)
    with pytest.raises(MergeError) as exc:
        check_against_args(shape, namespace, "ckpt/base")
    message = str(exc.value)
    assert message.startswith("ckpt/base: ") and "\n" not in message
    for word in words:
        assert word in message, message


def test_mindspeed_yarn_needs_head_dim_of_hidden_over_heads(tmp_path):
    shape = shape_with(tmp_path, config={**SMALL_QWEN2, "model_type": "qwen3", "head_dim": 16}, **YARN_HF)
    with pytest.raises(MergeError, match="MindSpeed's YaRN scales the latter"):
        check_against_args(shape, megatron_args(shape, **YARN_ARGS), "ckpt")


# --- other args that change the function


@pytest.mark.parametrize("args,words", [
    ({"vocab_size": 251}, ["args.vocab_size=251 is larger than the HF config's vocab_size=250"]),
    ({"padded_vocab_size": 249}, ["args.padded_vocab_size=249"]),
    ({"sliding_window": 4096}, ["args.sliding_window=4096", "sliding-window"]),
    ({"window_size": (1024, 0)}, ["args.window_size=(1024, 0)"]),
    ({"rotary_base": 1000000}, ["args.rotary_base=1000000", "rope_theta is 10000.0"]),
])
def test_other_args_that_differ(tmp_path, args, words):
    shape = read(tmp_path)
    with pytest.raises(MergeError) as exc:
        check_against_args(shape, megatron_args(shape, **args), "ckpt")
    for word in words:
        assert word in str(exc.value)
    check_against_args(shape, megatron_args(shape, vocab_size=250, sliding_window=None), "ckpt")


def test_absent_rope_theta_is_the_default_against_args(tmp_path):
    shape = read(tmp_path, rope_theta=DROP)
    with pytest.raises(MergeError, match="args.rotary_base=1000000.0 but the HF config's rope_theta is 10000.0 "
                                         r"\(absent from config.json, so transformers' qwen2 default\)"):
        check_against_args(shape, megatron_args(shape, rotary_base=1000000.0), "ckpt")


# --- tokenizer.json


def write_tokenizer(hf: Path, content) -> Path:
    path = hf / "tokenizer.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_tokenizer_size(tmp_path):
    bpe = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 7}}, "added_tokens": [{"id": 9, "content": "<x>"}]}
    assert tokenizer_vocab_size(write_tokenizer(tmp_path, bpe)) == 10
    unigram = {"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0], ["c", -3.0]]}, "added_tokens": []}
    assert tokenizer_vocab_size(write_tokenizer(tmp_path, unigram)) == 3
    assert tokenizer_vocab_size(tmp_path / "absent.json") is None


@pytest.mark.parametrize("content,words", [
    ("{", ["not valid JSON"]),
    ([], ["top level is a JSON array"]),
    ({"model": {"type": "BPE"}}, ["model.vocab is null"]),
    ({"model": {"vocab": {"a": "0"}}}, ["token id '0'"]),
    ({"model": {"vocab": {"a": True}}}, ["token id True"]),
    ({"model": {"vocab": {"a": -1}}}, ["token id -1"]),
    ({"model": {"vocab": {"a": 0}}, "added_tokens": {"id": 1}}, ["added_tokens is not a list"]),
    ({"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": "x"}]}, ["token id None"]),
])
def test_malformed_tokenizer(tmp_path, content, words):
    hf = write_config(tmp_path, SMALL_QWEN2)
    write_tokenizer(hf, content)
    with pytest.raises(MergeError) as exc:
        read_hf_config(hf)
    assert str(exc.value).startswith(f"{hf / 'tokenizer.json'}: ")
    for word in words:
        assert word in str(exc.value)


def test_tokenizer_broken_symlink_and_directory(tmp_path):
    hf = write_config(tmp_path, SMALL_QWEN2)
    os.symlink(hf / "nowhere.json", hf / "tokenizer.json")
    with pytest.raises(MergeError, match="tokenizer.json: broken symlink"):
        read_hf_config(hf)
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").mkdir()
    with pytest.raises(MergeError, match="tokenizer.json: is a directory"):
        read_hf_config(hf)


def test_vocab_size_against_the_tokenizer(tmp_path):
    hf = write_config(tmp_path, SMALL_QWEN2)
    write_tokenizer(hf, {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 250}]})
    with pytest.raises(MergeError, match="vocab_size=250 is smaller than the tokenizer's 251 token ids"):
        read_hf_config(hf)
    write_tokenizer(hf, {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 249}]})
    assert read_hf_config(hf)[0].tokenizer_vocab == 250


@pytest.mark.parametrize("changes,words", [
    ({"architectures": ["LlamaForCausalLM"]}, ("'LlamaForCausalLM'", "'Qwen2ForCausalLM'")),
    ({"use_cache": "yes"}, ("'use_cache' must be true or false",)),
    ({"layer_types": ["full_attention"] * 2}, ("layer_types has 2 entries", "num_hidden_layers=4")),
    ({"bos_token_id": 300}, ("bos_token_id=300", "vocab_size")),
])
def test_configs_transformers_would_refuse_or_misread_are_refused(tmp_path, changes, words):
    refused(tmp_path, *words, config={**SMALL_QWEN2, **changes})


# --- what the installed transformers reads is what is checked


def test_a_config_transformers_refuses_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import transformers

    def refuses(cls, *args, **kwargs):
        raise TypeError("rope_scaling must be a dict\nsecond line")

    monkeypatch.setattr(transformers.Qwen2Config, "from_dict", classmethod(refuses))
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    fails_in_cli(copied_args(root, tmp_path / "out"), capsys, "transformers", "refuses it: rope_scaling must be a dict")


def test_a_model_type_the_installed_transformers_does_not_know_is_refused(tmp_path, monkeypatch):
    import transformers

    monkeypatch.delitem(transformers.CONFIG_MAPPING._extra_content, "qwen2", raising=False)
    monkeypatch.setattr(type(transformers.CONFIG_MAPPING), "__getitem__",
                        lambda self, key: (_ for _ in ()).throw(KeyError(key)))
    refused(tmp_path, "does not know model type 'qwen2'", "could not load the merged model")


def test_the_shape_is_transformers_reading_of_the_file(tmp_path):
    """Values come from transformers' config object: a 4.x file's rope_theta and torch_dtype, and what
    the class fills in, are what the shape holds."""
    shape = read(tmp_path, torch_dtype="bfloat16", rope_theta=12345.0, num_key_value_heads=DROP, num_attention_heads=32)
    hf = transformers.Qwen2Config.from_dict({**{k: v for k, v in SMALL_QWEN2.items() if k != "num_key_value_heads"},
                                             "num_attention_heads": 32})
    assert shape.groups == hf.num_key_value_heads and shape.dtype is transformers.Qwen2Config.from_dict(
        {**SMALL_QWEN2, "torch_dtype": "bfloat16"}).dtype
    assert shape.rope_theta == 12345.0



def glm_config() -> dict:
    return json.loads((Path(__file__).parent / "fixtures_moe/glm4moe_tp2etp1_ep2/hf_ref/config.json").read_text())


@pytest.mark.parametrize("rope,words", [
    # 16-dim heads: 1/16 rotates one dim and 0.01 none (RoPE turns pairs); above 1 and with scaling: refused
    ({"partial_rotary_factor": 0.0625}, ["rotates 1 dims", "even number"]),
    ({"partial_rotary_factor": 0.01}, ["rotates 0 dims"]),
    ({"partial_rotary_factor": 1.5}, ["partial_rotary_factor=1.5"]),
    ({"partial_rotary_factor": 0.5, "rope_type": "linear", "factor": 2.0}, ["with RoPE scaling", "linear"]),
])
def test_partial_rope_is_read_where_megatron_computes_it(tmp_path, rope, words):
    config = glm_config()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    refused(tmp_path, *words, config=config)


def test_partial_rope_fraction_is_read_from_either_place_and_must_agree(tmp_path):
    config = glm_config()
    assert read(tmp_path, config).rotary_percent == 0.5
    config["partial_rotary_factor"] = 0.5  # as the releases state it, beside transformers 5's rope_parameters
    assert read(tmp_path, config).rotary_percent == 0.5
    config["partial_rotary_factor"] = 0.25
    refused(tmp_path, "partial_rotary_factor", config=config)
