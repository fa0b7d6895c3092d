"""Every 3-D layout of a world, measured on the same live ranks, and the calibration the cost
model (`helpers.cost.parallel3d`) needs.

* `step_layout`: rank function. Steps one layout on a `Trainer3D` the rank keeps between
  calls (a rank-side cache keyed by layout and model, for as long as the world's process
  group lives; `forget_layouts` empties it), and returns the timelines of several steps.
  Building a layout (its groups, the sharded model, DDP, the optimizer) costs far more than
  a step; cached, a round of the round-robin costs only its steps.
* `calibrate`: rank function. Times every term of the model under the conditions of the
  step, every rank at once: the forward + backward of each compute `Shape` (the blocks
  sharded for real on the layouts' TP groups, their all-reduces timed while the other ranks
  compute, cut out of the compute), the gradient all-reduces on the DP group sizes (groups
  side by side), one p2p hop, the optimizer step on each stage's parameters, and the
  lateness of the slowest replica. `fit_calibration` turns several rounds of points into a
  `Calibration` (α–β from `helpers.cost.alpha_beta.fit_alpha_beta`).
* `measure`: parent side. Round-robin over the layouts: each round calibrates, then steps
  every layout in turn, so every layout sees the same machine load.
* `measure_placed`: the same on emulated nodes (`LiveRanks(4, nodes=2)`), each layout in each
  placement that differs (`helpers.layout.placements`), the calibration timing every term
  inside a node and across the link, the link's counters giving each layout's bytes across;
  `cluster_layouts` is its benchmark record. With mode="wait" every piece of compute waits
  its time alone on one core (`wait_mode_seconds`, `helpers.parallel.wait_mode`), steps and
  calibration alike: a processor per rank, as on GPUs.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.checks import check_choice
from helpers.configs import TRANSFORMER, TransformerConfig
from helpers.cost.alpha_beta import Fit, coefficients, fit_alpha_beta
from helpers.cost.parallel3d import (BYTES_PER_FLOAT, LAYOUTS_4, Breakdown, Calibration, Comparison,
                                     Shape, cluster_summary, measured_breakdown, micro_batch,
                                     plan_calibration, predict, shapes_used, stages_used)
from helpers.labs.parallel3d import Rank3D, Trainer3D, check_3d, cpu_tensors
from helpers.layout import Layout, Split, blocks_on, placements
from helpers.models import Block, Head, Transformer, lm_loss
from helpers.optimizers import make_optimizer
from helpers.parallel.groups import split_groups
from helpers.parallel.parallel3d import Stage
from helpers.parallel.tp import counting
from helpers.parallel.tp_transformer import shard_block, shard_dim
from helpers.parallel.wait_mode import WaitBlock, WaitHead, attention_share
from helpers.timing import times_of

MODES = ("compute", "wait")  # the real model, or every piece waiting its time alone

# ----------------------------------------------------------------------------------------
# Rank side: the layouts kept built between calls.
# ----------------------------------------------------------------------------------------

CACHED_LAYOUTS = 12  # built layouts a rank keeps (least recently used dropped beyond)
# (Layout, config, waits) → (Trainer3D, its first step as a Rank3D), on the world in _WORLD
_TRAINERS: OrderedDict = OrderedDict()
_WORLD: list = []


def layout_waits(layout: Layout, config: TransformerConfig, waits) -> tuple | None:
    """(block_s, head_s) of `layout`'s micro-batch in wait mode, from `waits` (pairs
    (Shape, seconds): `wait_mode_seconds`); None (compute mode) for None."""
    if waits is None:
        return None
    seconds = dict(waits)
    tokens = micro_batch(layout, config) * config.seq
    return seconds[Shape("block", tokens, layout.t)], seconds[Shape("head", tokens, 1)]


def _trainer(rank: int, world_size: int, layout: Layout, config: TransformerConfig,
             waits=None):
    """This rank's built `layout` and the record of its first step, from the cache or built
    now: the first step (from the fresh model: what `train_3d` with steps=1 returns) is the
    untimed warm-up of the optimizer's state, DDP's buckets and the first-call kernels. A new
    world process group (LiveRanks re-formed it) destroyed every sub-group: the cache starts
    over. `waits`: wait mode (`layout_waits`)."""
    if not _WORLD or _WORLD[0] is not dist.group.WORLD:
        _TRAINERS.clear()
        _WORLD[:] = [dist.group.WORLD]
    key = (layout, config, waits)
    if key in _TRAINERS:
        _TRAINERS.move_to_end(key)
        return _TRAINERS[key]
    if len(_TRAINERS) >= CACHED_LAYOUTS:  # every rank drops the same one: groups stay paired
        _TRAINERS.popitem(last=False)[1][0].close()
    trainer = Trainer3D(rank, world_size, layout.d, layout.t, layout.p, layout.m, config,
                        waits=layout_waits(layout, config, waits))
    result = trainer.step(keep_grads=True)
    losses = [result.loss] if result.loss is not None else None
    first = Rank3D(rank, trainer.me, losses, result.grads,
                   cpu_tensors(trainer.stage.named_parameters()), trainer.shards)
    _TRAINERS[key] = trainer, first
    return trainer, first


def first_step(rank: int, world_size: int, layout: Layout,
               config: TransformerConfig = TRANSFORMER) -> Rank3D:
    """Rank function: the first step of the cached `layout` (building it if needed), as
    `train_3d(..., steps=1)` returns it: checkable against `reference_3d` with `assemble`."""
    return _trainer(rank, world_size, layout, config)[1]


def build_layout(rank: int, world_size: int, layout: Layout,
                 config: TransformerConfig = TRANSFORMER, waits=None) -> None:
    """Rank function: build the cached `layout` if needed (its first step included), returning
    nothing: what must happen before bytes on a link are counted for its steps alone."""
    _trainer(rank, world_size, layout, config, waits)


def forget_layouts(rank: int, world_size: int) -> int:
    """Rank function: destroy every cached layout's groups and empty the cache; returns how
    many there were."""
    count = len(_TRAINERS)
    while _TRAINERS:
        _TRAINERS.popitem()[1][0].close()
    return count


@dataclass(frozen=True)
class RankSteps:
    """What one rank of `step_layout` returns: each step's spans and loss (last stage), and
    the loss of the layout's first step, from the fresh model (last stage)."""
    timelines: tuple
    losses: tuple
    first_loss: float | None = None


def step_layout(rank: int, world_size: int, layout: Layout,
                config: TransformerConfig = TRANSFORMER, steps: int = 3,
                waits=None) -> RankSteps:
    """Rank function: `steps` timed training steps of the cached `layout` (see `_trainer`)."""
    trainer, first = _trainer(rank, world_size, layout, config, waits)
    results = [trainer.step(timeline=True) for _ in range(steps)]
    return RankSteps(tuple(tuple(r.spans) for r in results),
                     tuple(r.loss for r in results if r.loss is not None),
                     first.losses[0] if first.losses else None)


# ----------------------------------------------------------------------------------------
# Rank side: calibration.
# ----------------------------------------------------------------------------------------

WARMUP = 2  # untimed calls before each timed series (first-call allocations, kernels)


def _timings(fn, repeat: int, warmup: int = WARMUP) -> list[float]:
    """`repeat` timings of fn (after `warmup` calls), in call order."""
    for _ in range(warmup):
        fn()
    return times_of(fn, repeat)


@dataclass(frozen=True)
class CommPoint:
    """One measured message: op ("all_reduce" or "send_recv"), group size, bytes, seconds,
    and the nodes each group spanned (1: inside a node)."""
    op: str
    ranks: int
    nbytes: int
    seconds: float
    nodes: int = 1

    @property
    def split(self) -> Split:
        return Split(self.ranks // self.nodes, self.nodes)


@dataclass(frozen=True)
class CalibrationPoints:
    """What one `calibrate` call measured: seconds per compute shape on every rank at once
    (mean over ranks) and on one rank alone; the TP all-reduces timed inside the sharded
    blocks (`tp`, mean over ranks) and the quiet ones (`comm`: DP gradients, p2p); the
    optimizer step per (t, p, stage); the slowest replica's lateness per group size d, as a
    fraction of the compute."""
    world: int
    compute_s: dict
    alone_s: dict
    tp: tuple
    comm: tuple
    optimizer_s: dict
    lateness: dict


def _piece(shape: Shape, config: TransformerConfig, group, waits=None):
    """One rank's piece at `shape`, as the step runs it: a block of the model sharded over
    `group` (t ranks; its TP all-reduces inside), or the head and the loss; with `waits`,
    their wait-mode stand-ins."""
    seconds = None if waits is None else dict(waits)[shape]
    if shape.part == "block":
        block = shard_block(Block(config), group)
        return block if waits is None else WaitBlock(
            block, seconds, attention_share(config.hidden, config.seq), group)
    return Head(config) if waits is None else WaitHead(Head(config), seconds)


def _piece_step(piece, shape: Shape, config: TransformerConfig, generator):
    """A call that runs one forward + backward of `piece` on a micro-batch of its shape."""
    rows = shape.tokens // config.seq
    x = torch.randn(rows, config.seq, config.hidden, generator=generator, requires_grad=True)
    if shape.part == "block":
        return lambda: piece(x).square().mean().backward()
    targets = torch.randint(config.vocab, (rows, config.seq), generator=generator)
    return lambda: lm_loss(piece(x), targets).backward()


def _gather(value: float) -> list[float]:
    """Every rank's value, in rank order."""
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    out[dist.get_rank()] = value
    dist.all_reduce(out)
    return out.tolist()


def _lateness(per_rank: list[list[float]], size: int) -> float:
    """The mean wait for the slowest of each group of `size` consecutive ranks, as a fraction
    of the group's mean: per repeat r, (max − mean)/mean of the ranks' times, averaged."""
    world, repeats = len(per_rank), len(per_rank[0])
    fractions = []
    for r in range(repeats):
        for start in range(0, world, size):
            times = [per_rank[k][r] for k in range(start, start + size)]
            mean = statistics.fmean(times)
            fractions.append((max(times) - mean) / mean)
    return statistics.fmean(fractions)


def calibrate(rank: int, world_size: int, layouts=LAYOUTS_4,
              config: TransformerConfig = TRANSFORMER, repeat: int = 5,
              placed=None, nodes=None, waits=None) -> CalibrationPoints:
    """Rank function: time, on every rank at once, each compute `Shape` the layouts use
    (forward + backward: a block sharded over t ranks as in the step, with groups side by
    side, or the head and loss), the TP all-reduces inside those blocks (while the other
    groups compute), the gradient all-reduce of every stage on its DP group size (groups side
    by side), one p2p hop per activation size (ping-pong within pairs, halved) and the
    optimizer step on every stage's parameters. The t = 1 shapes are also timed on rank 0
    alone (the others wait in a broadcast, using no core): their ratio says how many cores the
    ranks share. Compute, TP and optimizer times are means over the `repeat` calls and the
    ranks (what a step that chains many pieces adds up: with more ranks than cores, a piece is
    sometimes cut by the scheduler and sometimes not, and the median would drop the cuts); a
    quiet collective, the slowest rank's median.

    On a cluster, `nodes` is the node of each rank now and `placed` the (layout, placement)
    pairs to price (`plan_calibration`): every group term is timed on groups lying as the
    step's do (`blocks_on`: inside a node, or across the link), each block sharded on the
    ways its TP groups lie; a shape's compute is the mean over them. `waits`: the pieces in
    wait mode, as the steps run them (`wait_mode_seconds`)."""
    placed = tuple((lay, None) for lay in layouts) if placed is None else tuple(placed)
    nodes = (0,) * world_size if nodes is None else tuple(nodes)
    plan = plan_calibration(placed, config)
    generator = torch.Generator().manual_seed(rank)
    work_of, alone, tp, lateness = {}, {}, [], {}
    groups = {}
    per_rank = []  # every repeat of every shape, on this rank: the replicas' spread
    for shape, split in plan.tp:
        if split not in groups:
            groups[split] = split_groups(blocks_on(nodes, split))
        step = _piece_step(_piece(shape, config, groups[split], waits), shape, config,
                           generator)
        with counting() as log:
            dist.barrier()
            times = _timings(step, repeat)
        calls = len(log) // (repeat + WARMUP)  # the warm-up calls logged theirs too
        timed = log[WARMUP * calls:]
        comm = [sum(r.seconds for r in timed[i * calls:(i + 1) * calls]) for i in range(repeat)]
        work = [a - c for a, c in zip(times, comm)]
        per_rank.append(work)
        work_of.setdefault(shape, []).append(statistics.fmean(_gather(statistics.fmean(work))))
        if calls:
            seconds = statistics.fmean(r.seconds for r in timed)
            tp.append(CommPoint("all_reduce", shape.t, timed[0].nbytes,
                                statistics.fmean(_gather(seconds)), split.nodes))
        if shape.t == 1 and shape not in alone:
            dist.barrier()
            seconds = torch.tensor([statistics.fmean(_timings(step, repeat))
                                    if rank == 0 else 0.0], dtype=torch.float64)
            dist.broadcast(seconds, src=0)  # the others wait here, using no core
            alone[shape] = float(seconds)
    compute = {shape: statistics.fmean(values) for shape, values in work_of.items()}
    for group in groups.values():
        dist.destroy_process_group(group)
    # the replicas' spread: every rank's compute of all the shapes, repeat by repeat
    totals = [sum(piece[r] for piece in per_rank) for r in range(repeat)]
    everyone = [_gather(total) for total in totals]  # [repeat][rank]
    by_rank = [[everyone[r][k] for r in range(repeat)] for k in range(world_size)]
    for d in sorted({lay.d for lay, _ in placed if lay.d > 1}):
        lateness[d] = _lateness(by_rank, d)
    comm = []
    for split, nbytes in plan.all_reduce:
        group = split_groups(blocks_on(nodes, split))
        buf = torch.zeros(nbytes // BYTES_PER_FLOAT)
        dist.barrier()
        seconds = statistics.median(_timings(lambda: dist.all_reduce(buf, group=group),
                                                    repeat))
        comm.append(CommPoint("all_reduce", split.ranks, nbytes, _slowest(seconds), split.nodes))
        dist.destroy_process_group(group)
    for split, nbytes in plan.send_recv:
        pair = next(block for block in blocks_on(nodes, split) if rank in block)
        peer = pair[1 - pair.index(rank)]
        buf = torch.zeros(nbytes // BYTES_PER_FLOAT)

        def ping_pong():
            first, second = (dist.send, dist.recv) if pair[0] == rank else (dist.recv, dist.send)
            first(buf, peer)
            second(buf, peer)
        dist.barrier()
        seconds = statistics.median(_timings(ping_pong, repeat)) / 2
        comm.append(CommPoint("send_recv", 2, nbytes, _slowest(seconds), split.nodes))
    optimizer = {}
    for key in stages_used([lay for lay, _ in placed], config):
        opt = _optimizer_on(*key, config)
        dist.barrier()
        optimizer[key] = statistics.fmean(_gather(statistics.fmean(_timings(opt.step, repeat))))
    return CalibrationPoints(world=world_size, compute_s=compute, alone_s=alone, tp=tuple(tp),
                             comm=tuple(comm), optimizer_s=optimizer, lateness=lateness)


def time_alone(rank: int, world_size: int, shapes, config: TransformerConfig,
               repeat: int = 5) -> dict:
    """Rank function: each unsharded `Shape`'s forward + backward, timed on rank 0 alone (the
    others wait in a broadcast, using no core): {shape: median seconds}, on every rank."""
    out = [None]
    if rank == 0:
        generator = torch.Generator().manual_seed(0)
        out[0] = {}
        for shape in shapes:
            piece = Block(config) if shape.part == "block" else Head(config)
            step = _piece_step(piece, shape, config, generator)
            out[0][shape] = statistics.median(_timings(step, repeat))
    dist.broadcast_object_list(out, src=0)  # the others wait here, using no core
    return out[0]


def _optimizer_on(t: int, p: int, stage: int, config: TransformerConfig):
    """The step's optimizer (`make_optimizer("adamw")`) over tensors of the shapes one TP
    rank of stage `stage` of p holds (each sharded weight cut t ways), gradients set."""
    with torch.device("meta"):
        whole = Stage(Transformer(config), stage, p)
    params = []
    for name, q in whole.named_parameters():
        shape = list(q.shape)
        if (dim := shard_dim(name)) is not None:
            shape[dim] //= t
        params.append(torch.zeros(shape, requires_grad=True))
        params[-1].grad = torch.full(shape, 1e-3)
    return make_optimizer("adamw", params)


def _slowest(seconds: float) -> float:
    """The slowest rank's value (what the others wait for)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def fit_calibration(rounds: list[CalibrationPoints]) -> Calibration:
    """One `Calibration` from several rounds of `calibrate`: the median over rounds of every
    point, then per group size an α–β fit (`fit_alpha_beta`, relative weighting) of the TP
    all-reduces timed in the blocks, one of the quiet (DP) all-reduces, one of the p2p hop."""
    med = lambda values: statistics.median(values)  # noqa: E731
    first = rounds[0]
    compute = {s: med(r.compute_s[s] for r in rounds) for s in first.compute_s}
    alone = {s: med(r.alone_s[s] for r in rounds) for s in first.alone_s}
    points = lambda attr: [CommPoint(c.op, c.ranks, c.nbytes,  # noqa: E731
                                     med(getattr(r, attr)[i].seconds for r in rounds), c.nodes)
                           for i, c in enumerate(getattr(first, attr))]
    tp, comm = points("tp"), points("comm")
    # the cores the ranks share: all of them at once take world/cores times as long as one alone
    cores = first.world * sum(alone.values()) / sum(compute[s] for s in alone)
    inside = lambda pts: [c for c in pts if c.nodes == 1]  # noqa: E731
    across = lambda pts: [c for c in pts if c.nodes > 1]  # noqa: E731
    fits = lambda pts: {g: _fit("all_reduce", [c for c in pts if c.ranks == g])  # noqa: E731
                        for g in sorted({c.ranks for c in pts})}
    fits_by_split = lambda pts: {sp: _fit("all_reduce", [c for c in pts if c.split == sp])  # noqa: E731
                                 for sp in sorted({c.split for c in pts})}
    all_reduces = [c for c in comm if c.op == "all_reduce"]
    hops = [c for c in comm if c.op == "send_recv"]
    return Calibration(
        world=first.world, compute_s=compute, cores=min(float(first.world), cores),
        tp_all_reduce=fits(inside(tp)), all_reduce=fits(inside(all_reduces)),
        send_recv=_fit("send_recv", inside(hops)),
        optimizer_s={k: med(r.optimizer_s[k] for r in rounds) for k in first.optimizer_s},
        lateness={d: med(r.lateness[d] for r in rounds) for d in first.lateness},
        tp_across=fits_by_split(across(tp)), all_reduce_across=fits_by_split(across(all_reduces)),
        send_recv_across=_fit("send_recv", across(hops)) if across(hops) else None)


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
    """One call of `step_layout`: its median step (the slowest rank's last span end), that
    step's breakdown and per-rank spans, every step's time, the first loss of this call and
    the loss of the layout's very first step (the fresh model's: the same on every layout).
    The layout stays built between calls and trains on, so `loss` falls call after call."""
    layout: Layout
    step_s: float
    breakdown: Breakdown
    timelines: tuple
    steps_s: tuple
    loss: float
    first_loss: float | None = None


def first_steps(ranks, layout: Layout, config: TransformerConfig = TRANSFORMER) -> list:
    """Every rank's `first_step` of `layout` (a list of `Rank3D`, for `assemble`); the layout
    stays built on the ranks for `run_layout`."""
    check_3d(layout.d, layout.t, layout.p, layout.m, config)
    ranks.resize(layout.world)
    return ranks.run(first_step, layout, config)


def run_layout(ranks, layout: Layout, config: TransformerConfig = TRANSFORMER,
               steps: int = 3, waits=None) -> Run:
    """`steps` timed steps of `layout` on the live ranks (built on the first call, kept
    between calls); the median step is broken down. `waits`: wait mode."""
    check_3d(layout.d, layout.t, layout.p, layout.m, config)
    ranks.resize(layout.world)
    results = ranks.run(step_layout, layout, config, steps, waits)
    per_step = [tuple(r.timelines[i] for r in results) for i in range(steps)]
    times = [max(span.end for spans in step for span in spans) for step in per_step]
    median = sorted(range(steps), key=times.__getitem__)[(steps - 1) // 2]
    last = next(r for r in results if r.losses)  # a rank of the last stage
    return Run(layout, times[median],
               measured_breakdown(per_step[median], times[median], pipelined=layout.p > 1,
                                  data_parallel=layout.d > 1),
               per_step[median], tuple(times), last.losses[0], last.first_loss)


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
            rounds: int = 3, steps: int = 3) -> Measured:
    """Round-robin on the same live ranks: each round calibrates once, then runs `steps`
    steps of every layout, so that each layout and the calibration see the machine in the
    same state; the medians over rounds are robust to a busy moment in any one of them."""
    layouts = tuple(lay.check(config) for lay in layouts)
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
    return Measured(runs, fit_calibration(points))


def wait_mode_seconds(ranks, layouts, config: TransformerConfig, repeat: int = 5) -> tuple:
    """Wait mode's time per micro-batch for every compute `Shape` the layouts use, as pairs
    (Shape, seconds): the unsharded shape's forward + backward timed alone on one core
    (`time_alone`), a block cut t ways taking 1/t of it (TP splits its matmuls evenly; with a
    processor per rank, as on GPUs, the t shards run side by side)."""
    shapes = shapes_used(layouts, config)
    ones = sorted({Shape(s.part, s.tokens, 1) for s in shapes})
    alone = ranks.run(time_alone, ones, config, repeat)[0]
    return tuple((s, alone[Shape(s.part, s.tokens, 1)] / s.t) for s in shapes)


# ----------------------------------------------------------------------------------------
# Parent side: the same layouts on emulated nodes, in each placement that differs.
# ----------------------------------------------------------------------------------------

# The decoder on the cluster: narrower and with more tokens than notebook 07's flat run, so
# that a step's TP activations outweigh its gradients, as in a real run (there, per rank and
# step, 4·(layers/p)·2 all-reduces of b·s·h against one of the parameters / t); a wider model
# on this few tokens would make every placement a DP all-reduce, the same either way. 128
# sequences, so that a TP all-reduce's time on the link outweighs gloo's cost per call (with
# 64, 1·2·2's TP across took only 1.3× TP inside, even in wait mode).
CLUSTER_CONFIG = TRANSFORMER.with_(vocab=256, hidden=32, seq=64, batch=128)


def placed_layouts(layouts=LAYOUTS_4, nodes: int = 2) -> tuple:
    """(layout, placement) for every layout in each placement on `nodes` nodes that differs
    (`helpers.layout.placements`), the launcher's (consecutive ranks on a node) first."""
    return tuple((lay, placement) for lay in layouts for placement in placements(lay, nodes))


@dataclass(frozen=True)
class PlacedMeasured:
    """Every round's `Run` of each (layout, placement), the bytes one of its steps sent over
    the link (median over rounds, from the shapers' counters), the calibration, and in wait
    mode the pieces' waits (`wait_mode_seconds`; None: compute mode)."""
    runs: dict            # (Layout, placement) → [Run per round]
    wire_bytes: dict      # (Layout, placement) → bytes per step across the link
    calibration: Calibration
    waits: tuple | None = None

    def median_run(self, key) -> Run:
        runs = sorted(self.runs[key], key=lambda r: r.step_s)
        return runs[(len(runs) - 1) // 2]

    def comparisons(self, config: TransformerConfig = CLUSTER_CONFIG) -> list[Comparison]:
        return [Comparison(lay, self.median_run((lay, pl)).breakdown,
                           predict(lay, config, self.calibration, pl)) for lay, pl in self.runs]


def measure_placed(ranks, placed=None, config: TransformerConfig = CLUSTER_CONFIG,
                   rounds: int = 1, steps: int = 3, repeat: int = 5,
                   mode: str = "compute") -> PlacedMeasured:
    """On live ranks on emulated nodes (`LiveRanks(world, nodes=n)`): each round, for each
    placement in turn (the ranks' own first), `ranks.place` it (the ranks restart on their
    nodes), then run `steps`
    steps of each layout placed so; the round's calibration is timed on the first placement,
    with groups lying inside a node and across the link as the layouts' do. The link's
    counters give each layout's bytes across per step. `repeat`: calibration timings per term.
    `mode`: "compute" (the real model) or "wait" (`helpers.parallel.wait_mode`: every piece
    waits its time alone on one core, timed first; steps and calibration alike)."""
    check_choice("mode", mode, MODES)
    if not ranks.nodes:
        raise ValueError("measure_placed needs ranks on emulated nodes: LiveRanks(4, nodes=2) "
                         "(where namespaces cannot be made, LiveRanks says why)")
    placed = placed_layouts(LAYOUTS_4, ranks.nodes) if placed is None else tuple(placed)
    placed = tuple((lay.check(config), tuple(pl)) for lay, pl in placed)
    by_placement: dict = {}
    if ranks.placement in {pl for _, pl in placed}:  # start where the ranks are: no restart
        by_placement[ranks.placement] = []
    for lay, pl in placed:
        by_placement.setdefault(pl, []).append(lay)
    runs = {key: [] for key in placed}
    wire = {key: [] for key in placed}
    points = []
    waits = None
    if mode == "wait":
        ranks.place(next(iter(by_placement)))
        waits = wait_mode_seconds(ranks, tuple(lay for lay, _ in placed), config, repeat)
    for _ in range(rounds):
        for i, (placement, layouts) in enumerate(by_placement.items()):
            ranks.place(placement)
            if i == 0:
                points.append(ranks.run(calibrate, tuple(lay for lay, _ in placed), config,
                                        repeat, placed=placed, nodes=placement,
                                        waits=waits)[0])
            for lay in layouts:
                ranks.run(build_layout, lay, config, waits)  # connections made: not counted
                before = ranks.wire_bytes(resent=False)
                runs[(lay, placement)].append(run_layout(ranks, lay, config, steps, waits))
                wire[(lay, placement)].append((ranks.wire_bytes(resent=False) - before) / steps)
    return PlacedMeasured(runs, {k: statistics.median(v) for k, v in wire.items()},
                          fit_calibration(points), waits)


def cluster_layouts(ranks, config: TransformerConfig = CLUSTER_CONFIG, rounds: int = 1,
                    steps: int = 3, mode: str = "compute") -> dict:
    """The benchmark's record of every 4-rank layout in each placement on the ranks' emulated
    nodes (`LiveRanks(4, nodes=2)`): "layouts", one row per (layout, placement) {d, t, p, m,
    placement, nodes, step_s, predicted_s, rel_error, wire_bytes_per_step}; then
    median_rel_error, max_rel_error, best_measured, best_predicted, best_predicted_slower,
    orders, gaps, tp_ratios and tp_across_over_inside (`helpers.cost.parallel3d.ClusterSummary`)."""
    ranks.resize(4)
    return cluster_record(measure_placed(ranks, None, config, rounds, steps, mode=mode), config)


def cluster_record(measured: PlacedMeasured, config: TransformerConfig = CLUSTER_CONFIG) -> dict:
    """`cluster_layouts`'s record of a `measure_placed` result (JSON-ready)."""
    record = cluster_summary(measured.comparisons(config)).as_json()
    rows = record.pop("results")
    for row, key in zip(rows, measured.runs):
        row["nodes"] = list(row["nodes"])
        row["wire_bytes_per_step"] = measured.wire_bytes[key]
    return {"layouts": rows, **record}
