"""Splitting five parallel degrees over the network levels, as numpy tables (spec §6).

The reference enumerates placements one tuple at a time; a three-level network gives
thousands per layout, so here they are built level by level with array operations, in the
same order (outer loops over inner levels, each level's factorizations lexicographic).
Each placement is also expressed as indices into the distinct splits of DP, of (TP_model,
TP_ff) and of (PP, EP), the three groups the communication cost separates into.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .reference import ordered_factorizations


@lru_cache(maxsize=None)
def factorization_table(cap: int) -> np.ndarray:
    """All ordered 5-way factorizations of `cap`, lexicographic, as an (n, 5) array."""
    return np.array(list(ordered_factorizations(cap, 5)), dtype=np.int64).reshape(-1, 5)


@dataclass(frozen=True)
class PlacementTable:
    degrees: np.ndarray  # (n, levels, 5): each placement's degree per level and type
    dp: tuple            # distinct DP splits (tuples over levels)
    tp: tuple            # distinct (TP_model, TP_ff) splits
    ppep: tuple          # distinct (PP, EP) splits
    dp_index: np.ndarray
    tp_index: np.ndarray
    ppep_index: np.ndarray

    def place(self, i: int) -> tuple[tuple[int, ...], ...]:
        """Placement `i` as `place[type][level]`, the reference's form."""
        return tuple(tuple(int(x) for x in self.degrees[i, :, t]) for t in range(5))


def _distinct(table: np.ndarray, types: list[int], caps: tuple[int, ...]):
    """Distinct splits of some types, and each placement's index among them.

    A split is fixed by its inner levels (the outermost takes the rest), whose degrees are
    at most the level sizes, so a mixed-radix number identifies it: 1-D `np.unique` is far
    faster than comparing rows.
    """
    key = np.zeros(len(table), dtype=np.int64)
    for t in types:
        for k, cap in enumerate(caps):
            key = key * (cap + 1) + table[:, k, t]
    _, first, index = np.unique(key, return_index=True, return_inverse=True)
    rows = table[first][:, :, types].transpose(0, 2, 1).tolist()  # [split][type][level]
    if len(types) == 1:
        splits = tuple(tuple(r[0]) for r in rows)
    else:
        splits = tuple(tuple(tuple(x) for x in r) for r in rows)
    return splits, index.reshape(-1)


@lru_cache(maxsize=None)
def placement_table(caps: tuple[int, ...], degrees: tuple[int, ...]) -> PlacementTable | None:
    """Every placement of `degrees` on levels of (shrunk) sizes `caps` plus an outer level."""
    left = np.array([degrees], dtype=np.int64)  # what each type still has to place
    done = np.ones((1, 0, 5), dtype=np.int64)
    for cap in caps:
        facs = factorization_table(cap)
        fits = (left[:, None, :] % facs[None, :, :] == 0).all(axis=2)
        i, j = np.nonzero(fits)  # row-major: earlier inner-level choices first
        done = np.concatenate([done[i], facs[j][:, None, :]], axis=1)
        left = left[i] // facs[j]
    if len(left) == 0:
        return None
    table = np.concatenate([done, left[:, None, :]], axis=1)
    dp, dp_i = _distinct(table, [0], caps)
    tp, tp_i = _distinct(table, [1, 2], caps)
    pe, pe_i = _distinct(table, [3, 4], caps)
    assert all(math.prod(table[0, :, t]) == degrees[t] for t in range(5))
    return PlacementTable(table, dp, tp, pe, dp_i, tp_i, pe_i)
