import signal
from pathlib import Path

import pytest

from helpers import BASE_ONLY, fixture_root, merge_args


@pytest.fixture(scope="session")
def merged_fixture(tmp_path_factory):
    """Merge a fixture (its name under tests/fixtures*, or its folder), with extra CLI options if given, once
    per test session, and hand out the output dir. The outputs are shared: copy one before changing it."""
    from lora_merge.cli import main

    cache = {}

    def get(fixture: str | Path, *options: str) -> Path:
        key = (fixture_root(fixture), options)
        if key not in cache:
            out = tmp_path_factory.mktemp("merged") / key[0].name
            assert main(merge_args(key[0], out) + list(options)) == 0
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def base_model(merged_fixture):
    """A fixture's base model in HF form (the LoRA scaled to nothing: BASE_ONLY), merged once per session."""
    return lambda fixture, *options: merged_fixture(fixture, *BASE_ONLY, *options)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """lora_merge.entry.main leaves SIGINT, SIGTERM and SIGHUP ignored once a run has finished, as a process
    about to exit should; tests that call it in-process get this process's handlers back, so that later
    tests (and the processes they start, which inherit an ignored signal) see the usual ones."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
