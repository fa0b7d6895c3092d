"""Run a function on N real ranks from a notebook cell, and get the results back in rank order.

`spawn(fn, world_size, ...)` is the lecture's `mp.spawn` done right: fresh processes, each in
a real `torch.distributed` process group, returning `[fn(0, N, ...), fn(1, N, ...), ...]`.
`LiveRanks(world_size)` keeps those processes (and their process group) alive between calls,
so a slider can re-run a collective in milliseconds instead of seconds.

This module is the name readers import; the code lives in helpers.launch, one concern each:

    LiveRanks, spawn, live_rank_limit            helpers.launch.live (the pool and its cap too)
    RankError, RankTimeoutError                  helpers.launch.errors
    cpu_cores, max_cpu_world_size, threads_per_rank, intra_op_threads, resolve_backend,
    loopback_interface, pin_transports, BACKENDS, TRANSPORT_VARIABLES
                                                 helpers.launch.host
    check_world_size, check_rank_function, check_timeout, MIN_TIMEOUT_S, MAX_TIMEOUT_S
                                                 helpers.launch.checks
    pack, with_cell_lines (cells by value, cloudpickle; stale modules)
                                                 helpers.launch.shipping
    the rank side and the launcher               helpers.launch.worker
    process handles, kill and reap, folders      helpers.launch.process

Two settings are read by helpers.launch.live at call time and can be set here:
`helpers.ranks.LIVE_RANK_LIMIT = n` (most rank processes alive at once; None: as many as
`max_cpu_world_size()`) and `helpers.ranks.FORK_RANKS = False` (one `python -c` process per
rank instead of forking from a launcher). Setting either here sets it there.
"""
from __future__ import annotations

import sys
import types

from helpers.launch import live as _live
from helpers.launch.checks import (MAX_TIMEOUT_S, MIN_TIMEOUT_S, check_rank_function,
                                   check_timeout, check_world_size)
from helpers.launch.errors import RankError, RankTimeoutError
from helpers.launch.host import (BACKENDS, TRANSPORT_VARIABLES, cpu_cores, intra_op_threads,
                                 loopback_interface, max_cpu_world_size, pin_transports,
                                 resolve_backend, threads_per_rank)
from helpers.launch.live import LiveRanks, live_rank_limit, spawn

__all__ = [
    "LiveRanks", "spawn", "live_rank_limit", "RankError", "RankTimeoutError",
    "cpu_cores", "max_cpu_world_size", "threads_per_rank", "intra_op_threads",
    "resolve_backend", "loopback_interface", "pin_transports", "BACKENDS",
    "TRANSPORT_VARIABLES", "check_world_size", "check_rank_function", "check_timeout",
    "MIN_TIMEOUT_S", "MAX_TIMEOUT_S", "LIVE_RANK_LIMIT", "FORK_RANKS",
]


def _forwarded(name: str) -> property:
    """helpers.ranks.<name> reads and sets helpers.launch.live.<name>, where it is used."""
    return property(lambda module: getattr(_live, name),
                    lambda module, value: setattr(_live, name, value),
                    doc=f"helpers.launch.live.{name}, read and set through helpers.ranks")


class _Facade(types.ModuleType):
    """This module, with the settings as properties: a plain module attribute would be a copy,
    and assigning to it would change nothing that LiveRanks reads."""

    LIVE_RANK_LIMIT = _forwarded("LIVE_RANK_LIMIT")
    FORK_RANKS = _forwarded("FORK_RANKS")


sys.modules[__name__].__class__ = _Facade
