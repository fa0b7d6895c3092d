"""Benchmark collectives correctly: warm up, many back-to-back iterations, interleaved sizes,
a robust estimator, nccl-tests units.

Rank functions (`time_collective`, `gloo_facts`, `scheduler_waits`) run on live ranks
(`helpers.ranks.LiveRanks`) or under torchrun; everything else runs in the notebook (figures
and the widget: `helpers.views.bench`). Conventions, stated once:

* Calls run back to back, as in nccl-tests (one barrier before each batch, none per call); each
  call is timed alone (perf_counter on CPU, CUDA events on GPU). An iteration's time is the
  slowest rank's: a collective is done when every rank has its result.
* Sizes are visited in rounds (every size a few calls, then again), so a burst of load from
  elsewhere hits every size alike rather than a few neighbours.
* The time that stands for a point is `uncontended_time`: the 10th percentile of its iterations.
  CPU ranks share cores, and a call whose thread had to wait for a core (up to a scheduler tick,
  4 ms here) costs that wait on top of the collective's own; the α–β model describes the latter.
  The median and spread are printed beside it, so the waiting is shown, not hidden.
* 1 GB = 1e9 bytes everywhere (nccl-tests does the same). Message sizes are powers of two
  (1 KiB = 1024 B) because buffers are, but every bandwidth is in GB/s.
* n is the message size in bytes, as `helpers.cost.alpha_beta.OPS[op].bytes_are` says; p the ranks.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from helpers.checks import check_choice, check_divisible, check_int
from helpers.cost import alpha_beta as ab
from helpers.cost.alpha_beta import GB, GiB, OPS
from helpers.timing import Measurement, format_seconds, times_of

KiB, MiB = 1024, 1024**2
ELEMENT_BYTES = 4                      # every buffer is fp32
# 1 KiB … 16 MiB: on CPU ranks 16 MiB is deep in the bandwidth regime (tens of ms against α's
# fraction of one), and a 64 MiB size would double the default sweep's time.
DEFAULT_SIZES = tuple(KiB * 4**k for k in range(8))
FULL_SIZES = tuple(KiB * 2**k for k in range(19))            # 1 KiB … 256 MiB
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
FULL_WORLD_SIZES = tuple(range(2, 9))
# Big messages take long: fewer iterations above this size keep a sweep bounded (a 16 MiB call
# lasts tens of ms, and one scheduler tick is a small part of it); never fewer than this many.
_FULL_ITERS_UP_TO = 1 * MiB
_MIN_ITERS = 5
# The point's time is this quantile of its iterations (see `uncontended_time`).
FLOOR_QUANTILE = 0.1
# A reduce-scatter slower than this fraction of an all-reduce of the same buffer is doing an
# all-reduce's work: a real ring reduce-scatter needs half of it in the bandwidth regime.
_EMULATED_IF_RATIO_ABOVE = 0.75

# The lecture's benchmark (CS336 Spring 2025, lecture 8 "Parallelism 2", lecture_08.py,
# `benchmarking()`): H100s, world size 4, 100·1024² fp32 elements, one timed call each.
# Its printed bandwidths (labelled "GB/s", computed with / 1024**3):
LECTURE = {"gpu": "H100", "world_size": 4, "num_elements": 100 * 1024**2, "element_bytes": 4,
           "all_reduce_printed": 277, "reduce_scatter_printed": 70}


# ----------------------------------------------------------------------------------------
# Checking what a caller asks for, in the parent, before any process starts.
# ----------------------------------------------------------------------------------------

def check_ops(ops: Iterable[str]) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    if not ops:
        raise ValueError(f"ops must name at least one of {tuple(sorted(OPS))}, got ()")
    for op in ops:
        check_choice("op", op, sorted(OPS))
    return ops


def size_quantum(op: str, world_size: int) -> int:
    """Sizes must be a multiple of this: whole fp32 elements, and p equal chunks if the op splits."""
    return ELEMENT_BYTES * (world_size if ab.model(op).splits else 1)


def check_sizes(sizes: Iterable[int], ops: Sequence[str], world_size: int) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if not sizes:
        raise ValueError("sizes must list at least one message size in bytes, got ()")
    for n in sizes:
        check_int("sizes (bytes)", n, 1)
        for op in ops:
            why = (f"{op} cuts it into {world_size} equal chunks of fp32" if ab.model(op).splits
                   else "whole fp32 elements")
            check_divisible(f"sizes (bytes, {op} at p={world_size})", n,
                            size_quantum(op, world_size), why)
    return sizes


def snap_size(n: int, op: str, world_size: int) -> int:
    """The nearest valid size for (op, p): for sweeps that cover world sizes like 3 or 6."""
    q = size_quantum(op, world_size)
    return max(q, round(n / q) * q)


def parse_size(text: str) -> int:
    """'4MiB' -> 4194304, '1KiB' -> 1024, '1000' -> 1000, '1e6' -> 1000000 (bytes)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*", text)
    units = {None: 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    try:
        value = float(match.group(1)) * units[match.group(2)]
    except (AttributeError, ValueError):
        value = None
    if value is None or value != int(value):
        raise ValueError(f"sizes must be whole bytes like 4096, 4KiB or 1MB, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Whole KiB/MiB/GiB by name; anything else (a size snapped for p = 3) in plain bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale:.0f} {unit}"
    return f"{n:.0f} B"


def iterations_for(nbytes: int, iters: int) -> int:
    """Timed calls at this size: `iters` up to 1 MiB, fewer above (at least 5, or `iters` if
    smaller). Every rank computes the same count (they must agree, or they hang)."""
    if nbytes <= _FULL_ITERS_UP_TO:
        return iters
    return max(min(iters, _MIN_ITERS), iters * _FULL_ITERS_UP_TO // nbytes)


def per_round(nbytes: int, iters: int, rounds: int) -> int:
    """Calls per round at this size: the size's iterations shared out over the rounds."""
    return max(1, -(-iterations_for(nbytes, iters) // rounds))


# ----------------------------------------------------------------------------------------
# Rank side: build one collective call, time it.
# ----------------------------------------------------------------------------------------

def _collective_call(op: str, nbytes: int, group, device):
    """A zero-argument function that runs `op` once on preallocated n-byte buffers.

    Ranks and sizes are the group's; the root (member 0) and the ring neighbours of
    send_recv are handed to torch as global ranks.
    """
    import torch
    import torch.distributed as dist

    from helpers.parallel.groups import (all_gather_into, global_rank, group_rank, group_size,
                                         reduce_scatter_into)

    rank, size = group_rank(group), group_size(group)
    numel = nbytes // ELEMENT_BYTES
    chunk = numel // size
    buf = torch.zeros(numel, device=device)
    root = global_rank(group, 0)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        mine = torch.zeros(chunk, device=device)
        return lambda: all_gather_into(buf, mine, group=group)
    if op == "reduce_scatter":
        mine = torch.zeros(chunk, device=device)
        return lambda: reduce_scatter_into(mine, buf, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(buf, src=root, group=group)
    if op == "reduce":
        return lambda: dist.reduce(buf, dst=root, group=group)
    if op == "all_to_all":
        out = torch.zeros(numel, device=device)
        return lambda: dist.all_to_all_single(out, buf, group=group)
    if op == "send_recv":
        inbox = torch.zeros(numel, device=device)
        right = global_rank(group, (rank + 1) % size)
        left = global_rank(group, (rank - 1) % size)

        def ring_shift():
            ops = [dist.P2POp(dist.isend, buf, right, group), dist.P2POp(dist.irecv, inbox, left, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return ring_shift
    check_choice("op", op, sorted(OPS))


def _back_to_back(call, count: int, cuda: bool) -> list[float]:
    """`count` calls in a row, each timed alone (seconds)."""
    if cuda:
        import torch
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    return times_of(call, count)


def time_collective(rank: int, world_size: int, op: str, sizes, iters: int = 20,
                    warmup: int = 5, rounds: int = 1, group=None) -> list[dict]:
    """Rank function: time `op` at each message size (bytes; one int or several); one record
    per size, the same on every member of the group (its `world_size` is the group's size p)."""
    import torch
    import torch.distributed as dist

    from helpers.parallel.groups import group_size, rank_device

    sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
    device = rank_device()
    cuda = device.type == "cuda"
    calls = [_collective_call(op, n, group, device) for n in sizes]
    for call in calls:                 # first calls set up connections, buffers, caches
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(rounds):            # every size in every round: load hits all sizes alike
        for n, call, mine in zip(sizes, calls, times):
            dist.barrier(group=group)  # start together; then calls back to back, no barrier
            mine += _back_to_back(call, per_round(n, iters, rounds), cuda)
    # An iteration's time is its slowest member's (exchanged after the timing, not timed).
    slowest = torch.tensor([t for mine in times for t in mine], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    slowest = slowest.cpu().tolist()
    records, start = [], 0
    for n, mine in zip(sizes, times):
        records.append({"op": op, "world_size": group_size(group), "bytes": n,
                        "backend": dist.get_backend(group), "times_s": slowest[start:start + len(mine)],
                        "threads_per_rank": torch.get_num_threads()})
        start += len(mine)
    return records


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


def scheduler_waits(rank: int, world_size: int, nbytes: int = KiB, iters: int = 200,
                    group=None) -> dict | None:
    """Rank function: `iters` back-to-back all-reduces of n bytes, and what the kernel says
    this rank's threads did meanwhile: ran, or waited for a core. None off Linux."""
    import os
    import torch.distributed as dist
    if not os.path.exists("/proc/self/task"):
        return None
    from helpers.parallel.groups import rank_device
    call = _collective_call("all_reduce", nbytes, group, rank_device())
    _back_to_back(call, 20, False)
    dist.barrier(group=group)
    before, t0 = _thread_clocks(), time.perf_counter()
    times = _back_to_back(call, iters, False)
    elapsed, after = time.perf_counter() - t0, _thread_clocks()
    threads = {name: {"run_s": (a[0] - before[name][0]) / 1e9,
                      "wait_s": (a[1] - before[name][1]) / 1e9, "slices": a[2] - before[name][2]}
               for name, a in after.items() if name in before}
    return {"times_s": times, "elapsed_s": elapsed,
            "threads": {k: v for k, v in threads.items() if v["slices"] > 0}}


def uncontended_time(record: dict) -> float:
    """The time that stands for a point: the 10th percentile of its iterations.

    On shared CPU cores an iteration's time is a mixture: the collective's own cost, or that
    plus a wait for a core (a scheduler tick, 4 ms here, when the core is busy). The median of
    such a mixture jumps between the two as the machine's load moves the share of waits past
    one half. The low quantile is the calls that did not wait: the cost the α–β model
    describes, and it stays put until nine calls in ten wait."""
    return float(np.quantile(record["times_s"], FLOOR_QUANTILE))


def median_time(record: dict) -> float:
    """What a call typically cost here, waits included (printed beside `uncontended_time`)."""
    return statistics.median(record["times_s"])


def measurement(record: dict) -> Measurement:
    """The uniform measurement line of helpers.timing for one sweep point."""
    what = f"{record['op']} p={record['world_size']} n={format_bytes(record['bytes'])}"
    return Measurement(what, tuple(record["times_s"]))


# ----------------------------------------------------------------------------------------
# Parent side: sweeps over live ranks.
# ----------------------------------------------------------------------------------------

def plan_sweep(ops, sizes, world_sizes, snap: bool = False) -> list[tuple[int, str, int]]:
    """(p, op, n) points to measure, checked before any process starts.

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
              progress: bool = True) -> list[dict]:
    """Measure every (p, op, n) on the live ranks; one record per point (see time_collective).

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
# The model on the sweep: fit, predict, tabulate.
# ----------------------------------------------------------------------------------------

def fit_sweep(records: list[dict], weighting: str = "relative") -> dict[str, ab.Fit]:
    """One (α, β) per operation, fitted over all its sizes and world sizes."""
    by_op: dict[str, list] = {}
    for r in records:
        by_op.setdefault(r["op"], []).append((r["world_size"], r["bytes"], uncontended_time(r)))
    return {op: ab.fit_alpha_beta(op, pts, weighting) for op, pts in by_op.items()}


def fit_per_world_size(records: list[dict], weighting: str = "relative") -> dict[int, dict[str, ab.Fit]]:
    """{p: {op: Fit}}: a separate (α, β) at each world size.

    The model says α and β do not depend on p. That holds when every rank has its own
    GPU or cores; CPU ranks that outnumber the cores take turns, so each hop also waits
    for a context switch and α grows with p. Fitting per p shows by how much.
    """
    sizes = sorted({r["world_size"] for r in records})
    return {p: fit_sweep([r for r in records if r["world_size"] == p], weighting) for p in sizes}


def fit_for(fits: dict, op: str, p: int) -> ab.Fit:
    """`fits` is {op: Fit} (one fit for every p) or {p: {op: Fit}} (fit_per_world_size)."""
    return fits[p][op] if p in fits else fits[op]


def result_rows(records: list[dict], fits: dict) -> list[dict]:
    """The benchmark's per-point results: measured, nccl-tests bandwidths, predicted, error."""
    rows = []
    for r in records:
        t, p, n = uncontended_time(r), r["world_size"], r["bytes"]
        predicted = fit_for(fits, r["op"], p).predict(p, n)
        rows.append({"op": r["op"], "world_size": p, "bytes": n, "time_s": t,
                     "algbw_GBps": ab.algbw_GBps(n, t), "busbw_GBps": ab.busbw_GBps(r["op"], p, n, t),
                     "predicted_s": predicted, "rel_error": ab.relative_error(predicted, t)})
    return rows


def median_rel_error(rows: list[dict]) -> float:
    return statistics.median(row["rel_error"] for row in rows)


def format_table(rows: list[dict], labels: dict[str, str] | None = None) -> str:
    """Predicted vs measured, one line per point (GB = 1e9 B)."""
    labels = labels or {}
    w = max([9] + [len(labels.get(row["op"], row["op"])) for row in rows]) + 2
    head = (f"{'operation':<{w}}{'p':>3}{'n':>11}{'measured':>11}{'predicted':>11}{'error':>7}"
            f"{'algbw GB/s':>12}{'busbw GB/s':>12}")
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{labels.get(row['op'], row['op']):<{w}}{row['world_size']:>3}"
            f"{format_bytes(row['bytes']):>11}{format_seconds(row['time_s']):>11}"
            f"{format_seconds(row['predicted_s']):>11}{row['rel_error']:>7.0%}"
            f"{row['algbw_GBps']:>12.3g}{row['busbw_GBps']:>12.3g}")
    return "\n".join(lines)


def fit_lines(fits: dict[str, ab.Fit], labels: dict[str, str] | None = None) -> list[str]:
    labels = labels or {}

    def beta(f):
        if f.beta_s_per_byte == 0:   # all sizes in the latency regime: β is not resolved
            return "β ≈ 0 (messages too small to see the bandwidth)"
        return f"β = {f.beta_s_per_byte:.3g} s/B (1/β = {f.bandwidth_GBps:.3g} GB/s)"
    return [f"{labels.get(op, op)}: α = {format_seconds(f.alpha_s)}, {beta(f)}"
            for op, f in fits.items()]


# ----------------------------------------------------------------------------------------
# gloo's quirks, probed rather than asserted.
# ----------------------------------------------------------------------------------------

def gloo_facts(rank: int, world_size: int) -> dict[str, str]:
    """Rank function: what gloo on this torch does with AVG and with reduce-scatter shapes.

    Runs on a gloo group even when the default backend is NCCL, so the answer is the same
    everywhere. Every message is reduced to its deterministic part (no times, no pids).
    """
    import torch
    import torch.distributed as dist

    from helpers.parallel.groups import fd2_muted, reduce_scatter_into

    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    facts = {}

    def attempt(name, fn):
        try:
            facts[name] = fn()
        except Exception as error:  # the lesson is the error, shown in words
            message = str(error)
            core = message.split("Check failed:")[-1].strip() if "Check failed:" in message \
                else message.splitlines()[0][:120]
            facts[name] = f"refused: {type(error).__name__}: {core}"

    def avg():
        x = torch.full((2,), float(rank))
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
        return f"accepted; mean of the ranks' values 0..{world_size - 1} = {x[0].item():g}"
    attempt("all_reduce(op=ReduceOp.AVG)", avg)

    def flat_dim0():
        inp = torch.ones(world_size * 2, 3)
        out = torch.empty(2, 3)
        reduce_scatter_into(out, inp, group=group)
        return f"accepted; output {tuple(out.shape)} = {out[0, 0].item():g} everywhere"
    attempt(f"reduce_scatter input ({world_size * 2}, 3) -> (2, 3)", flat_dim0)

    def split_dim1():
        inp = torch.ones(2, 3 * world_size)
        out = torch.empty(2, 3)
        with fd2_muted():
            reduce_scatter_into(out, inp, group=group)
        return "accepted"
    attempt(f"reduce_scatter input (2, {3 * world_size}) -> (2, 3)", split_dim1)
    dist.barrier(group=group)
    return facts


def reduce_scatter_ratios(records: list[dict]) -> list[dict]:
    """t(reduce_scatter) / t(all_reduce) on the same n-byte buffer and world size.

    A ring reduce-scatter moves (p−1)/p·n per rank, an all-reduce twice that, so the ratio
    tends to 0.5 for large messages. gloo builds reduce_scatter_tensor from an all-reduce,
    which puts it at 1 or above.
    """
    times = {(r["op"], r["world_size"], r["bytes"]): uncontended_time(r) for r in records}
    out = []
    for (op, p, n), t in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if op == "reduce_scatter" and ("all_reduce", p, n) in times:
            out.append({"world_size": p, "bytes": n, "ratio": t / times["all_reduce", p, n]})
    return out


def reduce_scatter_is_emulated(records: list[dict], min_bytes: int = 1 * MiB) -> bool | None:
    """True when reduce-scatter costs what an all-reduce does (bandwidth regime); None if unmeasured."""
    ratios = [r["ratio"] for r in reduce_scatter_ratios(records) if r["bytes"] >= min_bytes]
    if not ratios:
        return None
    return statistics.median(ratios) > _EMULATED_IF_RATIO_ABOVE


def op_labels(records: list[dict]) -> dict[str, str]:
    """Names for tables and legends, with reduce-scatter marked when it is measured emulated."""
    labels = {r["op"]: r["op"] for r in records}
    if "reduce_scatter" in labels and reduce_scatter_is_emulated(records):
        backend = records[0]["backend"]
        labels["reduce_scatter"] = f"reduce_scatter ({backend}: all-reduce inside)"
    return labels


# ----------------------------------------------------------------------------------------
# The lecture's formulas beside nccl-tests', on the same measurements.
# ----------------------------------------------------------------------------------------

def lecture_all_reduce_bw(size_bytes: float, p: int, seconds: float) -> float:
    """lecture_08.py: size·2(p−1) bytes "sent", over p·duration, divided by 1024³ (GiB/s)."""
    return size_bytes * 2 * (p - 1) / (p * seconds) / GiB


def lecture_reduce_scatter_bw(output_bytes: float, p: int, seconds: float) -> float:
    """lecture_08.py, the revision consistent with the printed ≈70: the OUTPUT's bytes·(p−1) over p·duration, /1024³."""
    return output_bytes * (p - 1) / (p * seconds) / GiB


def lecture_vs_nccl_tests(all_reduce_s: float, reduce_scatter_s: float, n_bytes: float,
                          p: int) -> list[dict]:
    """Both conventions on one all-reduce of n bytes and one reduce-scatter of n input bytes."""
    out_bytes = n_bytes / p
    rows = []
    for op, t, lecture in (
        ("all_reduce", all_reduce_s, lecture_all_reduce_bw(n_bytes, p, all_reduce_s)),
        ("reduce_scatter", reduce_scatter_s, lecture_reduce_scatter_bw(out_bytes, p, reduce_scatter_s)),
    ):
        busbw = ab.busbw_GBps(op, p, n_bytes, t)
        rows.append({"op": op, "time_s": t, "lecture_printed": lecture,
                     "lecture_in_GB": lecture * GiB / GB, "nccl_busbw_GBps": busbw,
                     "busbw_over_lecture": busbw / lecture})
    return rows


def explain_lecture_numbers(lecture: dict = LECTURE) -> list[dict]:
    """Undo the lecture's two formulas on its printed numbers: what time did it measure, and
    what bus bandwidth (nccl-tests, GB/s) does that time mean?"""
    p, n = lecture["world_size"], lecture["num_elements"] * lecture["element_bytes"]
    rows = []
    # all-reduce: printed = n·2(p−1)/(p·t)/GiB  ->  t
    printed = lecture["all_reduce_printed"]
    t = n * 2 * (p - 1) / (p * printed * GiB)
    rows.append({"op": "all_reduce", "printed": printed, "time_s": t,
                 "printed_in_GB": printed * GiB / GB, "formula_factor": 1.0,
                 "nccl_busbw_GBps": ab.busbw_GBps("all_reduce", p, n, t)})
    # reduce-scatter: input p×n on each rank, output n; printed = n·(p−1)/(p·t)/GiB  ->  t
    printed = lecture["reduce_scatter_printed"]
    t = n * (p - 1) / (p * printed * GiB)
    rows.append({"op": "reduce_scatter", "printed": printed, "time_s": t,
                 "printed_in_GB": printed * GiB / GB, "formula_factor": float(p),
                 "nccl_busbw_GBps": ab.busbw_GBps("reduce_scatter", p, p * n, t)})
    return rows


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
    `world_size` ranks; fewer iterations for large messages. Pure: tests call it directly."""
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
    records: list[dict]
    fits: dict[str, ab.Fit] | None   # None with a single size: nothing to fit


def run_small_sweep(ranks, op: str, world_size: int,
                    size_exponents: tuple[int, int]) -> SmallSweep:
    """The widget's measurement: a small live sweep and, from two sizes up, its fit."""
    plan = plan_small_sweep(op, world_size, size_exponents)
    records = run_sweep(ranks, (op,), plan.sizes, (world_size,), iters=plan.iters,
                        warmup=1, rounds=plan.iters, progress=False)
    return SmallSweep(plan, records, fit_sweep(records) if len(records) >= 2 else None)
