"""Argument checks with one wording, used by every module: the parent calls them before it
starts a process or computes anything, so bad input costs one clear line and nothing else.

Every message reads "<name> must be <what is allowed>, got <value>".
"""
from __future__ import annotations

import math
from typing import Any, Iterable


def check_int(name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """An int (not a bool) in [low, high]; TypeError for another type, ValueError outside."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                 *, low_inclusive: bool = True, unit: str = "") -> float:
    """A finite real number in the given range (an open lower end with low_inclusive=False)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number{unit and ' of ' + unit}, "
                        f"got {type(value).__name__} {value!r}")
    value = float(value)
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    if not math.isfinite(value) or too_low or (high is not None and value > high):
        lo = "" if low is None else (f">= {low:g}" if low_inclusive else f"> {low:g}")
        hi = "" if high is None else f"<= {high:g}"
        allowed = " and ".join(part for part in (lo, hi) if part) or "finite"
        raise ValueError(f"{name} must be {allowed}{unit and ' ' + unit}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable) -> Any:
    """One of a fixed set of values."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def shorten(text: str, limit: int = 80) -> str:
    """Input quoted in a message: non-printing characters (a terminal's escape codes, lone
    surrogates, line breaks) as escapes, cut to at most `limit` characters."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def check_that(holds: bool, name: str, allowed: str, value: Any) -> None:
    """The general check, for what the others cannot say: ValueError unless `holds`. The value
    is quoted short and printable (it may come from a file or a command line)."""
    if not holds:
        raise ValueError(f"{name} must be {allowed}, got {shorten(repr(value))}")


def is_number(value: Any) -> bool:
    """A real number a float can hold: an int or float, not a bool, not NaN (a JSON integer
    of 400 digits is not one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return not math.isnan(float(value))
    except OverflowError:
        return False


def check_divisible(name: str, value: int, by: int, why: str) -> int:
    """value % by == 0; `why` says what the division is for (e.g. "t ranks share the columns")."""
    if value % by:
        raise ValueError(f"{name} must be a multiple of {by} ({why}), got {value}")
    return value
