"""Splitting five parallel degrees over the network levels, as numpy tables (docs/cost_model.md §6).

The reference enumerates placements one tuple at a time; a three-level network gives
thousands per layout, so here they are built level by level with array operations, in the
same order (outer loops over inner levels, each level's factorizations lexicographic).
Each placement is also expressed as indices into the distinct splits of DP, of (TP_model,
TP_ff) and of (PP, EP), the three groups the communication cost separates into.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .reference import ordered_factorizations


@lru_cache(maxsize=None)
def factorization_table(cap: int) -> np.ndarray:
    """All ordered 5-way factorizations of `cap`, lexicographic, as an (n, 5) array."""
    return np.array(list(ordered_factorizations(cap, 5)), dtype=np.int64).reshape(-1, 5)


class PlacementTable:
    """Every placement of one layout's degrees (a plain class: built once per layout)."""

    __slots__ = ("inner", "prod", "degrees", "dp", "tp", "ppep", "dp_index", "tp_index",
                 "ppep_index", "columns")

    def __init__(self, inner, prod, degrees, dp, tp, ppep, dp_index, tp_index, ppep_index,
                 columns):
        self.inner = inner    # (n, inner levels, 5): each placement's degree per inner level
        self.prod = prod      # (n, 5): each type's product over the inner levels
        self.degrees = degrees  # the outermost level takes what is left: degree // prod
        self.dp = dp          # distinct DP splits (tuples over levels)
        self.tp = tp          # distinct (TP_model, TP_ff) splits
        self.ppep = ppep      # distinct (PP, EP) splits
        self.dp_index = dp_index
        self.tp_index = tp_index
        self.ppep_index = ppep_index
        # (6, n): where each placement's (bandwidth, latency) of each group sits in the flat
        # list [tp splits; PP/EP splits; DP splits] of (bandwidth, latency) pairs
        self.columns = columns

    def place(self, i: int) -> tuple[tuple[int, ...], ...]:
        """Placement `i` as `place[type][level]`, the reference's form."""
        return tuple(tuple(int(x) for x in self.inner[i, :, t])
                     + (self.degrees[t] // int(self.prod[i, t]),) for t in range(5))


def _distinct(inner: np.ndarray, types: list[int], caps: tuple[int, ...]):
    """Distinct inner-level splits of some types, and each placement's index among them.

    A split is fixed by its inner levels (the outermost takes the rest), whose degrees are
    at most the level sizes, so a mixed-radix number identifies it: 1-D `np.unique` is far
    faster than comparing rows.
    """
    key = np.zeros(len(inner), dtype=np.int64)
    for t in types:
        for k, cap in enumerate(caps):
            key = key * (cap + 1) + inner[:, k, t]
    _, first, index = np.unique(key, return_index=True, return_inverse=True)
    rows = inner[first][:, :, types].transpose(0, 2, 1).tolist()  # [split][type][level]
    return [tuple(tuple(x) for x in r) for r in rows], index.reshape(-1)


@lru_cache(maxsize=None)
def _inner_table(caps: tuple[int, ...], sig: tuple[int, ...]):
    """The inner levels of every placement, for degrees whose gcd with Π caps is `sig`.

    An inner split is allowed when its product for each type divides the type's degree;
    that product always divides Π caps, so only gcd(degree, Π caps) matters.
    """
    left = np.array([sig], dtype=np.int64)  # what each type may still place
    done = np.ones((1, 0, 5), dtype=np.int64)
    for cap in caps:
        facs = factorization_table(cap)
        fits = (left[:, None, :] % facs[None, :, :] == 0).all(axis=2)
        i, j = np.nonzero(fits)  # row-major: earlier inner-level choices first
        done = np.concatenate([done[i], facs[j][:, None, :]], axis=1)
        left = left[i] // facs[j]
    if len(done) == 0:
        return None
    prod = done.prod(axis=1)  # (n, 5): each type's product over the inner levels
    dp, tp, pe = (_distinct(done, [0], caps), _distinct(done, [1, 2], caps),
                  _distinct(done, [3, 4], caps))
    stacked = np.stack([tp[1], pe[1] + len(tp[0]), dp[1] + len(tp[0]) + len(pe[0])], axis=1)
    columns = np.ascontiguousarray((2 * stacked[:, :, None] + np.arange(2)).reshape(-1, 6).T)
    return done, prod, dp, tp, pe, columns


@lru_cache(maxsize=None)
def _with_outer(caps: tuple[int, ...], sig: tuple[int, ...], part: int,
                degrees: tuple[int, ...]) -> tuple:
    """The distinct splits of one group of types (0: DP, 1: TP pair, 2: PP/EP pair), each
    completed by the outer level: each type's degree over its inner product."""
    splits = _inner_table(caps, sig)[2 + part][0]
    out = tuple(tuple(x + (deg // math.prod(x),) for x, deg in zip(sp, degrees))
                for sp in splits)
    return tuple(x[0] for x in out) if part == 0 else out


@lru_cache(maxsize=None)
def placement_table(caps: tuple[int, ...], degrees: tuple[int, ...]) -> PlacementTable | None:
    """Every placement of `degrees` on levels of (shrunk) sizes `caps` plus an outer level."""
    cap_prod = math.prod(caps)
    sig = tuple(math.gcd(x, cap_prod) for x in degrees)
    got = _inner_table(caps, sig)
    if got is None:
        return None
    inner, prod, (_, dp_i), (_, tp_i), (_, pe_i), columns = got
    return PlacementTable(inner, prod, degrees, _with_outer(caps, sig, 0, degrees[:1]),
                          _with_outer(caps, sig, 1, degrees[1:3]),
                          _with_outer(caps, sig, 2, degrees[3:5]), dp_i, tp_i, pe_i, columns)


def clear_caches() -> None:
    """Forget the tables (for honest cold-start benchmarks: `search.clear_caches`)."""
    for fn in (factorization_table, _inner_table, _with_outer, placement_table):
        fn.cache_clear()
