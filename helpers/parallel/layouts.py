"""Every 3-D layout of a world, measured on the same live ranks, and the calibration the cost
model (`helpers.cost.parallel3d`) needs.

* `calibrate`: rank function. Every rank times, all at once (as they run in a layout), the
  forward + backward of each compute `Shape` the layouts use; then all-reduce on the group
  sizes used (groups side by side, as in the layouts) over a few message sizes, and one p2p
  hop (ping-pong between neighbours). Returns the points; `fit_calibration` turns them into
  a `Calibration` (α–β from `helpers.cost.alpha_beta.fit_alpha_beta`).
* `measure`: rank function. Round-robin over the layouts: round r runs one step of every
  layout in turn (each layout's model and groups built once, before the first round), so
  every layout sees the same machine load; a step's time is the slowest rank's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.cost.alpha_beta import Fit, coefficients, fit_alpha_beta
from helpers.cost.parallel3d import (BYTES_PER_FLOAT, LAYOUTS_4, Breakdown, Calibration,
                                     Comparison, Layout, Shape, activation_bytes, check_layout,
                                     measured_breakdown, predict, shape_flops, shapes_used,
                                     stage_parameters)
from helpers.models import TRANSFORMER, TransformerConfig, causal_attention
from helpers.parallel.groups import split_groups
from helpers.parallel.parallel3d import run_3d


class ShardShaped(nn.Module):
    """The compute of one TP rank's piece at its shape, without its collectives: a block with
    Q, K, V, `up` cut to h/t and 4h/t output columns, `out` and `down` to h/t and 4h/t input
    columns, attention on heads/t heads and both LayerNorms whole; or the head (final LayerNorm,
    LM head, cross-entropy), which TP replicates."""

    def __init__(self, shape: Shape, config: TransformerConfig):
        super().__init__()
        h, t = config.hidden, shape.t
        self.part, self.heads = shape.part, config.heads // t
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        if shape.part == "block":
            self.q, self.k, self.v = (nn.Linear(h, h // t, bias=False) for _ in range(3))
            self.out = nn.Linear(h // t, h, bias=False)
            self.up, self.down = nn.Linear(h, 4 * h // t, bias=False), nn.Linear(4 * h // t, h, bias=False)
        else:
            self.lm = nn.Linear(h, config.vocab, bias=False)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.part == "head":
            logits = self.lm(self.norm1(x))
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        a = self.norm1(x)
        x = x + self.out(causal_attention(self.q(a), self.k(a), self.v(a), self.heads))
        return (x + self.down(nn.functional.gelu(self.up(self.norm2(x))))).square().mean()


def _median_seconds(fn, repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class CommPoint:
    """One measured message: op ("all_reduce" or "send_recv"), group size, bytes, seconds."""
    op: str
    ranks: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class CalibrationPoints:
    """What `calibrate` measured: seconds per compute shape on every rank at once and on
    one rank alone, and communication points."""
    world: int
    compute_s: dict
    alone_s: dict
    comm: tuple


def calibrate(rank: int, world_size: int, layouts=LAYOUTS_4,
              config: TransformerConfig = TRANSFORMER, repeat: int = 3) -> CalibrationPoints:
    """Rank function: time, on every rank at once, each compute `Shape` the layouts use
    (forward + backward), each all-reduce they call (the activation on TP groups, the
    gradients on DP groups, groups side by side as in the layouts) and one p2p hop of each
    activation size (ping-pong between ranks 2i and 2i+1, halved). Every value is the
    slowest rank's median over `repeat` calls (compute: the mean over ranks)."""
    generator = torch.Generator().manual_seed(rank)
    compute, alone = {}, {}
    for shape in shapes_used(layouts, config):
        piece = ShardShaped(shape, config)
        rows = shape.tokens // config.seq
        x = torch.randn(rows, config.seq, config.hidden, generator=generator, requires_grad=True)
        targets = torch.randint(config.vocab, (rows, config.seq), generator=generator)
        step = lambda: piece.loss(x, targets).backward()  # noqa: E731
        dist.barrier()
        compute[shape] = _mean(_median_seconds(step, repeat))
        dist.barrier()
        seconds = torch.tensor([_median_seconds(step, repeat) if rank == 0 else 0.0],
                               dtype=torch.float64)
        dist.broadcast(seconds, src=0)  # the others wait here, using no core
        alone[shape] = float(seconds)
    comm = []
    for ranks, nbytes in _collectives_used(layouts, config):
        group = split_groups([list(range(i, i + ranks)) for i in range(0, world_size, ranks)])
        buf = torch.zeros(nbytes // BYTES_PER_FLOAT)
        dist.barrier()
        seconds = _median_seconds(lambda: dist.all_reduce(buf, group=group), repeat)
        comm.append(CommPoint("all_reduce", ranks, nbytes, _slowest(seconds)))
        dist.destroy_process_group(group)
    peer = rank ^ 1
    for nbytes in sorted({activation_bytes(lay, config) for lay in layouts if lay.p > 1} | {4096}):
        buf = torch.zeros(nbytes // BYTES_PER_FLOAT)

        def ping_pong():
            first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
            first(buf, peer)
            second(buf, peer)
        dist.barrier()
        comm.append(CommPoint("send_recv", 2, nbytes, _slowest(_median_seconds(ping_pong, repeat) / 2)))
    return CalibrationPoints(world=world_size, compute_s=compute, alone_s=alone, comm=tuple(comm))


def _collectives_used(layouts, config) -> list[tuple[int, int]]:
    """(group size, bytes) of every distinct all-reduce the layouts call: the TP activations
    and the DP gradients of each stage."""
    used = {(lay.t, activation_bytes(lay, config)) for lay in layouts if lay.t > 1}
    used |= {(lay.d, BYTES_PER_FLOAT * stage_parameters(lay, config, j))
             for lay in layouts if lay.d > 1 for j in range(lay.p)}
    return sorted(used)


def _mean(seconds: float) -> float:
    """The mean over ranks (what a rank's compute takes on average; the wait for the slowest
    shows up in the collective that follows, as it does in a measured step)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _slowest(seconds: float) -> float:
    """The slowest rank's value (what the others wait for)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def fit_calibration(rounds: list[CalibrationPoints],
                    config: TransformerConfig = TRANSFORMER) -> Calibration:
    """One `Calibration` from several rounds of `calibrate`: the median over rounds of every
    point, then FLOP/s per shape and, per group size, an α–β fit of all-reduce
    (`fit_alpha_beta`, relative weighting) and one of the p2p hop."""
    compute = {shape: statistics.median(r.compute_s[shape] for r in rounds)
               for shape in rounds[0].compute_s}
    alone = {shape: statistics.median(r.alone_s[shape] for r in rounds) for shape in compute}
    world = rounds[0].world
    comm = [CommPoint(c.op, c.ranks, c.nbytes, statistics.median(r.comm[i].seconds for r in rounds))
            for i, c in enumerate(rounds[0].comm)]
    rates = {shape: shape_flops(shape, config) / s for shape, s in alone.items()}
    # the cores the ranks share: all of them at once take world/cores times as long as one alone
    cores = world * sum(alone.values()) / sum(compute.values())
    groups = sorted({c.ranks for c in comm if c.op == "all_reduce"})
    all_reduce = {g: _fit("all_reduce", [c for c in comm if c.op == "all_reduce" and c.ranks == g])
                  for g in groups}
    return Calibration(flops_per_s=rates, cores=min(float(world), cores), all_reduce=all_reduce,
                       send_recv=_fit("send_recv", [c for c in comm if c.op == "send_recv"]))


def _fit(op: str, points: list[CommPoint]) -> Fit:
    """α–β through the points; a single size fixes only the time, which goes to β."""
    if len(points) == 1:
        (c,) = points
        return Fit(op, 0.0, c.seconds / (coefficients(op, c.ranks)[1] * c.nbytes))
    return fit_alpha_beta(op, [(c.ranks, c.nbytes, c.seconds) for c in points])


# ----------------------------------------------------------------------------------------
# Parent side: the layouts taking turns.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One measured step of one layout: its time (the slowest rank's last span), the per-rank
    spans, and the first loss (the last stage's)."""
    layout: Layout
    step_s: float
    breakdown: Breakdown
    timelines: tuple
    loss: float


def run_layout(ranks, layout: Layout, config: TransformerConfig = TRANSFORMER,
               steps: int = 2) -> Run:
    """`steps` steps of `train_3d` on the live ranks; the last one is timed and broken down."""
    results = run_3d(ranks, layout.d, layout.t, layout.p, layout.m, config, steps=steps,
                     timeline=True)
    timelines = tuple(tuple(r.timeline) for r in results)
    step = max(span.end_s for spans in timelines for span in spans)
    loss = next(r.losses[0] for r in results if r.losses)
    return Run(layout, step, measured_breakdown(timelines, step), timelines, loss)


@dataclass(frozen=True)
class Measured:
    """Every round of the round-robin, and the calibration measured between them."""
    runs: dict            # Layout → [Run per round]
    calibration: Calibration

    def median_run(self, layout: Layout) -> Run:
        """The round whose step is the median one (its breakdown adds up to that step)."""
        runs = sorted(self.runs[layout], key=lambda r: r.step_s)
        return runs[(len(runs) - 1) // 2]

    def comparisons(self, config: TransformerConfig = TRANSFORMER) -> list[Comparison]:
        return [Comparison(lay, self.median_run(lay).breakdown,
                           predict(lay, config, self.calibration)) for lay in self.runs]


def measure(ranks, layouts=LAYOUTS_4, config: TransformerConfig = TRANSFORMER,
            rounds: int = 3, steps: int = 2) -> Measured:
    """Round-robin on the same live ranks: each round calibrates once, then runs every layout
    once, so that each layout and the calibration see the machine in the same state; the
    medians over rounds are robust to a busy moment in any one of them."""
    layouts = tuple(check_layout(lay, config) for lay in layouts)
    world = {lay.world for lay in layouts}
    if len(world) != 1:
        raise ValueError(f"layouts must all cover one world size, got {sorted(world)}")
    ranks.resize(world.pop())
    runs = {lay: [] for lay in layouts}
    points = []
    for _ in range(rounds):
        points.append(ranks.run(calibrate, layouts, config)[0])
        for lay in layouts:
            runs[lay].append(run_layout(ranks, lay, config, steps))
    return Measured(runs, fit_calibration(points, config))
