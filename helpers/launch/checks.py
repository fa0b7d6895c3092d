"""What a call to `spawn` / `LiveRanks` may ask for, checked in the notebook before any process
starts: a bad argument costs one clear line, not a rank that dies on import or a hang.

The wording is helpers.checks' ("<name> must be <what is allowed>, got <value>").
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from helpers.checks import check_int
from helpers.launch.host import cuda_device_count, max_cpu_world_size

# Longest collective timeout accepted: a week. (Far longer would overflow the millisecond
# timeouts of poll() and of the backends; None means "no timeout" instead.)
MAX_TIMEOUT_S = 7 * 24 * 3600
# Shortest: below a second a busy machine fails collectives that are merely slow (at 1e-9
# every collective failed), and the parent could not tell a timeout from a crash.
MIN_TIMEOUT_S = 1.0


def check_world_size(world_size: Any) -> int:
    """1 … the ranks this machine can hold (memory and cores, or one per GPU)."""
    return check_int("world_size", world_size, 1, max(max_cpu_world_size(), cuda_device_count()))


def check_rank_function(fn: Any) -> Callable:
    """A rank function is a Python function (or a functools.partial of one): from a module it
    goes to the ranks by name, from a cell, a lambda or a closure by value (see
    helpers.launch.shipping)."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    target = fn.func if isinstance(fn, functools.partial) else fn
    if not inspect.isfunction(inspect.unwrap(target)):
        raise ValueError(f"fn={fn!r} must be a Python function, "
                         "called as fn(rank, world_size, *args, **kwargs)")
    return fn


def check_timeout(timeout: Any) -> float | None:
    """Seconds a collective may wait for its peers: a number in [MIN_TIMEOUT_S, MAX_TIMEOUT_S],
    or None."""
    ok = (timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                              and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S))
    if not ok:
        raise ValueError(f"timeout must be a number of seconds in [{MIN_TIMEOUT_S:g}, "
                         f"{MAX_TIMEOUT_S}] (one second to one week), or None for no timeout; "
                         f"got {timeout!r}")
    return None if timeout is None else float(timeout)
