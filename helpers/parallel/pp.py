"""Pipeline parallelism on live ranks: cut the MLP by depth and stream micro-batches through it.

Notebook 05 in one module:
* `lecture_forward`: the lecture's forward-only pipeline (blocking send/recv, no backward).
* `run_pipeline`: GPipe, 1F1B and interleaved 1F1B *with* backward, asynchronous
  isend/irecv, and an event log of every forward and backward on every rank.
  `mode="compute"` runs the real matmuls; `mode="wait"` replaces each F and B by a timed
  wait that uses no CPU, so p = 8 ranks on a 2-core laptop still keep exact schedule timing.
* `reference`: the same MLP trained in one process, the yardstick for outputs and gradients.
* `torch_pipelining_rank`: PyTorch's own `torch.distributed.pipelining` on the same model.
* `explore_pipeline` / `pipeline_widget`: p, m, schedule → Gantt chart and bubble.

The schedules themselves (lists of actions, the simulator, the bubble arithmetic) live in
`helpers.parallel.schedules`; the picture in `helpers.views.pp`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import ranks as _ranks
from helpers.views.pp import plot_gantt
from helpers.parallel.schedules import (MODES, Action, bubble_theory, check_schedule_args,
                                  make_plan, measured_bubble, peak_live, simulate, stage_of)

# The lecture's running example.
HIDDEN, NUM_LAYERS, BATCH, P, M = 1024, 4, 128, 2, 4
T_F = 0.03  # seconds per forward in wait mode; a backward waits twice as long


# ------------------------------------------------------------------------------------------
# The model: a deep MLP, x → gelu(x @ W) per layer, seeded per layer.
# ------------------------------------------------------------------------------------------

def init_weights(hidden: int = HIDDEN, num_layers: int = NUM_LAYERS, seed: int = 0) -> list:
    """Layer l's weight depends only on (seed, l), so every rank can build its own slice and
    the slices put together are exactly the unsharded model. (The lecture seeds with the
    rank instead, which makes the two layers on one rank identical.)"""
    weights = []
    for layer in range(num_layers):
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        weights.append(torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden))
    return weights


def make_batch(batch: int = BATCH, hidden: int = HIDDEN, seed: int = 0):
    """Inputs and regression targets for the whole batch."""
    g = torch.Generator().manual_seed(seed + 12345)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def mlp_forward(x, weights):
    for w in weights:
        x = F.gelu(x @ w)
    return x


def reference(hidden: int = HIDDEN, num_layers: int = NUM_LAYERS, batch: int = BATCH,
              seed: int = 0) -> dict:
    """Single-process training step on the whole batch: output, mean-squared-error loss and
    the gradient of every layer, the numbers every pipeline must reproduce."""
    weights = [w.requires_grad_() for w in init_weights(hidden, num_layers, seed)]
    x, y = make_batch(batch, hidden, seed)
    out = mlp_forward(x, weights)
    loss = F.mse_loss(out, y)
    loss.backward()
    return {"output": out.detach(), "loss": loss.item(),
            "grads": {layer: w.grad for layer, w in enumerate(weights)}}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_model(p: int, m: int, v: int, num_layers, batch) -> None:
    num_layers = check_positive_int("num_layers", num_layers)
    batch = check_positive_int("batch", batch)
    if num_layers % (p * v):
        cut = f"p·v = {p}·{v} = {p * v} stages" if v > 1 else f"p = {p} stages"
        raise ValueError(f"num_layers must be divisible by the number of pipeline stages: "
                         f"num_layers={num_layers} cannot be cut into {cut}")
    if batch % m:
        raise ValueError(f"batch must be divisible by m (micro-batches of equal size): "
                         f"batch={batch}, m={m}")


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


# ------------------------------------------------------------------------------------------
# 1. The lecture's pipeline: forward only, blocking send/recv, one micro-batch at a time.
# ------------------------------------------------------------------------------------------

def lecture_forward(rank, world_size, num_layers=NUM_LAYERS, m=M, batch=BATCH,
                    hidden=HIDDEN, seed=0):
    """Rank r owns layers [r·L/p, (r+1)·L/p). Rank 0 cuts the batch into m micro-batches;
    each later rank receives a micro-batch, runs its layers and passes it on. The last rank
    returns the whole output; the others return None."""
    device = _device()
    per_rank = num_layers // world_size
    local = [w.to(device) for w in
             init_weights(hidden, num_layers, seed)[rank * per_rank:(rank + 1) * per_rank]]
    if rank == 0:
        micro_batches = make_batch(batch, hidden, seed)[0].to(device).chunk(m)
    else:  # room for what the previous rank will send
        micro_batches = [torch.empty(batch // m, hidden, device=device) for _ in range(m)]
    outputs = []
    for x in micro_batches:
        if rank > 0:
            dist.recv(x, src=rank - 1)           # blocks until the activations arrive
        x = mlp_forward(x, local)
        if rank + 1 < world_size:
            dist.send(x.contiguous(), dst=rank + 1)  # blocks until rank + 1 has them
        else:
            outputs.append(x)
    return torch.cat(outputs) if outputs else None


def run_lecture_forward(p: int = P, m: int = M, *, ranks=None, num_layers: int = NUM_LAYERS,
                        batch: int = BATCH, hidden: int = HIDDEN, seed: int = 0):
    """Run `lecture_forward` on p ranks and return the last rank's output."""
    check_positive_int("p", p)
    check_positive_int("m", m)
    _check_model(p, m, 1, num_layers, batch)
    args = (num_layers, m, batch, hidden, seed)
    if ranks is None:
        return _ranks.spawn(lecture_forward, p, *args)[-1]
    return ranks.resize(p).run(lecture_forward, *args)[-1]


# ------------------------------------------------------------------------------------------
# 2. Schedules with backward, asynchronous messages and an event log.
# ------------------------------------------------------------------------------------------

def _wait(seconds: float) -> None:
    """Sleep (no CPU) until `seconds` have passed; loops in case a sleep wakes up early."""
    deadline = time.perf_counter() + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class _Mailbox:
    """One rank's asynchronous messages.

    Every message gets a distinct tag per (kind, stage, micro-batch), so activations can
    never be mistaken for another micro-batch's, or for a gradient, whatever order they
    arrive in. Receives are posted ahead of need (`post`); sends go out with isend and are
    only waited for at the end (`flush`). A message to oneself (stage s and s ± 1 on the
    same rank, which happens when p = 1 with interleaving) never leaves the process.
    """

    def __init__(self, rank: int, p: int, m: int, v: int, shape: tuple):
        self.rank, self.p, self.m, self.stages, self.shape = rank, p, m, p * v, shape
        self.posted: dict[Action, tuple] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.sends: list = []

    def tag(self, kind: str, stage: int, mb: int) -> int:
        return ((kind == "B") * self.stages + stage) * self.m + mb

    def source(self, a: Action):
        """(src rank, tag) of the message action `a` consumes, or None at the pipeline's ends."""
        s = stage_of(a, self.rank, self.p)
        if a.kind == "F" and s > 0:
            return (s - 1) % self.p, self.tag("F", s, a.mb)
        if a.kind == "B" and s < self.stages - 1:
            return (s + 1) % self.p, self.tag("B", s, a.mb)
        return None

    def post(self, a: Action) -> None:
        """Start receiving what `a` will need, without waiting for it."""
        src = self.source(a)
        if src is not None and src[0] != self.rank and a not in self.posted:
            buffer = torch.empty(self.shape)
            self.posted[a] = (dist.irecv(buffer, src=src[0], tag=src[1]), buffer)

    def take(self, a: Action):
        """Block until the input of `a` has arrived and return it (None if it needs none)."""
        src = self.source(a)
        if src is None:
            return None
        if src[0] == self.rank:
            return self.local.pop(src[1])
        self.post(a)
        work, buffer = self.posted.pop(a)
        work.wait()
        return buffer

    def send(self, tensor, stage: int, kind: str, mb: int) -> None:
        """Hand `tensor` to whoever runs `stage` and return at once."""
        dst, tag = stage % self.p, self.tag(kind, stage, mb)
        if dst == self.rank:
            self.local[tag] = tensor
        else:  # keep the tensor alive until the send completes
            self.sends.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def flush(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def _stage_layers(rank, p, v, hidden, num_layers, seed) -> dict:
    """chunk -> {global layer index: weight} for the stages this rank holds."""
    per_stage = num_layers // (p * v)
    weights = init_weights(hidden, num_layers, seed)
    return {c: {l: weights[l].clone().requires_grad_() for l in
                range((c * p + rank) * per_stage, (c * p + rank + 1) * per_stage)}
            for c in range(v)}


def pipeline_rank(rank, p, schedule, m, v, mode, t_f, t_b, hidden, num_layers, batch, seed):
    """One rank of a pipeline schedule. Returns its event log, its peak number of live
    micro-batches, its layers' gradients and (last stage) the loss.

    Before running action i the rank already posts the receive for action i + 1, and it
    sends its outputs with isend without waiting, so activations and gradients travel while
    the next F or B computes. A rank only ever blocks on the input it needs now, which is
    what the schedule's dependencies allow.
    """
    plan = make_plan(schedule, p, m, rank, v)
    last = p * v - 1
    shape = (batch // m, hidden)
    mail = _Mailbox(rank, p, m, v, shape)
    compute = mode == "compute"
    if compute:
        layers = _stage_layers(rank, p, v, hidden, num_layers, seed)
        xs, ys = (t.chunk(m) for t in make_batch(batch, hidden, seed))
        for chunk in layers.values():  # first-call costs (thread pools, allocator) stay
            mlp_forward(torch.zeros(shape, requires_grad=True), chunk.values()).sum().backward()
            for w in chunk.values():   # outside the timeline
                w.grad = None
    else:
        placeholder = torch.zeros(shape)  # wait mode still sends messages of the real size

    saved: dict[tuple, tuple] = {}  # (chunk, mb) -> what its backward will need
    events, losses, peak = [], [], 0
    dist.barrier()  # everyone starts the clock together
    for i, a in enumerate(plan):
        if i + 1 < len(plan):
            mail.post(plan[i + 1])  # the next input travels while this action runs
        received = mail.take(a)
        s = stage_of(a, rank, p)
        start = time.perf_counter()
        if a.kind == "F":
            if compute:
                inp = xs[a.mb] if s == 0 else received.requires_grad_()
                out = mlp_forward(inp, layers[a.chunk].values())
                if s == last:  # loss per micro-batch / m: they add up to the full-batch mean
                    out = F.mse_loss(out, ys[a.mb]) / m
                    losses.append(out.item())
                saved[(a.chunk, a.mb)] = (inp, out)
            else:
                _wait(t_f / v)
                saved[(a.chunk, a.mb)] = (None, placeholder)
            peak = max(peak, len(saved))
            end = time.perf_counter()
            if s < last:
                mail.send(saved[(a.chunk, a.mb)][1].detach(), s + 1, "F", a.mb)
        else:
            inp, out = saved.pop((a.chunk, a.mb))
            if compute:
                out.backward(None if s == last else received)  # weight grads accumulate
            else:
                _wait(t_b / v)
            end = time.perf_counter()
            if s > 0:
                mail.send(inp.grad if compute else placeholder, s - 1, "B", a.mb)
        events.append({"rank": rank, "kind": a.kind, "chunk": a.chunk, "mb": a.mb,
                       "start": start, "end": end})
    mail.flush()
    dist.barrier()
    grads = {l: w.grad for chunk in layers.values() for l, w in chunk.items()} if compute else {}
    return {"events": events, "peak_live": peak, "grads": grads,
            "loss": sum(losses) if losses else None}


@dataclass
class PipelineRun:
    """What a pipeline run brings back to the notebook."""
    schedule: str
    p: int
    m: int
    v: int
    mode: str
    events: list = field(repr=False)      # every F and B on every rank, times in seconds from 0
    peak_live: list = field(default_factory=list)  # per rank
    grads: dict = field(default_factory=dict, repr=False)  # layer -> gradient (compute mode)
    loss: float | None = None

    @property
    def bubble_measured(self) -> float:
        return measured_bubble(self.events, self.p)

    @property
    def bubble_theory(self) -> float:
        return bubble_theory(self.p, self.m, self.v)

    @property
    def makespan(self) -> float:
        return max(e["end"] for e in self.events) - min(e["start"] for e in self.events)

    def summary(self) -> str:
        v = f", v={self.v}" if self.v > 1 else ""
        formula = "(p−1)/(v·m+p−1)" if self.v > 1 else "(p−1)/(m+p−1)"
        how = "simulated" if self.mode == "simulated" else f"{self.mode} mode"
        word = "simulated" if self.mode == "simulated" else "measured"
        return (f"{self.schedule} p={self.p} m={self.m}{v} ({how}): bubble {word} "
                f"{self.bubble_measured:.3f}, theory {formula} = {self.bubble_theory:.3f}")


def run_pipeline(schedule: str = "1f1b", p: int = P, m: int = M, *, ranks=None,
                 v: int | None = None, mode: str | None = None, t_f: float = T_F,
                 t_b: float | None = None, hidden: int = HIDDEN, num_layers: int = NUM_LAYERS,
                 batch: int = BATCH, seed: int = 0, timeout: float = 60) -> PipelineRun:
    """Run one training step of `schedule` on p live ranks and collect what they recorded.

    mode: "compute" (real matmuls, the default while p <= cores) or "wait" (each F waits
    t_f seconds and each B t_b = 2·t_f, using no CPU: the default when p > cores).
    ranks: a `LiveRanks` on the gloo backend to reuse (resized to p); None spawns fresh ones.
    All arguments are checked here, before any process starts.
    """
    v = check_schedule_args(p, m, schedule, v)
    if mode is None:
        mode = "compute" if p <= _ranks.cpu_cores() else "wait"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_model(p, m, v, num_layers, batch)  # wait mode too: same pipeline, no matmuls
    t_b = 2 * t_f if t_b is None else t_b
    for name, value in (("t_f", t_f), ("t_b", t_b)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    _ranks.check_world_size(p)
    args = (schedule, m, v, mode, t_f, t_b, hidden, num_layers, batch, seed)
    if ranks is None:
        results = _ranks.spawn(pipeline_rank, p, *args, backend="gloo", timeout=timeout)
    else:
        ranks.resize(p)
        if ranks.backend != "gloo":
            raise ValueError("ranks must be LiveRanks(..., backend='gloo'): the hand-written "
                             f"schedules exchange CPU tensors, got backend={ranks.backend!r}")
        results = ranks.run(pipeline_rank, *args)
    t0 = min(e["start"] for r in results for e in r["events"])
    events = [{**e, "start": e["start"] - t0, "end": e["end"] - t0}
              for r in results for e in r["events"]]
    grads = {layer: g for r in results for layer, g in r["grads"].items()}
    return PipelineRun(schedule, p, m, v, mode, events, [r["peak_live"] for r in results],
                       grads, results[-1]["loss"])


def simulated_run(schedule: str = "1f1b", p: int = P, m: int = M, v: int | None = None,
                  t_f: float = T_F, t_b: float | None = None) -> PipelineRun:
    """The same record as `run_pipeline(mode="wait")`, computed instead of measured."""
    v = check_schedule_args(p, m, schedule, v)
    events = simulate(schedule, p, m, t_f, 2 * t_f if t_b is None else t_b, v)
    return PipelineRun(schedule, p, m, v, "simulated", events,
                       [peak_live(make_plan(schedule, p, m, r, v)) for r in range(p)])


def check_gradients(run: PipelineRun, ref: dict) -> str:
    """assert_close every layer's gradient against single-process training; say so."""
    if sorted(run.grads) != sorted(ref["grads"]):
        raise AssertionError(f"layers {sorted(run.grads)} vs reference {sorted(ref['grads'])}")
    for layer, g in ref["grads"].items():
        torch.testing.assert_close(run.grads[layer], g, msg=lambda s: f"layer {layer}: {s}")
    torch.testing.assert_close(run.loss, ref["loss"])
    return (f"{run.schedule}: gradients of all {len(ref['grads'])} layers equal single-process "
            f"training (assert_close passed); loss {run.loss:.6f}")


# ------------------------------------------------------------------------------------------
# 3. PyTorch's own pipelining on the same model.
# ------------------------------------------------------------------------------------------

class StageModule(nn.Module):
    """A slice of the MLP as an nn.Module, the form torch.distributed.pipelining expects."""

    def __init__(self, weights):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w.clone()) for w in weights)

    def forward(self, x):
        return mlp_forward(x, self.weights)


def torch_pipelining_rank(rank, p, schedule="1f1b", m=M, hidden=HIDDEN,
                          num_layers=NUM_LAYERS, batch=BATCH, seed=0):
    """One training step with torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B."""
    return _torch_pipelining_step(rank, p, schedule, m, hidden, num_layers, batch, seed)


def _torch_pipelining_step(rank, p, schedule, m, hidden, num_layers, batch, seed):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    device = _device()
    per_rank = num_layers // p
    first = rank * per_rank
    module = StageModule(init_weights(hidden, num_layers, seed)[first:first + per_rank]).to(device)
    stage = PipelineStage(module, rank, p, device)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # loss_fn averages within a micro-batch; the schedule divides by m (scale_grads=True),
    # which together is the full-batch mean, as in `reference`.
    runner = kind(stage, n_microbatches=m, loss_fn=F.mse_loss)
    x, y = (t.to(device) for t in make_batch(batch, hidden, seed))
    losses = []
    if rank == 0:
        runner.step(x)
    elif rank == p - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    loss = torch.stack(losses).mean().item() if losses else None
    return {"grads": {first + j: w.grad for j, w in enumerate(module.weights)}, "loss": loss}


def run_torch_pipelining(schedule: str = "1f1b", p: int = P, m: int = M, *, ranks=None,
                         num_layers: int = NUM_LAYERS, batch: int = BATCH,
                         hidden: int = HIDDEN, seed: int = 0, timeout: float = 30):
    """Run `torch_pipelining_rank` on p ranks (NCCL when there is a GPU per rank, gloo
    otherwise); a hang becomes a RankTimeoutError after `timeout` seconds."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    check_positive_int("p", p)
    if p < 2:
        raise ValueError(f"p must be >= 2 for torch.distributed.pipelining here, got {p}")
    check_positive_int("m", m)
    _check_model(p, m, 1, num_layers, batch)
    args = (schedule, m, hidden, num_layers, batch, seed)
    if ranks is None:
        results = _ranks.spawn(torch_pipelining_rank, p, *args, timeout=timeout)
    else:
        results = ranks.resize(p).run(torch_pipelining_rank, *args)
    return PipelineRun(f"torch {schedule}", p, m, 1, "compute", [], [],
                       {k: g for r in results for k, g in r["grads"].items()}, results[-1]["loss"])


# ------------------------------------------------------------------------------------------
# 4. The widget: a thin shell over explore_pipeline.
# ------------------------------------------------------------------------------------------

def explore_pipeline(p: int, m: int, schedule: str, ranks=None, t_f: float = 0.02, ax=None):
    """Run (wait mode, on `ranks`) or simulate (ranks=None) one schedule, draw its Gantt chart
    and return (run, one-line summary). v = 2 for the interleaved schedule."""
    if ranks is None:
        run = simulated_run(schedule, p, m, t_f=t_f)
    else:
        # one notional layer per stage: the wait mode times the schedule, not the model
        stages = p * check_schedule_args(p, m, schedule)
        run = run_pipeline(schedule, p, m, ranks=ranks, mode="wait", t_f=t_f, num_layers=stages)
    text = run.summary() + f"; peak live micro-batches per rank {run.peak_live}"
    plot_gantt(run.events, p, title=text.split(";")[0], ax=ax)
    return run, text


def pipeline_widget(ranks, t_f: float = 0.02):
    """Sliders for p and m and a schedule menu; each change runs the schedule on live ranks."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    out = w.Output()
    p = w.IntSlider(value=4, min=2, max=8, description="p (ranks)")
    m = w.IntSlider(value=4, min=1, max=16, description="m (micro)")
    schedule = w.Dropdown(options=["gpipe", "1f1b", "interleaved"], value="1f1b",
                          description="schedule")

    def update(_=None):
        with out:
            out.clear_output(wait=True)
            try:
                fig, ax = plt.subplots(figsize=(10, max(2.6, 0.5 * p.value + 1.4)), layout="constrained")
                _, text = explore_pipeline(p.value, m.value, schedule.value, ranks, t_f, ax)
                plt.show()
                print(text)
            except (ValueError, TypeError) as error:
                plt.close("all")
                print(f"not a valid pipeline: {error}")

    for control in (p, m, schedule):
        control.observe(update, names="value")
    update()
    display(w.VBox([w.HBox([p, m, schedule]), out]))


# ------------------------------------------------------------------------------------------
# 5. Bubble against m, measured on live ranks.
# ------------------------------------------------------------------------------------------

def bubble_sweep(ranks, ps=(2, 4), ms=(1, 2, 4, 8, 16), schedule: str = "1f1b",
                 t_f: float = 0.01) -> list[dict]:
    """Wait-mode runs over a grid of (p, m): one row per run with measured and theory."""
    rows = []
    for p in ps:
        for m in ms:
            run = run_pipeline(schedule, p, m, ranks=ranks, mode="wait", t_f=t_f, num_layers=p)
            rows.append({"p": p, "m": m, "bubble_measured": run.bubble_measured,
                         "bubble_theory": run.bubble_theory, "makespan_s": run.makespan})
    return rows


def plot_bubble_sweep(rows: list[dict], ax=None):
    """Measured bubble (dots) over the curve (p−1)/(m+p−1) for each p."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, p in enumerate(sorted({r["p"] for r in rows})):
        mine = [r for r in rows if r["p"] == p]
        ms = [r["m"] for r in mine]
        fine = [m / 4 for m in range(4, 4 * max(ms) + 1)]
        colour = plt.get_cmap("tab10")(i)
        ax.plot(fine, [bubble_theory(p, m) for m in fine], color=colour, label=f"(p−1)/(m+p−1), p={p}")
        ax.plot(ms, [r["bubble_measured"] for r in mine], "o", color=colour,
                label=f"measured, p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (micro-batches)")
    ax.set_ylabel("bubble (idle fraction)")
    ax.legend(fontsize=8, frameon=False)
    return ax
