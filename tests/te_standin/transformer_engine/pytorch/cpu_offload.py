import contextlib

from transformer_engine import __getattr__  # noqa: F401


def get_cpu_offload_context(enabled=False, *args, **kwargs):
    assert not enabled, "CPU offloading is not modelled"
    return contextlib.nullcontext(), None
