"""Architectures, each a short module owning how its HF config reads, its table of layout rules and what PEFT
does with its adapters (see `base.Architecture`). A module of this package that defines `ARCHITECTURE` for an
HF model type is that type's support: adding a model type is adding a module."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from lora_merge.model.architectures.base import Architecture, HfConfig, iter_rules, pick_name  # noqa: F401
from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.shown import shown

if TYPE_CHECKING:
    from lora_merge.model.model_shape import ModelShape

def _registered() -> dict[str, Architecture]:
    found: dict[str, Architecture] = {}
    for info in pkgutil.iter_modules(__path__):
        arch = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ARCHITECTURE", None)
        if isinstance(arch, Architecture) and arch.config is not None:
            if arch.name in found:
                raise RuntimeError(f"two architecture modules claim model_type {arch.name!r}")
            found[arch.name] = arch
    return found


ARCHITECTURES = _registered()


def architecture_for(shape: ModelShape) -> Architecture:
    try:
        return ARCHITECTURES[shape.model_type]
    except KeyError:
        raise UnsupportedInput(f"HF config model_type {shown(shape.model_type)} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
