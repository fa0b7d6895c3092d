"""What a 3-D layout (d, t, p, m) of notebook 07's decoder should cost: pure arithmetic.

One step of `helpers.parallel.parallel3d.Trainer3D` on d·t·p ranks (forwards, backwards,
DP all-reduce, optimizer step), predicted from the counts of its work and a `Calibration`
whose every term was timed under the conditions of the step (all ranks at once), none
fitted to the step times it predicts:

* compute: the FLOPs of a rank's share (`forward_flops`, backward = 2 × forward) at the
  time one rank took for that shape *while every rank computed at once* (on a machine with
  fewer cores than ranks the ranks share the cores; fewer busy ranks share them less);
* TP communication: 4 all-reduces per block, α–β (`helpers.cost.alpha_beta.predict`) fitted
  per group size on the all-reduces timed inside the sharded blocks, between their compute;
* the pipeline: the fill and drain of the schedule, `helpers.cost.bubble.bubble_theory`,
  plus the point-to-point hops of the activations and their gradients;
* DP communication: the wait for the slowest replica, then one α–β all-reduce of the
  stage's gradients; then the optimizer step, timed on the stage's parameters.

On a cluster of nodes (`placement`: the node of each rank) every communication term is priced
at the level its group crosses (`helpers.layout.splits`, `crossing_hops`): inside a node with
the fits by group size, across the link with the fits by `Split`, each calibrated on groups
that lie the same way. Nothing else changes: the compute, the bubble and the optimizer are
the same on one node or two.

Notation: p pipeline stages, m micro-batches, t tensor degree, d data degree, b micro-batch
(sequences), s sequence length, h hidden width. Model sizes come as any object with the
attributes of `helpers.models.TransformerConfig` (vocab, hidden, heads, layers, seq,
batch): this module reads numbers only and imports no torch.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from helpers.cost.alpha_beta import Fit, relative_error
from helpers.cost.bubble import bubble_theory
from helpers.cost.schedules import simulate
from helpers.layout import Groups, Layout, Split, crossing_hops, placement_name, splits

BYTES_PER_FLOAT = 4  # float32 activations, gradients and weights


# ----------------------------------------------------------------------------------------
# FLOPs of the decoder (the one definition; helpers.models.transformer_flops calls it).
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerFlops:
    """Forward FLOPs of one step (the whole batch), by part; a matmul (m×k)·(k×n) is 2·m·n·k.

    With n = batch·s tokens: one block's Linears are 24·n·h² (Q, K, V, out: 8·n·h²; MLP:
    16·n·h²), its attention 4·n·s·h (QKᵀ and AV over the full s×s scores: the math kernel
    computes the masked half too), the LM head 2·n·h·V. LayerNorm, GELU, softmax and the
    embedding lookups are not matmuls and are not counted. Backward is about 2× forward.
    """
    block_linears: int
    block_attention: int
    head: int
    layers: int

    @property
    def block(self) -> int:
        """One decoder block: what a pipeline stage pays per block it holds."""
        return self.block_linears + self.block_attention

    @property
    def total(self) -> int:
        return self.layers * self.block + self.head


def forward_flops(tokens: int, hidden: int, seq: int, vocab: int, layers: int) -> TransformerFlops:
    """Forward FLOPs of the decoder on `tokens` tokens (sequences of length `seq`)."""
    n, h, s = tokens, hidden, seq
    return TransformerFlops(block_linears=24 * n * h * h, block_attention=4 * n * s * h,
                            head=2 * n * h * vocab, layers=layers)


# ----------------------------------------------------------------------------------------
# Layouts.
# ----------------------------------------------------------------------------------------

# The six ways to lay 4 ranks out, each with m = 4 micro-batches where there is a pipeline
# to fill (m = 1 otherwise: without a pipeline, micro-batches only shrink the matmuls).
LAYOUTS_4 = (Layout(4, 1, 1), Layout(1, 4, 1), Layout(1, 1, 4, 4),
             Layout(2, 2, 1), Layout(2, 1, 2, 4), Layout(1, 2, 2, 4))


# ----------------------------------------------------------------------------------------
# The work of one rank: what the cost model counts.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Shape:
    """A piece of compute at the shape one rank runs it: `part` "block" (one decoder block's
    shard: its Linears cut t ways, its attention on heads/t heads, its LayerNorms whole) or
    "head" (final LayerNorm, LM head and loss, replicated on the TP group), on `tokens`
    tokens (one micro-batch). The head's `t` is always 1: every TP rank computes all of it."""
    part: str
    tokens: int
    t: int


def micro_batch(layout: Layout, config) -> int:
    """b: sequences per micro-batch (the batch split d ways, then m ways)."""
    return config.batch // (layout.d * layout.m)


def shape_flops(shape: Shape, config) -> float:
    """Forward + backward FLOPs (3 × forward) of one piece at its shape on one rank."""
    f = forward_flops(shape.tokens, config.hidden, config.seq, config.vocab, 1)
    return 3 * (f.block / shape.t if shape.part == "block" else f.head)


def stage_shapes(layout: Layout, config, stage: int) -> list[Shape]:
    """Every piece stage `stage` computes per micro-batch, one entry per block."""
    tokens = micro_batch(layout, config) * config.seq
    pieces = [Shape("block", tokens, layout.t)] * (config.layers // layout.p)
    return pieces + ([Shape("head", tokens, 1)] if stage == layout.p - 1 else [])


def shapes_used(layouts: Iterable[Layout], config) -> list[Shape]:
    """The distinct pieces a set of layouts runs: what calibration must time."""
    return sorted({s for lay in layouts for j in range(lay.p) for s in stage_shapes(lay, config, j)})


def stage_parameters(layout: Layout, config, stage: int) -> int:
    """Parameters one rank of stage `stage` holds (and all-reduces over its DP group): its
    blocks' Linears cut t ways (12·h²/t) plus their LayerNorms (4·h, replicated); stage 0 the
    embeddings (V·h + s·h), the last stage the final LayerNorm and LM head (2·h + h·V)."""
    h = config.hidden
    n = config.layers // layout.p * (12 * h * h // layout.t + 4 * h)
    if stage == 0:
        n += config.vocab * h + config.seq * h
    if stage == layout.p - 1:
        n += 2 * h + h * config.vocab
    return n


def activation_bytes(layout: Layout, config) -> int:
    """One micro-batch's (b, s, h) activation: what a TP all-reduce and a pipeline hop move."""
    return BYTES_PER_FLOAT * micro_batch(layout, config) * config.seq * config.hidden


# ----------------------------------------------------------------------------------------
# Calibration and prediction.
# ----------------------------------------------------------------------------------------

def stages_used(layouts: Iterable[Layout], config) -> list[tuple[int, int, int]]:
    """The distinct (t, p, stage) of a set of layouts: whose parameters an optimizer steps."""
    return sorted({(lay.t, lay.p, j) for lay in layouts for j in range(lay.p)})


@dataclass(frozen=True)
class Calibration:
    """What the machine measured, every term under the conditions of the step (every rank of
    the `world` at once):

    * `compute_s`: seconds of one piece's forward + backward at each `Shape` (the TP
      all-reduces inside a sharded block cut out), and `cores`: the cores the ranks
      effectively share (world · t_alone / t_all, from the t = 1 shapes also timed alone);
    * `tp_all_reduce`: α–β by group size, fitted on the all-reduces timed inside the sharded
      blocks while the other ranks compute (the wait for the group's last member included);
    * `all_reduce`: α–β by group size of all-reduce with every group at once and nothing
      else running (the DP gradients' and the TP activations' sizes); `send_recv`: one
      p2p hop;
    * `optimizer_s`: the optimizer step of one rank of (t, p, stage);
    * `lateness`: by group size d, how late the slowest of d replicas finishes the same
      compute, as a fraction of it (what a DP all-reduce waits for before it can start).

    The fits above are for groups inside one node (all of them on a flat network). On a
    cluster, `tp_across`, `all_reduce_across` (by `Split`) and `send_recv_across` are the same
    terms timed on groups that cross the link between nodes."""
    world: int
    compute_s: Mapping[Shape, float]
    cores: float
    tp_all_reduce: Mapping[int, Fit]
    all_reduce: Mapping[int, Fit]
    send_recv: Fit
    optimizer_s: Mapping[tuple, float]
    lateness: Mapping[int, float]
    tp_across: Mapping[Split, Fit] = field(default_factory=dict)
    all_reduce_across: Mapping[Split, Fit] = field(default_factory=dict)
    send_recv_across: Fit | None = None

    def flops_per_s(self, shape: Shape, config) -> float:
        """The rate one rank reached at `shape` while every rank computed."""
        return shape_flops(shape, config) / self.compute_s[shape]

    def seconds(self, shape: Shape, busy: float) -> float:
        """One piece's time while `busy` ranks compute at once: the ranks share the cores
        evenly, so beyond `cores` ranks each one slows down by busy / cores (calibrated with
        all `world` ranks busy)."""
        if shape not in self.compute_s:
            raise ValueError(f"no calibrated time for {shape}: calibrate the layouts you predict")
        share = lambda n: max(1.0, n / self.cores)  # noqa: E731
        return self.compute_s[shape] * share(busy) / share(self.world)

    def _fit(self, fits: Mapping[int, Fit], ranks: int, nbytes: float, what: str) -> float:
        if ranks == 1:
            return 0.0
        if ranks not in fits:
            raise ValueError(f"no {what} fit for groups of {ranks}: have {sorted(fits)}")
        return fits[ranks].predict(ranks, nbytes)

    def _across(self, fits: Mapping[Split, Fit], split: Split, nbytes: float, what: str) -> float:
        if split not in fits:
            raise ValueError(f"no {what} fit for groups {split} ({split.per_node} ranks on each): "
                             f"have {sorted(fits)}")
        return fits[split].predict(split.ranks, nbytes)

    def tp_s(self, ranks: int, nbytes: float, split: Split | None = None) -> float:
        """One TP all-reduce inside a block, on a group inside a node (or lying as `split`)."""
        if split is not None and split.crosses:
            return self._across(self.tp_across, split, nbytes, "TP all_reduce")
        return self._fit(self.tp_all_reduce, ranks, nbytes, "TP all_reduce")

    def all_reduce_s(self, ranks: int, nbytes: float, split: Split | None = None) -> float:
        """One quiet all-reduce (every group at once), inside a node (or lying as `split`)."""
        if split is not None and split.crosses:
            return self._across(self.all_reduce_across, split, nbytes, "all_reduce")
        return self._fit(self.all_reduce, ranks, nbytes, "all_reduce")

    def hop_s(self, nbytes: float, crosses: bool = False) -> float:
        """One pipeline hop, inside a node or across the link."""
        if not crosses:
            return self.send_recv.predict(2, nbytes)
        if self.send_recv_across is None:
            raise ValueError("no send_recv fit across nodes: calibrate on the cluster")
        return self.send_recv_across.predict(2, nbytes)


PING_BYTES = 4096  # the small hop timed beside the activations': the hop's α


@dataclass(frozen=True)
class CalibrationPlan:
    """What a calibration times for a set of (layout, placement) pairs: every compute `Shape`,
    each with the way its TP group lies (`Split`, groups of 1 for the unsharded ones); the
    quiet all-reduces (split, bytes): each stage's gradients on its DP group, the TP
    activation on a TP group inside a node; the pipeline hops (split, bytes): inside a node
    always, across the link where a stage boundary crosses it."""
    tp: tuple
    all_reduce: tuple
    send_recv: tuple


def plan_calibration(placed: Iterable[tuple], config) -> CalibrationPlan:
    """The plan for `placed`: pairs (layout, placement), placement None on a flat network."""
    tp, all_reduce, send_recv = set(), set(), {(Split(2, 1), PING_BYTES)}
    for layout, placement in placed:
        where = flat_splits(layout) if placement is None else splits(layout, placement)
        act = activation_bytes(layout, config)
        for j in range(layout.p):
            for shape in stage_shapes(layout, config, j):
                tp.add((shape, where.tp if shape.part == "block" else Split(1, 1)))
            if layout.d > 1:
                all_reduce.add((where.dp, BYTES_PER_FLOAT * stage_parameters(layout, config, j)))
        if layout.t > 1 and not where.tp.crosses:
            all_reduce.add((where.tp, act))
        if layout.p > 1:
            send_recv.add((Split(2, 1), act))
            if placement is not None and any(crossing_hops(layout, placement)):
                send_recv |= {(Split(1, 2), act), (Split(1, 2), PING_BYTES)}
    return CalibrationPlan(tuple(sorted(tp)), tuple(sorted(all_reduce)), tuple(sorted(send_recv)))


def busy_ranks(layout: Layout) -> float:
    """How many ranks compute at once while a rank computes (what its compute shares the
    cores with), on average over its compute time: all of them without a pipeline (data and
    tensor parallel ranks compute in lockstep); with one, the d·t ranks of each stage times
    the stages busy during a stage's work in the 1F1B schedule
    (`helpers.cost.schedules.simulate`, backward = 2 × forward): Σ overlap / Σ busy time
    over its events. (The time average would be p·(1 − bubble_theory(p, m)); a rank's own
    work falls more often where the others work too.)"""
    if layout.p == 1:
        return float(layout.world)
    events = simulate("1f1b", layout.p, layout.m, t_f=1.0, t_b=2.0)
    overlap = sum(max(0.0, min(e.end, o.end) - max(e.start, o.start)) for e in events for o in events)
    return layout.world // layout.p * overlap / sum(e.end - e.start for e in events)


@dataclass(frozen=True)
class Breakdown:
    """One step by cause, in seconds, averaged over the ranks so that the parts add up to the
    step: compute, TP collectives, the pipeline's hops (a wait for the neighbour included),
    DP collectives (a wait for the slowest replica included), the optimizer step, and the
    rest. With a pipeline the rest is idle time: a stage waiting in the bubble or for a slower
    stage. Without one, the rest is unattributed: time outside every span (Python between
    them), which the model does not price."""
    compute_s: float
    tp_comm_s: float
    p2p_s: float
    dp_comm_s: float
    optimizer_s: float
    idle_s: float = 0.0
    unattributed_s: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(getattr(self, part) for part in self.PARTS)

    PARTS = ("compute_s", "tp_comm_s", "p2p_s", "dp_comm_s", "optimizer_s", "idle_s",
             "unattributed_s")
    LABELS = ("compute", "TP comm", "pipeline p2p", "DP comm", "optimizer", "idle",
              "unattributed")


@dataclass(frozen=True)
class Prediction:
    """The model's step for one layout, and the terms it is made of."""
    layout: Layout
    breakdown: Breakdown
    bubble_s: float        # idle fill and drain of the pipeline (part of breakdown.idle_s)
    p2p_s: float           # hops on the critical path (breakdown.p2p_s)
    stage_s: tuple         # one micro-batch's forward + backward (+ TP) per stage
    placement: tuple | None = None  # the node of each rank (None: one flat network)

    @property
    def step_s(self) -> float:
        return self.breakdown.step_s


def flat_splits(layout: Layout) -> Groups:
    """Every group inside one node: a flat network."""
    return Groups(Split(layout.d, 1), Split(layout.t, 1), Split(layout.p, 1))


def predict(layout: Layout, config, calibration: Calibration, placement=None) -> Prediction:
    """One step of `layout`, from the counts above and the calibration.

    Per stage j and micro-batch: T_j = Σ pieces' compute (at the rate of `busy_ranks`
    sharing the cores) + 4 TP all-reduces per block (2 forward, 2 backward) of the (b, s, h)
    activation on t ranks (`tp_s`). The schedule (GPipe or 1F1B: the same length) runs
    Σ_j T_j + (m−1)·max_j T_j: the slowest stage's m micro-batches back to back, plus the
    fill and drain of the others, (p−1)·T̄, which is `bubble_theory(p, m) /
    (1 − bubble_theory(p, m))` · m·T̄ (T̄ the mean of the other stages; with equal stages
    exactly the bubble of notebook 05). The first micro-batch's activation hops p−1 times
    forward and its gradient p−1 times back, one α–β p2p each, and so does every later one
    through the slowest stage (2 per micro-batch): 2·(p−1+m−1) hops. Then every stage
    all-reduces its gradients over d ranks, one call (one bucket), after waiting for the
    slowest replica (`lateness[d]` × its compute), and steps its optimizer; the step ends
    with the last stage to finish that.

    With a `placement` (the node of each rank) each TP, DP and hop term is priced at the level
    its group crosses; the hops then add up boundary by boundary: 2·(Σ_boundaries hop +
    (m−1)·slowest hop), which is 2·(p−1+m−1) hops when they are all alike.
    """
    layout.check(config)
    where = flat_splits(layout) if placement is None else splits(layout, placement)
    crossing = (False,) * (layout.p - 1) if placement is None else crossing_hops(layout, placement)
    d, t, p, m = layout.d, layout.t, layout.p, layout.m
    act = activation_bytes(layout, config)
    blocks = config.layers // p
    busy = busy_ranks(layout)
    compute, tp, stage, dp, opt = [], [], [], [], []
    for j in range(p):
        c = sum(calibration.seconds(s, busy) for s in stage_shapes(layout, config, j))
        comm = 4 * blocks * calibration.tp_s(t, act, where.tp)
        compute.append(m * c)
        tp.append(m * comm)
        stage.append(c + comm)
        wait = calibration.lateness.get(d, 0.0) * m * c if d > 1 else 0.0
        dp.append(wait + calibration.all_reduce_s(
            d, BYTES_PER_FLOAT * stage_parameters(layout, config, j), where.dp))
        opt.append(calibration.optimizer_s[(t, p, j)])
    slowest = max(stage)
    if p > 1:
        others = (sum(stage) - slowest) / (p - 1)
        b = bubble_theory(p, m)
        bubble = b / (1 - b) * m * others
        hops = [calibration.hop_s(act, crosses) for crosses in crossing]
        p2p = 2 * (sum(hops) + (m - 1) * max(hops))
    else:
        bubble = p2p = 0.0
    step = m * slowest + bubble + p2p + max(x + y for x, y in zip(dp, opt))
    mean = statistics.fmean
    # What the ranks' own work leaves of the step is time they wait: the bubble, a slower
    # stage, a slower replica's DP and optimizer
    parts = Breakdown(compute_s=mean(compute), tp_comm_s=mean(tp), p2p_s=p2p,
                      dp_comm_s=mean(dp), optimizer_s=mean(opt),
                      idle_s=step - mean(compute) - mean(tp) - p2p - mean(dp) - mean(opt))
    return Prediction(layout, parts, bubble_s=bubble, p2p_s=p2p, stage_s=tuple(stage),
                      placement=None if placement is None else tuple(placement))


# ----------------------------------------------------------------------------------------
# Measured against predicted.
# ----------------------------------------------------------------------------------------

KINDS = ("compute", "tp_comm", "pp_comm", "dp_comm", "optimizer")


def measured_breakdown(spans_by_rank: Iterable[Iterable], step_s: float,
                       pipelined: bool = True, data_parallel: bool = True) -> Breakdown:
    """A measured step by cause, from every rank's spans of that step (objects with `kind`,
    `start`, `end`): each part is the mean over ranks of its spans' summed lengths; the rest
    of the step, time inside no span, is `idle_s` with a pipeline (`pipelined`: its ranks wait
    in the bubble) and `unattributed_s` without one. Without data parallelism (d = 1) the
    gradient hook still runs on a group of one and sends nothing: its span is not
    communication, so it is counted as unattributed."""
    totals = []
    for spans in spans_by_rank:
        sums = dict.fromkeys(KINDS, 0.0)
        for span in spans:
            if span.kind not in sums:
                raise ValueError(f"span kind must be one of {KINDS}, got {span.kind!r}")
            sums[span.kind] += span.end - span.start
        totals.append(sums)
    if not totals:
        raise ValueError("spans_by_rank must hold at least one rank")
    mean = {k: statistics.fmean(s[k] for s in totals) for k in KINDS}
    lone = 0.0 if data_parallel else mean.pop("dp_comm")
    rest = step_s - sum(mean.values()) - lone
    return Breakdown(compute_s=mean["compute"], tp_comm_s=mean["tp_comm"],
                     p2p_s=mean["pp_comm"], dp_comm_s=mean.get("dp_comm", 0.0),
                     optimizer_s=mean["optimizer"], idle_s=rest if pipelined else 0.0,
                     unattributed_s=lone + (0.0 if pipelined else rest))


@dataclass(frozen=True)
class Comparison:
    """One layout: its measured step (median over steps) and breakdown, and the model's."""
    layout: Layout
    measured: Breakdown
    predicted: Prediction

    @property
    def step_s(self) -> float:
        return self.measured.step_s

    @property
    def predicted_s(self) -> float:
        return self.predicted.step_s

    @property
    def rel_error(self) -> float:
        """(predicted − measured) / measured: signed, > 0 when the model is pessimistic."""
        return (self.predicted_s - self.step_s) / self.step_s


@dataclass(frozen=True)
class LayoutResult:
    """One layout's row of the benchmark: measured and predicted step, and the error."""
    d: int
    t: int
    p: int
    m: int
    step_s: float
    predicted_s: float
    rel_error: float


@dataclass(frozen=True)
class Summary:
    """Every layout's row, the median and worst |relative error|, and the fastest layout
    measured and predicted (as "d·t·p"). `as_json()` is the benchmark's JSON record."""
    world_size: int
    results: tuple[LayoutResult, ...]
    median_rel_error: float
    max_rel_error: float
    best_measured: str
    best_predicted: str

    def as_json(self) -> dict:
        return asdict(self)


def summary(comparisons: Iterable[Comparison]) -> Summary:
    """The comparisons summed up as the benchmark records them."""
    rows = list(comparisons)
    if not rows:
        raise ValueError("comparisons must not be empty")
    errors = [relative_error(c.predicted_s, c.step_s) for c in rows]
    name = lambda c: f"{c.layout.d}·{c.layout.t}·{c.layout.p}"  # noqa: E731
    return Summary(
        world_size=rows[0].layout.world,
        results=tuple(LayoutResult(c.layout.d, c.layout.t, c.layout.p, c.layout.m, c.step_s,
                                   c.predicted_s, c.rel_error) for c in rows),
        median_rel_error=statistics.median(errors),
        max_rel_error=max(errors),
        best_measured=name(min(rows, key=lambda c: c.step_s)),
        best_predicted=name(min(rows, key=lambda c: c.predicted_s)))


def misses(comparisons: Iterable[Comparison]) -> str:
    """Where each layout's error comes from, one line per layout: the step's miss
    (predicted − measured) and the term that misses most, with its measured and predicted
    values (ms)."""
    lines = []
    for c in comparisons:
        diffs = {label: (getattr(c.measured, k), getattr(c.predicted.breakdown, k))
                 for k, label in zip(Breakdown.PARTS, Breakdown.LABELS)}
        label, (got, want) = max(diffs.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]))
        lines.append(f"{c.layout.d}·{c.layout.t}·{c.layout.p}: step {c.rel_error:+.0%} "
                     f"({1e3 * (c.predicted_s - c.step_s):+.1f} ms); most from {label}: "
                     f"measured {1e3 * got:.1f} ms, predicted {1e3 * want:.1f} ms "
                     f"({1e3 * (want - got):+.1f} ms)")
    return "\n".join(lines)


def table(comparisons: Iterable[Comparison]) -> str:
    """Measured against predicted, one line per layout, times in ms."""
    head = " ".join(f"{label:>12}" for label in Breakdown.LABELS)
    lines = [f"{'d·t·p':>6} {'m':>2} | {'measured':>9} {'predicted':>9} {'error':>6} | {head}",
             " " * 10 + "|" + " " * 28 + "|" + "   (measured / predicted, ms)"]
    for c in comparisons:
        lay, ms = c.layout, lambda s: f"{round(1e3 * s, 1) + 0.0:.1f}"  # + 0.0: never "-0.0"
        parts = " ".join(f"{ms(getattr(c.measured, k)) + '/' + ms(getattr(c.predicted.breakdown, k)):>12}"
                         for k in Breakdown.PARTS)
        lines.append(f"{lay.d}·{lay.t}·{lay.p:<2} {lay.m:>2} | {ms(c.step_s):>6} ms "
                     f"{ms(c.predicted_s):>6} ms {c.rel_error:>+6.0%} | {parts}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# On a cluster: the same layouts in each placement that differs.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlacedResult:
    """One (layout, placement)'s row of the cluster benchmark: `placement` names where its
    groups lie ("tp inside · dp across"), `nodes` the node of each rank."""
    d: int
    t: int
    p: int
    m: int
    placement: str
    nodes: tuple
    step_s: float
    predicted_s: float
    rel_error: float


@dataclass(frozen=True)
class ClusterSummary:
    """Every placed layout's row; the median |relative error|; the fastest measured and
    predicted ("d·t·p tp inside · dp across") and how much slower the predicted fastest
    measured than the fastest (`best_predicted_slower`: 0 when they are the same); for each
    (d, t, p) measured in two placements, whether the model orders them as measured
    (`orders`: "d·t·p" → bool) and how far apart their measured steps are (`gaps`: the slower
    over the faster, minus 1: an order inside the noise says little); for each with t > 1, the step with TP across the link over the
    step with TP inside a node (`tp_ratios`), and `tp_across_over_inside`, the smallest."""
    results: tuple[PlacedResult, ...]
    median_rel_error: float
    max_rel_error: float
    best_measured: str
    best_predicted: str
    best_predicted_slower: float
    orders: dict
    gaps: dict
    tp_ratios: dict
    tp_across_over_inside: float | None

    def as_json(self) -> dict:
        return asdict(self)


def _name(c: Comparison) -> str:
    lay = c.layout
    return f"{lay.d}·{lay.t}·{lay.p} {placement_name(lay, c.predicted.placement)}"


def cluster_summary(comparisons: Iterable[Comparison]) -> ClusterSummary:
    """The placed comparisons (each predicted with its placement) summed up."""
    rows = list(comparisons)
    if not rows or any(c.predicted.placement is None for c in rows):
        raise ValueError("comparisons must be a non-empty list, each predicted with a placement")
    by_mesh: dict = {}
    for c in rows:
        by_mesh.setdefault((c.layout.d, c.layout.t, c.layout.p), []).append(c)
    orders, gaps, ratios = {}, {}, {}
    for (d, t, p), pair in by_mesh.items():
        if len(pair) != 2:
            continue
        a, b = pair
        orders[f"{d}·{t}·{p}"] = (a.step_s < b.step_s) == (a.predicted_s < b.predicted_s)
        gaps[f"{d}·{t}·{p}"] = max(a.step_s, b.step_s) / min(a.step_s, b.step_s) - 1
        if t > 1:
            inside = [c for c in pair if not splits(c.layout, c.predicted.placement).tp.crosses]
            across = [c for c in pair if splits(c.layout, c.predicted.placement).tp.crosses]
            if inside and across:
                ratios[f"{d}·{t}·{p}"] = across[0].step_s / inside[0].step_s
    errors = [relative_error(c.predicted_s, c.step_s) for c in rows]
    fastest = min(rows, key=lambda c: c.step_s)
    picked = min(rows, key=lambda c: c.predicted_s)
    return ClusterSummary(
        results=tuple(PlacedResult(c.layout.d, c.layout.t, c.layout.p, c.layout.m,
                                   placement_name(c.layout, c.predicted.placement),
                                   c.predicted.placement, c.step_s, c.predicted_s, c.rel_error)
                      for c in rows),
        median_rel_error=statistics.median(errors), max_rel_error=max(errors),
        best_measured=_name(fastest), best_predicted=_name(picked),
        best_predicted_slower=picked.step_s / fastest.step_s - 1, orders=orders, gaps=gaps,
        tp_ratios=ratios, tp_across_over_inside=min(ratios.values()) if ratios else None)


def placed_table(comparisons: Iterable[Comparison], wire_bytes: Mapping | None = None) -> str:
    """Measured against predicted per (layout, placement), times in ms: the node of each rank,
    where the groups lie, the step and its compute, TP, pipeline hop, DP and idle parts
    (measured / predicted; the optimizer and unattributed time are left out); with `wire_bytes` ((layout, nodes) → bytes per step that crossed the link),
    those too."""
    lines = [f"{'d·t·p':>6} {'m':>2} {'nodes':>6}  {'groups':<22}| {'measured':>9} "
             f"{'predicted':>9} {'error':>6} | {'compute':>9} {'TP comm':>9} {'p2p':>7} "
             f"{'DP comm':>9} {'idle':>7}" + (" | link MB/step" if wire_bytes is not None else "")]
    for c in comparisons:
        lay, nodes, ms = c.layout, c.predicted.placement, lambda s: f"{round(1e3 * s) + 0:.0f}"
        parts = " ".join(f"{ms(getattr(c.measured, k)) + '/' + ms(getattr(c.predicted.breakdown, k)):>{w}}"
                         for k, w in (("compute_s", 9), ("tp_comm_s", 9), ("p2p_s", 7),
                                      ("dp_comm_s", 9), ("idle_s", 7)))
        wire = (f" | {wire_bytes[(lay, nodes)] / 1e6:>7.2f}" if wire_bytes is not None else "")
        lines.append(f"{lay.d}·{lay.t}·{lay.p:<2} {lay.m:>2} {''.join(map(str, nodes)):>6}  "
                     f"{placement_name(lay, nodes):<22}| {ms(c.step_s):>6} ms {ms(c.predicted_s):>6} ms "
                     f"{c.rel_error:>+6.0%} | {parts}{wire}")
    return "\n".join(lines)
