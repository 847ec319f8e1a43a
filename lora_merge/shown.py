"""How a value read from an input is shown in a message: a bounded text, whatever the value.

`repr` of an input value can cost anything: a pickled args value may be a nested list that references
itself (a 44 KB rank file holds a list of 2^40 leaves), a string or an int may be huge, and an inert
stand-in for a pickled object shows whatever it was given. `shown` walks the value itself and stops once
it has written `limit` characters, so every value costs at most a few hundred steps to show; it never
calls `repr` on a container or on an object it does not know.
"""

from __future__ import annotations

import enum
from argparse import Namespace
from pathlib import PurePath
from types import SimpleNamespace

LIMIT = 80
_MAX_DEPTH = 6  # deeper containers show as "..."
_MAX_INT_BITS = 128  # a longer int shows its size (its decimal form could take seconds to compute)


def shown(value, limit: int = LIMIT) -> str:
    """`value` as repr would show it, cut to at most `limit` characters (+ "...")."""
    out = _Text(limit)
    _walk(value, out, 0)
    text = "".join(out.parts)
    return text if len(text) <= limit else text[:limit] + "..."


class _Text:
    def __init__(self, limit: int):
        self.parts: list[str] = []
        self.size = 0
        self.limit = limit

    @property
    def full(self) -> bool:
        return self.size > self.limit

    def add(self, text: str) -> None:
        if not self.full:
            self.parts.append(text)
            self.size += len(text)


def _walk(value, out: _Text, depth: int) -> None:
    if out.full:
        return
    if value is None or isinstance(value, (bool, float)):
        out.add(repr(value))
    elif isinstance(value, int):
        out.add(repr(value) if value.bit_length() <= _MAX_INT_BITS else f"<an int of {value.bit_length()} bits>")
    elif isinstance(value, (str, bytes, bytearray)):
        head = value[: out.limit + 1]  # never the repr of the whole of a huge string
        out.add(repr(head) + ("..." if len(value) > len(head) else ""))
    elif isinstance(value, (enum.Enum, PurePath)):
        out.add(repr(value)[: out.limit + 1])
    elif isinstance(value, (list, tuple, set, frozenset, dict)):
        _container(value, out, depth)
    elif isinstance(value, (Namespace, SimpleNamespace)):
        out.add(f"{type(value).__name__}(")
        _items(vars(value).items(), out, depth, lambda k: out.add(f"{k}="))
        out.add(")")
    else:
        _object(value, out, depth)


def _container(value, out: _Text, depth: int) -> None:
    opening, closing = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
    if isinstance(value, (set, frozenset)) and not value:
        out.add(f"{type(value).__name__}()")
        return
    if depth >= _MAX_DEPTH:
        out.add(f"{opening}...{closing}")
        return
    out.add(opening)
    if isinstance(value, dict):
        _items(value.items(), out, depth, lambda k: (_walk(k, out, depth + 1), out.add(": ")))
    else:
        _items(((None, v) for v in value), out, depth, None)
        if isinstance(value, tuple) and len(value) == 1:
            out.add(",")
    out.add(closing)


def _items(pairs, out: _Text, depth: int, key) -> None:
    for i, (k, v) in enumerate(pairs):
        if out.full:
            return
        if i:
            out.add(", ")
        if key is not None:
            key(k)
        _walk(v, out, depth + 1)


def _object(value, out: _Text, depth: int) -> None:
    """An object of another type: its class name, and for the inert stand-ins of pickled objects
    (safe_load.StandIn) what they were given."""
    name = type(value).__qualname__
    args = getattr(value, "args", None) if _is_stand_in(value) else None
    if isinstance(args, tuple):
        out.add(f"{name}(")
        _items(((None, a) for a in args), out, depth, None)
        out.add(")")
    elif type(value).__module__ == "torch" and name == "dtype":
        out.add(repr(value))
    else:
        out.add(f"<{name}>")


def _is_stand_in(value) -> bool:
    """safe_load.StandIn (and its subclasses), known by its marker: safe_load shows its stand-ins with this
    module, so this one does not import it."""
    return getattr(type(value), "INERT_STAND_IN", False) is True
