"""The search of docs/cost_model.md §6, fast: same candidates, same arithmetic, far fewer evaluations.

Every result is bit-identical to `reference.best_plan` (`python -m benchmarks.simulator`
checks the whole default H100 curve, tests/test_simulator.py half of it, its end and samples
of the others). What makes it fast:

* vectors — all layouts of a cluster (TP, DP, PP, TP shape, schedule, m) are enumerated at
  once with numpy in the model's order and bounded from below in one pass; all placements
  of one layout are timed at once, with the same IEEE operations in the same order as the
  scalar `reference.step_seconds`;
* a floor per cluster size, its FLOP and matmul latencies alone (`step_floor`): sizes that
  cannot finish in time are skipped before any layout is enumerated; and past the latency
  wall, one bound that holds for every larger size (`latency_wall`) ends the search;
* bounds, each provably below the exact step: per (TP, DP, PP) triple against the run's
  deadline; per row, the six matmuls at their FLOP or their least HBM traffic (shaved by
  1e-9) with each communication part at its own best split over the levels; then with
  TP and DP sharing the innermost level (when TP fills a node, DP's all-reduce leaves
  it: this cuts the layouts placed on the levels about eightfold); then the exact matmul
  time. Rows are taken best first and the search stops when the smallest bound left
  exceeds the best run time found;
* N-free caches — each communication part is a cluster-wide factor (·/N) times a sum or
  maximum of small integers over each level's bandwidth, so its best split is cached once
  per curve (shaved by 1e-12: computed in another order than `comm`, it may differ from
  the exact value by a few ulps) and only scaled per cluster size. Matmul times, divisors
  and placement tables are cached too; the exact communication of each split is memoised
  within one `best_plan` call (the model or N changes from one call to the next).

The GPU is read once per model into a `machine.Machine` (a `Cluster` per size N): the
caches key on the part of it their result depends on, the matmul times on its `Chip`, the
communication bounds on its network `levels`. `best_plan` is its steps in order: the rows
that bounds 0 and 1 leave (`_bounded_rows`), taken best first (`_best_first`, with
`_Queue` and the per-group work of `_Groups`), the winner made a `Plan`.

Ties are settled as in the reference (`reference.tie_key`, the public reference code's
rule): among equal (run time, bandwidth time) keys the earliest row in the model's
enumeration order wins, and within it the earliest placement, so the order of evaluation
does not change the answer. A row whose bandwidth floor already exceeds the best's cannot
win a tie and is skipped.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from helpers.hardware import GPU

from . import placement
from .comm import ep_frequencies, outer, pp_frequencies, top_level
from .machine import SHAVE_9, Cluster, Machine
from .matmul import Chip, matmul_seconds, tile
from .placement import placement_table
from .plan import Plan
from .reference import combine, schedule_options, step_seconds
from .reference import divisors as _slow_divisors
from .scaling import Model
from .settings import Settings


@lru_cache(maxsize=None)
def _matmul(chip: Chip, d1: int, d2: int, b: int, weight_grad: bool) -> float:
    return matmul_seconds(chip, d1, d2, b, weight_grad)


@lru_cache(maxsize=None)
def _six_matmuls(chip: Chip, fp: int, dp_: int, b: int) -> float:
    """The six matmuls of one layer and microbatch, summed in the reference's order."""
    a, c = _matmul(chip, fp, dp_, b, False), _matmul(chip, dp_, fp, b, False)
    return a + c + _matmul(chip, fp, dp_, b, True) + c + a + _matmul(chip, dp_, fp, b, True)


divisors = lru_cache(maxsize=None)(lambda n: tuple(_slow_divisors(n)))


@lru_cache(maxsize=None)
def _divisor_array(n: int) -> np.ndarray:
    """`divisors(n)` as an int64 array (none for 0); shared, so never written to."""
    out = np.array(divisors(n) if n else (), dtype=np.int64)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=None)
def _microbatches(per_gpu: int, PP: int, zb: bool) -> tuple[int, ...]:
    """The first 4 (1 under ZB) divisors of the per-replica batch that fill the pipeline."""
    lo = 2 * PP if zb else PP
    return tuple(x for x in divisors(per_gpu) if x >= lo)[:1 if zb else 4] if per_gpu else ()


@lru_cache(maxsize=None)
def _splits(caps: tuple[int, ...], degree: int) -> tuple[tuple[int, ...], ...]:
    """Every way one type's degree can sit on the levels, ignoring the other types."""
    out = [()]
    for cap in caps:
        out = [t + (x,) for t in out for x in divisors(math.gcd(cap, degree // math.prod(t)))]
    return tuple(t + (degree // math.prod(t),) for t in out)


@lru_cache(maxsize=None)
def _pair_splits(caps, a: int, b: int):
    """Splits of two types that could share the inner levels (their product fits each)."""
    return tuple((x, y) for x in _splits(caps, a) for y in _splits(caps, b)
                 if all(cap % (i * j) == 0 for cap, i, j in zip(caps, x, y)))


def _allreduce_levels(words, split, rs, rp, cluster: Cluster) -> tuple[list[float], list[float]]:
    """(bandwidth, latency) per level of one TP kind, as in `comm.tp_comm`'s loop: the
    operations of `comm.allreduce`, in its order, written out (this runs for every split)."""
    N, by = cluster.N, cluster.machine.bytes_per_word
    bws, lats = [], []
    for k, (bw, lat, _) in enumerate(cluster.machine.levels):
        p = split[k]
        bws.append(2 * (p - 1) * words * rs * (rp * math.prod(split[k + 1:])) * by
                   / (N * bw / 2))
        lats.append(2 * rs * lat if p > 1 else 0.0)
    return bws, lats


def _dp_exact(P, split, cluster: Cluster) -> tuple[float, float]:
    """`comm.dp_comm`, its operations in its order, written out (this runs for every split)."""
    N, by = cluster.N, cluster.machine.bytes_per_word
    bw_max, lat_sum = 0.0, 0.0
    for k, (bw, lat, _) in enumerate(cluster.machine.levels):
        g = split[k]
        # allreduce(P, g, rs=1, rp=outer): the factors of 1 dropped (exact on ints and floats)
        bw_max = max(bw_max, 2 * (g - 1) * P * math.prod(split[k + 1:]) * by / (N * bw / 2))
        lat_sum += 2 * lat if g > 1 else 0.0
    return bw_max, lat_sum


# --- lower bounds on each communication part, free of N and mostly of the model ----------
#
# Each time in `comm` is a product of the cluster-wide factor (say 4·P·bytes/N for DP) and
# a sum or maximum over levels of small integers divided by each level's bandwidth (or times
# its latency). The integers depend only on the split, so the best split's value is cached
# once per curve and scaled per call. Computed in another order than `comm`, the result may
# differ from the exact best by a few ulps, so it is shaved by SHAVE: a bound, never above.
SHAVE = 1 - 1e-12


def _inner(caps) -> tuple[int, ...]:
    """The degrees a type may take on the innermost level: the divisors of its size (1 on a
    one-level network, which has no inner level)."""
    return divisors(caps[0]) if caps else (1,)


@lru_cache(maxsize=None)
def _type_terms(caps, degree: int):
    """One type's splits (`_splits`) as integer arrays over (split, level): (x_k − 1)·Π_{j>k}
    x_j, whether x_k > 1, and the degrees on the inner levels."""
    x = np.array(_splits(caps, degree), dtype=np.int64).reshape(-1, len(caps) + 1)
    outer_ = np.ones_like(x)
    outer_[:, :-1] = np.cumprod(x[:, :0:-1], axis=1)[:, ::-1]
    return (x - 1) * outer_, (x > 1).astype(np.int64), x[:, :-1]


@lru_cache(maxsize=None)
def _pair_terms(caps, a: int, b: int):
    """`_type_terms` of the pairs of splits of two types that fit the inner levels together
    (`_pair_splits`), and each pair's position in `_inner(caps)` by its product on level 0."""
    wa, ca, xa = _type_terms(caps, a)
    wb, cb, xb = _type_terms(caps, b)
    both = xa[:, None, :] * xb[None, :, :]
    i, j = np.nonzero((np.array(caps, dtype=np.int64) % both == 0).all(axis=2))
    at = (np.searchsorted(np.array(_inner(caps)), both[i, j, 0]) if caps
          else np.zeros(len(i), dtype=np.int64))
    return wa[i], wb[j], ca[i] + cb[j], at


def _speeds(levels) -> tuple[np.ndarray, np.ndarray]:
    """Each level's bandwidth and latency, as two arrays."""
    return np.array([(lv.bandwidth_Bps, lv.latency_s) for lv in levels]).T


def _least_per_inner(caps, at, bw, lat) -> np.ndarray:
    """(len(_inner(caps)), 2): the least `bw` and `lat` of the splits at each innermost
    degree (inf where none), read-only (it is cached)."""
    out = np.full((len(_inner(caps)), 2), math.inf)
    np.minimum.at(out[:, 0], at, bw)
    np.minimum.at(out[:, 1], at, lat)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=None)
def _dp_unit_inner(levels, caps, DP) -> np.ndarray:
    """Per degree c on the innermost level (`_inner(caps)`): min over DP's splits with
    x_0 = c of max_k (x_k − 1)·Π_{j>k} x_j / bw_k, and of Σ_k 2·lat_k·[x_k > 1] (inf if
    none)."""
    w, crosses, x = _type_terms(caps, DP)
    at = (np.searchsorted(np.array(_inner(caps)), x[:, 0]) if caps
          else np.zeros(len(w), dtype=np.int64))
    bws, lats = _speeds(levels)
    return _least_per_inner(caps, at, (w / bws).max(axis=1), (crosses * (2 * lats)).sum(axis=1))


@lru_cache(maxsize=None)
def _tp_unit_inner(levels, caps, TPm, TPf, f, d) -> np.ndarray:
    """Per product a = x_0·y_0 of the pair on the innermost level (`_inner(caps)`): min over
    the pair's splits of max_k ((x_k−1)·Π x_{>k}·f + (y_k−1)·Π y_{>k}·d)/bw_k, and of
    Σ_k lat_k·([x_k > 1] + [y_k > 1]) (inf if no split has that product)."""
    wm, wf, crosses, at = _pair_terms(caps, TPm, TPf)
    bws, lats = _speeds(levels)
    return _least_per_inner(caps, at, ((wm * f + wf * d) / bws).max(axis=1),
                            (crosses * lats).sum(axis=1))


@lru_cache(maxsize=None)
def _inner_pairs(caps) -> tuple[np.ndarray, np.ndarray]:
    """The (TP pair, DP) degrees on the innermost level that fit it together, as indices
    into `_inner(caps)`: the five types' degrees there multiply to its size."""
    inner = _inner(caps)
    size = caps[0] if caps else 1
    ia, ic = zip(*[(i, j) for i, a in enumerate(inner) for j, c in enumerate(inner)
                   if size % (a * c) == 0])
    return np.array(ia, dtype=np.int64), np.array(ic, dtype=np.int64)


@lru_cache(maxsize=None)
def _ppep_weights(levels, caps, PP, EP):
    """Per split of (PP, EP): the top PP level, the outer products of PP, and per PP level
    pl ∈ {−1, …} the weights Σ_el ep_bw[el]/bw and Σ_el ep_lat[el]·lat over the levels
    max(pl, el) ≥ 0 (`comm.ppep_comm`'s double loop with the PP frequency factored out)."""
    out = []
    K = len(levels)
    for x, y in _pair_splits(caps, PP, EP):
        top = top_level(x)
        ep_top = top_level(y)
        ebw = [1 / EP] + [(math.prod(y[el:]) - outer(y, el)) / (outer(y, el) * math.prod(y[el:]))
                          for el in range(K)]
        elat = [1.0 if ep_top == -1 else 0.0] + [1.0 if el == ep_top else 0.0 for el in range(K)]
        w_bw, w_lat = [], []
        for pl in range(-1, top + 1):
            wb = wl = 0.0
            for el in range(-1, K):
                lv = max(pl, el)
                if lv >= 0:
                    wb += ebw[el + 1] / levels[lv][0]
                    wl += elat[el + 1] * levels[lv][1]
            w_bw.append(wb)
            w_lat.append(wl)
        out.append((top, tuple(x), tuple(outer(x, k) for k in range(K)), tuple(w_bw),
                    tuple(w_lat)))
    return tuple(out)


@lru_cache(maxsize=None)
def _ppep_unit(levels, caps, PP, EP, v, L) -> tuple[float, float]:
    """min over splits of Σ_pl (L−1)·pp_freq[pl]·w_bw[pl], and of Σ_pl 2·(L−1)·pp_freq[pl]·w_lat[pl].
    (L−1)·pp_freq is an exact non-negative integer, so nothing cancels."""
    bw = lat = math.inf
    for top, x, out_x, w_bw, w_lat in _ppep_weights(levels, caps, PP, EP):
        num = [L - v * PP]
        for pl in range(top + 1):
            num.append(v * x[pl] - 1 if pl == top else v * out_x[pl] * (x[pl] - 1))
        bw = min(bw, sum(n * w for n, w in zip(num, w_bw)))
        lat = min(lat, 2 * sum(n * w for n, w in zip(num, w_lat)))
    return bw, lat


def clear_caches() -> None:
    """Forget every cached result (for honest cold-start benchmarks)."""
    for fn in (tile, _matmul, _six_matmuls, divisors, _divisor_array, _microbatches, _splits,
               _pair_splits, _type_terms, _pair_terms, _dp_unit_inner, _tp_unit_inner,
               _inner_pairs, _ppep_weights, _ppep_unit, _tp_unit_any, _ppep_unit_any, _tp_units,
               _ppep_units, _tp_shapes, _schedules, _schedule_kinds, _tp_rows, _ppep_terms,
               _ep_terms):
        fn.cache_clear()
    placement.clear_caches()


@lru_cache(maxsize=None)
def _tp_shapes(TP: int, d: int, f: int) -> tuple[tuple[int, int], ...]:
    """(TP_model, TP_ff) splits of TP allowed by the model, TP_ff ascending. Both splits
    divide TP, so `d` and `f` may be given as their gcds with TP: the answer is the same."""
    r = math.isqrt(TP)
    return tuple((TP // x, x) for x in divisors(TP)
                 if r <= x <= 4 * r and d % (TP // x) == 0 and f % x == 0)


@lru_cache(maxsize=None)
def _schedules(schedules: tuple[str, ...], PP: int, L: int) -> tuple[tuple[bool, int], ...]:
    return tuple(schedule_options(Settings(schedules=schedules), PP, L))


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows repeated `counts` times: (which row, position within its repeats)."""
    row = np.repeat(np.arange(len(counts)), counts)
    start = np.cumsum(counts) - counts
    return row, np.arange(len(row)) - start[row]


class _Pairs:
    """The (TP, DP, PP) triples of N GPUs that fit in memory, in the model's order (TP
    ascending, then DP ascending), with what the pre-filter of `best_plan` needs."""

    def __init__(self, model: Model, cluster: Cluster):
        d, f, L, s, B, P = model.d, model.f, model.L, model.s, model.B, model.P
        N, by, hbm_bytes = cluster.N, cluster.machine.bytes_per_word, cluster.machine.hbm_bytes
        EP = math.gcd(N, s)
        R = N // EP
        self.EP = EP
        self.tp_g, self.pp_g = math.gcd(R, d * f), math.gcd(R, L)
        self.tps, self.shapes, self.min_area = _tp_rows(self.tp_g, d, f)
        self.pps = divisors(self.pp_g)[::-1]  # PP descending = DP ascending for one TP
        TPa = np.array(self.tps, dtype=np.int64)
        self.PPa = PPa = np.array(self.pps, dtype=np.int64)
        prod = TPa[:, None] * PPa[None, :]
        ok = R % prod == 0
        DPg = np.where(ok, R // np.where(ok, prod, 1), 1)
        ok &= B % DPg == 0
        ok &= N * hbm_bytes >= P * by * DPg + 4 * P * by  # `reference.memory_ok`
        self.ti, self.pj = np.nonzero(ok)  # row-major: TP ascending, then DP ascending
        self.DPp = DPg[self.ti, self.pj]
        # The distinct DP degrees (their bounds are looked up once each) and each triple's.
        self.dp_keys = sorted(set(self.DPp.tolist()))
        self.dp_index = np.searchsorted(np.array(self.dp_keys, dtype=np.int64), self.DPp)


@lru_cache(maxsize=None)
def _tp_rows(g: int, d: int, f: int) -> tuple[list[int], list, np.ndarray]:
    """The TP degrees dividing `g` that the model allows, their shapes, and per degree the
    fewest padded 8×8×8 FLOP blocks of the six matmuls per token, over its shapes."""
    # d and f matter to a degree's shapes only through their gcd with it, so keyed by those
    # gcds one cache entry serves every grid model (their widths share most factors)
    every = [(x, _tp_shapes(x, math.gcd(d, x), math.gcd(f, x))) for x in divisors(g)]
    tps = [x for x, sh in every if sh]
    shapes = [sh for _, sh in every if sh]
    min_area = np.array([min(6 * 1024 * -(-(f // b) // 8) * -(-(d // a) // 8) for a, b in x)
                         for x in shapes], dtype=float)
    return tps, shapes, min_area


def _by_tp_shape(shapes, ti: np.ndarray):
    """Each (TP, DP, PP) triple (`ti`: its TP's index) expanded by the TP's shapes: every
    shape, which triple each expanded row comes from, and each row's shape."""
    n_sh = np.array([len(x) for x in shapes], dtype=np.int64)
    sh_start = np.cumsum(n_sh) - n_sh
    pair, k = _segments(n_sh[ti])
    return [sh for x in shapes for sh in x], pair, sh_start[ti[pair]] + k


def _by_schedule(pps, pj: np.ndarray, L: int, schedules: tuple[str, ...]):
    """Rows (`pj`: the index of each one's PP) expanded by the schedules of their PP: every
    (PP, v), which row each expanded one comes from, its (PP, v), and per (PP, v) whether
    it is zero-bubble and its v."""
    opts = [_schedules(schedules, int(x), L) for x in pps]
    n_op = np.array([len(x) for x in opts], dtype=np.int64)
    op_start = np.cumsum(n_op) - n_op
    pe_keys = [(int(pps[j]), v) for j, x in enumerate(opts) for _, v in x]
    op_zb = np.array([zb for x in opts for zb, _ in x], dtype=bool)
    op_v = np.array([v for x in opts for _, v in x], dtype=np.int64)
    row, k = _segments(n_op[pj])
    return pe_keys, row, op_start[pj[row]] + k, op_zb, op_v


def _by_microbatches(g_dp: np.ndarray, g_pp: np.ndarray, g_zb: np.ndarray, B: int, s: int):
    """Groups expanded by their microbatch counts: the first 4 (1 under ZB) divisors of
    B/(s·DP) that are ≥ PP (≥ 2·PP under ZB). Returns the distinct DP degrees, each
    group's index among them, each row's group and each row's m."""
    dp_keys = sorted(set(g_dp.tolist()))  # (np.unique would import numpy.ma)
    dps = np.array(dp_keys, dtype=np.int64)
    g_dpk = np.searchsorted(dps, g_dp)
    divs = [_divisor_array(B // (s * int(x))) for x in dps]
    n_div = np.array([len(x) for x in divs], dtype=np.int64)
    div_start = np.cumsum(n_div) - n_div
    flat = np.concatenate(divs) if divs else np.zeros(0, np.int64)
    big = int(flat.max()) + 1 if len(flat) else 1
    code = np.repeat(np.arange(len(divs), dtype=np.int64), n_div) * big + flat
    lo = np.where(g_zb, 2 * g_pp, g_pp)
    first = np.searchsorted(code, g_dpk * big + np.minimum(lo, big - 1))
    first = np.where(lo < big, first, div_start[g_dpk] + n_div[g_dpk])
    n_m = np.minimum(np.maximum(div_start[g_dpk] + n_div[g_dpk] - first, 0),
                     np.where(g_zb, 1, 4))
    grp, k = _segments(n_m)
    return dp_keys, g_dpk, grp, flat[first[grp] + k]


class _Layouts:
    """The model's layouts for N GPUs, one row per (degrees, v, zero-bubble, m), in the
    model's enumeration order: TP, then DP ascending; TP_ff ascending; schedule; m.

    Only the triples of `pairs` selected by `keep` are expanded (the order is kept). Every
    column is an array. A group is one (degrees, v, zero-bubble): the rows that share a
    placement table. Keys index the distinct TP shapes, DP degrees and (PP, v) pairs.
    """

    def __init__(self, pairs: _Pairs, keep, model: Model, schedules: tuple[str, ...]):
        self.EP = pairs.EP
        ti, pj, DPp = pairs.ti[keep], pairs.pj[keep], pairs.DPp[keep]
        self.tp_keys, pair, tp_key = _by_tp_shape(pairs.shapes, ti)
        pj2, DP2 = pj[pair], DPp[pair]
        self.pe_keys, row, pe_key, op_zb, op_v = _by_schedule(pairs.pps, pj2, model.L,
                                                              schedules)
        g_tp, g_dp, g_pp = tp_key[row], DP2[row], pairs.PPa[pj2[row]]
        g_zb, g_v = op_zb[pe_key], op_v[pe_key]
        self.dp_keys, g_dpk, grp, self.m = _by_microbatches(g_dp, g_pp, g_zb, model.B, model.s)
        self.n_groups = len(g_tp)
        self.group = grp
        self.g_tp, self.g_dp, self.g_dpk, self.g_pp = g_tp, g_dp, g_dpk, g_pp
        self.g_pe, self.g_zb, self.g_v = pe_key, g_zb, g_v
        tp_arr = np.array(self.tp_keys, dtype=np.int64).reshape(-1, 2)
        self.g_tpm, self.g_tpf = tp_arr[g_tp, 0], tp_arr[g_tp, 1]
        self.pp, self.v, self.zb = g_pp[grp], g_v[grp], g_zb[grp]
        self._matmul_columns(model)

    def _matmul_columns(self, model: Model) -> None:
        """Per row, what bound 1 reads of its six matmuls."""
        d, f, L, s, B = model.d, model.f, model.L, model.s, model.B
        grp = self.group
        dp_r, tpm_r, tpf_r = self.g_dp[grp], self.g_tpm[grp], self.g_tpf[grp]
        # The FLOP of the six matmuls, in padded 8×8×8 blocks of 2·8³, is
        # 6·1024·⌈f'/8⌉·⌈d'/8⌉·⌈b/8⌉ (`matmul.matmul_flop`); in floats (a bound only).
        b = B // (dp_r * self.m * s)
        fp, dp_ = f // tpf_r, d // tpm_r
        self.flop_blocks = (6.0 * 1024 * -(-fp // 8) * -(-dp_ // 8) * -(-b // 8))
        # Words the six matmuls move between HBM and L2 at least (`matmul.boundary_io` with
        # one tile row and column): each reads its two activations once, Σ = 6·(f'+d')·b;
        # weights that do not stay in L2 are read (W) or read and written (2W, weight
        # gradients): 8·f'·d' over the six.
        self.act_words = 6.0 * (fp + dp_) * b
        self.weight_words = 8.0 * fp * dp_
        self.per_stage_m = ((L // self.pp) * (s // self.EP) * self.m).astype(float)

    def degrees(self, g: int) -> tuple[int, int, int, int, int]:
        return (int(self.g_dp[g]), int(self.g_tpm[g]), int(self.g_tpf[g]), int(self.g_pp[g]),
                self.EP)


def _tp_pair(model: Model, x, y, cluster: Cluster, kinds: dict) -> tuple[float, float]:
    """`comm.tp_comm` for one (TP_model, TP_ff) split, reusing each kind's per-level times
    (`kinds`: this call's memo of `_allreduce_levels`, keyed by words and split)."""
    d, f, L, B = model.d, model.f, model.L, model.B
    bw1, lat1 = kinds.get((f, x)) or kinds.setdefault((f, x), _allreduce_levels(
        f, x, 2 * L, B, cluster))
    bw2, lat2 = kinds.get((d, y)) or kinds.setdefault((d, y), _allreduce_levels(
        d, y, 2 * L, B, cluster))
    bw_max, lat_sum = 0.0, 0.0
    for k in range(len(bw1)):
        bw_max = max(bw_max, bw1[k] + bw2[k])
        lat_sum += lat1[k] + lat2[k]
    return bw_max, lat_sum


@lru_cache(maxsize=None)
def _ep_terms(EP) -> tuple[tuple[int, float, float], ...]:
    """(level, bandwidth weight, latency weight) of the expert all-to-all, as
    `comm.ep_frequencies` gives them, in its order."""
    ep_bw, ep_lat = ep_frequencies(EP)
    return tuple((el, eb, ep_lat[el]) for el, eb in ep_bw.items())


@lru_cache(maxsize=None)
def _ppep_terms(L, v, PP, EP) -> tuple[tuple, tuple]:
    """The repeat counts of `comm.ppep_comm`'s double loop that are not exactly 0, in its
    order, with the level each is charged on: (bandwidth terms, latency terms). They do not
    depend on the model's width, the batch, the network's speeds or N."""
    ep_terms = _ep_terms(EP)
    bw, lat = [], []
    for pl, pf in pp_frequencies(L, v, PP).items():
        crossings = 2 * (L - 1) * pf   # the reference's 2·(L−1)·pf·w, left to right
        for el, eb, el_lat in ep_terms:
            level = pl if pl > el else el
            if level < 0:
                continue
            rs = crossings * eb
            if rs != 0.0:
                bw.append((level, rs))
            rs = crossings * el_lat
            if rs != 0.0:
                lat.append((level, rs))
    return tuple(bw), tuple(lat)


def _ppep_exact(model: Model, v, PP, EP, cluster: Cluster) -> tuple[float, float]:
    """`comm.ppep_comm`, operation for operation, leaving out the terms whose repeat count
    is exactly 0 (each would add +0.0, which changes no sum)."""
    d, B, N, by = model.d, model.B, cluster.N, cluster.machine.bytes_per_word
    levels = cluster.machine.levels
    bw_terms, lat_terms = _ppep_terms(model.L, v, PP, EP)
    bw_sum, lat_sum = 0.0, 0.0
    for level, rs in bw_terms:
        bw_sum += d * rs * B * by / (N * levels[level][0] / 2)
    for level, rs in lat_terms:
        lat_sum += rs * levels[level][1]
    return bw_sum, lat_sum


class _PlacedComm:
    """The communication parts of every placement of a layout, for one model on one cluster
    (one `best_plan` call). Each split's parts are memoised in dicts keyed by the split
    alone: cheaper than caches keyed by the model and cluster too (and across calls the
    model or N differs, so such caches would never hit)."""

    def __init__(self, model: Model, cluster: Cluster):
        self.model, self.cluster = model, cluster
        self.tp, self.ppep, self.dp, self.kinds = {}, {}, {}, {}

    def __call__(self, deg: tuple[int, ...], v: int):
        """(placement table, six arrays: tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat,
        one column per placement), or None when `deg` cannot be placed."""
        model, cluster = self.model, self.cluster
        table = placement_table(cluster.caps, deg)
        if table is None:
            return None
        parts = []
        for x, y in table.tp:
            got = self.tp.get((x, y))
            if got is None:
                got = self.tp[x, y] = _tp_pair(model, x, y, cluster, self.kinds)
            parts += got
        for x, y in table.ppep:
            got = self.ppep.get((v, x, y))
            if got is None:
                got = self.ppep[v, x, y] = _ppep_exact(model, v, x, y, cluster)
            parts += got
        for x in table.dp:
            got = self.dp.get(x)
            if got is None:
                got = self.dp[x] = _dp_exact(model.P, x, cluster)
            parts += got
        return table, tuple(np.array(parts, dtype=float).take(table.columns))


def _floors(model: Model, lay: _Layouts, cluster: Cluster):
    """Per group: each communication part at its own best split over the levels (six
    arrays, shaved; no placement does better on any part, so they bound every placement),
    and the TP and DP parts per degree on the innermost level ((groups, degrees, 2) arrays,
    shaved, for `_joint_bounds`)."""
    d, f, L, B, P = model.d, model.f, model.L, model.B, model.P
    levels, caps, N = cluster.machine.levels, cluster.caps, cluster.N
    by = cluster.machine.bytes_per_word
    g = math.gcd(f, d)
    tp = np.array([_tp_unit_inner(levels, caps, a, b, f // g, d // g) for a, b in lay.tp_keys],
                  dtype=float) * [SHAVE * (8 * L * B * by / N * g), SHAVE * (4 * L)]
    pe = np.array([_ppep_unit(levels, caps, pp, lay.EP, v, L) for pp, v in lay.pe_keys],
                  dtype=float).reshape(-1, 2)
    dp = np.array([_dp_unit_inner(levels, caps, x) for x in lay.dp_keys],
                  dtype=float) * [SHAVE * (4 * P * by / N), SHAVE]
    tp, dp = tp[lay.g_tp], dp[lay.g_dpk]
    # k·min(u) = min(k·u) exactly (rounding is monotone): these are the plain floors
    tp_best, dp_best = tp.min(axis=1), dp.min(axis=1)
    floors = (tp_best[:, 0], tp_best[:, 1], SHAVE * (4 * d * B * by / N) * pe[lay.g_pe, 0],
              SHAVE * pe[lay.g_pe, 1], dp_best[:, 0], dp_best[:, 1])
    return floors, (tp, dp, *_inner_pairs(caps))


def _joint_parts(floors, joint, gi: int) -> list[tuple[float, ...]]:
    """The six parts of `_joint_bounds` for group `gi`, one tuple per pair of innermost
    degrees that fit together (those no split reaches left out), as Python floats."""
    tp, dp, ia, ic = joint
    pe_bw, pe_lat = float(floors[2][gi]), float(floors[3][gi])
    return [(tb, tl, pe_bw, pe_lat, db, dl)
            for (tb, tl), (db, dl) in zip(tp[gi, ia].tolist(), dp[gi, ic].tolist())
            if tb < math.inf and db < math.inf]


def _step_formula(matmul, tp_bw, tp_lat, pe_bw, pe_lat, dp_bw, dp_lat, PP, m, v, zb,
                  flags) -> np.ndarray:
    """`reference.step_seconds` elementwise over arrays (or scalars), the same operations in
    the same order: from the exact parts the exact step, from lower bounds of the parts a
    lower bound of it (every operation is monotone)."""
    overlap_tp, overlap_pp, overlap_dp = flags
    z = (v - 1) * np.maximum(0, PP - m)
    bubble = np.where(zb, 0.0, (z + PP - 1) / (z + PP - 1 + v * m))
    hidden = (tp_bw if overlap_tp else 0.0) + (pe_bw if overlap_pp else 0.0)
    exposed = (0.0 if overlap_tp else tp_bw) + (0.0 if overlap_pp else pe_bw)
    pipe = (np.maximum(matmul, hidden) + exposed) / (1 - bubble)
    pipe = np.where(zb, pipe, pipe + (tp_lat + pe_lat))
    if overlap_dp:
        return np.maximum(pipe, dp_bw) + dp_lat
    return pipe + dp_bw + dp_lat


def _bounds(matmul, floors, lay: _Layouts, flags, rows=slice(None)) -> np.ndarray:
    """A lower bound on the step of each row, each part at its own best split."""
    group = lay.group[rows]
    return _step_formula(matmul, *(x[group] for x in floors), lay.pp[rows], lay.m[rows],
                         lay.v[rows], lay.zb[rows], flags)


def _joint_bounds(matmul, floors, joint, lay: _Layouts, flags, rows) -> np.ndarray:
    """A tighter lower bound on the step of each row: TP and DP share the innermost level
    (their degrees there multiply to at most its size), so the bound is the least over
    the pairs of innermost degrees that fit together of each part at its best split with
    that degree there. When TP fills a node, DP's all-reduce must leave it."""
    tp, dp, ia, ic = joint
    group = lay.group[rows]
    t, u = tp[group], dp[group]

    def col(x):
        return x[:, None]

    return _step_formula(col(matmul), t[:, ia, 0], t[:, ia, 1], col(floors[2][group]),
                         col(floors[3][group]), u[:, ic, 0], u[:, ic, 1], col(lay.pp[rows]),
                         col(lay.m[rows]), col(lay.v[rows]), col(lay.zb[rows]),
                         flags).min(axis=1)


@lru_cache(maxsize=None)
def _tp_unit_any(levels, caps, shapes, f, d) -> np.ndarray:
    """`_tp_unit_inner` at the best of the TP shapes (each part and innermost product on
    its own)."""
    return np.minimum.reduce([_tp_unit_inner(levels, caps, a, b, f, d) for a, b in shapes])


@lru_cache(maxsize=None)
def _ppep_unit_any(levels, caps, PP, EP, L, schedules) -> tuple[float, float]:
    """`_ppep_unit` at the best of PP's schedules (each part on its own)."""
    units = [_ppep_unit(levels, caps, PP, EP, v, L) for _, v in _schedules(schedules, PP, L)]
    return min(u[0] for u in units), min(u[1] for u in units)


@lru_cache(maxsize=None)
def _tp_units(levels, caps, tp_g: int, d: int, f: int) -> np.ndarray:
    """`_tp_unit_any` of each TP degree of `_tp_rows(tp_g, d, f)`, as one (degrees, innermost
    products, 2) array (one cache lookup per call instead of one per degree)."""
    g = math.gcd(f, d)
    out = np.array([_tp_unit_any(levels, caps, x, f // g, d // g)
                    for x in _tp_rows(tp_g, d, f)[1]], dtype=float)
    out = out.reshape(-1, len(_inner(caps)), 2)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=None)
def _ppep_units(levels, caps, pp_g: int, EP: int, L: int, schedules) -> np.ndarray:
    """`_ppep_unit_any` of each PP degree (divisors of `pp_g`, descending), as one array."""
    out = np.array([_ppep_unit_any(levels, caps, pp, EP, L, schedules)
                    for pp in divisors(pp_g)[::-1]], dtype=float).reshape(-1, 2)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=None)
def _schedule_kinds(schedules, pps: tuple[int, ...], L: int) -> tuple[np.ndarray, np.ndarray]:
    """Per PP: whether it has a zero-bubble schedule, and whether it has another one."""
    kinds = [_schedules(schedules, int(x), L) for x in pps]
    return (np.array([any(zb for zb, _ in k) for k in kinds], dtype=bool),
            np.array([any(not zb for zb, _ in k) for k in kinds], dtype=bool))


def _pair_comm_bounds(model: Model, pairs: _Pairs, cluster: Cluster,
                      schedules: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """Each communication part of each (TP, DP, PP) triple at its best split, TP shape and
    schedule, per pair of TP and DP degrees on the innermost level that fit together
    (shaved): tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat."""
    d, f, L, B, P = model.d, model.f, model.L, model.B, model.P
    levels, caps, N = cluster.machine.levels, cluster.caps, cluster.N
    by = cluster.machine.bytes_per_word
    g = math.gcd(f, d)
    ia, ic = _inner_pairs(caps)
    tp = _tp_units(levels, caps, pairs.tp_g, d, f)
    pe = _ppep_units(levels, caps, pairs.pp_g, pairs.EP, L, schedules)
    dp = np.array([_dp_unit_inner(levels, caps, x) for x in pairs.dp_keys])[pairs.dp_index]
    ti, pj = pairs.ti, pairs.pj
    tp = tp[ti][:, ia]  # (triples, innermost pairs that fit, 2)
    dp = dp[:, ic]
    tp_bw = SHAVE * (8 * L * B * by / N * g) * tp[:, :, 0]
    tp_lat = SHAVE * (4 * L) * tp[:, :, 1]
    pe_bw = (SHAVE * (4 * d * B * by / N) * pe[pj, 0])[:, None]
    pe_lat = (SHAVE * pe[pj, 1])[:, None]
    dp_bw = SHAVE * (4 * P * by / N) * dp[:, :, 0]
    dp_lat = SHAVE * dp[:, :, 1]
    return tp_bw, tp_lat, pe_bw, pe_lat, dp_bw, dp_lat


def _pair_bounds(model: Model, pairs: _Pairs, cluster: Cluster, settings: Settings) -> np.ndarray:
    """A lower bound on the step of every row of each (TP, DP, PP) triple, with TP and DP
    sharing the innermost level as in `_joint_bounds`."""
    L, s, B = model.L, model.s, model.B
    machine, pj, ti = cluster.machine, pairs.pj, pairs.ti
    schedules, flags = tuple(settings.schedules), _overlaps(settings)
    tp_bw, tp_lat, pe_bw, pe_lat, dp_bw, dp_lat = _pair_comm_bounds(model, pairs, cluster,
                                                                    schedules)
    PP = pairs.PPa[pj]
    per_stage = (L // PP) * (s // pairs.EP)
    per_gpu = B // (s * pairs.DPp)
    flop = (per_stage * (pairs.min_area[ti] * (per_gpu / 8) * machine.s_per_flop))[:, None]
    # m ≥ PP micro-batches, six latencies each
    fixed = (per_stage * (PP * machine.six_latencies_s))[:, None]
    overlap_tp, overlap_pp, overlap_dp = flags
    hidden = (tp_bw if overlap_tp else 0.0) + (pe_bw if overlap_pp else 0.0)
    exposed = (0.0 if overlap_tp else tp_bw) + (0.0 if overlap_pp else pe_bw)

    def step(matmul, latency):
        pipe = np.maximum(matmul, hidden) + exposed + latency
        if overlap_dp:
            return np.maximum(pipe, dp_bw) + dp_lat
        return pipe + dp_bw + dp_lat

    # Zero-bubble rows hide the TP/PP latency but need m ≥ 2·PP; the others pay it. Each
    # triple takes the lower bound of the kinds of schedule its PP has.
    has_zb, has_other = _schedule_kinds(schedules, tuple(pairs.pps), L)
    has_zb, has_other = has_zb[pj, None], has_other[pj, None]
    return np.minimum(np.where(has_other, step(flop + fixed, tp_lat + pe_lat), math.inf),
                      np.where(has_zb, step(flop + 2 * fixed, 0.0), math.inf)).min(axis=1)


def _overlaps(settings: Settings) -> tuple[bool, bool, bool]:
    """Which parts overlap the matmuls: (TP, PP/EP, DP), as `_step_formula` takes them."""
    return settings.overlap_tp, settings.overlap_pp, settings.overlap_dp


def best_plan(gpu: GPU, model: Model, settings: Settings, N: int,
              max_step: float = math.inf) -> Plan | None:
    """The fastest layout of `model` on `N` GPUs, identical to `reference.best_plan`.

    With `max_step`, layouts that cannot beat it are skipped and None means "none does".
    """
    return _best_plan(Cluster.of(Machine.of(gpu), N), model, settings, max_step)


def _best_plan(cluster: Cluster, model: Model, settings: Settings,
               max_step: float) -> Plan | None:
    """`best_plan` on a machine read already (`size_cluster` reads it once per model)."""
    rows = _bounded_rows(cluster, model, settings, max_step)
    if rows is None:
        return None
    groups = _Groups(rows, cluster, model, settings)
    best = _best_first(rows, groups, model.D / model.B, max_step)
    if best is None or best.step > max_step:
        return None
    return best.plan(cluster.N, settings)


class _Rows(NamedTuple):
    """The rows of one cluster's layouts that bounds 0 and 1 leave, and what the best-first
    search reads of them."""

    lay: _Layouts
    floors: tuple        # per group, each communication part at its best split (`_floors`)
    joint: tuple         # per group, TP and DP per innermost degree (`_floors`)
    low: np.ndarray      # per row, bound 1
    order: np.ndarray    # the rows left, bound 1 ascending
    traffic: np.ndarray  # per group, the least bandwidth time over the run of any placement


def _bounded_rows(cluster: Cluster, model: Model, settings: Settings,
                  max_step: float) -> _Rows | None:
    """The layouts whose bounds 0 and 1 do not exceed `max_step` (None if none is left)."""
    pairs = _Pairs(model, cluster)
    if not len(pairs.ti):
        return None
    keep = slice(None)
    if max_step < math.inf:
        # Bound 0, per (TP, DP, PP): FLOP at the sustained rate (m·⌈b/8⌉ ≥ B/(s·DP)/8, m ≥
        # PP) and each communication part at its best split, TP shape and schedule; no
        # bubble, and no TP/PP latency if a zero-bubble schedule may hide it. It bounds
        # every row of the triple, so triples above the deadline are never expanded.
        keep = np.flatnonzero(_pair_bounds(model, pairs, cluster, settings) <= max_step)
        if not len(keep):
            return None
    lay = _Layouts(pairs, keep, model, tuple(settings.schedules))
    if not len(lay.m):
        return None
    floors, joint = _floors(model, lay, cluster)
    low, alive = _row_bounds(lay, floors, joint, cluster.machine, _overlaps(settings), max_step)
    if not len(alive):
        return None
    # The bandwidth time over the run that any placement of a group needs at least: on an
    # exact tie in run time, a row whose floor exceeds the best's cannot win.
    n_steps = model.D / model.B
    traffic = n_steps * floors[0] + n_steps * floors[4] + n_steps * floors[2]
    return _Rows(lay, floors, joint, low, alive[np.argsort(low[alive], kind="stable")], traffic)


def _row_bounds(lay: _Layouts, floors, joint, machine: Machine, flags,
                max_step: float) -> tuple[np.ndarray, np.ndarray]:
    """Bound 1 of every row, and the rows it keeps within `max_step`.

    The six matmuls at their FLOP at the sustained rate plus their fixed latency (shaved by
    1e-9 so float rounding can never lift it above the exact time), with each communication
    part at its own best split; then, for the rows that leaves, with TP and DP sharing the
    innermost level (`_joint_bounds`). A matmul takes at least its FLOP time and at least
    its HBM traffic time, so the six take at least the larger of the two sums.
    """
    by = machine.bytes_per_word
    io_words = lay.act_words + np.where(lay.weight_words / 4 * by > machine.chip.l2_cap,
                                        lay.weight_words, 0.0)
    matmul1 = lay.per_stage_m * (np.maximum(lay.flop_blocks * machine.s_per_flop,
                                            io_words * machine.s_per_hbm_word)
                                 + machine.six_latencies_s)
    low = _bounds(matmul1, floors, lay, flags)
    alive = np.flatnonzero(low <= max_step)
    low[alive] = _joint_bounds(matmul1[alive], floors, joint, lay, flags, alive)
    return low, alive[low[alive] <= max_step]


class _Queue:
    """The rows best first, from two sources: the rows at bound 1 in ascending order (a
    sorted array, read as Python values a chunk at a time) and a heap of rows at bound 2.
    An entry is (bound, row, group, m, matmul): matmul is None at bound 1."""

    CHUNK = 64
    __slots__ = ("rows", "at", "base", "chunk", "heap")

    def __init__(self, rows: _Rows):
        self.rows, self.at, self.base, self.chunk, self.heap = rows, 0, -self.CHUNK, None, []

    def push(self, entry: tuple) -> None:
        heapq.heappush(self.heap, entry)

    def pop(self) -> tuple | None:
        at, heap = self.at, self.heap
        if at < len(self.rows.order):
            if at >= self.base + self.CHUNK:
                self._read(at)
            bounds, idx, group, m = self.chunk
            k = at - self.base
            if not heap or bounds[k] <= heap[0][0]:
                self.at = at + 1
                return bounds[k], idx[k], group[k], m[k], None
        return heapq.heappop(heap) if heap else None

    def _read(self, at: int) -> None:
        self.base = at
        sl = self.rows.order[at:at + self.CHUNK]
        lay = self.rows.lay
        self.chunk = (self.rows.low[sl].tolist(), sl.tolist(), lay.group[sl].tolist(),
                      lay.m[sl].tolist())


def _best_first(rows: _Rows, groups: _Groups, n_steps: float,
                max_step: float) -> _Candidate | None:
    """The best row and placement, rows taken best first: a row comes up at bound 1 and is
    queued again at bound 2 (its exact matmul time in place of the FLOP bound); when it
    comes up again, every placement of it on the real levels is timed. Nothing still
    queued can beat the best once the smallest bound left exceeds it (in run time, as
    `reference.tie_key` compares), and on an exact tie in run time a row whose bandwidth
    floor exceeds the best's, or that comes later, cannot win."""
    queue = _Queue(rows)
    best = None
    while (entry := queue.pop()) is not None:
        bound, idx, gi, m, matmul = entry
        if best is None:
            if bound > max_step:
                break
        else:
            run = n_steps * bound
            if run > best.key[0]:
                break
            if run == best.key[0] and (float(rows.traffic[gi]), idx) > best.key[1:3]:
                continue
        if matmul is None:
            queue.push(groups.bound2(idx, gi, m))
            continue
        found = groups.fastest_placement(idx, gi, m, matmul, best)
        if found is not None:
            best = found
    return best


class _Candidate(NamedTuple):
    """A row at its fastest placement, and the key it wins on."""

    key: tuple[float, float, int, int]  # `reference.tie_key`, then the row and placement
    degrees: tuple[int, int, int, int, int]  # DP, TP_model, TP_ff, PP, EP
    m: int
    v: int
    zb: bool
    place: tuple[tuple[int, ...], ...]  # `place[type][level]`
    matmul: float
    comm: tuple[float, ...]  # tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat
    step: float

    def plan(self, N: int, settings: Settings) -> Plan:
        DP, TPm, TPf, PP, EP = self.degrees
        t = combine(self.matmul, *self.comm, PP, self.m, self.v, self.zb, settings)
        return Plan(N, DP, TPm, TPf, PP, EP, self.m, self.v, self.zb, tuple(zip(*self.place)),
                    t)


class _Groups:
    """What the best-first search works out once per group (a layout's degrees, v and
    zero-bubble: the rows that share a placement table), within one `best_plan` call."""

    def __init__(self, rows: _Rows, cluster: Cluster, model: Model, settings: Settings):
        self.rows, self.model, self.chip = rows, model, cluster.machine.chip
        self.flags, self.n_steps = _overlaps(settings), model.D / model.B
        self.placed_comm = _PlacedComm(model, cluster)
        self.layouts, self.joint_parts, self.placed = {}, {}, {}

    def layout(self, gi: int) -> tuple[tuple[int, ...], int, bool]:
        """(degrees, v, zero-bubble) of group `gi`."""
        got = self.layouts.get(gi)
        if got is None:
            lay = self.rows.lay
            got = self.layouts[gi] = (lay.degrees(gi), int(lay.g_v[gi]), bool(lay.g_zb[gi]))
        return got

    def bound2(self, idx: int, gi: int, m: int) -> tuple:
        """The queue entry of row `idx` at bound 2: `_joint_bounds` with the exact matmul
        time in place of its FLOP bound."""
        (DP, TPm, TPf, PP, EP), v, zb = self.layout(gi)
        d, f, L, s, B = self.model.d, self.model.f, self.model.L, self.model.s, self.model.B
        matmul = (L // PP) * (s // EP) * m * _six_matmuls(self.chip, f // TPf, d // TPm,
                                                          B // (DP * m * s))
        parts = self.joint_parts.get(gi)
        if parts is None:
            parts = self.joint_parts[gi] = _joint_parts(self.rows.floors, self.rows.joint, gi)
        low2 = min((step_seconds(matmul, *x, PP, m, v, zb, *self.flags)[0] for x in parts),
                   default=math.inf)
        return low2, idx, gi, m, matmul

    def fastest_placement(self, idx: int, gi: int, m: int, matmul: float,
                          best: _Candidate | None) -> _Candidate | None:
        """Row `idx` at its fastest placement, if it beats `best` (`reference.tie_key`:
        run time, then bandwidth time over the run, then the earliest row and placement)."""
        deg, v, zb = self.layout(gi)
        if gi not in self.placed:
            self.placed[gi] = self.placed_comm(deg, v)
        if self.placed[gi] is None:
            return None
        table, comm = self.placed[gi]
        n_steps = self.n_steps
        steps = _step_formula(matmul, *comm, deg[3], m, v, zb, self.flags)
        runs = n_steps * steps
        run = float(runs.min())
        if best is not None and run > best.key[0]:
            return None
        ties = np.flatnonzero(runs == run)
        tp_bw, _, ppep_bw, _, dp_bw, _ = (c[ties] for c in comm)
        moved = n_steps * tp_bw + n_steps * dp_bw + n_steps * ppep_bw
        least = float(moved.min())
        p = int(ties[np.flatnonzero(moved == least)[0]])
        key = (run, least, idx, p)
        if best is not None and not key < best.key:
            return None
        return _Candidate(key, deg, m, v, zb, table.place(p), matmul,
                          tuple(float(c[p]) for c in comm), float(steps[p]))


def step_floor(machine: Machine, model: Model, N: int) -> float:
    """A lower bound on the step of every layout of `model` on `N` GPUs, from its matmuls
    alone: the FLOP of one step spread over the N GPUs at the sustained rate (2·f'·d'·b per
    matmul, six per layer and micro-batch; padding only adds), plus six matmul latencies
    for each of the ≥ L layer-micro-batches of a GPU (m ≥ PP micro-batches on L/PP layers).
    With one expert the micro-batches cover all B tokens; with s experts B/(s·DP) is rounded
    down, losing fewer than s·DP ≤ N of them. Shaved by 1e-9, as bound 1 is."""
    chip = machine.chip
    tokens = model.B if model.s == 1 else max(0, model.B - N)
    flop = 12 * model.L * model.f * model.d * tokens / (N * chip.sustained_flops)
    return SHAVE_9 * (flop + 6 * model.L * chip.latency_per_matmul_s)


def _largest_degrees(model: Model) -> tuple[int, int]:
    """The largest TP and PP degrees any N = s·2^i allows: the powers of two in d·f and L."""
    df = model.d * model.f
    return df & -df, model.L & -model.L


def latency_wall(machine: Machine, model: Model, settings: Settings) -> float:
    """A lower bound on the step of every layout on every N = s·2^i from one on where TP
    and PP can grow no further (`_largest_degrees`) and the inner levels are full
    (`Machine.inner_sizes`): whatever N, each GPU pays the matmul latencies of ≥ L
    layer-micro-batches (≥ 2L under zero-bubble) and, outside zero-bubble, TP's and PP's
    latencies at their best split; and TP·PP·EP GPUs must hold the weights (memory:
    N·HBM ≥ P·bytes·DP), which rules out the small degrees whose latencies are small."""
    L, d, f, EP = model.L, model.d, model.f, model.s
    levels, caps = machine.levels, machine.inner_sizes
    tp_g, pp_g = _largest_degrees(model)
    schedules = tuple(settings.schedules)
    tps = np.array(_tp_rows(tp_g, d, f)[0], dtype=float)
    pps = divisors(pp_g)[::-1]
    tp_lat = SHAVE * (4 * L) * _tp_units(levels, caps, tp_g, d, f)[:, :, 1].min(axis=1)
    pe_lat = SHAVE * _ppep_units(levels, caps, pp_g, EP, L, schedules)[:, 1]
    has_zb, has_other = _schedule_kinds(schedules, pps, L)
    lat6 = machine.six_latencies_s
    holds = (tps[:, None] * np.array(pps, dtype=float) * (EP * machine.hbm_bytes * (1 + 1e-9))
             >= model.P * machine.bytes_per_word)
    step = np.minimum(np.where(has_other, L * lat6 + (tp_lat[:, None] + pe_lat), math.inf),
                      np.where(has_zb, 2 * L * lat6, math.inf))
    return float(step[holds].min()) if holds.any() else math.inf


def _last_step_in_time(T: float, steps: float) -> float:
    """The largest step that still finishes in time (`steps · step < T`), to the last bit."""
    max_step = T / steps
    while steps * max_step >= T:
        max_step = math.nextafter(max_step, 0.0)
    while steps * math.nextafter(max_step, math.inf) < T:
        max_step = math.nextafter(max_step, math.inf)
    return max_step


def size_cluster(gpu: GPU, model: Model, settings: Settings) -> Plan | None:
    """Smallest `N = s·2^i` that finishes within the duration; None past the latency wall."""
    machine = Machine.of(gpu)
    T = settings.duration_s
    need = model.C / (T * machine.chip.sustained_flops)
    steps = model.D / model.B
    max_step = _last_step_in_time(T, steps)
    # Past the latency wall no larger cluster helps either: from the size on where TP and
    # PP have all the degrees they can take and the inner levels are full, one bound holds
    # for every larger N. It is checked once, after the first such size fails (cheap then:
    # its caches are warm from that size's search).
    wall_from = max(model.s * max(_largest_degrees(model)), math.prod(machine.inner_sizes))
    wall_checked = False
    for i in range(60):
        N = model.s * 2**i
        if N < need or step_floor(machine, model, N) > max_step:
            continue
        plan = _best_plan(Cluster.of(machine, N), model, settings, max_step)
        if plan is not None and steps * plan.time.step < T:
            return plan
        if N >= wall_from and not wall_checked:
            wall_checked = True
            if latency_wall(machine, model, settings) > max_step:
                return None
    return None
