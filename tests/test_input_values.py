"""Inputs validated where they are read, each refused in one line naming what is wrong (exit 2, no
output): numbers (type, finiteness, range) in adapter_config.json, Megatron args and the command line;
every safetensors file's header (one reader for HF bases, PEFT adapters and verify); every tensor's dtype."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import FIXTURES, copied_args, copy_fixture, merge_args, rank_files, rewrite
from lora_merge.cli import main
from lora_merge.value_checks import shown_value
from test_damaged_inputs import fails
from test_peft_input import NAME, hf_base, make_adapter  # noqa: F401 (hf_base: the fixture)

ROOT = FIXTURES / NAME


def peft_run(adapter, out, base):
    return ["--base", str(base), "--lora", str(adapter), "--hf-ref", str(ROOT / "hf_ref"), "--out", str(out),
            "--no-progress"]


@pytest.fixture
def adapter(hf_base, tmp_path, capsys):
    make_adapter(hf_base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    capsys.readouterr()
    return tmp_path / "adapter"


def set_config(adapter, **change):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


# ----------------------------------------------------------------------------- 3: numbers and fields

NAN = float("nan")
CONFIG_VALUES = {
    "alpha_nan": ({"lora_alpha": NAN}, ["lora_alpha=nan", "finite"]),
    "alpha_inf": ({"lora_alpha": float("inf")}, ["lora_alpha=inf", "finite"]),
    "alpha_huge": ({"lora_alpha": 1e300}, ["lora_alpha=1e+300", "at most"]),
    "alpha_string": ({"lora_alpha": "16"}, ["lora_alpha='16'"]),
    "alpha_zero": ({"lora_alpha": 0}, ["lora_alpha=0", "above 0"]),
    "r_float": ({"r": 2.5}, ["r=2.5", "positive integer"]),
    "r_huge": ({"r": 1 << 40}, ["at most"]),
    "r_string": ({"r": "2"}, ["r='2'"]),
    "alpha_pattern_nan": ({"alpha_pattern": {"q_proj": NAN}}, ["alpha_pattern['q_proj']=nan"]),
    "alpha_pattern_string": ({"alpha_pattern": {"q_proj": "8"}}, ["alpha_pattern['q_proj']='8'"]),
    "rank_pattern_null": ({"rank_pattern": {"q_proj": None}}, ["rank_pattern['q_proj']=None"]),
    "rank_pattern_bad_regex": ({"rank_pattern": {"q_proj(": 4}}, ["rank_pattern key 'q_proj('", "regular expression"]),
    "rank_pattern_list": ({"rank_pattern": [1, 2]}, ["rank_pattern=[1, 2]", "object"]),
    "target_regex_invalid": ({"target_modules": "q_proj("}, ["target_modules", "regular expression"]),
    "target_nested": ({"target_modules": [["q_proj"]]}, ["target_modules=[['q_proj']]"]),
    "exclude_number": ({"exclude_modules": 3}, ["exclude_modules=3"]),
    "layers_string": ({"layers_to_transform": "0"}, ["layers_to_transform='0'"]),
    "layers_negative": ({"layers_to_transform": [-1]}, ["layers_to_transform=[-1]"]),
    "layers_with_regex": ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, ["regex target_modules"]),
    "pattern_without_layers": ({"layers_pattern": "layers"}, ["layers_pattern without layers_to_transform"]),
    "rslora_string": ({"use_rslora": "yes"}, ["use_rslora='yes'"]),
    "deep_nesting": ({"rank_pattern": {"q_proj": [[[[[[[[[[1]]]]]]]]]]}}, ["rank_pattern['q_proj']=[[[[", "expected a positive integer"]),
}


@pytest.mark.parametrize("case", CONFIG_VALUES)
def test_adapter_config_values_are_checked_where_read(case, adapter, hf_base, tmp_path, capsys):
    change, expected = CONFIG_VALUES[case]
    set_config(adapter, **change)
    fails(peft_run(adapter, tmp_path / "out", hf_base), capsys, "adapter_config.json", *expected)
    assert not (tmp_path / "out").exists()


def test_json_nested_too_deep_is_one_line(adapter, hf_base, tmp_path, capsys):
    (adapter / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    fails(peft_run(adapter, tmp_path / "out", hf_base), capsys, "adapter_config.json", "unreadable")


@pytest.mark.parametrize("option,value,expected", [("--lora-alpha", "1e300", "at most"),
                                                   ("--lora-alpha", "nan", "finite"),
                                                   ("--lora-r", str(1 << 40), "at most")])
def test_command_line_lora_settings_are_bounded(option, value, expected, tmp_path, capsys):
    fails(merge_args("tp2_fp32_filtered", tmp_path / "out") + [option, value], capsys, option, expected)


def test_api_lora_alpha_is_bounded(tmp_path):
    from lora_merge import api
    from lora_merge.errors import MergeError
    with pytest.raises(MergeError, match="lora_alpha=1e\\+300"):
        api.merge(lora=FIXTURES / "tp2_fp32_filtered" / "lora", hf_ref=FIXTURES / "tp2_fp32_filtered" / "hf_ref",
                  out=tmp_path / "out", lora_alpha=1e300)


def rewrite_args(root, **change):
    for rank in rank_files(root / "lora"):
        rewrite(rank, lambda state: [setattr(state["args"], k, v) for k, v in change.items()])


@pytest.mark.parametrize("change,expected", [
    ({"hidden_size": "64"}, "args.hidden_size='64'"),
    ({"num_attention_heads": 8.5}, "args.num_attention_heads=8.5"),
    ({"ffn_hidden_size": -3}, "args.ffn_hidden_size=-3"),
    ({"padded_vocab_size": [256]}, "args.padded_vocab_size=[256]"),
    ({"rotary_base": float("nan")}, "args.rotary_base=nan"),
    ({"norm_epsilon": "1e-6"}, "args.norm_epsilon='1e-6'"),
    ({"lora_alpha": float("nan")}, "args.lora_alpha=nan"),
    ({"lora_r": "8"}, "args.lora_r='8'"),
    ({"lora_target_modules": [["linear_qkv"]]}, "args.lora_target_modules=[['linear_qkv']]"),
    ({"noop_layers": [[1]]}, "noop_layers [[1]]"),
])
def test_megatron_args_are_checked_where_read(change, expected, tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    rewrite_args(root, **change)
    fails(copied_args(root, tmp_path / "out") + ["--no-progress"], capsys, expected)
    assert not (tmp_path / "out").exists()


def test_values_in_messages_are_bounded():
    bomb = [[]]
    for _ in range(40):  # 2^40 leaves by reference
        bomb = [bomb, bomb]
    assert len(shown_value(bomb)) <= 80
    assert len(shown_value("x" * 10**7)) <= 80
    assert "bits" in shown_value(10**100000)


# -------------------------------------------------------------------- 4: one safetensors reader

def header_of(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_header(path, header, data, length=None):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def overlapping(header, data):
    """One tensor's offsets pointed at another's bytes of the same size (a header that still adds up in
    sizes, but not in positions): the merge would use the other tensor's values."""
    by_size = {}
    for name, entry in header.items():
        if name != "__metadata__":
            by_size.setdefault(entry["data_offsets"][1] - entry["data_offsets"][0], []).append(name)
    first, second = next(names for names in by_size.values() if len(names) > 1)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    return header, data


def past_end(header, data):
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"] = [o + 64 for o in header[last]["data_offsets"]]
    return header, data


def negative(header, data):
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"] = [-4, header[first]["data_offsets"][1] - 4]
    return header, data


def int8_dtype(header, data):
    first = next(k for k in header if k != "__metadata__")
    count = 1
    for d in header[first]["shape"]:
        count *= d
    header[first]["dtype"] = "I8"
    header[first]["shape"] = [count * 4]  # same bytes, as int8
    return header, data


HEADER_DAMAGE = {
    "overlapping_offsets": (overlapping, "gap or overlap"),
    "offsets_past_the_end": (past_end, "(gap or overlap)"),
    "negative_offset": (negative, "is not {dtype, shape, data_offsets}"),
    "truncated": (lambda h, d: (h, d[:-10]), "truncated"),
    "not_json": (lambda h, d: (b"{not json", d), "not JSON"),
    "not_an_object": (lambda h, d: (b"[1, 2]", d), "not a JSON object"),
    "unknown_dtype": (lambda h, d: ({k: ({**v, "dtype": "Q9"} if k != "__metadata__" else v) for k, v in h.items()},
                                    d), "unknown dtype 'Q9'"),
    "integer_dtype": (int8_dtype, "dtype I8"),
}


def damage(path, how):
    header, data = header_of(path)
    header, data = how(header, data)
    write_header(path, header, data)


@pytest.mark.parametrize("case", HEADER_DAMAGE)
def test_a_damaged_adapter_safetensors_is_one_line(case, adapter, hf_base, tmp_path, capsys):
    how, expected = HEADER_DAMAGE[case]
    damage(adapter / "adapter_model.safetensors", how)
    fails(peft_run(adapter, tmp_path / "out", hf_base), capsys, "adapter_model.safetensors", expected)


@pytest.mark.parametrize("case", HEADER_DAMAGE)
def test_a_damaged_hf_base_shard_is_one_line(case, adapter, hf_base, tmp_path, capsys):
    import shutil
    how, expected = HEADER_DAMAGE[case]
    base = tmp_path / "base"
    shutil.copytree(hf_base, base)
    damage(base / "model.safetensors", how)
    fails(peft_run(adapter, tmp_path / "out", base), capsys, "model.safetensors", expected)


@pytest.mark.parametrize("length", [1 << 60, 1 << 26])
def test_a_huge_header_length_is_never_allocated(length, adapter, hf_base, tmp_path, capsys):
    header, data = header_of(adapter / "adapter_model.safetensors")
    write_header(adapter / "adapter_model.safetensors", header, data, length=length)
    fails(peft_run(adapter, tmp_path / "out", hf_base), capsys, "adapter_model.safetensors",
          "above safetensors' limit" if length > 100_000_000 else "truncated")


def test_verify_reads_rows_through_the_same_reader(merged_fixture, tmp_path):
    """verify reads row ranges with the offsets of the header it checked (no second parser)."""
    from lora_merge.readers.safetensors_dir import SafetensorsDir
    out = merged_fixture("tp2_fp32_filtered")
    found = SafetensorsDir(out)
    tensors = load_file(next(out.glob("*.safetensors")))
    for name in list(tensors)[:10]:
        t = tensors[name]
        if t.dim():
            assert torch.equal(found.rows(name, 1, 3), t[1:3])
            assert torch.equal(found.rows(name, 0, t.shape[0]), t)


# --------------------------------------------------------------------------------- 5: tensor dtypes

def test_an_integer_tensor_in_a_megatron_base_is_refused(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for rank in rank_files(root / "base"):
        rewrite(rank, lambda state: state["model"].update({k: v.to(torch.int8) for k, v in state["model"].items()
                                                           if k.endswith("linear_qkv.weight")}))
    fails(copied_args(root, tmp_path / "out") + ["--no-progress"], capsys, "linear_qkv.weight", "dtype int8",
          "floating point")
    assert not (tmp_path / "out").exists()


def test_an_integer_lora_factor_is_refused(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    for rank in rank_files(root / "lora"):
        rewrite(rank, lambda state: state["model"].update({k: v.to(torch.int32) for k, v in state["model"].items()
                                                           if ".lora_A." in k and v is not None}))
    fails(copied_args(root, tmp_path / "out") + ["--no-progress"], capsys, "lora_A", "dtype int32")


def test_an_integer_factor_in_a_peft_adapter_bin_is_refused(adapter, hf_base, tmp_path, capsys):
    state = load_file(adapter / "adapter_model.safetensors")
    key = next(iter(state))
    state[key] = state[key].to(torch.int8)
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(state, adapter / "adapter_model.bin")
    fails(peft_run(adapter, tmp_path / "out", hf_base), capsys, "adapter_model.bin", "dtype int8")


def test_an_fp8_hf_base_tensor_is_refused(adapter, hf_base, tmp_path, capsys):
    import shutil
    base = tmp_path / "base"
    shutil.copytree(hf_base, base)
    tensors = load_file(base / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    fails(peft_run(adapter, tmp_path / "out", base), capsys, "model.norm.weight", "dtype F8_E4M3")


def test_misaligned_data_is_read_as_a_copy_and_merged_the_same(adapter, hf_base, tmp_path):
    """safetensors allows data not aligned to its dtype (a header of any length): such tensors are copied
    when loaded, and their pages are never handed back as a mapping's (which on a copy would zero memory)."""
    assert main(peft_run(adapter, tmp_path / "aligned", hf_base)) == 0
    header, data = header_of(adapter / "adapter_model.safetensors")
    text = json.dumps(header).encode()
    text += b" " * ((4 - len(text) % 4) % 4 + 1)  # 8 + len(text) is 1 more than a multiple of 4
    (adapter / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    assert main(peft_run(adapter, tmp_path / "misaligned", hf_base)) == 0
    aligned = load_file(tmp_path / "aligned" / "model.safetensors")
    misaligned = load_file(tmp_path / "misaligned" / "model.safetensors")
    assert aligned.keys() == misaligned.keys() and all(torch.equal(aligned[k], misaligned[k]) for k in aligned)
