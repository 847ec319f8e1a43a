import json
import signal
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())


# Options that write the base model in HF form: alpha 0 is refused (a likely mistake), and 1e-30·B·A is far
# below the rounding step of every weight, so W + 1e-30·B·A rounds back to W bit for bit.
BASE_ONLY = ["--lora-alpha", "1e-30"]


def fixture_info(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def merge_args(name: str, out: Path, with_base: bool | None = None) -> list[str]:
    """CLI arguments merging fixture `name`; unfiltered LoRA fixtures run without --base by default."""
    root = FIXTURES / name
    if with_base is None:
        with_base = fixture_info(name)["lora"] == "filtered"
    args = ["--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out), "--no-progress"]
    return (["--base", str(root / "base")] if with_base else []) + args


@pytest.fixture(scope="session")
def merged_fixture(tmp_path_factory):
    """Merge each fixture once per test session and hand out the output dir."""
    from lora_merge.cli import main

    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp("merged") / name
            assert main(merge_args(name, out)) == 0
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """lora_merge.entry.main leaves SIGINT, SIGTERM and SIGHUP ignored once a run has finished, as a process
    about to exit should; tests that call it in-process get this process's handlers back, so that later
    tests (and the processes they start, which inherit an ignored signal) see the usual ones."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def peft_model_loading_every_key(base_dir: Path, adapter: Path):
    """PEFT's model of `adapter` on the HF model in `base_dir`, after checking that PEFT loads every key of
    the adapter (none unexpected) and finds every factor it expects (none missing)."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    probe = PeftModel(base(), PeftConfig.from_pretrained(adapter))
    loaded = probe.load_adapter(adapter, adapter_name="probe")
    assert not loaded.unexpected_keys, loaded.unexpected_keys[:4]
    assert not [k for k in loaded.missing_keys if ".probe." in k or k.endswith(".probe")], loaded.missing_keys[:4]
    return PeftModel.from_pretrained(base(), adapter).eval()
