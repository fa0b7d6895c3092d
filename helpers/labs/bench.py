"""Notebook 02's runs: benchmarking collectives on live ranks.

Rank functions (`time_collective`, `scheduler_waits`) run on live ranks
(`helpers.ranks.LiveRanks`) or under torchrun; the sweeps (`run_sweep`, and `run_small_sweep`
behind the widget) call them on live ranks, one call of the ranks per (p, op). The timing
itself is `helpers.parallel.bench`; the sizes, the estimator, the fit and the tables are
`helpers.cost.bench`; the figure and the widget are `helpers.views.bench`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from helpers.checks import check_int
from helpers.cost import alpha_beta as ab
from helpers.cost.bench import (DEFAULT_OPS, DEFAULT_SIZES, KiB, MiB, Timing, check_ops,
                                check_sizes, fit_sweep, snap_size)
from helpers.parallel.bench import back_to_back, collective_call, time_on_group


# ----------------------------------------------------------------------------------------
# Rank functions.
# ----------------------------------------------------------------------------------------

def time_collective(rank: int, world_size: int, op: str, sizes, iters: int = 20,
                    warmup: int = 5, rounds: int = 1, group=None) -> list[Timing]:
    """Rank function: time `op` at each message size (bytes; one int or several); one Timing
    per size, the same on every member of the group (its `world_size` is the group's size p)."""
    return time_on_group(op, sizes, iters, warmup, rounds, group)


def _thread_clocks() -> dict[str, list[int]]:
    """{thread name: [ns running, ns runnable but waiting for a core, times scheduled]},
    summed over this process's threads of that name (Linux: /proc/self/task/*/schedstat)."""
    import os
    clocks: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                values = [int(v) for v in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
        total = clocks.setdefault(name, [0, 0, 0])
        for i, v in enumerate(values):
            total[i] += v
    return clocks


@dataclass(frozen=True)
class ThreadTime:
    """What the kernel says one thread (all of a rank's threads of that name) did."""
    run_s: float      # seconds on a core
    wait_s: float     # seconds runnable but waiting for a core
    slices: int       # times it was scheduled


@dataclass(frozen=True)
class SchedulerWaits:
    """`scheduler_waits`'s answer on one rank."""
    times_s: tuple[float, ...]         # every call, back to back
    elapsed_s: float                   # all of them, wall clock
    threads: dict[str, ThreadTime]     # the rank's threads that ran meanwhile, by name


def scheduler_waits(rank: int, world_size: int, nbytes: int = KiB, iters: int = 200,
                    group=None) -> SchedulerWaits | None:
    """Rank function: `iters` back-to-back all-reduces of n bytes, and what the kernel says
    this rank's threads did meanwhile: ran, or waited for a core. None off Linux."""
    import os
    import torch.distributed as dist
    if not os.path.exists("/proc/self/task"):
        return None
    from helpers.parallel.groups import rank_device
    call = collective_call("all_reduce", nbytes, group, rank_device())
    back_to_back(call, 20, False)
    dist.barrier(group=group)
    before, t0 = _thread_clocks(), time.perf_counter()
    times = back_to_back(call, iters, False)
    elapsed, after = time.perf_counter() - t0, _thread_clocks()
    threads = {name: ThreadTime((a[0] - before[name][0]) / 1e9, (a[1] - before[name][1]) / 1e9,
                                a[2] - before[name][2])
               for name, a in after.items() if name in before}
    return SchedulerWaits(tuple(times), elapsed,
                          {k: v for k, v in threads.items() if v.slices > 0})


# ----------------------------------------------------------------------------------------
# Parent side: sweeps over live ranks.
# ----------------------------------------------------------------------------------------

def plan_sweep(ops, sizes, world_sizes, snap: bool = False) -> list[tuple[int, str, int]]:
    """(p, op, n) points to measure, checked before any process starts (world sizes against
    the ranks this machine can hold).

    With snap=True each size moves to the nearest multiple the (op, p) pair allows
    (world size 3 cannot cut 1 KiB into three fp32 chunks); otherwise a bad size is an error.
    """
    from helpers.ranks import check_world_size
    ops = check_ops(ops)
    world_sizes = (world_sizes,) if isinstance(world_sizes, int) else tuple(world_sizes)
    if not world_sizes:
        raise ValueError("world_sizes must list at least one world size >= 2")
    plan = []
    for p in world_sizes:
        check_world_size(p)
        check_int("world_sizes (a collective needs at least 2 ranks)", p, 2)
        for op in ops:
            if snap:
                points = sorted({snap_size(n, op, p) for n in check_sizes(sizes, (), p)})
            else:
                points = check_sizes(sizes, (op,), p)
            plan.extend((p, op, n) for n in points)
    return plan


def run_sweep(ranks, ops=DEFAULT_OPS, sizes=DEFAULT_SIZES, world_sizes=(2,), iters: int = 20,
              warmup: int = 5, rounds: int = 5, snap: bool = False,
              progress: bool = True) -> list[Timing]:
    """Measure every (p, op, n) on the live ranks; one Timing per point (see time_collective).

    One call of the ranks per (p, op) times all its sizes, interleaved over `rounds` rounds."""
    plan = plan_sweep(ops, sizes, world_sizes, snap)
    check_int("iters", iters, 1)
    check_int("warmup", warmup, 0)
    check_int("rounds", rounds, 1)
    batches: dict[tuple[int, str], list[int]] = {}
    for p, op, n in plan:
        batches.setdefault((p, op), []).append(n)
    records = []
    bar = progress_bar(len(plan), progress)
    try:
        for (p, op), points in batches.items():
            if ranks.world_size != p:
                ranks.resize(p)
            bar.set_description(f"p={p} {op}")
            records += ranks.run(time_collective, op, points, iters=iters, warmup=warmup,
                                 rounds=rounds)[0]
            bar.update(len(points))
    finally:
        bar.close()
    return records


def progress_bar(total: int, show: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, disable=not show, leave=False, unit="point")


def cores_line(backend: str, world_size: int) -> str:
    """What each rank runs on: always say it, since CPU ranks share the machine's cores."""
    from helpers.ranks import cpu_cores, threads_per_rank
    if backend == "nccl":
        return f"nccl: {world_size} ranks, one GPU each"
    cores, per = cpu_cores(), threads_per_rank(world_size)
    shared = " (more ranks than cores: they take turns)" if world_size > cores else ""
    return (f"gloo on CPU: {world_size} ranks on {cores} cores, {per} torch thread(s) per rank "
            f"= {cores / world_size:.2g} core(s) per rank{shared}")


# ----------------------------------------------------------------------------------------
# The small sweep behind notebook 02's widget (the widget itself: helpers.views.bench).
# ----------------------------------------------------------------------------------------

SIZE_EXPONENTS = (10, 28)     # the widget's range: 2^10 = 1 KiB … 2^28 = 256 MiB


@dataclass(frozen=True)
class SweepPlan:
    op: str
    world_size: int
    sizes: tuple[int, ...]
    iters: int


def plan_small_sweep(op: str, world_size: int, size_exponents: tuple[int, int],
                     points: int = 5) -> SweepPlan:
    """Up to `points` sizes between 2^lo and 2^hi bytes, snapped so they split evenly on
    `world_size` ranks; fewer iterations for large messages. Starts nothing: tests call it directly."""
    check_ops((op,))
    lo, hi = size_exponents
    check_int("size_exponents[0] (log2 bytes)", lo, SIZE_EXPONENTS[0], SIZE_EXPONENTS[1])
    check_int("size_exponents[1] (log2 bytes)", hi, lo, SIZE_EXPONENTS[1])
    exps = sorted({round(e) for e in np.linspace(lo, hi, min(points, hi - lo + 1))})
    sizes = tuple(sorted({snap_size(2**e, op, world_size) for e in exps}))
    plan_sweep((op,), sizes, (world_size,))  # same checks as any sweep
    return SweepPlan(op, world_size, sizes, 5 if sizes[-1] <= 16 * MiB else 3)


@dataclass(frozen=True)
class SmallSweep:
    plan: SweepPlan
    records: list[Timing]
    fits: dict[str, ab.Fit] | None   # None with a single size: nothing to fit


def run_small_sweep(ranks, op: str, world_size: int,
                    size_exponents: tuple[int, int]) -> SmallSweep:
    """The widget's measurement: a small live sweep and, from two sizes up, its fit."""
    plan = plan_small_sweep(op, world_size, size_exponents)
    records = run_sweep(ranks, (op,), plan.sizes, (world_size,), iters=plan.iters,
                        warmup=1, rounds=plan.iters, progress=False)
    return SmallSweep(plan, records, fit_sweep(records) if len(records) >= 2 else None)
