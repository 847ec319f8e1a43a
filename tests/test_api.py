"""The Python API, called directly: the same merge as the command, results as objects, one exception type,
progress through a callback, warnings through `warnings`, nothing printed."""

import hashlib
import re
import warnings

import pytest
import torch
from safetensors import safe_open

import lora_merge
from helpers import FIXTURES

NAME = "tp2pp2_fp32_filtered"
ROOT = FIXTURES / NAME


def test_merge_returns_what_it_did_and_matches_the_command(tmp_path, capsys, merged_fixture):
    calls = []
    result = lora_merge.merge(base=ROOT / "base", lora=str(ROOT / "lora"), hf_ref=ROOT / "hf_ref",
                              out=tmp_path / "out", progress=lambda done, total: calls.append((done, total)))
    assert capsys.readouterr() == ("", "")  # a library prints nothing
    assert isinstance(result, lora_merge.MergeResult) and not result.dry_run
    assert result.out == tmp_path / "out" and result.r == 4 and result.alpha == 12 and result.lora_modules == 16
    assert result.skipped and result.tensors > 0 and result.dtype == "float32"
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert shards and set(shards) <= set(result.files)
    for name in result.files:  # every file written, hashed as it was written (the model card aside)
        if name != "README.md":
            assert result.sha256[name] == hashlib.sha256((tmp_path / "out" / name).read_bytes()).hexdigest()
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "r=4, alpha=12" in card
    assert all(f"| {name} | `{digest}` |" in card for name, digest in result.sha256.items())
    assert calls and calls[-1] == (result.bytes, result.bytes) and all(a <= b for (a, _), (b, _) in zip(calls, calls[1:]))
    for shard in shards:  # byte for byte what the command writes
        assert (tmp_path / "out" / shard).read_bytes() == (merged_fixture(NAME) / shard).read_bytes()


def test_dry_run_writes_nothing_and_describes_the_plan(tmp_path):
    result = lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "out",
                              dry_run=True)
    assert result.dry_run and result.plan is not None and result.tensors == len(result.plan.tensors)
    assert not (tmp_path / "out").exists()


def test_bad_input_raises_one_exception_type(tmp_path):
    with pytest.raises(lora_merge.MergeError, match="does not exist"):
        lora_merge.merge(base=tmp_path / "nope", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "out")
    with pytest.raises(lora_merge.MergeError, match="below 1MB"):
        lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o",
                         max_shard_size="100KB")
    with pytest.raises(lora_merge.MergeError, match="dtype 'int8'"):
        lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o",
                         dtype="int8")
    with pytest.raises(lora_merge.MergeError, match="dtype 'fp8'"):  # an adapter is not written in FP8
        lora_merge.export_adapter(lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o", dtype="fp8")
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_warnings_go_through_warnings(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "out",
                         lora_alpha=16, dry_run=True)
    assert any("--lora-alpha 16 overrides args.lora_alpha=12" in str(w.message) for w in caught)


def test_verify_export_and_inspect(tmp_path, merged_fixture):
    report = lora_merge.verify(merged_fixture(NAME), lora=ROOT / "lora", base=ROOT / "base", hf_ref=ROOT / "hf_ref")
    assert report.ok and report.statuses and not report.problems

    exported = lora_merge.export_adapter(lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "adapter")
    assert exported.target_modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert len(list(f.keys())) == exported.tensors
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())

    text = lora_merge.inspect(ROOT / "lora")
    assert "legacy Megatron checkpoint" in text and "TP=2 PP=2" in text


@pytest.mark.parametrize("function,kwargs,expected", [
    ("merge", dict(lora=None, base=None), "merge: give lora (a LoRA to merge) or base"),
    ("merge", dict(hf_ref=None), "hf_ref is missing: expected the path of the HF model dir"),
    ("merge", dict(out=None), "out is missing: expected the path of the output dir"),
    ("merge", dict(lora=7), "lora=7: expected the path of"),
    ("merge", dict(base=""), "base='': expected the path of"),
    ("merge", dict(warn=None), "warn=None: expected a function"),
    ("merge", dict(progress="bar"), "progress='bar': expected a function or None"),
    ("export_adapter", dict(lora=None), "lora is missing"),
    ("export_adapter", dict(out=None), "out is missing: expected the path of the adapter dir"),
    ("verify", dict(out=None), "out is missing: expected the path of the merged HF model dir"),
    ("inspect", dict(checkpoint=None), "checkpoint is missing: expected the path of a Megatron checkpoint, HF model or PEFT adapter dir"),
])
def test_missing_or_mistyped_arguments_raise_merge_error(tmp_path, function, kwargs, expected):
    given = {"merge": dict(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o"),
             "export_adapter": dict(lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o"),
             "verify": dict(out=tmp_path / "o", lora=ROOT / "lora"),
             "inspect": dict(checkpoint=ROOT / "lora")}[function] | kwargs
    call = getattr(lora_merge, function)
    with pytest.raises(lora_merge.MergeError, match=re.escape(expected)):
        call(given.pop("checkpoint")) if function == "inspect" else \
            call(given.pop("out"), **given) if function == "verify" else call(**given)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value,expected", [
    (2500000.5, "max_shard_size 2500000.5"), (float("nan"), "max_shard_size nan"), (True, "max_shard_size True"),
    ([5], "max_shard_size [5]"),
])
def test_max_shard_size_of_the_wrong_type_says_so(tmp_path, value, expected):
    with pytest.raises(lora_merge.MergeError, match=re.escape(expected) + ": expected a whole number of bytes"):
        lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o",
                         max_shard_size=value)
    with pytest.raises(lora_merge.MergeError, match=re.escape("max_shard_size 100000.0 is below 1MB")):
        lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o",
                         max_shard_size=1e5)


def test_a_whole_float_max_shard_size_is_bytes(tmp_path):
    result = lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o",
                              max_shard_size=5e9, dry_run=True)
    assert result.dry_run


@pytest.mark.parametrize("function", ["merge", "export_adapter", "verify"])
@pytest.mark.parametrize("kwargs,expected", [
    (dict(lora_r=True), "lora_r=True: expected a positive int"),
    (dict(lora_r=4.0), "lora_r=4.0: expected a positive int"),
    (dict(lora_r="4"), "lora_r='4': expected a positive int"), (dict(lora_r=0), "lora_r=0: expected a positive int"),
    (dict(lora_alpha=False), "lora_alpha=False: expected a finite number above 0"),
    (dict(lora_alpha="12"), "lora_alpha='12': expected a finite number above 0"),
    (dict(lora_alpha=-1.0), "lora_alpha=-1.0: expected a finite number above 0"),
    (dict(lora_alpha=float("inf")), "lora_alpha=inf: expected a finite number above 0"),
])
def test_lora_r_and_alpha_are_type_checked(tmp_path, function, kwargs, expected):
    given = dict(lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", **kwargs)
    with pytest.raises(lora_merge.MergeError, match=re.escape(expected)):
        if function == "verify":
            lora_merge.verify(tmp_path / "o", **given)
        else:
            getattr(lora_merge, function)(out=tmp_path / "o", **given)
    assert not (tmp_path / "o").exists()


def test_a_failing_merge_restores_torch_threads(tmp_path, monkeypatch):
    from lora_merge import merge_pipeline

    def broken(jobs, reads=None):
        raise RuntimeError("checker failed to start")

    threads = torch.get_num_threads()
    monkeypatch.setattr(merge_pipeline, "RecordChecker", broken)
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="checker failed to start"):
            lora_merge.merge(base=ROOT / "base", lora=ROOT / "lora", hf_ref=ROOT / "hf_ref", out=tmp_path / "o")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "o").exists()
