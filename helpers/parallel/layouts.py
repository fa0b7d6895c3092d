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

from helpers.cost.alpha_beta import fit_alpha_beta
from helpers.cost.parallel3d import (LAYOUTS_4, Breakdown, Calibration, Comparison, Layout,
                                     Shape, activation_bytes, check_layout, measured_breakdown,
                                     predict, shapes_used, stage_parameters, BYTES_PER_FLOAT)
from helpers.models import TRANSFORMER, TransformerConfig, causal_attention
from helpers.parallel.groups import split_groups


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
    """What `calibrate` measured: seconds per compute shape, and communication points."""
    compute_s: dict
    comm: tuple


def calibrate(rank: int, world_size: int, layouts=LAYOUTS_4, config: TransformerConfig = TRANSFORMER,
              repeat: int = 5, sizes=None) -> CalibrationPoints:
    """Rank function: time every compute shape and the collectives the layouts use (see the
    module docstring). `sizes`: the message bytes of the sweep (default: a factor of 2 around
    the activations and gradients the layouts move)."""
    generator = torch.Generator().manual_seed(rank)
    compute = {}
    for shape in shapes_used(layouts, config):
        piece = ShardShaped(shape, config)
        rows = shape.tokens // config.seq
        x = torch.randn(rows, config.seq, config.hidden, generator=generator, requires_grad=True)
        targets = torch.randint(config.vocab, (rows, config.seq), generator=generator)

        def step():
            piece.loss(x, targets).backward()
        dist.barrier()
        compute[shape] = _median_seconds(step, repeat)
    if sizes is None:
        wanted = {activation_bytes(lay, config) for lay in layouts}
        wanted |= {BYTES_PER_FLOAT * stage_parameters(lay, config, j)
                   for lay in layouts if lay.d > 1 for j in range(lay.p)}
        sizes = sorted({max(1024, int(n * f)) // 1024 * 1024 for n in wanted for f in (0.5, 1, 2)})
    comm = []
    for ranks in sorted({g for lay in layouts for g in (lay.t, lay.d) if g > 1}):
        group = split_groups([list(range(i, i + ranks)) for i in range(0, world_size, ranks)])
        for nbytes in sizes:
            buf = torch.zeros(nbytes // BYTES_PER_FLOAT)
            dist.barrier()
            seconds = _median_seconds(lambda: dist.all_reduce(buf, group=group), repeat)
            comm.append(CommPoint("all_reduce", ranks, nbytes, _slowest(seconds)))
    peer = rank ^ 1  # pairs (0, 1), (2, 3): even ranks ping, odd ranks pong
    for nbytes in sorted({activation_bytes(lay, config) for lay in layouts if lay.p > 1}
                         | {1024}):
        buf = torch.zeros(nbytes // BYTES_PER_FLOAT)

        def ping_pong():
            if rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        dist.barrier()
        seconds = _median_seconds(ping_pong, repeat) / 2
        comm.append(CommPoint("send_recv", 2, nbytes, _slowest(seconds)))
    slowest = {shape: _slowest(s) for shape, s in compute.items()}
    return CalibrationPoints(compute_s=slowest, comm=tuple(comm))


def _slowest(seconds: float) -> float:
    """The slowest rank's value (what the others wait for)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def fit_calibration(points: CalibrationPoints, config: TransformerConfig = TRANSFORMER) -> Calibration:
    """FLOP/s per shape and α–β fits from what `calibrate` measured (any rank's copy)."""
    from helpers.cost.parallel3d import shape_flops
    rates = {shape: shape_flops(shape, config) / s for shape, s in points.compute_s.items()}
    groups = sorted({c.ranks for c in points.comm if c.op == "all_reduce"})
    all_reduce = {g: fit_alpha_beta("all_reduce", [(c.ranks, c.nbytes, c.seconds)
                                                   for c in points.comm
                                                   if c.op == "all_reduce" and c.ranks == g])
                  for g in groups}
    send_recv = fit_alpha_beta("send_recv", [(2, c.nbytes, c.seconds)
                                             for c in points.comm if c.op == "send_recv"])
    return Calibration(flops_per_s=rates, all_reduce=all_reduce, send_recv=send_recv)
