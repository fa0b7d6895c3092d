"""One measurement line for every notebook and benchmark: median, spread, and what was timed.

Machines are noisy, so a single time means little: warm up, repeat, and report the median
with the interquartile range. `Measurement` prints the same way everywhere.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from helpers.checks import check_int
from helpers.units import format_seconds


@dataclass(frozen=True)
class Measurement:
    what: str
    times_s: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times_s)

    @property
    def quartiles(self) -> tuple[float, float]:
        if len(self.times_s) < 2:
            return self.times_s[0], self.times_s[0]
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q1, q3

    def __str__(self) -> str:
        q1, q3 = self.quartiles
        return (f"{self.what}: median {format_seconds(self.median)} "
                f"(IQR {format_seconds(q1)} – {format_seconds(q3)}, n={len(self.times_s)})")


def wait(seconds: float) -> None:
    """Sleep (no CPU) until `seconds` have passed; loops in case a sleep wakes up early. Wait
    mode's stand-in for compute: a rank that waits leaves its core to the others."""
    deadline = time.perf_counter() + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def measure(fn: Callable[[], object], what: str, repeat: int = 5, warmup: int = 1,
            sync: Callable[[], object] | None = None) -> Measurement:
    """Time `fn()` `repeat` times after `warmup` untimed calls.

    `sync` runs before each clock read (e.g. `torch.cuda.synchronize`), so asynchronous
    work is counted where it happens and not where it is launched.
    """
    check_int("repeat", repeat, 1)
    check_int("warmup", warmup, 0)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return Measurement(what, tuple(times))


def times_of(fn: Callable[[], object], count: int) -> list[float]:
    """`count` calls of fn in a row, each timed alone with the wall clock (seconds)."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
