"""The pipeline bubble: the formula, and the same quantity measured on an event log.

Pure arithmetic: no torch, no processes. An event log is any iterable of objects with `start`
and `end` in seconds (`helpers.cost.schedules.Event`, simulated or recorded on live ranks).
"""
from __future__ import annotations

from typing import Iterable

from helpers.checks import check_int, check_number


def bubble_theory(p: int, m: float, v: int = 1) -> float:
    """Idle fraction of the pipeline: (p−1)/(v·m + p−1), or (p−1)/(m+p−1) with v = 1.

    Every rank does m·(t_F + t_B) of work and the schedule lasts (m + p − 1)·(t_F + t_B)
    (with v chunks, each of 1/v the work, the ramp shrinks to (p−1)·(t_F + t_B)/v). The ratio
    does not depend on t_B/t_F, so B = 2F (as in real backward passes) gives the same bubble.
    m may be fractional, to draw the curve between whole numbers of micro-batches.
    """
    check_int("p", p)
    check_int("v", v)
    check_number("m", m, 0, low_inclusive=False)
    return (p - 1) / (v * m + p - 1)


def measured_bubble(events: Iterable, p: int) -> float:
    """The fraction of rank-time spent idle during the whole schedule.

    span = (last end on any rank) − (first start on any rank); busy = the summed durations
    of every F and B on every rank; bubble = 1 − busy / (p · span). This is exactly the
    quantity `bubble_theory` computes: each rank's idle time inside the *global* span,
    averaged over ranks (not each rank's own first-start-to-last-end window, which would
    hide the ramp-up of the later ranks).
    """
    events = list(events)
    if not events:
        raise ValueError("events must not be empty")
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (p * span)
