"""What the fast search reads of a GPU, as hashable records built once (docs/cost_model.md §1).

`helpers.hardware.GPU` holds a dict (FLOP per clock, per bitwidth), so it cannot key a
cache. `Machine.of(gpu)` takes from it, once, what the search reads: the `matmul.Chip` a
matmul's time depends on, the network's levels as plain tuples, the HBM size, and three
rates the search's lower bounds use. A `Cluster` is a machine with N GPUs.

The search's caches key on the part of the machine their result depends on: matmul times
on `machine.chip` (a GPU that differs only in its network, as under notebook 06's
bandwidth slider, shares them), the communication bounds on `machine.levels`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from helpers.hardware import GPU

from .matmul import Chip
from .reference import level_capacities

SHAVE_9 = 1 - 1e-9  # a rate in a lower bound, shaved so float rounding never lifts the bound


class Link(NamedTuple):
    """A network level (`helpers.hardware.NetworkLevel`) as a plain tuple: hashing it is
    what every cache lookup of the search pays for."""

    bandwidth_Bps: float
    latency_s: float
    size: int | None  # GPUs that share the level; None for the outermost


@dataclass(frozen=True)
class Machine:
    """One GPU and its network, as the search reads them."""

    chip: Chip
    levels: tuple[Link, ...]  # innermost first
    hbm_bytes: float
    # For the lower bounds only, each shaved by 1e-9 (SHAVE_9):
    s_per_flop: float       # seconds per FLOP at the sustained rate
    six_latencies_s: float  # the fixed latency of one layer's six matmuls
    s_per_hbm_word: float   # seconds per word between HBM and L2

    @classmethod
    def of(cls, gpu: GPU) -> Machine:
        return cls(Chip.of(gpu),
                   tuple(Link(lv.bandwidth_Bps, lv.latency_s, lv.size)
                         for lv in gpu.network_levels),
                   gpu.hbm_bytes,
                   SHAVE_9 / gpu.sustained_flops,
                   SHAVE_9 * 6 * gpu.latency_per_matmul_s,
                   SHAVE_9 * gpu.bytes_per_word / gpu.hbm_Bps)

    @property
    def bytes_per_word(self) -> float:
        return self.chip.bytes_per_word

    @property
    def inner_sizes(self) -> tuple[int, ...]:
        """GPUs per inner level, full (a cluster of N GPUs may fill fewer: `Cluster.caps`)."""
        return tuple(lv.size for lv in self.levels[:-1])


@dataclass(frozen=True)
class Cluster:
    """N GPUs of one machine: what one `search.best_plan` call reads."""

    machine: Machine
    N: int
    caps: tuple[int, ...]  # the inner levels' sizes shrunk to N (the outermost takes the rest)

    @classmethod
    def of(cls, machine: Machine, N: int) -> Cluster:
        return cls(machine, N, tuple(level_capacities(machine.levels, N)))
