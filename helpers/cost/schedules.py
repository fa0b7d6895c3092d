"""Pipeline schedules as plain lists, an event-driven simulator, and the checks every event log
must pass. No processes here (the bubble arithmetic is `helpers.cost.bubble`).

A schedule is, for every rank, the ordered list of work it does: `Action("F", chunk, mb)`
runs the forward of micro-batch `mb` through the rank's `chunk`-th piece of the model,
`Action("B", chunk, mb)` its backward. With v chunks per rank the model is cut into p·v
stages and rank r holds stages r, p + r, 2p + r, ... (v = 1 for GPipe and 1F1B).
A run, simulated here or recorded on live ranks, is a list of `Event`s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from helpers.checks import check_choice, check_divisible, check_int

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    kind: str   # "F" or "B"
    chunk: int  # which of the rank's v model chunks
    mb: int     # micro-batch index


class Step(NamedTuple):
    """An action on a given rank of the pipeline."""
    rank: int
    action: Action


@dataclass(frozen=True)
class Event:
    """One forward or backward as it ran on one rank: `start` and `end` in seconds."""
    rank: int
    kind: str   # "F" or "B"
    chunk: int
    mb: int
    start: float
    end: float

    @property
    def action(self) -> Action:
        return Action(self.kind, self.chunk, self.mb)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def shifted(self, t0: float) -> "Event":
        """The same event on a clock that reads 0 at `t0`."""
        return replace(self, start=self.start - t0, end=self.end - t0)


def check_schedule_args(p, m, schedule: str = "1f1b", v: int | None = None) -> int:
    """Validate (p, m, schedule, v); return v (1 unless the schedule is interleaved)."""
    check_choice("schedule", schedule, PIPELINE_SCHEDULES)
    check_int("p", p)
    check_int("m", m)
    if schedule != "interleaved":
        if v not in (None, 1):
            raise ValueError(f"v (chunks per rank) must be 1 for schedule={schedule!r}, got {v}")
        return 1
    v = check_int("v", 2 if v is None else v)
    check_divisible("m", m, p, "the interleaved schedule sends micro-batches round in groups of p")
    return v


# ------------------------------------------------------------------------------------------
# The schedules.
# ------------------------------------------------------------------------------------------

def gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: every micro-batch's activations are alive at once."""
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-Flush: p−1−rank warm-up forwards, then alternate one F and one B.

    A backward frees a micro-batch's activations as soon as the pipeline allows, so a rank
    never holds more than p − rank micro-batches (stage 0 holds p).
    """
    warmup = min(p - 1 - rank, m)
    plan = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        plan += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return plan + [Action("B", 0, i) for i in range(m - warmup, m)]


def interleaved_1f1b(p: int, m: int, rank: int, v: int = 2) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: each rank holds v chunks; micro-batches go round in
    groups of p, first through chunk 0 of every rank, then chunk 1, and so on."""
    total = m * v

    def action(kind: str, k: int) -> Action:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk  # backwards run through the chunks in reverse
        return Action(kind, chunk, (k // (p * v)) * p + k % p)

    warmup = min((p - 1 - rank) * 2 + (v - 1) * p, total)
    plan = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        plan += [action("F", warmup + i), action("B", i)]
    return plan + [action("B", k) for k in range(total - warmup, total)]


def make_plan(schedule: str, p: int, m: int, rank: int, v: int | None = None) -> list[Action]:
    v = check_schedule_args(p, m, schedule, v)
    if schedule == "gpipe":
        return gpipe(p, m, rank)
    if schedule == "1f1b":
        return one_f_one_b(p, m, rank)
    return interleaved_1f1b(p, m, rank, v)


def stage_of(action: Action, rank: int, p: int) -> int:
    """The global stage (0 … p·v − 1) an action runs: chunk c of rank r is stage c·p + r."""
    return action.chunk * p + rank


# ------------------------------------------------------------------------------------------
# Memory, consistency and the simulator.
# ------------------------------------------------------------------------------------------

def peak_live(plan: list[Action]) -> int:
    """Most (chunk, micro-batch) pairs whose forward ran and whose backward has not."""
    live = peak = 0
    for a in plan:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def verify_plans(plans: list[list[Action]], m: int, v: int) -> None:
    """Every rank runs each (chunk, mb) forward exactly once and its backward after it."""
    for rank, plan in enumerate(plans):
        expected = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
        if len(plan) != len(expected) or set(plan) != expected:
            raise ValueError(f"rank {rank}: plan does not run every F and B exactly once")
        seen = set()
        for a in plan:
            if a.kind == "B" and ("F", a.chunk, a.mb) not in seen:
                raise ValueError(f"rank {rank}: backward {a} before its forward")
            seen.add(tuple(a))


def dependency(action: Action, rank: int, p: int, v: int) -> Step | None:
    """The step (rank, action) whose output this action consumes, or None for the pipeline's ends.

    A forward needs the previous stage's forward of the same micro-batch; a backward needs
    the next stage's backward (the last stage starts its backward from its own loss).
    """
    stage, last = stage_of(action, rank, p), p * v - 1
    if action.kind == "F":
        if stage == 0:
            return None
        prev = stage - 1
        return Step(prev % p, Action("F", prev // p, action.mb))
    if stage == last:
        return None
    nxt = stage + 1
    return Step(nxt % p, Action("B", nxt // p, action.mb))


def simulate(schedule: str, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0,
             v: int | None = None, latency: float = 0.0) -> list[Event]:
    """Play a schedule with fixed durations (F takes t_f, B t_b, each split over v chunks) and
    return the event log a live run would record. Raises if the schedule deadlocks."""
    v = check_schedule_args(p, m, schedule, v)
    plans = [make_plan(schedule, p, m, r, v) for r in range(p)]
    verify_plans(plans, m, v)
    done: dict[Step, float] = {}
    nxt, free = [0] * p, [0.0] * p
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(plans[r]):
                a = plans[r][nxt[r]]
                dep = dependency(a, r, p, v)
                if dep is not None and dep not in done:
                    break  # waits for a peer; try the other ranks first
                ready = free[r] if dep is None else max(free[r], done[dep] + latency)
                end = ready + (t_f if a.kind == "F" else t_b) / v
                events.append(Event(r, a.kind, a.chunk, a.mb, ready, end))
                done[Step(r, a)], free[r], nxt[r] = end, end, nxt[r] + 1
                progress = True
    if any(n < len(plan) for n, plan in zip(nxt, plans)):
        stuck = [r for r in range(p) if nxt[r] < len(plans[r])]
        raise RuntimeError(f"schedule {schedule!r} deadlocks on ranks {stuck}")
    return events


def log_violation(events: list[Event], p: int, m: int, v: int = 1) -> str:
    """What any real run must satisfy: every F and B once per rank, no two at a time on one
    rank, and no action starting before the output it consumes was produced. Returns the first
    violation in words, or "" when the log satisfies all three."""
    by_key = {}
    for e in events:
        key = Step(e.rank, e.action)
        if key in by_key:
            return f"duplicate event {key}"
        if not e.end >= e.start:
            return f"event ends before it starts: {e}"
        by_key[key] = e
    if len(by_key) != 2 * p * v * m:
        return f"expected {2 * p * v * m} events, got {len(by_key)}"
    for r in range(p):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        for a, b in zip(mine, mine[1:]):
            if b.start < a.end:
                return f"rank {r} overlaps {a} and {b}"
    for step, e in by_key.items():
        dep = dependency(step.action, step.rank, p, v)
        if dep is not None and e.start < by_key[dep].end:
            return (f"{step.action} on rank {step.rank} started before "
                    f"{dep.action} on rank {dep.rank} ended")
    return ""


def verify_event_log(events: list[Event], p: int, m: int, v: int = 1) -> None:
    """Raise AssertionError with `log_violation`'s words if the log breaks the schedule's rules."""
    violation = log_violation(events, p, m, v)
    if violation:
        raise AssertionError(violation)
