import os
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


@pytest.fixture(scope="session")
def s3():
    """An S3 server on localhost and a client of it, with a bucket `models`; the AWS environment a user would set.
    One for the session: moto keeps its buckets in the process, so a second server would see the first's."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://{host}:{port}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("models")
    yield fs
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()
