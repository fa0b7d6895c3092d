"""The search of spec §6, fast: same candidates, same arithmetic, far fewer evaluations.

Three things make it fast while keeping every result bit-identical to `reference`:

* caching — matmul times, divisors, placements and each parallelism type's communication
  are pure functions of small hashable arguments, so each is computed once;
* ordering — every candidate layout first gets the spec's optimistic time (one network
  level with all the bandwidth and the smallest latency, a lower bound on its real time);
  candidates are then tried cheapest-bound first and the search stops at the first bound
  that exceeds the best real time, since nothing after it can win;
* a deadline — when sizing a cluster, a layout whose bound already misses the run's
  duration cannot make the cluster feasible, so it is never placed on the levels.

Ties are settled as in the reference: the earliest candidate in the spec's enumeration
order wins among equal (step, exposed) times, so the order of evaluation does not matter.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache

from helpers.hardware import GPU

from .comm import dp_comm, ppep_comm, tp_comm
from .matmul import matmul_time, tile
from .plan import Plan, StepTime
from .reference import combine, level_capacities, schedule_options, step_seconds
from .scaling import Model
from .settings import Settings

_GPUS: dict[int, GPU] = {}
_GPU_IDS: dict[tuple, int] = {}


def _gpu_key(gpu: GPU) -> int:
    """A small hashable stand-in for a GPU (its record holds a dict, so it has no hash)."""
    key = (gpu.name, gpu.bitwidth, tuple(sorted(gpu.flop_per_clock_per_thread.items())),
           gpu.register_bytes_per_processing_block, gpu.num_sms, gpu.l2_Bps, gpu.l2_bytes,
           gpu.hbm_Bps, gpu.hbm_bytes, gpu.max_clock_Hz, gpu.effective_utilization,
           gpu.distributed_shared_memory, gpu.latency_per_matmul_s, gpu.network_levels)
    gk = _GPU_IDS.setdefault(key, len(_GPU_IDS))
    _GPUS[gk] = gpu
    return gk


@lru_cache(maxsize=None)
def _matmul(gk: int, d1: int, d2: int, b: int, weight_grad: bool) -> float:
    return matmul_time(_GPUS[gk], d1, d2, b, weight_grad)


@lru_cache(maxsize=None)
def _six_matmuls(gk: int, fp: int, dp_: int, b: int) -> float:
    """The six matmuls of one layer and microbatch, summed in the reference's order."""
    a, c = _matmul(gk, fp, dp_, b, False), _matmul(gk, dp_, fp, b, False)
    return (a + c + _matmul(gk, fp, dp_, b, True) + c + a + _matmul(gk, dp_, fp, b, True))


@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    from .reference import divisors as slow
    return tuple(slow(n))


@lru_cache(maxsize=None)
def _level_splits(cap: int, limits: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Ordered factorizations of `cap` whose t-th factor divides `limits[t]`, in the order of
    the unconstrained enumeration (first factor ascending) with the misfits left out."""
    if len(limits) == 1:
        return ((cap,),) if limits[0] % cap == 0 else ()
    return tuple((a,) + rest for a in divisors(math.gcd(cap, limits[0]))
                 for rest in _level_splits(cap // a, limits[1:]))


@lru_cache(maxsize=None)
def _placements(caps: tuple[int, ...], degrees: tuple[int, ...]) -> tuple:
    """Every split of the degrees over the levels as `place[type][level]`, reference order."""
    partial = [((), degrees)]  # (factors on the levels so far, what each type has left)
    for cap in caps:
        partial = [(done + (fac,), tuple(r // x for r, x in zip(left, fac)))
                   for done, left in partial for fac in _level_splits(cap, left)]
    return tuple(tuple(tuple(lv[t] for lv in done + (left,)) for t in range(5))
                 for done, left in partial)


class _Level(tuple):
    """A network level as a plain tuple: hashing it is what every cache lookup pays for."""

    __slots__ = ()
    bandwidth_Bps = property(lambda self: self[0])
    latency_s = property(lambda self: self[1])


def _plain_levels(levels) -> tuple[_Level, ...]:
    return tuple(_Level((lv.bandwidth_Bps, lv.latency_s)) for lv in levels)


_dp = lru_cache(maxsize=None)(dp_comm)
_tp = lru_cache(maxsize=None)(tp_comm)
_ppep = lru_cache(maxsize=None)(ppep_comm)


def clear_caches() -> None:
    """Forget every cached result (for honest cold-start benchmarks)."""
    for fn in (tile, _matmul, _six_matmuls, divisors, _microbatches, _level_splits, _placements,
               _dp, _tp, _ppep, _splits, _dp_floor, _tp_floor, _ppep_floor):
        fn.cache_clear()
    _GPUS.clear()
    _GPU_IDS.clear()


def _comm(model: Model, levels, place, v, N, by):
    DP, TPm, TPf, PP, EP = place
    return (_tp(model.d, model.f, model.L, model.B, TPm, TPf, levels, N, by)
            + _ppep(model.d, model.L, model.B, v, PP, EP, levels, N, by)
            + _dp(model.P, DP, levels, N, by))


@lru_cache(maxsize=None)
def _microbatches(per_gpu: int, PP: int, zb: bool) -> tuple[int, ...]:
    """The first 4 (1 under ZB) divisors of the per-replica batch that fill the pipeline."""
    lo = 2 * PP if zb else PP
    return tuple(x for x in divisors(per_gpu) if x >= lo)[:1 if zb else 4] if per_gpu else ()


def _candidates(gpu: GPU, model: Model, settings: Settings, N: int):
    """The spec's layouts for N GPUs in its enumeration order, grouped by (degrees, v):
    yields (degrees, v, zb, microbatch counts)."""
    d, f, L, s, B, P = model.d, model.f, model.L, model.s, model.B, model.P
    by = gpu.bytes_per_word
    EP = math.gcd(N, s)
    R = N // EP
    for TP in divisors(math.gcd(R, d * f)):
        r = math.isqrt(TP)
        tp_shapes = [(TP // x, x) for x in divisors(TP)
                     if r <= x <= 4 * r and d % (TP // x) == 0 and f % x == 0]
        if not tp_shapes:
            continue
        for DP in divisors(math.gcd(R // TP, B)):
            PP = R // TP // DP
            if L % PP or N * gpu.hbm_bytes < P * by * DP + 4 * P * by:
                continue
            per_gpu = B // (s * DP)
            for TPm, TPf in tp_shapes:
                for zb, v in schedule_options(settings, PP, L):
                    yield (DP, TPm, TPf, PP, EP), v, zb, _microbatches(per_gpu, PP, zb)


def _placed(model: Model, levels, caps, deg, v, N, by):
    """The placements of one layout worth trying, and the per-part minimum of their costs.

    A placement whose six communication parts are all at least those of an earlier one can
    never win (the step only grows with each part, and ties go to the earlier), so only the
    others are kept, in order.
    """
    front = []
    for p_idx, place in enumerate(_placements(caps, deg)):
        comm = _comm(model, levels, place, v, N, by)
        if not any(all(a <= b for a, b in zip(kept[2], comm)) for kept in front):
            front.append((p_idx, place, comm))
    return front


@lru_cache(maxsize=None)
def _splits(caps: tuple[int, ...], degree: int) -> tuple[tuple[int, ...], ...]:
    """Every way one type's degree can sit on the levels, ignoring the other types."""
    out = [()]
    for cap in caps:
        out = [t + (x,) for t in out for x in divisors(math.gcd(cap, degree // math.prod(t)))]
    return tuple(t + (degree // math.prod(t),) for t in out)


def _floor2(results):
    return min(r[0] for r in results), min(r[1] for r in results)


@lru_cache(maxsize=None)
def _dp_floor(P, DP, levels, caps, N, by):
    return _floor2([_dp(P, x, levels, N, by) for x in _splits(caps, DP)])


@lru_cache(maxsize=None)
def _tp_floor(d, f, L, B, TPm, TPf, levels, caps, N, by):
    return _floor2([_tp(d, f, L, B, a, b, levels, N, by)
                    for a in _splits(caps, TPm) for b in _splits(caps, TPf)
                    if all(cap % (x * y) == 0 for cap, x, y in zip(caps, a, b))])


@lru_cache(maxsize=None)
def _ppep_floor(d, L, B, v, PP, EP, levels, caps, N, by):
    return _floor2([_ppep(d, L, B, v, a, b, levels, N, by)
                    for a in _splits(caps, PP) for b in _splits(caps, EP)
                    if all(cap % (x * y) == 0 for cap, x, y in zip(caps, a, b))])


def best_plan(gpu: GPU, model: Model, settings: Settings, N: int,
              max_step: float = math.inf) -> Plan | None:
    """The fastest layout of `model` on `N` GPUs, identical to `reference.best_plan`.

    With `max_step`, layouts that cannot beat it are skipped and None means "none does".
    """
    gk = _gpu_key(gpu)
    levels = _plain_levels(gpu.network_levels)
    by = gpu.bytes_per_word
    caps = tuple(level_capacities(gpu.network_levels, N))
    flags = (settings.overlap_tp, settings.overlap_pp, settings.overlap_dp)
    L, s, B, d, f = model.L, model.s, model.B, model.d, model.f

    # Best-first: each candidate enters the queue keyed by its matmul time, a lower bound on
    # any step it can reach; when popped it is re-queued under a tighter bound (each part of
    # the communication at its own best split), and when popped again it is placed on the
    # real levels. The search ends when the smallest bound left exceeds the best real step:
    # nothing still queued can beat it.
    queue = []
    idx = 0
    for deg, v, zb, ms in _candidates(gpu, model, settings, N):
        DP, TPm, TPf, PP, EP = deg
        for m in ms:
            matmul = (L // PP) * (s // EP) * m * _six_matmuls(gk, f // TPf, d // TPm,
                                                              B // (DP * m * s))
            if matmul <= max_step:
                queue.append((matmul, 0, idx, deg, v, zb, m, matmul))
            idx += 1
    heapq.heapify(queue)

    groups: dict = {}
    floors: dict = {}
    best_key = None
    best = None
    while queue:
        bound, stage, idx, deg, v, zb, m, matmul = heapq.heappop(queue)
        if bound > (max_step if best_key is None else best_key[0]):
            break
        PP = deg[3]
        if stage == 0:
            floor = floors.get((deg, v))
            if floor is None:
                # Each part of the communication at its own best split over the levels.
                DP, TPm, TPf, PP, EP = deg
                floor = floors[deg, v] = (
                    _tp_floor(d, f, L, B, TPm, TPf, levels, caps, N, by)
                    + _ppep_floor(d, L, B, v, PP, EP, levels, caps, N, by)
                    + _dp_floor(model.P, DP, levels, caps, N, by))
            low, _ = step_seconds(matmul, *floor, PP, m, v, zb, *flags)
            heapq.heappush(queue, (low, 1, idx, deg, v, zb, m, matmul))
            continue
        group = groups.get((deg, v))
        if group is None:
            group = groups[deg, v] = _placed(model, levels, caps, deg, v, N, by)
        for p_idx, place, comm in group:
            step, _ = step_seconds(matmul, *comm, PP, m, v, zb, *flags)
            key = (step, step - matmul, idx, p_idx)
            if best_key is None or key < best_key:
                best_key = key
                best = (deg, m, v, zb, place, matmul, comm)
    if best is None or best_key[0] > max_step:
        return None
    (DP, TPm, TPf, PP, EP), m, v, zb, place, matmul, comm = best
    t = combine(matmul, *comm, PP, m, v, zb, settings)
    return Plan(N, DP, TPm, TPf, PP, EP, m, v, zb, tuple(zip(*place)), t)


def size_cluster(gpu: GPU, model: Model, settings: Settings) -> Plan | None:
    """Smallest `N = s·2^i` that finishes within the duration; None past the latency wall."""
    T = settings.duration_s
    need = model.C / (T * gpu.sustained_flops)
    steps = model.D / model.B
    # The largest step that still finishes in time: `steps · step < T`.
    max_step = T / steps
    while steps * max_step >= T:
        max_step = math.nextafter(max_step, 0.0)
    while steps * math.nextafter(max_step, math.inf) < T:
        max_step = math.nextafter(max_step, math.inf)
    for i in range(60):
        N = model.s * 2**i
        if N < need:
            continue
        plan = best_plan(gpu, model, settings, N, max_step)
        if plan is not None and steps * plan.time.step < T:
            return plan
    return None
