"""The model transcribed directly (§4–§6): slow, plain, and the yardstick for `search`.

Nothing here is vectorised or pruned beyond what the model says (only `matmul.tile`, a pure
function of the weight shape, is cached); `tests/test_simulator.py` checks that the fast
search returns exactly these plans. Read this file to see the model; read `search.py` to see it fast.
"""
from __future__ import annotations

import math

from helpers.hardware import GPU, NetworkLevel

from .comm import dp_comm, ppep_comm, tp_comm
from .matmul import matmul_time
from .plan import Plan, StepTime
from .scaling import Model
from .settings import Settings


def divisors(n: int) -> list[int]:
    """Ascending divisors of `n` (the numbers here are k·2^i with k small, so trial division
    of the odd part is quick)."""
    primes = {}
    while n % 2 == 0:
        primes[2] = primes.get(2, 0) + 1
        n //= 2
    p = 3
    while p * p <= n:
        while n % p == 0:
            primes[p] = primes.get(p, 0) + 1
            n //= p
        p += 2
    if n > 1:
        primes[n] = primes.get(n, 0) + 1
    out = [1]
    for p, e in primes.items():
        out = [x * p**i for x in out for i in range(e + 1)]
    return sorted(out)


def comm_times(model: Model, levels, place, v, N, by):
    """(tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat) for degrees `place[type][level]`."""
    DP, TPm, TPf, PP, EP = place
    tp_bw, tp_lat = tp_comm(model.d, model.f, model.L, model.B, TPm, TPf, levels, N, by)
    ppep_bw, ppep_lat = ppep_comm(model.d, model.L, model.B, v, PP, EP, levels, N, by)
    dp_bw, dp_lat = dp_comm(model.P, DP, levels, N, by)
    return tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat


def step_time(gpu: GPU, model: Model, settings: Settings, levels, place, m, v, zb, N) -> StepTime:
    """Spec §5 for one layout; `place[type][level]` are the degrees per network level."""
    d, f, L, s, B = model.d, model.f, model.L, model.s, model.B
    DP, TPm, TPf, PP, EP = (math.prod(x) for x in place)
    b = B // (DP * m * s)
    fp, dp_ = f // TPf, d // TPm
    six = (matmul_time(gpu, fp, dp_, b) + matmul_time(gpu, dp_, fp, b)
           + matmul_time(gpu, fp, dp_, b, True) + matmul_time(gpu, dp_, fp, b)
           + matmul_time(gpu, fp, dp_, b) + matmul_time(gpu, dp_, fp, b, True))
    matmul = (L // PP) * (s // EP) * m * six
    tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat = comm_times(
        model, levels, place, v, N, gpu.bytes_per_word)
    return combine(matmul, tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat, PP, m, v, zb,
                   settings)


def combine(matmul, tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat, PP, m, v, zb,
            settings: Settings) -> StepTime:
    """Overlap, bubble and latency rules that turn the parts into one step (docs/cost_model.md §5)."""
    step, bubble = step_seconds(matmul, tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat,
                                PP, m, v, zb, settings.overlap_tp, settings.overlap_pp,
                                settings.overlap_dp)
    return StepTime(matmul, tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat, bubble, step)


def bubble_fraction(PP: int, m: int, v: int, zb: bool) -> float:
    """Spec §5: 0 under zero-bubble; else (z + PP − 1)/(z + PP − 1 + v·m), z = (v−1)·max(0, PP − m)."""
    if zb:
        return 0.0
    z = (v - 1) * max(0, PP - m)
    return (z + PP - 1) / (z + PP - 1 + v * m)


def step_seconds(matmul, tp_bw, tp_lat, ppep_bw, ppep_lat, dp_bw, dp_lat, PP, m, v, zb,
                 overlap_tp, overlap_pp, overlap_dp) -> tuple[float, float]:
    """(step, bubble fraction): the arithmetic of `combine`, without building a record."""
    bubble = bubble_fraction(PP, m, v, zb)
    hidden = (tp_bw if overlap_tp else 0.0) + (ppep_bw if overlap_pp else 0.0)
    exposed = (0.0 if overlap_tp else tp_bw) + (0.0 if overlap_pp else ppep_bw)
    pipe = (max(matmul, hidden) + exposed) / (1 - bubble)
    if not zb:  # zero-bubble schedules hide TP and PP latency in their slack
        pipe += tp_lat + ppep_lat
    if overlap_dp:
        return max(pipe, dp_bw) + dp_lat, bubble
    return pipe + dp_bw + dp_lat, bubble


def tie_key(t: StepTime, steps: float) -> tuple[float, float]:
    """What "faster" means in the search, as the public reference code decides it
    (`optimal_parallelism` in its optimal_parallelism.ipynb): the whole run's time
    (`steps` = D/B steps of `t.step` seconds); on an exact tie, strictly less bandwidth
    time of TP + DP + PP/EP over the run (latencies are not part of it). A candidate that
    ties on both keeps the earlier one in the enumeration order (the caller compares with
    `<`)."""
    return steps * t.step, steps * t.tp_bw + steps * t.dp_bw + steps * t.ppep_bw


def memory_ok(gpu: GPU, model: Model, N: int, DP: int) -> bool:
    by = gpu.bytes_per_word
    return N * gpu.hbm_bytes >= model.P * by * DP + 4 * model.P * by


def ordered_factorizations(n: int, parts: int):
    """Every tuple of `parts` positive integers with product `n`, first entry ascending first."""
    if parts == 1:
        yield (n,)
        return
    for a in divisors(n):
        for rest in ordered_factorizations(n // a, parts - 1):
            yield (a,) + rest


def level_capacities(levels, N: int) -> list[int]:
    """Sizes of the inner levels shrunk to an `N`-GPU cluster (the outermost takes the rest)."""
    caps, prod = [], 1
    for lv in levels[:-1]:
        c = lv.size if prod * lv.size <= N else N // prod
        caps.append(c)
        prod *= c
    return caps


def placements(levels, N: int, degrees):
    """Every split of the five degrees over the levels, as `place[type][level]`."""
    caps = level_capacities(levels, N)

    def rec(k, used):
        if k == len(caps):
            if all(deg % u == 0 for deg, u in zip(degrees, used)):
                outer = tuple(deg // u for deg, u in zip(degrees, used))
                yield [outer]
            return
        for fac in ordered_factorizations(caps[k], 5):
            nxt = tuple(u * x for u, x in zip(used, fac))
            if all(deg % u == 0 for deg, u in zip(degrees, nxt)):
                for rest in rec(k + 1, nxt):
                    yield [fac] + rest

    for per_level in rec(0, (1,) * 5):
        yield tuple(tuple(lv[t] for lv in per_level) for t in range(5))


def schedule_options(settings: Settings, PP: int, L: int):
    """(zero_bubble, v) pairs the settings allow, in the model's order: non-ZB first."""
    out = []
    if "interleaved" in settings.schedules:
        out.append((False, L // PP if PP > 1 else 1))
    if "1f1b" in settings.schedules and not (out and out[-1][1] == 1):
        out.append((False, 1))
    if "zero_bubble" in settings.schedules:
        out.append((True, 1))
    return out


def best_plan(gpu: GPU, model: Model, settings: Settings, N: int) -> Plan | None:
    """The fastest layout of `model` on `N` GPUs (docs/cost_model.md §6), or None if none fits."""
    d, f, L, s, B = model.d, model.f, model.L, model.s, model.B
    levels = gpu.network_levels
    optimistic = (NetworkLevel(sum(lv.bandwidth_Bps for lv in levels),
                               min(lv.latency_s for lv in levels)),)
    EP = math.gcd(N, s)
    R = N // EP
    steps = model.D / model.B
    best = None
    for TP in divisors(math.gcd(R, d * f)):
        for DP in divisors(math.gcd(R // TP, B)):
            PP = R // TP // DP
            if L % PP or not memory_ok(gpu, model, N, DP):
                continue
            r = math.isqrt(TP)
            for TPf in [x for x in divisors(TP) if r <= x <= 4 * r]:
                TPm = TP // TPf
                if d % TPm or f % TPf:
                    continue
                for zb, v in schedule_options(settings, PP, L):
                    lo = 2 * PP if zb else PP
                    ms = [x for x in divisors(B // (s * DP)) if x >= lo] if B // (s * DP) else []
                    for m in ms[:1 if zb else 4]:
                        degrees = (DP, TPm, TPf, PP, EP)
                        one = tuple((x,) for x in degrees)
                        t_opt = step_time(gpu, model, settings, optimistic, one, m, v, zb, N)
                        if best is not None and steps * t_opt.step > steps * best.time.step:
                            continue
                        for place in placements(levels, N, degrees):
                            t = step_time(gpu, model, settings, levels, place, m, v, zb, N)
                            if best is None or tie_key(t, steps) < tie_key(best.time, steps):
                                best = Plan(N, DP, TPm, TPf, PP, EP, m, v, zb,
                                            tuple(zip(*place)), t)
    return best


def size_cluster(gpu: GPU, model: Model, settings: Settings) -> Plan | None:
    """Smallest `N = s·2^i` that finishes within the duration (docs/cost_model.md §6); None = latency wall."""
    T = settings.duration_s
    need = model.C / (T * gpu.sustained_flops)
    for i in range(60):
        N = model.s * 2**i
        if N < need:
            continue
        plan = best_plan(gpu, model, settings, N)
        if plan is not None and model.D / model.B * plan.time.step < T:
            return plan
    return None
