"""When does tensor parallelism pay? Compute vs communication time per layer (notebook 04's widget).

A step of one layer on t ranks costs 6·tokens·h²/t FLOPs of compute (forward 2, backward 4)
plus the layout's collectives, priced by the α–β model of notebook 02 (`helpers.cost.alpha_beta`)
on the link a ring of t ranks crosses: NVLink inside a node, InfiniBand beyond, or this
machine's fitted α, β. Nothing is overlapped, so the sum is an upper bound of what a real step
hides. Pure arithmetic: no torch, no processes.

The last section is notebook 06's model's 2-D layout (TP_model × TP_ff): which ranks share which
slice (`Grid2D`), the bytes the model charges per rank and network level (`model_bytes_2d`, from
the simulator's own `tp_comm`), and those bytes' time over a link against the matmuls'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from helpers.checks import check_choice, check_divisible, check_int
from helpers.configs import LECTURE, MLPConfig
from helpers.cost import alpha_beta
from helpers.cost.alpha_beta import COST_MODELS
from helpers.hardware import H100_SXM, HIERARCHY, ROOFLINE_PEAKS, NetworkLevel
from helpers.simulator.comm import tp_comm
from helpers.units import format_seconds

LAYOUTS = ("lecture", "megatron", "sequence")


def check_degree(t: int, hidden: int) -> None:
    """t ranks share every h × h weight: h must split evenly."""
    check_int("t", t)
    check_int("hidden", hidden)
    check_divisible("hidden", hidden, t, f"the tensor degree t={t} splits every weight")


def formula_collectives(layout: str, layers: int) -> dict[str, tuple[int, int]]:
    """op → (calls forward, calls backward) for one step with t > 1 (input needs a gradient).

    Every one of these collectives moves one full activation (the all-reduced tensor, the
    all-gather's output, the reduce-scatter's input)."""
    check_choice("layout", layout, LAYOUTS)
    pairs = layers // 2
    if layout == "lecture":
        return {"all_gather": (layers, 0), "all_reduce": (0, layers)}
    if layout == "megatron":
        return {"all_reduce": (pairs, pairs)}
    return {"all_gather": (pairs, pairs), "reduce_scatter": (pairs, pairs)}


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_Bps: float   # per direction, per rank
    latency_s: float       # α: one message


@dataclass(frozen=True)
class TPHardware:
    """What a tensor-parallel group runs on: one device's compute rate and the links a ring of
    t ranks crosses. `links` is ((size, Link), …), innermost first; a ring of t ranks runs at
    the speed of the first level holding t (size None: any t)."""
    name: str
    flops: float
    bytes_per_element: int
    links: tuple


@dataclass(frozen=True)
class SavedFit:
    """An all-reduce fit of this machine (notebook 02's, or `source`'s), and how its ranks
    were set up."""
    backend: str
    world_size: int
    cores_per_rank: float | None
    all_reduce: alpha_beta.Fit
    source: str = "notebook 02"


def h100_links() -> tuple[Link, Link]:
    """NVLink and InfiniBand per direction, from helpers.hardware.HIERARCHY (cited there)."""
    levels = {lv.name.split(" (")[0]: lv for lv in HIERARCHY["H100 SXM"]}
    nvlink, ib = levels["NVLink 4"], levels["InfiniBand NDR"]
    return (Link("NVLink 4", nvlink.bandwidth_Bps, nvlink.latency_s),
            Link("InfiniBand NDR", ib.bandwidth_Bps, ib.latency_s))


def load_fit(path: Path | str | None = None,
             level: str = alpha_beta.DEFAULT_LEVEL) -> SavedFit | None:
    """Notebook 02's all-reduce α–β fit of this machine at network `level`, or None if it has
    not been run here (or its file is corrupt: alpha_beta.load_fit warns)."""
    record = alpha_beta.load_fit(path, level)
    if not record or "all_reduce" not in record.get("fit", {}):
        return None
    return SavedFit(record.get("backend"), record.get("world_size"), record.get("cores_per_rank"),
                    alpha_beta.fits_from_record(record)["all_reduce"])


def hardware_choices(fit: SavedFit | None = None,
                     cpu_flops: float | None = None) -> dict[str, TPHardware]:
    """The widget's choices. H100 compute: dense bf16 peak (helpers.hardware.ROOFLINE_PEAKS).
    'this machine' appears only with an all-reduce fit of it (notebook 02's, or one measured
    where it is missing: `helpers.labs.tp.fit_all_reduce_here`) and a measured FLOP/s (fp32)."""
    peak = ROOFLINE_PEAKS["H100 SXM"][0]
    node = H100_SXM.network_levels[0].size  # 8 GPUs per node
    nvlink, ib = h100_links()
    out = {
        f"H100: NVLink inside a node of {node}, InfiniBand beyond":
            TPHardware("H100 cluster", peak, 2, ((node, nvlink), (None, ib))),
        "H100: InfiniBand only (one GPU per node)": TPHardware("H100 + IB", peak, 2, ((None, ib),)),
        "H100: NVLink at every size (hypothetical)": TPHardware("H100 + NVLink", peak, 2,
                                                                ((None, nvlink),)),
    }
    if fit is not None and cpu_flops:
        out[f"this machine: {fit.backend} fit from {fit.source}"] = this_machine(fit, cpu_flops)
    return out


def this_machine(fit: SavedFit, cpu_flops: float) -> TPHardware:
    """This machine as the model sees it: fp32 at `cpu_flops`, every ring on the fitted link."""
    link = Link(f"{fit.backend} (fitted, {fit.cores_per_rank} core(s)/rank)",
                1 / fit.all_reduce.beta_s_per_byte, fit.all_reduce.alpha_s)
    return TPHardware("this machine", cpu_flops, 4, ((None, link),))


def link_for(hardware: TPHardware, t: int) -> Link:
    for size, link in hardware.links:
        if size is None or t <= size:
            return link
    raise ValueError(f"t must be at most {hardware.links[-1][0]} on {hardware.name}, got {t}")


@dataclass(frozen=True)
class LayerTime:
    """Seconds per layer per training step on one rank."""
    t: int
    compute_s: float
    comm_s: float
    link: str            # the link the ring crosses ("none" at t = 1)
    speedup: float = 1.0  # over t = 1 (set by `tp_curve`)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


def layer_times(t: int, hidden: int, hardware: TPHardware, tokens: int,
                layout: str = "megatron") -> LayerTime:
    """Compute (6·tokens·h²/t FLOP: forward 2, backward 4) and communication (the layout's
    collectives per layer, each of one full activation, priced by `alpha_beta.predict`).
    Nothing is overlapped: Megatron's all-reduces sit on the critical path."""
    check_choice("layout", layout, LAYOUTS)
    check_degree(t, hidden)
    check_int("tokens", tokens)
    compute = 6 * tokens * hidden**2 / t / hardware.flops
    if t == 1:
        return LayerTime(t, compute, 0.0, "none")
    link = link_for(hardware, t)
    n = tokens * hidden * hardware.bytes_per_element
    # A pair of layers has whole numbers of collectives in every layout: half of it is one layer.
    comm = sum((forward + backward) / 2
               * alpha_beta.predict(op, t, n, link.latency_s, 1 / link.bandwidth_Bps)
               for op, (forward, backward) in formula_collectives(layout, 2).items())
    return LayerTime(t, compute, comm, link.name)


def tp_curve(hidden: int, hardware: TPHardware, tokens: int, layout: str = "megatron",
             ts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> list[LayerTime]:
    """layer_times for each t that divides hidden, with speedup over t = 1."""
    rows = [layer_times(t, hidden, hardware, tokens, layout) for t in ts if hidden % t == 0]
    base = rows[0].step_s
    return [LayerTime(r.t, r.compute_s, r.comm_s, r.link, base / r.step_s) for r in rows]


def best_t(rows: list[LayerTime]) -> int:
    """The t with the shortest step: beyond it, TP stops paying."""
    return min(rows, key=lambda r: r.step_s).t


def describe(t: int, hidden: int, hardware: TPHardware, tokens: int) -> str:
    """The widget's text: this t's split, and where TP stops paying on this hardware."""
    rows = tp_curve(hidden, hardware, tokens)
    row = next((r for r in rows if r.t == t), None)
    if row is None:
        return f"t={t} does not divide h={hidden}: pick another t"
    share = row.comm_s / row.step_s
    best = best_t(rows)
    if best == 1:
        verdict = "TP never pays here: even at t=2 the all-reduce costs more than the compute it saves."
    elif best == rows[-1].t:
        verdict = f"Still getting faster at t={best}, the largest t shown."
    else:
        verdict = (f"Fastest at t={best}; beyond it the all-reduce costs more than the compute "
                   f"it saves (link there: {next(r for r in rows if r.t == best).link}).")
    return (f"t={t}, h={hidden}, b·s={tokens}, link {row.link}: compute "
            f"{format_seconds(row.compute_s)} + communication {format_seconds(row.comm_s)} "
            f"per layer ({share:.0%} communication); speedup over t=1: {_times(row.speedup)}×.\n"
            + verdict)


def _times(x: float) -> str:
    """A speedup to two decimals, or to two significant digits below 0.01 (not "0.00")."""
    return f"{x:.2f}" if x >= 0.01 else f"{x:.2g}"


# ----------------------------------------------------------------------------------------
# Checks: one clear error, in the parent, before any process starts.
# ----------------------------------------------------------------------------------------

def check_config(t: int, config: MLPConfig = LECTURE, layout: str = "megatron") -> None:
    """Raise ValueError/TypeError naming the bad argument; return None when all is well."""
    check_choice("layout", layout, LAYOUTS)
    check_degree(t, config.hidden)
    if layout != "lecture":
        check_divisible("layers", config.layers, 2, f"layout={layout!r} pairs column and row layers")
    if layout == "sequence":
        check_divisible("batch", config.batch, t, f"each of the t={t} ranks keeps batch/t tokens")


def kind_of(layout: str, layer: int) -> str:
    """'column' or 'row': how `layout` cuts layer `layer` (0 … L−1)."""
    return "column" if layout == "lecture" or layer % 2 == 0 else "row"


# ----------------------------------------------------------------------------------------
# Formulas: what the counter should find, and what each rank keeps for the backward pass.
# (`formula_collectives`, op → calls per pass, is above, with the cost model.)
# ----------------------------------------------------------------------------------------

def formula_bytes(layout: str, t: int, config: MLPConfig = LECTURE, bytes_per_element: int = 4) -> int:
    """Per-rank bytes sent in one training step (forward + backward), ring algorithm.

    Every collective here moves a full activation n = tokens·h·bytes (gathered output,
    reduce-scattered input, or all-reduced tensor), each priced by alpha_beta's bus factor:
      lecture : L all-gathers + L all-reduces = 3L(t−1)/t · n
      megatron: L/2 + L/2 all-reduces          = 2L(t−1)/t · n
      sequence: L all-gathers + L reduce-scatters = 2L(t−1)/t · n
    """
    n = config.batch * config.hidden * bytes_per_element
    return sum((forward + backward) * round(COST_MODELS[op].bus_factor(t) * n)
               for op, (forward, backward) in formula_collectives(layout, config.layers).items())


def formula_activation_bytes(layout: str, t: int, config: MLPConfig = LECTURE,
                             bytes_per_element: int = 4) -> int:
    """Activations one rank keeps for the backward pass (weights excluded).

    Per layer (n = tokens·h·bytes, one full activation):
      lecture : the full input (n) and its own pre-GELU slice (n/t)            → n + n/t
      megatron: per pair, full input n, two slices n/t, full pre-GELU sum n    → (2n + 2n/t)/2
      sequence: per pair, gathered input n, two slices n/t, pre-GELU shard n/t → (n + 3n/t)/2
    """
    n, layers = config.batch * config.hidden * bytes_per_element, config.layers
    if layout == "lecture":
        return layers * (n + n // t)
    if layout == "megatron":
        return layers // 2 * (2 * n + 2 * n // t)
    return layers // 2 * (n + 3 * n // t)


# ----------------------------------------------------------------------------------------
# The route of one step through each layout (drawn by helpers.views.tp.plot_layouts).
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    index: int
    kind: str          # "column" or "row"


@dataclass(frozen=True)
class Comm:
    forward: str       # "AG", "RS", "AR" or "" (nothing on this pass)
    backward: str
    operator: str = ""  # "f", "g" or ""


@dataclass(frozen=True)
class Holds:
    activation: str    # b×h, b×h/t (its features), b/t×h (its tokens) or "partial b×h"


def layout_schedule(layout: str, layers: int) -> list[Layer | Comm | Holds]:
    """The route of one step through the sharded MLP: layers, collectives and what each rank
    holds in between (a partial sum of b×h is what the next collective completes)."""
    sequence = layout == "sequence"
    items: list[Layer | Comm | Holds] = [Holds("b/t×h" if sequence else "b×h")]
    for i in range(layers):
        kind = kind_of(layout, i)
        if kind == "column":
            items += [Comm("AG", "RS"), Holds("b×h")] if sequence else [Comm("", "AR", "f")]
        items += [Layer(i, kind), Holds("b×h/t" if kind == "column" else "partial b×h")]
        if layout == "lecture":
            items += [Comm("AG", ""), Holds("b×h")]
        elif kind == "row":
            items += ([Comm("RS", "AG"), Holds("b/t×h")] if sequence
                      else [Comm("AR", "", "g"), Holds("b×h")])
    return items




# ----------------------------------------------------------------------------------------
# 2-D tensor parallelism as notebook 06's model has it (docs/cost_model.md §4): TP_model ×
# TP_ff ranks, each holding an (h_ff/TP_ff) × (h/TP_model) block of both matrices of every
# feed-forward layer (h → h_ff = 4h → h).
# ----------------------------------------------------------------------------------------

FF_FACTOR = 4  # h_ff = 4h: the model's scaling law (docs/cost_model.md §3) and notebook 07's MLP


@dataclass(frozen=True)
class Grid2D:
    """Which ranks share which slice: rank = ff_index · tp_model + model_index.

    A *TP_model group* is the tp_model ranks holding the same h_ff slice and different h
    slices (they all-reduce h_ff/TP_ff words per token); a *TP_ff group* is the tp_ff ranks
    holding the same h slice (they all-reduce h/TP_model words per token). TP_model groups are
    runs of consecutive ranks, so placing consecutive ranks on a node keeps them inside it.
    """
    tp_model: int
    tp_ff: int

    def __post_init__(self):
        check_int("tp_model", self.tp_model)
        check_int("tp_ff", self.tp_ff)

    @property
    def world_size(self) -> int:
        return self.tp_model * self.tp_ff

    def model_groups(self) -> list[list[int]]:
        return [[i * self.tp_model + j for j in range(self.tp_model)] for i in range(self.tp_ff)]

    def ff_groups(self) -> list[list[int]]:
        return [[i * self.tp_model + j for i in range(self.tp_ff)] for j in range(self.tp_model)]

    def check(self, config: MLPConfig) -> None:
        """h splits over TP_model and h_ff over TP_ff (the model's own condition)."""
        check_divisible("hidden", config.hidden, self.tp_model,
                        f"TP_model={self.tp_model} splits h")
        check_divisible("hidden", FF_FACTOR * config.hidden, self.tp_ff,
                        f"TP_ff={self.tp_ff} splits h_ff = {FF_FACTOR}h")


def split_on_nodes(grid: Grid2D, placement: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(TP_model, TP_ff) as (degree inside a node, degree across nodes) when rank r sits on node
    `placement[r]`: the model's two network levels. Every group of a kind must span as many
    nodes as the others (the model places degrees, not ranks)."""
    if len(placement) != grid.world_size:
        raise ValueError(f"placement must name a node for each of the {grid.world_size} ranks, "
                         f"got {placement!r}")
    out = []
    for name, groups in (("TP_model", grid.model_groups()), ("TP_ff", grid.ff_groups())):
        spans = {len({placement[r] for r in group}) for group in groups}
        if len(spans) != 1:
            raise ValueError(f"placement {placement!r} puts some {name} groups on more nodes "
                             f"than others; the model gives each degree one split")
        (across,) = spans
        size = len(groups[0])
        if size % across:
            raise ValueError(f"placement {placement!r} splits {name} groups of {size} ranks "
                             f"over {across} nodes unevenly")
        out.append((size // across, across))
    return out[0], out[1]


def formula_collectives_2d(grid: Grid2D, layers: int) -> dict[str, tuple[int, int]]:
    """Group → (all-reduces forward, backward) in one step: each layer sums its first
    matmul's partial sums over TP_model and its second's over TP_ff forward, and the input
    gradients of the two the same way backward (2L of each a step, the model's `rs = 2L`).
    A group of one rank issues nothing."""
    return {name: (layers, layers) for name, size in
            (("TP_model", grid.tp_model), ("TP_ff", grid.tp_ff)) if size > 1}


def model_bytes_2d(config: MLPConfig, tp_model: tuple[int, ...], tp_ff: tuple[int, ...],
                   bytes_per_element: int = 4) -> tuple[int, ...]:
    """Bytes each rank sends in one step on each network level, innermost first, by notebook
    06's model: `helpers.simulator.comm.tp_comm` itself, so there is one definition.

    `tp_model` and `tp_ff` are the degrees on each level (`(2,)`: one level; `(2, 1)` and
    `(1, 2)`: TP_model inside a node, TP_ff across). `tp_comm` returns a time, bytes / (N ·
    bw_k / 2) on the slowest level; asking it about one level at a time, at bw_k = 2 B/s and
    every other level infinitely fast, makes that time the bytes per rank on level k. The
    model's N and tokens per batch are the run's: TP is the only parallelism (N = TP), and
    every rank sees the whole batch (b tokens: s = 1)."""
    if len(tp_model) != len(tp_ff):
        raise ValueError(f"tp_model and tp_ff must give a degree on every level, "
                         f"got {tp_model} and {tp_ff}")
    n = math.prod(tp_model) * math.prod(tp_ff)
    out = []
    for k in range(len(tp_model)):
        levels = [NetworkLevel(2.0 if i == k else math.inf, 0.0) for i in range(len(tp_model))]
        per_rank, _ = tp_comm(config.hidden, FF_FACTOR * config.hidden, config.layers,
                              config.batch, tp_model, tp_ff, levels, n, bytes_per_element)
        out.append(round(per_rank))
    return tuple(out)


def formula_bytes_2d(grid: Grid2D, config: MLPConfig = LECTURE, bytes_per_element: int = 4) -> int:
    """Bytes each rank sends in one step (ring all-reduces), all on one level."""
    (total,) = model_bytes_2d(config, (grid.tp_model,), (grid.tp_ff,), bytes_per_element)
    return total


def formula_bytes_2d_by_group(grid: Grid2D, config: MLPConfig = LECTURE,
                              bytes_per_element: int = 4) -> dict[str, int]:
    """The same, split by group: each group's share is the model's bytes with the other degree
    on a level of its own (TP_model on level 0, TP_ff on level 1)."""
    by_model, by_ff = model_bytes_2d(config, (grid.tp_model, 1), (1, grid.tp_ff),
                                     bytes_per_element)
    return {name: nbytes for name, nbytes, size in
            (("TP_model", by_model, grid.tp_model), ("TP_ff", by_ff, grid.tp_ff)) if size > 1}


def grids_2d(t: int, config: MLPConfig = LECTURE) -> list[Grid2D]:
    """Every TP_model × TP_ff = t that splits h and h_ff, TP_model ascending. TP_model = 1 is
    Megatron's layout (`up` column-parallel, `down` row-parallel, h words all-reduced)."""
    check_int("t", t)
    return [Grid2D(m, t // m) for m in range(1, t + 1)
            if t % m == 0 and config.hidden % m == 0 and FF_FACTOR * config.hidden % (t // m) == 0]


def searched_grids_2d(t: int, config: MLPConfig = LECTURE) -> list[Grid2D]:
    """The grids notebook 06's search tries: r ≤ TP_ff ≤ 4r with r = ⌊√t⌋, as
    `helpers.simulator.reference.best_plan` writes it (docs/cost_model.md §6)."""
    r = math.isqrt(t)
    return [g for g in grids_2d(t, config) if r <= g.tp_ff <= 4 * r]


def step_flops_2d(t: int, config: MLPConfig = LECTURE) -> float:
    """FLOP of one rank's matmuls in a step: 2 matrices of h × h_ff per layer, 2 FLOP per
    multiply-add forward and 4 backward, shared by t ranks however they are cut."""
    return 12 * config.batch * config.hidden * FF_FACTOR * config.hidden * config.layers / t


def comm_over_compute_2d(grid: Grid2D, config: MLPConfig, link_Bps: float, flops: float,
                         bytes_per_element: int = 2) -> float:
    """How long a rank's all-reduces take over one link (bytes per direction per second) next
    to how long its matmuls take at `flops`: below 1 the traffic can hide behind the matmuls
    (the model overlaps them), above 1 it sets the step. b cancels out; h does not."""
    comm = formula_bytes_2d(grid, config, bytes_per_element) / link_Bps
    return comm / (step_flops_2d(grid.world_size, config) / flops)
