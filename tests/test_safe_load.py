"""Loading pickles from strangers: data classes become inert stand-ins, code is never run."""


import argparse

import pytest
import torch

from lora_merge.errors import MergeError
from helpers import FIXTURES
from lora_merge.files.safe_load import StandIn, load_pt


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": _Evil(marker)}, path)
    with pytest.raises(MergeError, match="(posix|os)\\.system"):
        load_pt(path)
    assert not marker.exists()


def test_eval_global_is_refused(tmp_path):
    class Sneaky:
        def __reduce__(self):
            return (eval, ("1+1",))

    path = tmp_path / "x.pt"
    torch.save({"args": Sneaky()}, path)
    with pytest.raises(MergeError, match="builtins.eval"):
        load_pt(path)


def test_real_megatron_checkpoint_loads_with_stand_ins():
    # A rank file written by the real megatron-core: its args carry Megatron enums and its rng_state numpy
    # arrays. Neither Megatron nor any numpy code is needed to read it.
    path = next(FIXTURES.glob("tp2_fp32_filtered/lora/iter_0000010/mp_rank_00/model_optim_rng.pt"))
    theirs = torch.serialization.get_safe_globals()  # megatron, once imported in this process, adds its enums
    torch.serialization.clear_safe_globals()
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    finally:
        torch.serialization.add_safe_globals(theirs)
    assert "megatron.core.enums.ModelType" in unsafe
    state = load_pt(path)
    assert state["args"].tensor_model_parallel_size == 2
    assert isinstance(state["args"].model_type, StandIn)
    assert type(state["args"].model_type).__module__ == "megatron.core.enums"
    assert any(isinstance(v, torch.Tensor) for v in state["model"].values())


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"model": {"w": torch.ones(100)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MergeError, match="t.pt"):
        load_pt(path)


def test_not_a_pickle(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"hello world" * 10)
    with pytest.raises(MergeError, match="junk.pt"):
        load_pt(path)


def test_function_references_in_args_become_inert(tmp_path):
    # Some training scripts leave callables in args (an activation, a partial init function). They are
    # data to us: stand-ins, never called.
    import functools

    args = argparse.Namespace(activation_func=torch.nn.functional.silu,
                              init_method=functools.partial(torch.nn.init.normal_, std=0.02))
    path = tmp_path / "a.pt"
    torch.save({"args": args, "model": {"w": torch.ones(2)}}, path)
    state = load_pt(path)
    # a bare function reference unpickles as the stand-in class itself, a partial as a stand-in instance
    assert issubclass(state["args"].activation_func, StandIn)
    assert state["args"].activation_func.__qualname__ == "silu"
    assert isinstance(state["args"].init_method, StandIn)


def test_real_classes_a_caller_marked_safe_do_not_mix_with_the_stand_ins():
    """A training script calling the API has Megatron imported, which marks numpy's real classes safe in
    torch's process-wide list; the rank file still loads with stand-ins only, and the caller's list is
    left as it was."""
    import numpy

    path = next(FIXTURES.glob("tp2_fp32_filtered/lora/iter_0000010/mp_rank_00/model_optim_rng.pt"))
    theirs = [numpy.ndarray, numpy.dtype, (numpy._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
    saved = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(theirs)
    try:
        before = set(torch.serialization.get_safe_globals())
        state = load_pt(path)
        assert state["args"].tensor_model_parallel_size == 2
        assert set(torch.serialization.get_safe_globals()) == before
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
