"""Pipeline schedules as plain lists, an event-driven simulator, and the checks every event log
must pass. No processes here (the bubble arithmetic is `helpers.cost.bubble`).

A schedule is, for every rank, the ordered list of work it does: `Action("F", chunk, mb)`
runs the forward of micro-batch `mb` through the rank's `chunk`-th piece of the model,
`Action("B", chunk, mb)` its backward. With v chunks per rank the model is cut into p·v
stages and rank r holds stages r, p + r, 2p + r, ... (v = 1 for GPipe and 1F1B).
A run, simulated here or recorded on live ranks, is a list of `Event`s.

The zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split a backward
in two: where a plan also holds `Action("W", chunk, mb)`, that (chunk, mb)'s B computes only the
gradient of the stage's input (what the previous stage waits for) and W the gradient of its
weights (what nobody waits for before the optimizer step). A (chunk, mb) without a W has the
whole backward in its B. DualPipeV (DeepSeek's DualPipe folded into a V) places its two chunks
per rank differently: chunk 0 of rank r is stage r, chunk 1 is stage 2p − 1 − r (`placement`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from helpers.checks import check_choice, check_divisible, check_int

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-h2", "dualpipev")  # the backward split into B and W
ALL_SCHEDULES = PIPELINE_SCHEDULES + ZERO_BUBBLE_SCHEDULES


class Action(NamedTuple):
    kind: str   # "F", "B" or "W" (see the module's docstring)
    chunk: int  # which of the rank's v model chunks
    mb: int     # micro-batch index


class Step(NamedTuple):
    """An action on a given rank of the pipeline."""
    rank: int
    action: Action


@dataclass(frozen=True)
class Event:
    """One F, B or W as it ran on one rank: `start` and `end` in seconds."""
    rank: int
    kind: str   # "F", "B" or "W"
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
    """Validate (p, m, schedule, v); return v (2 for the interleaved schedule unless given, 2
    for DualPipeV, 1 otherwise)."""
    check_choice("schedule", schedule, ALL_SCHEDULES)
    check_int("p", p)
    check_int("m", m)
    if schedule == "dualpipev":
        if v not in (None, 2):
            raise ValueError(f"v (chunks per rank) must be 2 for schedule='dualpipev', got {v}")
        if m < 2 * p:
            raise ValueError(f"dualpipev needs m >= 2p = {2 * p} micro-batches (its warm-up "
                             f"sends 2p − 1 through rank 0 before the first backward), got m={m}")
        return 2
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
    if schedule == "zb-h1":
        return zb_h1(p, m, rank)
    if schedule == "zb-h2":
        return zb_h2(p, m, rank)
    if schedule == "dualpipev":
        return dualpipev(p, m, rank)
    return interleaved_1f1b(p, m, rank, v)


def placement(schedule: str) -> str:
    """How a schedule lays its chunks on the ranks: "loop" (chunk c of rank r is stage c·p + r)
    or "v" (DualPipeV: rank r holds stages r and 2p − 1 − r, so the last rank holds the middle
    two and the first and last stages share rank 0)."""
    return "v" if schedule == "dualpipev" else "loop"


def stage_of(action: Action, rank: int, p: int, layout: str = "loop") -> int:
    """The global stage (0 … p·v − 1) an action runs on `rank` under `layout` (`placement`)."""
    if layout == "v":
        return rank if action.chunk == 0 else 2 * p - 1 - rank
    return action.chunk * p + rank


def rank_of_stage(stage: int, p: int, layout: str = "loop") -> int:
    """Which rank runs `stage` under `layout`: the inverse of `stage_of`."""
    if layout == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def chunk_of_stage(stage: int, p: int, layout: str = "loop") -> int:
    """Which of its rank's chunks `stage` is under `layout`."""
    return int(stage >= p) if layout == "v" else stage // p


def split_backwards(plan: list[Action]) -> set[tuple[int, int]]:
    """The (chunk, mb) whose backward the plan splits: those with a W of their own."""
    return {(a.chunk, a.mb) for a in plan if a.kind == "W"}


# ------------------------------------------------------------------------------------------
# Zero bubble: B and W apart.
# ------------------------------------------------------------------------------------------

def _fill_weights(p: int, m: int, warmups: list[int], cap: int) -> list[list[Action]]:
    """1F1B's order of F and B (rank r runs warmups[r] forwards before its first B), with every
    backward split and its W put where the rank would otherwise wait.

    Played with F, B and W all one unit long (Qi et al.'s assumption for their handcrafted
    schedules), in time order: a rank that is free runs its next F or B if its input exists;
    if not, or if one more forward would hold more than `cap` micro-batches, it runs its
    oldest pending W instead; after its last B, its remaining Ws. The order each rank ends
    up with is its plan. Which rank's decision comes first is fixed by time, so the plans
    are deterministic."""
    skeleton = [_warmed(p, m, warmups[r]) for r in range(p)]
    done: dict[Step, float] = {}
    nxt, free, live = [0] * p, [0.0] * p, [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    plans: list[list[Action]] = [[] for _ in range(p)]
    while any(nxt[r] < len(skeleton[r]) or pending[r] for r in range(p)):
        best = None  # (start, rank, action)
        for r in range(p):
            ready, a = None, None
            if nxt[r] < len(skeleton[r]):
                a = skeleton[r][nxt[r]]
                dep = dependency(a, r, p, 1)
                if dep is None:
                    ready = free[r]
                elif dep in done:
                    ready = max(free[r], done[dep])
            full = a is not None and a.kind == "F" and live[r] >= cap
            if pending[r] and (ready is None or ready > free[r] or full):
                choice = (free[r], r, pending[r][0])
            elif ready is not None and not full:
                choice = (ready, r, a)
            else:
                continue
            if best is None or choice[0] < best[0]:
                best = choice
        if best is None:
            raise RuntimeError(f"zero-bubble plan for p={p}, m={m} deadlocks")
        start, r, a = best
        if a.kind == "W":
            pending[r].pop(0)
            live[r] -= 1  # the W frees what the micro-batch still held
        else:
            nxt[r] += 1
            done[Step(r, Action(a.kind, 0, a.mb))] = start + 1.0
            if a.kind == "F":
                live[r] += 1
            else:
                pending[r].append(Action("W", 0, a.mb))
        free[r] = start + 1.0
        plans[r].append(a)
    return plans


def _warmed(p: int, m: int, warmup: int) -> list[Action]:
    """1F1B's pattern with `warmup` forwards before the first backward."""
    warmup = min(warmup, m)
    plan = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        plan += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return plan + [Action("B", 0, i) for i in range(m - warmup, m)]


@lru_cache(maxsize=128)
def _zero_bubble_plans(p: int, m: int, handcrafted: str) -> tuple[tuple[Action, ...], ...]:
    if handcrafted == "zb-h1":  # 1F1B's warm-up, at most p micro-batches held, as 1F1B's rank 0
        plans = _fill_weights(p, m, [p - 1 - r for r in range(p)], cap=p)
    else:  # zb-h2: twice the warm-up, so rank 0 never waits for its first B; 2p − 1 held
        plans = _fill_weights(p, m, [2 * (p - 1 - r) for r in range(p)], cap=2 * p - 1)
    return tuple(tuple(plan) for plan in plans)


def zb_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, §3.1): 1F1B with B and W apart, the Ws filling what were 1F1B's
    waits; no rank holds more than p micro-batches (1F1B's rank 0). Bubble (p−1)(T_F+T_B−T_W)
    per rank instead of 1F1B's (p−1)(T_F+T_B+T_W)."""
    return list(_zero_bubble_plans(p, m, "zb-h1")[rank])


def zb_h2(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H2 (Qi et al. 2023, §3.1): 2(p−1−r) warm-up forwards on rank r, so that with
    T_F = T_B = T_W every rank works without a gap from its first F to its last W (a
    parallelogram), holding up to 2p − 1 micro-batches."""
    return list(_zero_bubble_plans(p, m, "zb-h2")[rank])


def dualpipev(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe folded into a V, the order of its reference code): rank r
    holds chunk 0 = stage r and chunk 1 = stage 2p − 1 − r; eight phases. A pair "F of one chunk,
    B of the other" is what DualPipe overlaps on a GPU (one's compute under the other's
    communication); here it runs as F then B. B is split (a W of its own, from a FIFO queue)
    in the warm-up's phase 3 and in the second half of the drain, whole elsewhere."""
    plan: list[Action] = []
    count = {}          # (kind, chunk) -> next micro-batch
    weights: list[Action] = []  # Ws owed, oldest first

    def add(kind: str, chunk: int, split: bool = False) -> None:
        mb = count.get((kind, chunk), 0)
        count[kind, chunk] = mb + 1
        plan.append(Action(kind, chunk, mb))
        if split:
            weights.append(Action("W", chunk, mb))

    def owed_weight() -> None:
        if weights:
            plan.append(weights.pop(0))

    far = p - 1 - rank  # ranks beyond this one on the way down to the V's tip
    for _ in range(2 * far):                  # 1: forwards of chunk 0
        add("F", 0)
    for _ in range(rank + 1):                 # 2: F0 F1
        add("F", 0), add("F", 1)
    for _ in range(far):                      # 3: B1 (split) W F1
        add("B", 1, split=True), owed_weight(), add("F", 1)
    for _ in range(m - 2 * p + rank + 1):     # 4: the steady state, F0 B1 F1 B0
        add("F", 0), add("B", 1), add("F", 1), add("B", 0)
    for _ in range(far):                      # 5: B1 F1 B0
        add("B", 1), add("F", 1), add("B", 0)
    split = False
    for i in range(rank + 1):                 # 6: B1 B0, split from the middle on
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add("B", 1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add("B", 0, split)
    for _ in range(far):                      # 7: W B0 (split)
        owed_weight(), add("B", 0, split=True)
    for _ in range(rank + 1):                 # 8: the Ws left
        owed_weight()
    return plan


# ------------------------------------------------------------------------------------------
# Memory, consistency and the simulator.
# ------------------------------------------------------------------------------------------

def peak_live(plan: list[Action]) -> int:
    """Most (chunk, micro-batch) pairs whose forward ran and whose backward has not finished
    (for a split backward: whose W has not run, since W still needs the layers' inputs)."""
    split = split_backwards(plan)
    live = peak = 0
    for a in plan:
        if a.kind == "F":
            live += 1
        elif a.kind == "W" or (a.chunk, a.mb) not in split:
            live -= 1
        peak = max(peak, live)
    return peak


def verify_plans(plans: list[list[Action]], m: int, v: int) -> None:
    """Every rank runs each (chunk, mb) forward exactly once and its backward after it, and
    any W once, after its B."""
    for rank, plan in enumerate(plans):
        expected = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
        weights = [a for a in plan if a.kind == "W"]
        if (len(plan) - len(weights) != len(expected) or set(plan) - set(weights) != expected
                or len(set(weights)) != len(weights)):
            raise ValueError(f"rank {rank}: plan does not run every F and B exactly once")
        seen = set()
        for a in plan:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.chunk, a.mb) not in seen:
                raise ValueError(f"rank {rank}: {a} before its {before}")
            seen.add(tuple(a))


def dependency(action: Action, rank: int, p: int, v: int, layout: str = "loop") -> Step | None:
    """The step (rank, action) whose output this action consumes, or None for the pipeline's ends.

    A forward needs the previous stage's forward of the same micro-batch; a backward needs
    the next stage's backward (the last stage starts its backward from its own loss); a W
    needs its own B, on the same rank.
    """
    if action.kind == "W":
        return Step(rank, Action("B", action.chunk, action.mb))
    stage, last = stage_of(action, rank, p, layout), p * v - 1
    if action.kind == "F":
        if stage == 0:
            return None
        other = stage - 1
    elif stage == last:
        return None
    else:
        other = stage + 1
    return Step(rank_of_stage(other, p, layout),
                Action(action.kind, chunk_of_stage(other, p, layout), action.mb))


def durations(plan: list[Action], t_f: float, t_b: float, t_w: float, v: int) -> list[float]:
    """How long each action of `plan` takes when a whole stage's F takes t_f and its backward
    t_b, of which t_w is the weight gradient (split: B takes t_b − t_w and W t_w), each shared
    over v chunks."""
    split = split_backwards(plan)
    seconds = []
    for a in plan:
        if a.kind == "F":
            seconds.append(t_f / v)
        elif a.kind == "W":
            seconds.append(t_w / v)
        else:
            seconds.append((t_b - t_w if (a.chunk, a.mb) in split else t_b) / v)
    return seconds


def simulate(schedule: str, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0,
             v: int | None = None, latency: float = 0.0, t_w: float | None = None,
             ) -> list[Event]:
    """Play a schedule with fixed durations (F takes t_f, B t_b, each split over v chunks; a
    split backward's W takes t_w, t_b/2 unless given, and its B the rest) and return the event
    log a live run would record. Raises if the schedule deadlocks."""
    v = check_schedule_args(p, m, schedule, v)
    layout = placement(schedule)
    t_w = t_b / 2 if t_w is None else t_w
    plans = [make_plan(schedule, p, m, r, v) for r in range(p)]
    verify_plans(plans, m, v)
    seconds = [durations(plan, t_f, t_b, t_w, v) for plan in plans]
    done: dict[Step, float] = {}
    nxt, free = [0] * p, [0.0] * p
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(plans[r]):
                a = plans[r][nxt[r]]
                dep = dependency(a, r, p, v, layout)
                if dep is not None and dep not in done:
                    break  # waits for a peer; try the other ranks first
                ready = free[r] if dep is None else max(free[r], done[dep] + latency)
                end = ready + seconds[r][nxt[r]]
                events.append(Event(r, a.kind, a.chunk, a.mb, ready, end))
                done[Step(r, a)], free[r], nxt[r] = end, end, nxt[r] + 1
                progress = True
    if any(n < len(plan) for n, plan in zip(nxt, plans)):
        stuck = [r for r in range(p) if nxt[r] < len(plans[r])]
        raise RuntimeError(f"schedule {schedule!r} deadlocks on ranks {stuck}")
    return events


def log_violation(events: list[Event], p: int, m: int, v: int = 1, layout: str = "loop") -> str:
    """What any real run must satisfy: every F and B once per rank (and any W once), no two at
    a time on one rank, and no action starting before the output it consumes was produced.
    Returns the first violation in words, or "" when the log satisfies all three."""
    by_key = {}
    for e in events:
        key = Step(e.rank, e.action)
        if key in by_key:
            return f"duplicate event {key}"
        if not e.end >= e.start:
            return f"event ends before it starts: {e}"
        by_key[key] = e
    forward_backward = sum(key.action.kind != "W" for key in by_key)
    if forward_backward != 2 * p * v * m:
        return f"expected {2 * p * v * m} forwards and backwards, got {forward_backward}"
    for r in range(p):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        for a, b in zip(mine, mine[1:]):
            if b.start < a.end:
                return f"rank {r} overlaps {a} and {b}"
    for step, e in by_key.items():
        dep = dependency(step.action, step.rank, p, v, layout)
        if dep is not None and (dep not in by_key or e.start < by_key[dep].end):
            return (f"{step.action} on rank {step.rank} started before "
                    f"{dep.action} on rank {dep.rank} ended")
    return ""


def verify_event_log(events: list[Event], p: int, m: int, v: int = 1,
                     layout: str = "loop") -> None:
    """Raise AssertionError with `log_violation`'s words if the log breaks the schedule's rules."""
    violation = log_violation(events, p, m, v, layout)
    if violation:
        raise AssertionError(violation)
