"""Load `.pt` pickles without running any code from them.

Megatron and MindSpeed pickle a few of their own classes into a checkpoint (`args` holds enums such as
`megatron.core.enums.ModelType`; `rng_state` holds numpy arrays). We never import those classes: each
global from a trusted namespace is replaced by an inert stand-in that only records its arguments, and
torch's weights-only unpickler does the rest. Any other global (`os.system`, `builtins.eval`, ...) makes
the load fail with the offending name. There is no fallback to a full unpickler.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pickle
import threading
import types
from collections import OrderedDict
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.files.torch_archive import MappedFile, TorchArchive

# Namespaces whose classes only ever carry data in a checkpoint. Whatever a name in them is, it gets a
# stand-in, so trusting a namespace never means running its code.
STAND_IN_PREFIXES = (
    "megatron.",
    "mindspeed.",
    "mindspeed_llm.",
    "modellink.",
    "transformer_engine.",
    "numpy.",
    "pathlib.",
    "io.BytesIO",
    "_io.BytesIO",  # how TransformerEngine's _extra_state pickles
    "torch.",  # e.g. an activation or init function named in args (torch's own tensor types stay real)
    "functools.partial",
    "collections.",
)

# Plain-data classes we let the unpickler build for real (object.__new__ plus a __dict__ update).
REAL_CLASSES = {
    "argparse.Namespace": argparse.Namespace,
    "types.SimpleNamespace": types.SimpleNamespace,
    "collections.OrderedDict": OrderedDict,
}


class StandIn:
    """Inert replacement for a pickled class or function: remembers what it was given, does nothing.

    Equality and hashing stay by identity: stand-ins can be dict keys in a pickle, hashed before their
    state is set."""

    INERT_STAND_IN = True  # how `shown` knows one without importing this module

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):  # bounded: what it was given is input, possibly a reference bomb
        from lora_merge.shown import shown

        return shown(self, limit=200)


def stand_in_class(full_name: str) -> type:
    """An inert class carrying the pickled name `full_name` (e.g. megatron.core.enums.ModelType)."""
    module, _, name = full_name.rpartition(".")
    return type(name, (StandIn,), {"__module__": module, "__qualname__": name})


def _allowed_globals(pickled: bytes, where: str) -> list:
    try:
        names = torch._weights_only_unpickler.get_globals_in_pkl(io.BytesIO(pickled))
    except Exception as exc:  # a damaged pickle: nothing in it is run by listing its globals
        raise MergeError(f"{where}: not a readable torch checkpoint ({_short(exc)})") from exc
    safe = set(torch._weights_only_unpickler._get_allowed_globals())
    allowed = []
    for full_name in sorted(set(names) - safe):
        if full_name in REAL_CLASSES:
            allowed.append((REAL_CLASSES[full_name], full_name))
        elif full_name.startswith(STAND_IN_PREFIXES):
            allowed.append((stand_in_class(full_name), full_name))
        else:
            raise MergeError(
                f"{where}: refusing to load: the pickle references {full_name!r}, which is not data a "
                "Megatron checkpoint holds (only tensors, Megatron/numpy data classes and argparse args are accepted)"
            )
    return allowed


def load_archive(archive: TorchArchive):
    """Unpickle a checked torch.save archive with the weights-only unpickler and our stand-ins; tensors
    are views into the archive's file."""
    pickled = archive.pickle_bytes()
    allowed = _allowed_globals(pickled, archive.where)
    try:
        with _only_our_globals(allowed):
            return archive.unpickle(pickled)
    except MergeError:
        raise
    except pickle.UnpicklingError as exc:
        raise MergeError(f"{archive.where}: refusing to load: {_short(exc)}") from exc
    except Exception as exc:  # a damaged pickle (wrong opcodes, bad tensor sizes): never a traceback
        raise MergeError(f"{archive.where}: corrupt or truncated torch checkpoint ({_short(exc)})") from exc


_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def _only_our_globals(allowed: list):
    """torch's list of safe globals is process-wide. A program calling us may have added real classes to
    it (Megatron adds numpy's, so a training script's process has them): under the same names as our
    stand-ins, the unpickler would mix real and inert classes. Ours alone apply while we load."""
    with _GLOBALS_LOCK:
        theirs = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            with torch.serialization.safe_globals(allowed):
                yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(theirs)


def load_pt(path: str | Path, mmap: bool = True, where: str | None = None):
    """Load a torch `.pt` file with the weights-only unpickler; tensors stay memory-mapped when `mmap`
    (else they are read into memory, for files about to be rewritten)."""
    return load_archive(TorchArchive(MappedFile(Path(path), in_memory=not mmap), where=where))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
