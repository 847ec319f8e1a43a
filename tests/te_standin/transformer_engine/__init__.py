"""A stand-in for TransformerEngine, for tests on hosts without CUDA (see ../README.md)."""
import importlib.abc
import importlib.machinery
import os
import sys
import types
from unittest.mock import MagicMock

__version__ = "2.8.0"


class _Mocked(types.ModuleType):
    """A TransformerEngine module this stand-in does not provide: every attribute a mock."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return MagicMock(name=f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("transformer_engine.") or fullname in sys.modules:
            return None
        here = os.path.join(os.path.dirname(__file__), *fullname.split(".")[1:])
        if os.path.exists(here + ".py") or os.path.isdir(here):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Mocked(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return MagicMock(name=f"transformer_engine.{name}")


from . import common, pytorch  # noqa: E402
