"""An exception means nothing was published: every warning of a run is given before its output is moved into
place, so a `warn=` that raises — or `warnings.simplefilter("error")` with the default `warn` — stops the
run with nothing at `out`. (The "no base_model" warning used to come after publishing: the call raised with
the output complete on disk.)

Each scenario below reaches one or more warning sites; the run is repeated, raising at each warning in turn."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

import lora_merge
from helpers import with_mtp_layer

TESTS = Path(__file__).parent
DENSE = TESTS / "fixtures/tp2pp2_fp32_filtered"
MOE = TESTS / "fixtures_moe/qwen2moe_tp2ep2"
MLA = TESTS / "fixtures_deepseek/deepseek_v3_ep2"


class Stop(Exception):
    pass


def noisy_reference(tmp_path: Path, fixture: Path) -> Path:
    """The fixture's reference with a config key transformers does not read and a subdirectory (each a note)."""
    ref = tmp_path / "noisy_ref"
    if not ref.exists():
        shutil.copytree(fixture / "hf_ref", ref)
        config = json.loads((ref / "config.json").read_text())
        (ref / "config.json").write_text(json.dumps({**config, "a_key_nothing_reads": 1}))
        (ref / "extra_dir").mkdir()
        (ref / "extra_dir/notes.txt").write_text("x")
    return ref


def hf_base_with_mtp(tmp_path: Path) -> tuple[Path, Path]:
    """An HF DeepSeek-V3 base with a multi-token-prediction layer, and its reference (num_nextn_predict_layers 1)."""
    hf_base, ref = tmp_path / "mtp_base", tmp_path / "mtp_ref"
    if not hf_base.exists():
        lora_merge.merge(base=MLA / "base", hf_ref=MLA / "hf_ref", out=hf_base, warn=lambda m: None)
        with_mtp_layer(hf_base, 3)
        shutil.copytree(MLA / "hf_ref", ref)
        config = json.loads((ref / "config.json").read_text())
        (ref / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return hf_base, ref


# name -> (a run writing `out` with `warn`, a phrase from each warning site it must reach)
SCENARIOS = {
    "merge": (lambda tmp, out, warn: lora_merge.merge(
        base=DENSE / "base", lora=DENSE / "lora", hf_ref=noisy_reference(tmp, DENSE), out=out, lora_alpha=16.0,
        warn=warn),
        ["does not read", "not copied to the output", "overrides args.lora_alpha", "names no Hub model"]),
    "merge with report and verify": (lambda tmp, out, warn: lora_merge.merge(
        base=DENSE / "base", lora=DENSE / "lora", hf_ref=DENSE / "hf_ref", out=out, report=tmp / "report.json",
        verify=True, warn=warn),
        ["names no Hub model"]),
    "merge onto an HF base with MTP layers": (lambda tmp, out, warn: lora_merge.merge(
        base=hf_base_with_mtp(tmp)[0], lora=MLA / "lora", hf_ref=hf_base_with_mtp(tmp)[1], out=out, warn=warn),
        ["multi-token-prediction", "names no Hub model"]),
    "export_adapter": (lambda tmp, out, warn: lora_merge.export_adapter(
        lora=MOE / "lora", hf_ref=noisy_reference(tmp, MOE), out=out, lora_alpha=16.0, warn=warn),
        ["does not read", "overrides args.lora_alpha", "PEFT (0.20 and later)", "names no Hub model"]),
    "to_megatron": (lambda tmp, out, warn: lora_merge.to_megatron(
        base=DENSE / "base", lora=DENSE / "lora", hf_ref=noisy_reference(tmp, DENSE), out=out, lora_alpha=16.0,
        warn=warn),
        ["does not read", "overrides args.lora_alpha"]),
}


def nothing_published(tmp_path: Path, out: Path, before: set[str]) -> None:
    assert not out.exists(), f"{out.name} was published, then the call raised"
    assert set(p.name for p in tmp_path.iterdir()) == before, "a staging dir or report was left behind"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_warning_that_raises_leaves_nothing_published(tmp_path, name):
    run, phrases = SCENARIOS[name]
    seen: list[str] = []
    run(tmp_path, tmp_path / "complete", seen.append)
    for phrase in phrases:
        assert any(phrase in message for message in seen), (phrase, seen)
    shutil.rmtree(tmp_path / "complete")
    (tmp_path / "report.json").unlink(missing_ok=True)
    before = set(p.name for p in tmp_path.iterdir())
    for at in range(len(seen)):
        count = 0

        def warn(message):
            nonlocal count
            count += 1
            if count > at:
                raise Stop(message)

        with pytest.raises(Stop):
            run(tmp_path, tmp_path / "out", warn)
        nothing_published(tmp_path, tmp_path / "out", before)


@pytest.mark.parametrize("name", ["merge", "export_adapter"])
def test_warnings_as_errors_with_the_default_warn_leave_nothing_published(tmp_path, name):
    """The same through Python's warnings machinery: `warnings.simplefilter("error")` turns the first warning
    into an exception, before anything is published."""
    run, _ = SCENARIOS[name]
    noisy_reference(tmp_path, DENSE if name == "merge" else MOE)
    before = set(p.name for p in tmp_path.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning):
            run(tmp_path, tmp_path / "out", lora_merge.api._warn_default)
    nothing_published(tmp_path, tmp_path / "out", before)
