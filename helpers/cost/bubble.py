"""The pipeline bubble: the formula, and the same quantity measured on an event log.

Pure arithmetic: no torch, no processes. An event log is any iterable of objects with `start`
and `end` in seconds (`helpers.cost.schedules.Event`, simulated or recorded on live ranks).
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

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


# ------------------------------------------------------------------------------------------
# The backward split into B (input gradient) and W (weight gradient).
# ------------------------------------------------------------------------------------------

class Durations(NamedTuple):
    """Mean seconds of one chunk's F, split B (input gradient only), W, and whole backward
    (nan where the log has none of that kind)."""
    f: float
    b: float
    w: float
    b_whole: float


def mean_durations(events: Iterable) -> Durations:
    """The mean F, B and W of an event log. A B counts as split when its (rank, chunk, mb)
    also has a W, as whole otherwise."""
    events = list(events)
    weighed = {(e.rank, e.chunk, e.mb) for e in events if e.kind == "W"}
    groups: dict[str, list[float]] = {"f": [], "b": [], "w": [], "b_whole": []}
    for e in events:
        if e.kind == "B":
            key = "b" if (e.rank, e.chunk, e.mb) in weighed else "b_whole"
        else:
            key = e.kind.lower()
        groups[key].append(e.end - e.start)
    return Durations(**{k: sum(v) / len(v) if v else math.nan for k, v in groups.items()})


CLOSED_FORMS = {
    # idle time per rank in one step, as each schedule's paper gives it
    "1f1b": "(p−1)(T_F+T_B+T_W)",       # Qi et al. 2023, §2 (handcrafted schedules)
    "zb-h1": "(p−1)(T_F+T_B−T_W)",      # Qi et al. 2023, §2 (handcrafted schedules)
    "zb-h2": "(p−1)(T_F+T_B−2T_W)",     # Qi et al. 2023, §2 (handcrafted schedules)
    "dualpipev": "(p−1)(T_F&B+T_B̄−3T_W)",  # DeepSeek-AI 2024 (V3 report), §3.2.1, Table 2; PP = 2p
}


def closed_form_idle(schedule: str, p: int, d: Durations) -> float:
    """Idle seconds per rank from the schedule's paper, with the durations `d` of one chunk.

    T_B is the split B (input gradient only); DualPipe's table uses the whole backward
    T_B̄ = T_B + T_W and T_F&B, a forward and a backward run as one overlapped pair, which on
    ranks that run the pair's halves one after the other is T_F + T_B̄. Its (PP/2 − 1) is p − 1
    here: DualPipeV's 2p stages on p ranks. ZB-H2's form can go below 0 (T_W > (T_F+T_B)/2);
    no schedule idles less than nothing, so it is clipped at 0.
    """
    check_int("p", p)
    if schedule == "1f1b":
        return (p - 1) * (d.f + d.b + d.w)
    if schedule == "zb-h1":
        return (p - 1) * (d.f + d.b - d.w)
    if schedule == "zb-h2":
        return max(0.0, (p - 1) * (d.f + d.b - 2 * d.w))
    if schedule == "dualpipev":
        whole = d.b + d.w if math.isnan(d.b_whole) else d.b_whole
        return (p - 1) * ((d.f + whole) + whole - 3 * d.w)
    raise ValueError(f"no closed form with B and W apart for schedule {schedule!r}; "
                     f"known: {', '.join(CLOSED_FORMS)}")


def idle_fraction(idle: float, work: float) -> float:
    """The bubble as a fraction of the step: idle / (work + idle), with `work` a rank's busy
    seconds and `idle` its idle seconds."""
    check_number("work", work, 0, low_inclusive=False)
    return idle / (work + idle)


def steady_bubble(events: Iterable, p: int) -> float:
    """The idle fraction inside each rank's *own* window, first start to last end on that rank,
    over all ranks: 1 − busy / Σ windows. What steps pay when one step's first forwards start
    as soon as the same rank's last W of the step before has run, instead of after every rank
    has finished (the optimizer step's synchronisation bypassed, Qi et al. 2023, §4); one
    synchronised step pays `measured_bubble`, which counts the ramp these windows leave out."""
    events = list(events)
    if not events:
        raise ValueError("events must not be empty")
    windows = 0.0
    for r in range(p):
        mine = [e for e in events if e.rank == r]
        windows += max(e.end for e in mine) - min(e.start for e in mine)
    return 1.0 - sum(e.end - e.start for e in events) / windows
