"""Notebook 02's runs: benchmarking collectives on live ranks.

Rank functions (`time_collective`, `scheduler_waits`) run on live ranks
(`helpers.ranks.LiveRanks`) or under torchrun; the sweeps (`run_sweep`, and `run_small_sweep`
behind the widget) call them on live ranks, one call of the ranks per (N, op). The timing
itself is `helpers.parallel.bench`; the sizes, the estimator, the fit and the tables are
`helpers.cost.bench`; the figure and the widget are `helpers.views.bench`.

Section 7 runs on emulated nodes (LiveRanks(..., nodes=2)): each level's sweep
(`measure_levels`), the flat against the hierarchical all-reduce (`measure_flat_and_hierarchical`,
the block in `helpers.parallel.hierarchical`) and the bytes the link's shapers counted
(`wire_bytes_per_all_reduce`); `level_fit_records` and `hierarchical_vs_flat_all_reduce` answer
for benchmarks/cluster.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from helpers.checks import check_int
from helpers.cost import alpha_beta as ab
from helpers.cost import bench as cost
from helpers.cost.bench import (DEFAULT_OPS, DEFAULT_SIZES, FlatVsHierarchical, KiB, MiB,
                                Timing, check_ops, check_sizes, fit_sweep, snap_size)
from helpers.parallel.bench import back_to_back, collective_call, time_on_group


# ----------------------------------------------------------------------------------------
# Rank functions.
# ----------------------------------------------------------------------------------------

def time_collective(rank: int, world_size: int, op: str, sizes, iters: int = 20,
                    warmup: int = 5, rounds: int = 1, group=None) -> list[Timing]:
    """Rank function: time `op` at each message size (bytes; one int or several); one Timing
    per size, the same on every member of the group (its `world_size` is the group's size N)."""
    return time_on_group(op, sizes, iters, warmup, rounds, group)


def thread_clocks() -> dict[str, list[int]]:
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
    before, t0 = thread_clocks(), time.perf_counter()
    times = back_to_back(call, iters, False)
    elapsed, after = time.perf_counter() - t0, thread_clocks()
    threads = {name: ThreadTime((a[0] - before[name][0]) / 1e9, (a[1] - before[name][1]) / 1e9,
                                a[2] - before[name][2])
               for name, a in after.items() if name in before}
    return SchedulerWaits(tuple(times), elapsed,
                          {k: v for k, v in threads.items() if v.slices > 0})


# ----------------------------------------------------------------------------------------
# Parent side: sweeps over live ranks.
# ----------------------------------------------------------------------------------------

def plan_sweep(ops, sizes, world_sizes, snap: bool = False) -> list[tuple[int, str, int]]:
    """(N, op, n) points to measure, checked before any process starts (world sizes against
    the ranks this machine can hold).

    With snap=True each size moves to the nearest multiple the (op, N) pair allows
    (world size 3 cannot cut 1 KiB into three fp32 chunks); otherwise a bad size is an error.
    """
    from helpers.ranks import check_world_size
    ops = check_ops(ops)
    world_sizes = (world_sizes,) if isinstance(world_sizes, int) else tuple(world_sizes)
    if not world_sizes:
        raise ValueError("world_sizes must list at least one world size >= 2")
    plan = []
    for world in world_sizes:
        check_world_size(world)
        check_int("world_sizes (a collective needs at least 2 ranks)", world, 2)
        for op in ops:
            if snap:
                points = sorted({snap_size(n, op, world) for n in check_sizes(sizes, (), world)})
            else:
                points = check_sizes(sizes, (op,), world)
            plan.extend((world, op, n) for n in points)
    return plan


def run_sweep(ranks, ops=DEFAULT_OPS, sizes=DEFAULT_SIZES, world_sizes=(2,), iters: int = 20,
              warmup: int = 5, rounds: int = 5, snap: bool = False,
              progress: bool = True) -> list[Timing]:
    """Measure every (N, op, n) on the live ranks; one Timing per point (see time_collective).

    One call of the ranks per (N, op) times all its sizes, interleaved over `rounds` rounds."""
    plan = plan_sweep(ops, sizes, world_sizes, snap)
    check_int("iters", iters, 1)
    check_int("warmup", warmup, 0)
    check_int("rounds", rounds, 1)
    batches: dict[tuple[int, str], list[int]] = {}
    for world, op, n in plan:
        batches.setdefault((world, op), []).append(n)
    records = []
    bar = progress_bar(len(plan), progress)
    try:
        for (world, op), points in batches.items():
            if ranks.world_size != world:
                ranks.resize(world)
            bar.set_description(f"N={world} {op}")
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


# ----------------------------------------------------------------------------------------
# Two network levels: ranks on emulated nodes (LiveRanks(..., nodes=2)).
#
# Inside a node: every node's ranks time a collective at once, on their loopback. Across
# nodes: one rank per node (rank 0 of each node) times it over the link while the other ranks
# wait. Both run on the same ranks, so the section needs no restart; on the flat network
# (no namespaces here) the same runs split the ranks into two pretend nodes, both on loopback.
# ----------------------------------------------------------------------------------------

LEVEL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# Across the link everything moves at about 60-100 MB/s: 1 MiB costs ~10-17 ms a call, so stop
# there. Its shaper is a token bucket, not a wire: it refills at the link's rate while the
# link is idle, so a message no larger than what refills during one call's software time
# (2α, some 0.1-0.3 ms: about 10-20 KB at these rates) crosses at loopback speed where a wire
# would take n/B, and the bucket's 64 KiB passes at full speed after a pause. Sizes there are
# on neither the α line nor the β line (16 KiB missed its fit by 30 %, pulling the median
# error to 25-50 % on an 80-100 MB/s link). The link's sizes skip them: 256 B to 4 KiB (α),
# then 512 KiB (256 KiB a rank for the ops that split it over 2) and 1 MiB (β).
LEVEL_SIZES = {cost.INSIDE: tuple(KiB * 4**k for k in range(7)),     # 1 KiB … 4 MiB
               cost.ACROSS: (KiB // 4, KiB, 4 * KiB, 512 * KiB, MiB)}
FLAT_VS_HIERARCHICAL_BYTES = 2 * MiB


def placement_of(ranks) -> tuple[int, ...]:
    """The node of each rank: the emulated nodes' placement, or on the flat network the split
    2 nodes would have (consecutive halves)."""
    return ranks.placement or tuple(r // (ranks.world_size // 2) for r in range(ranks.world_size))


def time_level(rank: int, world_size: int, placement: tuple[int, ...], level: str, ops,
               sizes, iters: int = 10, warmup: int = 2, rounds: int = 1) -> list[Timing] | None:
    """Rank function: time each of `ops` at `sizes` on one level: inside every node at once
    (level cost.INSIDE), or across nodes between the first rank of each node (cost.ACROSS; the
    others return None)."""
    from helpers.parallel.hierarchical import node_groups
    inside, across = node_groups(placement)
    if level == cost.ACROSS and rank not in ab.cross_blocks(placement)[0]:
        return None
    group = inside if level == cost.INSIDE else across
    # Each size is warmed up right before it is timed, not all sizes first: the link's shaper
    # (a token bucket) lets its burst after a pause through at full speed, and
    # the warm-up calls spend that burst, so the timed calls see the link's rate.
    return [t for op in ops for n in sizes
            for t in time_on_group(op, n, iters, warmup, rounds, group)]


def measure_levels(ranks, ops=LEVEL_OPS, sizes: dict | None = None, iters: int = 20,
                   rounds: int = 1) -> dict[str, list[Timing]]:
    """{level: its Timings}: each op swept inside a node and across nodes (see `time_level`).
    20 calls a size: across the shaped link a call sometimes waits milliseconds for a busy
    core, and the fit's low quantile (`cost.bench.uncontended_time`) needs calls that did not."""
    check_ops(ops)
    nodes = ranks.nodes or 2
    check_int(f"ranks per node (world_size / {nodes} nodes; the level inside needs 2)",
              ranks.world_size // nodes, 2)
    sizes = {**LEVEL_SIZES, **(sizes or {})}
    placement = placement_of(ranks)
    return {level: ranks.run(time_level, placement, level, ops, sizes[level], iters=iters,
                             rounds=rounds)[0]
            for level in (cost.INSIDE, cost.ACROSS)}


def flat_and_hierarchical(rank: int, world_size: int, placement: tuple[int, ...], nbytes: int,
                          iters: int = 10, warmup: int = 2) -> FlatVsHierarchical:
    """Rank function: the same all-reduce by gloo's flat ring and by the hierarchical one,
    first compared on the same integer inputs (sums of integers are exact: the results must
    be equal), then timed alternately, a call of each per round."""
    import torch
    import torch.distributed as dist

    from helpers.parallel.hierarchical import hierarchical_all_reduce, node_groups
    inside, across = node_groups(placement)
    numel = nbytes // cost.ELEMENT_BYTES
    mine = torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(rank))
    flat, hier = mine.float(), mine.float()
    dist.all_reduce(flat)
    hierarchical_all_reduce(hier, inside, across)
    difference = torch.tensor([float((flat - hier).abs().max())])
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    calls = {"flat": lambda: dist.all_reduce(flat),
             "hierarchical": lambda: hierarchical_all_reduce(hier, inside, across)}
    flat.zero_()                       # timed on zeros: repeated sums of data would overflow
    hier.zero_()
    times = {name: [] for name in calls}
    for i in range(warmup + iters):
        for name, call in calls.items():
            dist.barrier()
            took = back_to_back(call, 1, False)
            if i >= warmup:
                times[name] += took
    slowest = torch.tensor(times["flat"] + times["hierarchical"], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)   # a call ends when its slowest rank's does
    slowest = slowest.tolist()
    return FlatVsHierarchical(tuple(placement), nbytes, tuple(slowest[:iters]),
                              tuple(slowest[iters:]), float(difference))


def measure_flat_and_hierarchical(ranks, nbytes: int = FLAT_VS_HIERARCHICAL_BYTES,
                                  iters: int = 10) -> FlatVsHierarchical:
    check_int("iters", iters, 1)
    check_sizes((nbytes,), ("all_gather",), ranks.world_size)
    return ranks.run(flat_and_hierarchical, placement_of(ranks), nbytes, iters=iters)[0]


def all_reduce_calls(rank: int, world_size: int, placement: tuple[int, ...], nbytes: int,
                     calls: int, hierarchical: bool) -> None:
    """Rank function: `calls` all-reduces of n bytes, flat or hierarchical, between the same
    group set-up and barriers whatever `calls` is (so a run with 0 calls counts the rest)."""
    import torch
    import torch.distributed as dist

    from helpers.parallel.hierarchical import hierarchical_all_reduce, node_groups
    inside, across = node_groups(placement)
    x = torch.zeros(nbytes // cost.ELEMENT_BYTES)
    dist.barrier()
    for _ in range(calls):
        if hierarchical:
            hierarchical_all_reduce(x, inside, across)
        else:
            dist.all_reduce(x)
    dist.barrier()


def wire_bytes_per_all_reduce(ranks, nbytes: int, hierarchical: bool, calls: int = 3) -> float | None:
    """Bytes that crossed between nodes (all uplinks together, headers included, as the
    kernel's shapers counted them) per all-reduce of n bytes; None on the flat network.

    The same run with no all-reduce is counted too and taken off: what making the groups and
    the barriers sent is not the all-reduce's."""
    check_int("calls", calls, 1)
    if ranks.nodes is None:
        return None
    placement = placement_of(ranks)
    ranks.run(all_reduce_calls, placement, nbytes, 0, hierarchical)  # the ranks are up
    counted = []
    for n_calls in (0, calls):
        before = ranks.wire_bytes(resent=False)
        ranks.run(all_reduce_calls, placement, nbytes, n_calls, hierarchical)
        counted.append(ranks.wire_bytes(resent=False) - before)
    return (counted[1] - counted[0]) / calls


# -- what benchmarks/cluster.py reports --------------------------------------------------------

def level_fit_records(ranks, op: str = "all_reduce") -> list[dict]:
    """For live ranks on 2 nodes: `op`'s fit on each level as
    {"level", "alpha_s", "beta_s_per_byte", "median_rel_error"} ("loopback", then "link")."""
    return [f.as_record() for f in cost.level_fits(measure_levels(ranks, (op,)), op)]


def hierarchical_vs_flat_all_reduce(ranks, nbytes: int = FLAT_VS_HIERARCHICAL_BYTES) -> float:
    """For live ranks on 2 nodes: measured hierarchical all-reduce time / flat ring time, at
    `nbytes` per rank (each the 10th percentile of 10 alternating calls)."""
    return measure_flat_and_hierarchical(ranks, nbytes).ratio
