"""Checks for values read from JSON, pickled args and the command line, and how a value is shown in a
message: every number lora-merge uses is checked where it is read (type, finiteness, range) and refused in
one line naming the field."""

from __future__ import annotations

import math

from lora_merge.errors import MergeError
from lora_merge.shown import shown

# Above this a rank is not a LoRA (a full-rank update of the largest models is ~20k); it also keeps r·E
# and the factors' shapes far from any integer overflow.
MAX_RANK = 1 << 20
# alpha and every alpha/r (or alpha/√r) scale must stay where float32 arithmetic is exact enough to
# matter: 1e300 would overflow the first product with a factor to inf.
MAX_ALPHA = 1e6
# Megatron sizes (hidden, heads, layers, experts...) are positive ints below this.
MAX_SIZE = 1 << 40


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float (not a bool, not NaN or infinite, not an integer beyond float range)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False




def shown_value(value) -> str:
    """A value for a one-line message, bounded whatever its size or nesting (see `shown`): at most 80
    characters."""
    text = shown(value)
    return text if len(text) <= 80 else text[:77] + "..."


def positive_int(value, field: str, where: str, limit: int = MAX_SIZE) -> int:
    """`value` as a positive int (an int, not a bool; 64 and 64.0 both accepted from JSON, "64" not)."""
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    if not is_int(value) or not 0 < value <= limit:
        raise MergeError(f"{where}: {field}={shown_value(value)}; expected a positive integer"
                         + (f" (at most {limit})" if is_int(value) and value > limit else ""))
    return value


def non_negative_int(value, field: str, where: str, limit: int = MAX_SIZE) -> int:
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    if not is_int(value) or not 0 <= value <= limit:
        raise MergeError(f"{where}: {field}={shown_value(value)}; expected a non-negative integer"
                         + (f" (at most {limit})" if is_int(value) and value > limit else ""))
    return value


def finite_number(value, field: str, where: str, low: float | None = None, high: float | None = None,
                  low_open: bool = False) -> float:
    """`value` as a finite float within [low, high] ((low, high] when `low_open`), ints allowed."""
    if not is_number(value):
        raise MergeError(f"{where}: {field}={shown_value(value)}; expected a finite number")
    number = float(value)
    if low is not None and (number < low or (low_open and number == low)) or high is not None and number > high:
        bounds = (f"{'above' if low_open else 'at least'} {low:g}" if low is not None else "") + \
                 (" and " if low is not None and high is not None else "") + \
                 (f"at most {high:g}" if high is not None else "")
        raise MergeError(f"{where}: {field}={shown_value(value)}; expected a number {bounds}")
    return number


def lora_scale(alpha: float, r: int, rslora: bool, field: str, where: str) -> float:
    """alpha/r (alpha/√r with rsLoRA), checked finite and positive."""
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    if not (math.isfinite(scale) and scale > 0):
        raise MergeError(f"{where}: {field}: scale alpha/{'√' if rslora else ''}r = {scale!r} is not a finite "
                         "positive number")
    return scale
