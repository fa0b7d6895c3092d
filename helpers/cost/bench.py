"""Notebook 02's arithmetic: message sizes, iteration counts, the estimator, the α–β fit over a
sweep's records, its tables, and the lecture's bandwidth formulas beside nccl-tests'. No torch.

The records, one per idea: `Timing` (one point's calls, what `helpers.labs.bench.time_collective`
returns), `PointResult` (a point measured beside the model), `ReduceScatterRatio`, the lecture's
numbers, `LectureNumber` and `LectureVsBusbw`, and on two network levels `LevelFit` (one level's
fit) and `FlatVsHierarchical` (an all-reduce both ways, timed). Conventions, stated once:

* The time that stands for a point is `uncontended_time`: the 10th percentile of its iterations.
  CPU ranks share cores, and a call whose thread had to wait for a core (up to a scheduler tick,
  4 ms here) costs that wait on top of the collective's own; the α–β model describes the latter.
  The median and spread are printed beside it, so the waiting is shown, not hidden.
* 1 GB = 1e9 bytes everywhere (nccl-tests does the same). Message sizes are powers of two
  (1 KiB = 1024 B) because buffers are, but every bandwidth is in GB/s.
* n is the message size in bytes, as `helpers.cost.alpha_beta.COST_MODELS[op].bytes_are` says; N the ranks (the world size).
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from helpers.checks import check_choice, check_divisible, check_int
from helpers.cost import alpha_beta as ab
from helpers.cost.alpha_beta import COST_MODELS
from helpers.timing import Measurement
from helpers.units import GB, KB, MB, GiB, KiB, MiB, format_binary_bytes, format_seconds

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
LECTURE_BENCHMARK = {"gpu": "H100", "world_size": 4, "num_elements": 100 * 1024**2,
                     "element_bytes": 4, "all_reduce_printed": 277, "reduce_scatter_printed": 70}


# ----------------------------------------------------------------------------------------
# The records.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    """One sweep point as measured: `op` on `world_size` ranks (N) with an n-byte message.

    The same on every member of the group; it travels from the ranks to the notebook pickled."""
    op: str                     # the collective, a key of COST_MODELS
    world_size: int             # N: the group's ranks
    bytes: int                  # n: message size in bytes, as COST_MODELS[op].bytes_are says
    backend: str                # "gloo" or "nccl"
    times_s: tuple[float, ...]  # seconds per call, each the slowest member's, in call order
    threads_per_rank: int       # torch's intra-op threads on each rank


@dataclass(frozen=True)
class PointResult:
    """One point measured beside the α–β model: a line of the table and of the benchmark's JSON."""
    op: str
    world_size: int             # N
    bytes: int                  # n, bytes
    time_s: float               # measured: the point's `uncontended_time`, seconds
    algbw_GBps: float           # nccl-tests' algorithm bandwidth at time_s, GB/s (1e9 B)
    busbw_GBps: float           # nccl-tests' bus bandwidth at time_s, GB/s (1e9 B)
    predicted_s: float          # the fit's prediction, seconds
    rel_error: float            # |predicted − measured| / measured, a fraction


@dataclass(frozen=True)
class ReduceScatterRatio:
    """t(reduce_scatter) / t(all_reduce) on one n-byte buffer at world size N (see
    `reduce_scatter_ratios`)."""
    world_size: int             # N
    bytes: int                  # n, bytes
    ratio: float                # of the two `uncontended_time`s (a ring's tends to 0.5)


@dataclass(frozen=True)
class LectureNumber:
    """One bandwidth the lecture printed, undone: the time it implies and that time's busbw."""
    op: str                     # "all_reduce" or "reduce_scatter"
    printed: float              # what the lecture printed as "GB/s" (GiB/s in fact)
    time_s: float               # the time that prints it, seconds
    printed_in_GB: float        # the printed number in GB/s (1e9 B)
    formula_factor: float       # busbw's bytes over the formula's: 1, or N where it counts the output
    nccl_busbw_GBps: float      # nccl-tests' bus bandwidth at time_s, GB/s


@dataclass(frozen=True)
class LectureVsBusbw:
    """One measured time under both conventions: the lecture's formula and nccl-tests' busbw."""
    op: str                     # "all_reduce" or "reduce_scatter"
    time_s: float               # the measured time, seconds
    lecture_printed: float      # what the lecture's formula prints ("GB/s", GiB/s in fact)
    lecture_in_GB: float        # the same in GB/s (1e9 B)
    nccl_busbw_GBps: float      # nccl-tests' bus bandwidth, GB/s
    busbw_over_lecture: float   # nccl_busbw_GBps / lecture_printed


# ----------------------------------------------------------------------------------------
# What a caller asks for, checked in the parent before any process starts.
# ----------------------------------------------------------------------------------------

def check_ops(ops: Iterable[str]) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    if not ops:
        raise ValueError(f"ops must name at least one of {tuple(sorted(COST_MODELS))}, got ()")
    for op in ops:
        check_choice("op", op, sorted(COST_MODELS))
    return ops


def size_quantum(op: str, world_size: int) -> int:
    """Sizes must be a multiple of this: whole fp32 elements, and N equal chunks if the op splits."""
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
            check_divisible(f"sizes (bytes, {op} at N={world_size})", n,
                            size_quantum(op, world_size), why)
    return sizes


def snap_size(n: int, op: str, world_size: int) -> int:
    """The nearest valid size for (op, N): for sweeps that cover world sizes like 3 or 6."""
    q = size_quantum(op, world_size)
    return max(q, round(n / q) * q)


def parse_size(text: str) -> int:
    """'4MiB' -> 4194304, '1KiB' -> 1024, '1000' -> 1000, '1e6' -> 1000000 (bytes)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*", text)
    units = {None: 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "KB": KB, "MB": MB, "GB": GB}
    try:
        value = float(match.group(1)) * units[match.group(2)]
    except (AttributeError, ValueError):
        value = None
    if value is None or value != int(value):
        raise ValueError(f"sizes must be whole bytes like 4096, 4KiB or 1MB, got {text!r}")
    return int(value)


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
# One point's time, from its Timing.
# ----------------------------------------------------------------------------------------

def uncontended_time(record: Timing) -> float:
    """The time that stands for a point: the 10th percentile of its iterations.

    On shared CPU cores an iteration's time is a mixture: the collective's own cost, or that
    plus a wait for a core (a scheduler tick, 4 ms here, when the core is busy). The median of
    such a mixture jumps between the two as the machine's load moves the share of waits past
    one half. The low quantile is the calls that did not wait: the cost the α–β model
    describes, and it stays put until nine calls in ten wait."""
    return float(np.quantile(record.times_s, FLOOR_QUANTILE))


def median_time(record: Timing) -> float:
    """What a call typically cost here, waits included (printed beside `uncontended_time`)."""
    return statistics.median(record.times_s)


def measurement(record: Timing) -> Measurement:
    """The uniform measurement line of helpers.timing for one sweep point."""
    what = f"{record.op} N={record.world_size} n={format_binary_bytes(record.bytes)}"
    return Measurement(what, record.times_s)


# ----------------------------------------------------------------------------------------
# The model on the sweep: fit, predict, tabulate.
# ----------------------------------------------------------------------------------------

def fit_sweep(records: list[Timing], weighting: str = "relative") -> dict[str, ab.Fit]:
    """One (α, β) per operation, fitted over all its sizes and world sizes."""
    by_op: dict[str, list] = {}
    for r in records:
        by_op.setdefault(r.op, []).append((r.world_size, r.bytes, uncontended_time(r)))
    return {op: ab.fit_alpha_beta(op, pts, weighting) for op, pts in by_op.items()}


def fit_per_world_size(records: list[Timing], weighting: str = "relative") -> dict[int, dict[str, ab.Fit]]:
    """{N: {op: Fit}}: a separate (α, β) at each world size N.

    The model says α and β do not depend on N. That holds when every rank has its own
    GPU or cores; CPU ranks that outnumber the cores take turns, so each hop also waits
    for a context switch and α grows with N. Fitting per world size shows by how much.
    """
    sizes = sorted({r.world_size for r in records})
    return {world: fit_sweep([r for r in records if r.world_size == world], weighting) for world in sizes}


def fit_for(fits: dict, op: str, world_size: int) -> ab.Fit:
    """`fits` is {op: Fit} (one fit for every N) or {N: {op: Fit}} (fit_per_world_size)."""
    return fits[world_size][op] if world_size in fits else fits[op]


def result_rows(records: list[Timing], fits: dict) -> list[PointResult]:
    """The benchmark's per-point results: measured, nccl-tests bandwidths, predicted, error."""
    rows = []
    for r in records:
        t, world, n = uncontended_time(r), r.world_size, r.bytes
        predicted = fit_for(fits, r.op, world).predict(world, n)
        rows.append(PointResult(r.op, world, n, t, algbw_GBps=ab.algbw_GBps(n, t),
                                busbw_GBps=ab.busbw_GBps(r.op, world, n, t), predicted_s=predicted,
                                rel_error=ab.relative_error(predicted, t)))
    return rows


def median_rel_error(rows: list[PointResult]) -> float:
    return statistics.median(row.rel_error for row in rows)


def format_table(rows: list[PointResult], labels: dict[str, str] | None = None) -> str:
    """Predicted vs measured, one line per point (GB = 1e9 B)."""
    labels = labels or {}
    w = max([9] + [len(labels.get(row.op, row.op)) for row in rows]) + 2
    head = (f"{'operation':<{w}}{'N':>3}{'n':>11}{'measured':>11}{'predicted':>11}{'error':>7}"
            f"{'algbw GB/s':>12}{'busbw GB/s':>12}")
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{labels.get(row.op, row.op):<{w}}{row.world_size:>3}"
            f"{format_binary_bytes(row.bytes):>11}{format_seconds(row.time_s):>11}"
            f"{format_seconds(row.predicted_s):>11}{row.rel_error:>7.0%}"
            f"{row.algbw_GBps:>12.3g}{row.busbw_GBps:>12.3g}")
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
# gloo's reduce-scatter, told from the measurements.
# ----------------------------------------------------------------------------------------

def reduce_scatter_ratios(records: list[Timing]) -> list[ReduceScatterRatio]:
    """t(reduce_scatter) / t(all_reduce) on the same n-byte buffer and world size.

    A ring reduce-scatter moves (N−1)/N·n per rank, an all-reduce twice that, so the ratio
    tends to 0.5 for large messages. gloo builds reduce_scatter_tensor from an all-reduce,
    which puts it at 1 or above.
    """
    times = {(r.op, r.world_size, r.bytes): uncontended_time(r) for r in records}
    out = []
    for (op, world, n), t in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if op == "reduce_scatter" and ("all_reduce", world, n) in times:
            out.append(ReduceScatterRatio(world, n, t / times["all_reduce", world, n]))
    return out


def reduce_scatter_is_emulated(records: list[Timing], min_bytes: int = 1 * MiB) -> bool | None:
    """True when reduce-scatter costs what an all-reduce does (bandwidth regime); None if unmeasured."""
    ratios = [r.ratio for r in reduce_scatter_ratios(records) if r.bytes >= min_bytes]
    if not ratios:
        return None
    return statistics.median(ratios) > _EMULATED_IF_RATIO_ABOVE


def op_labels(records: list[Timing]) -> dict[str, str]:
    """Names for tables and legends, with reduce-scatter marked when it is measured emulated."""
    labels = {r.op: r.op for r in records}
    if "reduce_scatter" in labels and reduce_scatter_is_emulated(records):
        backend = records[0].backend
        labels["reduce_scatter"] = f"reduce_scatter ({backend}: all-reduce inside)"
    return labels


# ----------------------------------------------------------------------------------------
# The lecture's formulas beside nccl-tests', on the same measurements.
# ----------------------------------------------------------------------------------------

def lecture_all_reduce_bw(size_bytes: float, world_size: int, seconds: float) -> float:
    """lecture_08.py: size·2(N−1) bytes "sent", over N·duration, divided by 1024³ (GiB/s)."""
    return size_bytes * 2 * (world_size - 1) / (world_size * seconds) / GiB


def lecture_reduce_scatter_bw(output_bytes: float, world_size: int, seconds: float) -> float:
    """lecture_08.py, the revision consistent with the printed ≈70: the OUTPUT's bytes·(N−1) over N·duration, /1024³."""
    return output_bytes * (world_size - 1) / (world_size * seconds) / GiB


def lecture_vs_nccl_tests(all_reduce_s: float, reduce_scatter_s: float, n_bytes: float,
                          world_size: int) -> list[LectureVsBusbw]:
    """Both conventions on one all-reduce of n bytes and one reduce-scatter of n input bytes."""
    out_bytes = n_bytes / world_size
    rows = []
    for op, t, lecture in (
        ("all_reduce", all_reduce_s, lecture_all_reduce_bw(n_bytes, world_size, all_reduce_s)),
        ("reduce_scatter", reduce_scatter_s, lecture_reduce_scatter_bw(out_bytes, world_size, reduce_scatter_s)),
    ):
        busbw = ab.busbw_GBps(op, world_size, n_bytes, t)
        rows.append(LectureVsBusbw(op, t, lecture_printed=lecture, lecture_in_GB=lecture * GiB / GB,
                                   nccl_busbw_GBps=busbw, busbw_over_lecture=busbw / lecture))
    return rows


def explain_lecture_numbers(lecture: dict = LECTURE_BENCHMARK) -> list[LectureNumber]:
    """Undo the lecture's two formulas on its printed numbers: what time did it measure, and
    what bus bandwidth (nccl-tests, GB/s) does that time mean?

    Each formula is bytes / t, so the time it printed `printed` at is its value at t = 1 s over
    `printed`."""
    world, n = lecture["world_size"], lecture["num_elements"] * lecture["element_bytes"]
    rows = []
    # all-reduce of n bytes on each rank: the formula counts n·2(N−1)/N
    printed = lecture["all_reduce_printed"]
    t = lecture_all_reduce_bw(n, world, 1.0) / printed
    rows.append(LectureNumber("all_reduce", printed, t, printed_in_GB=printed * GiB / GB,
                              formula_factor=1.0,
                              nccl_busbw_GBps=ab.busbw_GBps("all_reduce", world, n, t)))
    # reduce-scatter: input N×n on each rank, output n; the formula counts the output, n·(N−1)/N
    printed = lecture["reduce_scatter_printed"]
    t = lecture_reduce_scatter_bw(n, world, 1.0) / printed
    rows.append(LectureNumber("reduce_scatter", printed, t, printed_in_GB=printed * GiB / GB,
                              formula_factor=float(world),
                              nccl_busbw_GBps=ab.busbw_GBps("reduce_scatter", world, world * n, t)))
    return rows


# ----------------------------------------------------------------------------------------
# Two network levels: inside a node (loopback) and across nodes (the link).
# ----------------------------------------------------------------------------------------

# The fit file's names for them (helpers.cost.alpha_beta.save_fit's `level`).
INSIDE, ACROSS = "loopback", "link"


@dataclass(frozen=True)
class LevelFit:
    """One operation's α–β fit on one network level, with how well it predicts its sweep."""
    level: str                  # INSIDE or ACROSS
    op: str
    world_size: int             # N: the group's ranks (the ranks per node inside, the nodes across)
    alpha_s: float
    beta_s_per_byte: float
    median_rel_error: float     # over the level's sizes, a fraction
    largest_bytes: int          # n of the largest size measured
    busbw_GBps: float           # nccl-tests' bus bandwidth measured at that size, GB/s (1e9 B)

    def as_record(self) -> dict:
        """The benchmark's record: {"level", "alpha_s", "beta_s_per_byte", "median_rel_error"}."""
        return {"level": self.level, "alpha_s": self.alpha_s,
                "beta_s_per_byte": self.beta_s_per_byte, "median_rel_error": self.median_rel_error}


def level_fits(records: dict[str, list[Timing]], op: str = "all_reduce") -> list[LevelFit]:
    """`op`'s fit on each level of {level: that level's Timings}, in the order given."""
    out = []
    for level, timings in records.items():
        mine = [r for r in timings if r.op == op]
        fit = fit_sweep(mine)[op]
        largest = max(mine, key=lambda r: r.bytes)
        t = uncontended_time(largest)
        out.append(LevelFit(level, op, largest.world_size, fit.alpha_s, fit.beta_s_per_byte,
                            median_rel_error(result_rows(mine, {op: fit})), largest.bytes,
                            ab.busbw_GBps(op, largest.world_size, largest.bytes, t)))
    return out


@dataclass(frozen=True)
class FlatVsHierarchical:
    """One all-reduce of n bytes per rank on nodes, two ways, timed alternately."""
    placement: tuple[int, ...]             # the node of each rank
    bytes: int                             # n: the buffer on each rank
    flat_s: tuple[float, ...]              # dist.all_reduce (gloo's ring over all ranks)
    hierarchical_s: tuple[float, ...]      # reduce-scatter inside, all-reduce across, all-gather
    max_abs_difference: float              # between the two results on the same inputs

    @property
    def flat_time(self) -> float:
        return float(np.quantile(self.flat_s, FLOOR_QUANTILE))

    @property
    def hierarchical_time(self) -> float:
        return float(np.quantile(self.hierarchical_s, FLOOR_QUANTILE))

    @property
    def ratio(self) -> float:
        """hierarchical / flat, each the 10th percentile of its calls (`uncontended_time`)."""
        return self.hierarchical_time / self.flat_time
