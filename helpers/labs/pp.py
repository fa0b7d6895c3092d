"""Pipeline parallelism on live ranks: cut the MLP by depth and stream micro-batches through it.

Notebook 05's runs:
* `lecture_forward`: the lecture's forward-only pipeline (blocking send/recv, no backward).
* `pipeline_rank` / `run_pipeline`: GPipe, 1F1B and interleaved 1F1B *with* backward,
  asynchronous isend/irecv, and an event log of every forward and backward on every rank;
  the zero-bubble schedules (ZB-H1, ZB-H2, DualPipeV) the same way, their backwards split
  into B and W (`split_backward_check` shows the split exact on one stage).
  `mode="compute"` runs the real matmuls; `mode="wait"` replaces each F and B by a timed
  wait that uses no CPU, so p = 8 ranks on a 2-core laptop still keep exact schedule timing.
* `reference`: the same MLP trained in one process, the yardstick for outputs and gradients.
* `torch_pipelining_rank`: PyTorch's own `torch.distributed.pipelining` on the same model;
  `torch_v_schedule_rank` its ScheduleZBVZeroBubble and ScheduleDualPipeV, and
  `torch_schedule_order` the order its DualPipeV plans, to hold ours against.
* `timed_schedule` / `bubble_sweep`: the schedule alone (simulated, or waits on live ranks),
  what the widget and the bubble-against-m plot show.

The model is `helpers.models`' MLP (`make_mlp`, sliced per stage with `mlp_layers`) and its
loss `mlp_loss`; the stage's layers and the mailbox are `helpers.parallel.pp`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from helpers import ranks as live_ranks
from helpers.checks import check_choice, check_divisible, check_int, check_number
from helpers.configs import LECTURE, MLPConfig
from helpers.cost.bubble import (bubble_theory, closed_form_idle, idle_fraction, mean_durations,
                                 measured_bubble, steady_bubble)
from helpers.cost.schedules import (ZERO_BUBBLE_SCHEDULES, Action, Event, Step, check_schedule_args,
                                    dependency, durations, make_plan, peak_live, placement,
                                    simulate, split_backwards, stage_of)
from helpers.models import make_batch, make_mlp, mlp_layers, mlp_loss
from helpers.parallel.groups import global_rank, group_rank, group_size, rank_device
from helpers.parallel.pp import (Mailbox, backward_input, backward_weight, record_forward,
                                 stage_range)
from helpers.timing import wait

MODES = ("compute", "wait")


T_F = 0.03  # seconds per forward in wait mode; a backward waits twice as long


# ------------------------------------------------------------------------------------------
# The model, cut by depth.
# ------------------------------------------------------------------------------------------

def check_model(p: int, m: int, v: int, config: MLPConfig) -> None:
    """The model must cut into p·v equal stages and the batch into m equal micro-batches."""
    check_divisible("layers", config.layers, p * v,
                    f"every one of the p·v = {p}·{v} pipeline stages gets as many layers")
    check_divisible("batch", config.batch, m, "m micro-batches of equal size")


def layer_grads(layers: torch.nn.Sequential, first: int) -> dict[int, torch.Tensor]:
    """{global layer index: weight gradient} of a slice of the MLP starting at layer `first`."""
    return {first + j: linear.weight.grad for j, linear in enumerate(layers[0::2])}


@dataclass
class Reference:
    """Single-process training on the whole batch: the numbers every pipeline reproduces."""
    output: torch.Tensor = field(repr=False)
    loss: float
    grads: dict[int, torch.Tensor] = field(repr=False)  # layer -> weight gradient


def reference(config: MLPConfig = LECTURE) -> Reference:
    """One training step of the unsharded MLP on the whole batch, loss `mlp_loss`."""
    model = make_mlp(config)
    out = model(make_batch(config))
    loss = mlp_loss(out)
    loss.backward()
    return Reference(out.detach(), loss.item(), layer_grads(model, 0))


# ------------------------------------------------------------------------------------------
# 1. The lecture's pipeline: forward only, blocking send/recv, one micro-batch at a time.
# ------------------------------------------------------------------------------------------

def lecture_forward(rank, world_size, m, config: MLPConfig = LECTURE, group=None):
    """Stage `stage` = group_rank(group) of p = group_size(group) owns layers
    [stage·L/p, (stage+1)·L/p).
    Stage 0 cuts the batch into m micro-batches; each later stage receives a micro-batch
    from the stage before, runs its layers and passes it on. The last stage returns the
    whole output; the others return None."""
    device = rank_device()
    stage, p = group_rank(group), group_size(group)
    mine = stage_range(stage, p, config)
    layers = mlp_layers(make_mlp(config), mine.start, mine.stop).to(device)
    if stage == 0:
        micro_batches = make_batch(config).to(device).chunk(m)
    else:  # room for what the previous stage will send
        micro_batches = [torch.empty(config.batch // m, config.hidden, device=device)
                         for _ in range(m)]
    outputs = []
    with torch.no_grad():  # forward only
        for x in micro_batches:
            if stage > 0:  # blocks until the activations arrive
                dist.recv(x, src=global_rank(group, stage - 1), group=group)
            x = layers(x)
            if stage + 1 < p:  # blocks until the next stage has them
                dist.send(x.contiguous(), dst=global_rank(group, stage + 1), group=group)
            else:
                outputs.append(x)
    return torch.cat(outputs) if outputs else None


def check_ranks(ranks, backend: str | None = None):
    """The live ranks a runner uses: a `LiveRanks` (of `backend`, when one is required)."""
    if not isinstance(ranks, live_ranks.LiveRanks):
        raise TypeError(f"ranks must be a LiveRanks (helpers.ranks.LiveRanks(p, backend='gloo')); "
                        f"got {type(ranks).__name__}")
    if backend is not None and ranks.backend != backend:
        raise ValueError(f"ranks must be LiveRanks(..., backend={backend!r}): the hand-written "
                         f"schedules exchange CPU tensors, got backend={ranks.backend!r}")
    return ranks


def run_lecture_forward(ranks, p: int = 2, m: int = 4, config: MLPConfig = LECTURE):
    """Run `lecture_forward` on p of the live `ranks` and return the last rank's output."""
    check_int("p", p)
    check_int("m", m)
    check_model(p, m, 1, config)
    return check_ranks(ranks).resize(p).run(lecture_forward, m, config)[-1]


# ------------------------------------------------------------------------------------------
# 2. Schedules with backward, asynchronous messages and an event log.
# ------------------------------------------------------------------------------------------

class SplitCheck(NamedTuple):
    """`split_backward_check`'s findings, each True when the split matches the whole backward."""
    input_grads_equal: bool    # every micro-batch's B gave backward()'s input gradient
    weights_untouched_by_b: bool  # no weight had a gradient after the Bs
    weight_grads_equal: bool   # after the Ws, every weight's gradient is backward()'s


def split_backward_check(config: MLPConfig = LECTURE, first: int = 1, last: int = 3,
                         m: int = 4) -> SplitCheck:
    """Layers [first, last) of the MLP as a stage, m micro-batches of the batch, one process:
    `backward()` on one copy, B for every micro-batch then W for every one on another (the
    schedules' order: W after all its micro-batch's B, oldest first), compared bit for bit."""
    whole, split = (mlp_layers(make_mlp(config), first, last) for _ in range(2))
    grad_out = torch.randn(config.batch // m, config.hidden,
                           generator=torch.Generator().manual_seed(config.seed + 2))
    inputs_equal, owed = True, []
    for x in make_batch(config).chunk(m):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        whole(a).backward(grad_out)
        grad_in, work = backward_input(record_forward(split, b, b), grad_out)
        inputs_equal &= torch.equal(grad_in, a.grad)
        owed.append(work)
    untouched = all(p.grad is None for p in split.parameters())
    for work in owed:
        backward_weight(work)
    weights_equal = all(torch.equal(mine.grad, theirs.grad)
                        for mine, theirs in zip(split.parameters(), whole.parameters()))
    return SplitCheck(inputs_equal, untouched, weights_equal)


@dataclass
class StageLog:
    """What one rank brings back from a pipeline step."""
    events: list[Event] = field(default_factory=list)
    peak_live: int | None = None  # most micro-batches whose activations it held at once
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # its layers (compute mode)
    loss: float | None = None     # the last stage only


def pipeline_rank(rank, world_size, schedule: str, m: int, v: int, mode: str, t_f: float,
                  t_b: float, config: MLPConfig = LECTURE, group=None,
                  t_w: float | None = None) -> StageLog:
    """One rank of a pipeline schedule: stage group_rank(group) of p = group_size(group).
    Returns its event log, its peak number of live micro-batches, its layers' gradients and
    (last stage) the loss.

    Before running action i the rank already posts the receive for action i + 1, and it
    sends its outputs with isend without waiting, so activations and gradients travel while
    the next F or B computes. A rank only ever blocks on the input it needs now, which is
    what the schedule's dependencies allow. Where the plan has a W for a (chunk, mb), its B
    computes the input's gradient only (`backward_input`) and the W the weights'
    (`backward_weight`); in wait mode such a B waits t_b − t_w and the W t_w (t_w = t_b/2).
    """
    me, p = group_rank(group), group_size(group)
    plan = make_plan(schedule, p, m, me, v)
    layout = placement(schedule)
    split = split_backwards(plan)
    seconds = durations(plan, t_f, t_b, t_b / 2 if t_w is None else t_w, v)
    last = p * v - 1
    shape = (config.batch // m, config.hidden)
    mail = Mailbox(m, v, shape, group, layout)
    compute = mode == "compute"
    if compute:
        model = make_mlp(config)
        mine = {c: stage_range(stage_of(Action("F", c, 0), me, p, layout), p * v, config)
                for c in range(v)}
        chunks = {c: mlp_layers(model, r.start, r.stop) for c, r in mine.items()}
        xs = make_batch(config).chunk(m)
        numel = config.batch * config.hidden  # per micro-batch Σy²/numel: they add up to the loss
        for layers in chunks.values():  # first-call costs (thread pools, allocator) stay
            layers(torch.zeros(shape, requires_grad=True)).sum().backward()
            layers.zero_grad(set_to_none=True)  # outside the timeline
    else:
        placeholder = torch.zeros(shape)  # wait mode still sends messages of the real size

    saved: dict[tuple, object] = {}  # (chunk, mb) -> what its B and W still need
    events, losses, peak = [], [], 0
    dist.barrier(group=group)  # everyone starts the clock together
    for i, a in enumerate(plan):
        if i + 1 < len(plan):
            mail.post(plan[i + 1])  # the next input travels while this action runs
        received = mail.take(a)
        stage = stage_of(a, me, p, layout)
        key = (a.chunk, a.mb)
        start = time.perf_counter()
        if a.kind == "F":
            if compute:
                inp = None if stage == 0 else received.requires_grad_()
                tape = record_forward(chunks[a.chunk], inp, xs[a.mb] if stage == 0 else inp)
                if stage == last:
                    tape = tape._replace(out=mlp_loss(tape.out, numel=numel))
                    losses.append(tape.out.item())
                out = tape.out
            else:
                wait(seconds[i])
                tape, out = None, placeholder
            saved[key] = tape
            peak = max(peak, len(saved))
            end = time.perf_counter()
            if stage < last:
                mail.send(out.detach(), stage + 1, "F", a.mb)
        elif a.kind == "B":
            grad_in = placeholder if not compute else None
            if compute and key in split:  # B now, W later: the weights' work stays in `saved`
                grad_in, saved[key] = backward_input(saved[key], None if stage == last else received)
            elif compute:
                tape = saved.pop(key)
                tape.out.backward(None if stage == last else received)  # weight grads accumulate
                grad_in = tape.inp.grad if tape.inp is not None else None
            else:
                wait(seconds[i])
                if key not in split:
                    saved.pop(key)
            end = time.perf_counter()
            if stage > 0:
                mail.send(grad_in, stage - 1, "B", a.mb)
        else:  # W: the weights' gradients of a B that ran earlier; nobody waits for them
            work = saved.pop(key)
            if compute:
                backward_weight(work)
            else:
                wait(seconds[i])
            end = time.perf_counter()
        events.append(Event(me, a.kind, a.chunk, a.mb, start, end))
    mail.flush()
    dist.barrier(group=group)
    grads = {}
    if compute:
        for c, layers in chunks.items():
            grads.update(layer_grads(layers, mine[c].start))
    return StageLog(events, peak, grads, sum(losses) if losses else None)


@dataclass
class PipelineRun:
    """What a pipeline run brings back to the notebook."""
    schedule: str
    p: int
    m: int
    v: int
    mode: str
    events: list[Event] = field(repr=False)  # every F and B on every rank, seconds from 0
    peak_live: list[int] = field(default_factory=list)  # per rank
    grads: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # layer -> gradient
    loss: float | None = None

    @classmethod
    def from_logs(cls, schedule: str, m: int, v: int, mode: str,
                  logs: list[StageLog]) -> "PipelineRun":
        """Put one pipeline's stages together (in stage order), clocks starting at 0."""
        events = [e for log in logs for e in log.events]
        t0 = min((e.start for e in events), default=0.0)
        return cls(schedule, len(logs), m, v, mode, [e.shifted(t0) for e in events],
                   [log.peak_live for log in logs],
                   {layer: g for log in logs for layer, g in log.grads.items()},
                   # the rank holding the last stage: rank p − 1, or rank 0 in DualPipeV's V
                   next((log.loss for log in logs if log.loss is not None), None))

    @property
    def layout(self) -> str:
        return placement(self.schedule.removeprefix("torch "))

    @property
    def bubble_measured(self) -> float:
        """The idle fraction of this one step (`measured_bubble`); for ZB-H2, whose paper's
        zero holds for steps that follow each other without waiting for every rank, the
        fraction inside each rank's own window (`steady_bubble`)."""
        if self.schedule == "zb-h2":
            return steady_bubble(self.events, self.p)
        return measured_bubble(self.events, self.p)

    @property
    def bubble_one_step(self) -> float:
        """The idle fraction inside the step's whole span, whatever the schedule."""
        return measured_bubble(self.events, self.p)

    @property
    def bubble_theory(self) -> float:
        """The schedule's formula. With B and W apart, its paper's closed form
        (`closed_form_idle`) evaluated with the F, B and W durations this run measured, as a
        fraction of this run's mean busy time per rank."""
        if self.schedule not in ZERO_BUBBLE_SCHEDULES:
            return bubble_theory(self.p, self.m, self.v)
        work = sum(e.duration for e in self.events) / self.p
        return idle_fraction(closed_form_idle(self.schedule, self.p, self.durations), work)

    @property
    def durations(self):
        """The mean F, B (split), W and whole-B seconds of one chunk in this run."""
        return mean_durations(self.events)

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def summary(self) -> str:
        v = f", v={self.v}" if self.v > 1 and self.schedule != "dualpipev" else ""
        formula = "(p−1)/(v·m+p−1)" if self.v > 1 else "(p−1)/(m+p−1)"
        if self.schedule in ZERO_BUBBLE_SCHEDULES:
            formula = "closed form"
        if self.schedule == "zb-h2":
            formula += " (steady)"
        how = "simulated" if self.mode == "simulated" else f"{self.mode} mode"
        word = "simulated" if self.mode == "simulated" else "measured"
        return (f"{self.schedule} p={self.p} m={self.m}{v} ({how}): bubble {word} "
                f"{self.bubble_measured:.3f}, theory {formula} = {self.bubble_theory:.3f}")


# On each rank: the group of ranks 0 … p−1 for each p run so far, made by every rank of the
# world it belongs to (a new world, after LiveRanks re-formed it, starts the cache over). Each
# group sits in a list: the ranks destroy a group nothing refers to after a call, and they
# look for referrers with the garbage collector, which does not see a dict that holds only
# ints, strings and C++ objects.
_FIRST_P: dict = {}


def first_p_pipeline(rank, world_size, p: int, *args, **kwargs) -> StageLog | None:
    """Rank function: `pipeline_rank(*args, **kwargs)` on the first p ranks of the world, as
    one group made once per p and kept; the other ranks return None at once. A change of p
    then forms no process group and starts no rank."""
    world = dist.group.WORLD
    if _FIRST_P.get("world") is not world:
        _FIRST_P.clear()
        _FIRST_P["world"] = world
    if p not in _FIRST_P:  # every rank makes every group, members or not
        _FIRST_P[p] = [None if p == world_size else dist.new_group(list(range(p)))]
    if rank >= p:
        return None
    return pipeline_rank(rank, world_size, *args, group=_FIRST_P[p][0], **kwargs)


def run_pipeline(ranks, schedule: str = "1f1b", p: int = 2, m: int = 4, *,
                 v: int | None = None, mode: str | None = None, t_f: float = T_F,
                 t_b: float | None = None, config: MLPConfig = LECTURE,
                 t_w: float | None = None, within: bool = False) -> PipelineRun:
    """Run one training step of `schedule` on p of the live `ranks` (a `LiveRanks` on the gloo
    backend, resized to p) and collect what they recorded. `within`: run on the first p of
    the ranks as they are (`first_p_pipeline`) where there are that many, so that a widget's
    change of p restarts nothing (the others wait, using no core).

    mode: "compute" (real matmuls, the default while p <= cores) or "wait" (each F waits
    t_f seconds and each B t_b = 2·t_f, using no CPU: the default when p > cores; a split
    backward's W waits t_w = t_b/2 of that and its B the rest).
    All arguments are checked here, before any rank runs.
    """
    v = check_schedule_args(p, m, schedule, v)
    if mode is None:
        mode = "compute" if p <= live_ranks.cpu_cores() else "wait"
    check_choice("mode", mode, MODES)
    check_model(p, m, v, config)  # wait mode too: same pipeline, no matmuls
    t_b = 2 * t_f if t_b is None else t_b
    check_number("t_f", t_f, 0, low_inclusive=False, unit="seconds")
    check_number("t_b", t_b, 0, low_inclusive=False, unit="seconds")
    t_w = t_b / 2 if t_w is None else t_w
    check_number("t_w", t_w, 0, t_b, low_inclusive=False, unit="seconds")  # W is part of B
    live_ranks.check_world_size(p)
    ranks = check_ranks(ranks, "gloo")
    if within and ranks.world_size >= p:
        logs = [log for log in ranks.run(first_p_pipeline, p, schedule, m, v, mode, t_f, t_b,
                                         config, t_w=t_w) if log is not None]
    else:
        logs = ranks.resize(p).run(pipeline_rank, schedule, m, v, mode, t_f, t_b, config,
                                   t_w=t_w)
    return PipelineRun.from_logs(schedule, m, v, mode, logs)


def simulated_run(schedule: str = "1f1b", p: int = 2, m: int = 4, v: int | None = None,
                  t_f: float = T_F, t_b: float | None = None,
                  t_w: float | None = None, latency: float = 0.0) -> PipelineRun:
    """The same record as `run_pipeline(mode="wait")`, computed instead of measured.
    `latency`: seconds every action waits after the output it consumes is produced (a
    message's cost; `simulate` charges it to every dependency)."""
    v = check_schedule_args(p, m, schedule, v)
    check_number("latency", latency, 0, unit="seconds")
    events = simulate(schedule, p, m, t_f, 2 * t_f if t_b is None else t_b, v,
                      latency=latency, t_w=t_w)
    return PipelineRun(schedule, p, m, v, "simulated", events,
                       [peak_live(make_plan(schedule, p, m, r, v)) for r in range(p)])


def replayed(run: PipelineRun) -> PipelineRun:
    """`run` replayed with each F and B keeping its measured duration, but starting as soon as
    its rank is free and its input exists: no message time, no wait for a CPU. What the schedule
    alone makes of these durations; `run`'s idle time beyond it is waiting for something else."""
    order = {r: sorted((e for e in run.events if e.rank == r), key=lambda e: e.start)
             for r in range(run.p)}
    done, free, events = {}, [0.0] * run.p, []
    while len(events) < len(run.events):
        for r, queue in order.items():
            while queue:
                e = queue[0]
                dep = dependency(e.action, r, run.p, run.v, run.layout)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                events.append(Event(r, e.kind, e.chunk, e.mb, start, start + e.duration))
                done[Step(r, e.action)] = free[r] = start + e.duration
                queue.pop(0)
    return PipelineRun(run.schedule, run.p, run.m, run.v, "replayed", events, run.peak_live)


def message_gaps(run: PipelineRun) -> list[float]:
    """For every action that waited for another rank's output (its rank was free before that
    output existed): seconds from the end of the action producing it to this action's start,
    the message's time plus any delay in waking up. The replay (`replayed`) counts 0 there."""
    ends = {Step(e.rank, e.action): e.end for e in run.events}
    gaps = []
    for r in range(run.p):
        previous_end = None
        for e in sorted((e for e in run.events if e.rank == r), key=lambda e: e.start):
            dep = dependency(e.action, r, run.p, run.v, run.layout)
            if dep is not None and dep.rank != r and (previous_end is None
                                                      or previous_end < ends[dep]):
                gaps.append(e.start - ends[dep])
            previous_end = e.end
    return gaps


def gradient_error(run: PipelineRun, ref: Reference) -> float:
    """The largest absolute difference between the run's loss and layer gradients and
    single-process training's (a notebook claims it is below 1e-5)."""
    if sorted(run.grads) != sorted(ref.grads):
        raise ValueError(f"the run has layers {sorted(run.grads)}, the reference {sorted(ref.grads)}")
    worst = max((run.grads[layer] - g).abs().max().item() for layer, g in ref.grads.items())
    return max(worst, abs(run.loss - ref.loss))


def verify_gradients(run: PipelineRun, ref: Reference) -> None:
    """Raise (torch.testing.assert_close's AssertionError, naming the layer) unless the loss and
    every layer's gradient equal single-process training's."""
    if sorted(run.grads) != sorted(ref.grads):
        raise AssertionError(f"layers {sorted(run.grads)} vs reference {sorted(ref.grads)}")
    for layer, g in ref.grads.items():
        torch.testing.assert_close(run.grads[layer], g, msg=lambda s: f"layer {layer}: {s}")
    torch.testing.assert_close(run.loss, ref.loss)


# ------------------------------------------------------------------------------------------
# 3. PyTorch's own pipelining on the same model.
# ------------------------------------------------------------------------------------------

def torch_pipelining_rank(rank, world_size, schedule: str, m: int,
                          config: MLPConfig = LECTURE, group=None) -> StageLog:
    """One training step with torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B,
    stage group_rank(group) of p = group_size(group)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    device = rank_device()
    s, p = group_rank(group), group_size(group)
    mine = stage_range(s, p, config)
    layers = mlp_layers(make_mlp(config), mine.start, mine.stop).to(device)
    stage = PipelineStage(layers, s, p, device, group=group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # loss_fn(output, target) is the mean within a micro-batch; the schedule divides the
    # gradients by m (scale_grads=True): together the full-batch mean, as in `reference`.
    runner = kind(stage, n_microbatches=m, loss_fn=lambda output, _target: mlp_loss(output))
    losses = []
    if s == 0:
        runner.step(make_batch(config).to(device))
    elif s == p - 1:  # the lecture's loss has no labels: the target is a placeholder
        runner.step(target=torch.zeros(config.batch, device=device), losses=losses)
    else:
        runner.step()
    loss = torch.stack(losses).mean().item() if losses else None
    grads = {layer: g.cpu() for layer, g in layer_grads(layers, mine.start).items()}
    return StageLog(grads=grads, loss=loss)


def run_torch_pipelining(ranks, schedule: str = "1f1b", p: int = 2, m: int = 4,
                         config: MLPConfig = LECTURE) -> PipelineRun:
    """Run `torch_pipelining_rank` on p >= 2 of the live `ranks` (NCCL where they have a GPU
    each, gloo otherwise); a hang becomes a RankTimeoutError after the ranks' timeout."""
    check_choice("schedule", schedule, ("gpipe", "1f1b"))
    check_int("p", p, low=2)
    check_int("m", m)
    check_model(p, m, 1, config)
    logs = check_ranks(ranks).resize(p).run(torch_pipelining_rank, schedule, m, config)
    return PipelineRun.from_logs(f"torch {schedule}", m, 1, "compute", logs)


TORCH_V_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def torch_v_schedule_rank(rank, world_size, schedule: str, m: int,
                          config: MLPConfig = LECTURE, group=None) -> StageLog:
    """One training step with torch.distributed.pipelining's ScheduleZBVZeroBubble or
    ScheduleDualPipeV: two stages per rank in a V (rank r holds stages r and 2p − 1 − r of 2p),
    B and W apart inside the library. Rank 0 holds both the first stage (the input) and the
    last (the loss)."""
    from torch.distributed import pipelining
    device = rank_device()
    s, p = group_rank(group), group_size(group)
    model, stages, ranges = make_mlp(config), [], []
    for index in (s, 2 * p - 1 - s):
        mine = stage_range(index, 2 * p, config)
        layers = mlp_layers(model, mine.start, mine.stop).to(device)
        stages.append(pipelining.PipelineStage(layers, index, 2 * p, device, group=group))
        ranges.append((layers, mine.start))
    kind = getattr(pipelining, TORCH_V_SCHEDULES[schedule])
    runner = kind(stages, n_microbatches=m, loss_fn=lambda output, _target: mlp_loss(output))
    losses = []
    if s == 0:  # the lecture's loss has no labels: the target is a placeholder
        runner.step(make_batch(config).to(device), target=torch.zeros(config.batch, device=device),
                    losses=losses)
    else:
        runner.step()
    loss = torch.stack(losses).mean().item() if losses else None
    grads = {layer: g.cpu() for layers, first in ranges
             for layer, g in layer_grads(layers, first).items()}
    return StageLog(grads=grads, loss=loss)


def run_torch_v_schedule(ranks, schedule: str = "dualpipev", p: int = 2, m: int = 4,
                         config: MLPConfig = LECTURE) -> PipelineRun:
    """Run `torch_v_schedule_rank` (schedule "zbv" or "dualpipev") on p >= 2 of the live
    `ranks`; the model must cut into 2p stages, and DualPipeV wants m >= 2p."""
    check_choice("schedule", schedule, tuple(TORCH_V_SCHEDULES))
    check_int("p", p, low=2)
    check_int("m", m)
    check_model(p, m, 2, config)
    if m < 2 * p:
        raise ValueError(f"{TORCH_V_SCHEDULES[schedule]} runs m >= 2p = {2 * p} micro-batches, "
                         f"got m={m}")
    logs = check_ranks(ranks).resize(p).run(torch_v_schedule_rank, schedule, m, config)
    return PipelineRun.from_logs(f"torch {schedule}", m, 2, "compute", logs)


# Names of torch's computation types in our letters: its I (input gradient) is our B with a
# W of its own, its B a whole backward.
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_schedule_order(schedule: str, p: int, m: int) -> list[list[tuple[str, int, int]]] | None:
    """Each rank's (kind, chunk, mb) in the order torch's schedule class plans them, from
    `torch.distributed.pipelining._schedule_visualizer.get_schedule_ops` (no process group),
    kinds as in `_TORCH_KINDS`. A fused forward-and-backward action (DualPipeV's overlapped
    pair) reads as its forward then its backward. None where the private module or the
    function is missing (it is not a public API and may move)."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError:
        return None
    name = {"dualpipev": "DualPipeV", "zbv": "ZBVZeroBubble"}[schedule]
    order = []
    for rank, actions in enumerate(get_schedule_ops(name, p, m)):
        mine = []
        for action in actions:
            if action is None:  # a slot the visualizer leaves empty
                continue
            for part in action.sub_actions or (action,):
                stage = part.stage_index
                mine.append((_TORCH_KINDS[part.computation_type.name],
                             int(stage >= p), part.microbatch_index))
        order.append(mine)
    return order


def our_order(schedule: str, p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Our plans in `torch_schedule_order`'s letters: a B with a W of its own is an I."""
    order = []
    for rank in range(p):
        plan = make_plan(schedule, p, m, rank)
        split = split_backwards(plan)
        order.append([("I" if a.kind == "B" and (a.chunk, a.mb) in split else a.kind,
                       a.chunk, a.mb) for a in plan])
    return order


def order_differences(ours, theirs) -> list[str]:
    """Every place two per-rank orders part, in words: the first differing position of each
    rank and what each side runs there, and any difference in length."""
    words = []
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:
            words.append(f"rank {rank}, step {first}: ours {''.join(map(str, a[first]))}, "
                         f"torch's {''.join(map(str, b[first]))}")
        elif len(a) != len(b):
            words.append(f"rank {rank}: ours has {len(a)} steps, torch's {len(b)}")
    if len(ours) != len(theirs):
        words.append(f"{len(ours)} ranks against {len(theirs)}")
    return words


# ------------------------------------------------------------------------------------------
# 4. The schedule alone: what the widget and the bubble sweep show.
# ------------------------------------------------------------------------------------------

def timed_schedule(schedule: str, p: int, m: int, ranks=None, t_f: float = 0.02,
                   config: MLPConfig = LECTURE, within: bool = False) -> PipelineRun:
    """Simulate one schedule (ranks=None) or run it in wait mode on `ranks`, with one notional
    layer per stage: this times the schedule, not the model (whose batch and hidden size
    still set the messages' size). v = 2 for the interleaved schedule. `within`: see
    `run_pipeline`."""
    if ranks is None:
        return simulated_run(schedule, p, m, t_f=t_f)
    stages = p * check_schedule_args(p, m, schedule)
    return run_pipeline(ranks, schedule, p, m, mode="wait", t_f=t_f,
                        config=config.with_(layers=stages), within=within)


def bubble_sweep(ranks, ps=(2, 4), ms=(1, 2, 4, 8, 16), schedule: str = "1f1b",
                 t_f: float = 0.01) -> list[PipelineRun]:
    """Wait-mode runs on live `ranks` over a grid of (p, m), one run each."""
    check_ranks(ranks)  # the sweep measures: no simulation here
    return [timed_schedule(schedule, p, m, ranks, t_f) for p in ps for m in ms]


