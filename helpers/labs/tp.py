"""Notebook 04's runs: the lecture's MLP under each tensor-parallel layout on live ranks (the
lecture's forward, a training step), checked against one process; the bytes each rank hands to
torch.distributed against the formulas of `helpers.cost.tp`; PyTorch's DTensor plan for the
same layouts; timed steps (t = 1 against t = 2 taking turns, and a small all-reduce fit to
price them with); and notebook 06's model's 2-D tensor parallelism, checked the same way,
its bytes against the model's formula, on the link between emulated nodes too. The layers and
f/g are `helpers.parallel.tp`."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.checks import check_choice, check_int
from helpers.configs import LECTURE, MLPConfig, TransformerConfig
from helpers.cost.tp import (Grid2D, SavedFit, check_config, formula_activation_bytes,
                             formula_bytes, formula_collectives, kind_of, model_bytes_2d,
                             split_on_nodes)
from helpers.launch import cluster
from helpers.launch.host import intra_op_threads
from helpers.models import FeedForward, make_batch, make_mlp, mlp_loss
from helpers.parallel.groups import group_rank, group_size, rank_device, split_groups
from helpers.parallel.tp import (ColumnParallelLinear, CommSummary, FeedForward2D,
                                 RowParallelLinear, all_gather, build_groups, counting, my_slice,
                                 record, reduce_scatter, saved_activations, shard_feed_forwards,
                                 shard_mlp, summarize)
from helpers.timing import Measurement, measure

# ----------------------------------------------------------------------------------------
# Results a rank sends back.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Param:
    """A parameter of the reference MLP, by layer (0 … L−1) and name ("weight" or "bias")."""
    layer: int
    name: str

    def __str__(self) -> str:
        return f"layer {self.layer} {self.name}"


@dataclass(frozen=True)
class StepResult:
    """One training step: on a rank its shards, after `assemble` (or unsharded) the whole."""
    output: torch.Tensor
    loss: torch.Tensor
    input_grad: torch.Tensor
    grads: dict[Param, torch.Tensor]
    comm: CommSummary | None = None          # what this module's wrappers counted
    activation_bytes: int | None = None      # kept for backward (saved_activations)
    collectives: dict[str, int] | None = None  # torch_tp_step: CommDebugMode's counts by op

    def cpu(self) -> "StepResult":
        """The same result with every tensor on the CPU (what a rank sends back)."""
        return replace(self, output=self.output.detach().cpu(), loss=self.loss.detach().cpu(),
                       input_grad=self.input_grad.cpu(),
                       grads={k: v.cpu() for k, v in self.grads.items()})


@dataclass(frozen=True)
class LectureForward:
    output: torch.Tensor
    comm: CommSummary
    local_shape: tuple[int, int]    # this rank's activation slice, b × h/t
    weight_shape: tuple[int, int]   # this rank's weight slice, h × h/t (x @ W convention)


@dataclass(frozen=True)
class TimedSteps:
    measurement: Measurement
    comm: CommSummary               # the last timed step's collectives
    comm_shares: tuple[float, ...]  # per timed step: seconds inside collectives / step

    @property
    def comm_share(self) -> float:
        return statistics.median(self.comm_shares)


# ----------------------------------------------------------------------------------------
# Rank functions (run through helpers.ranks): the lecture's forward, and a full training step.
# `blocks` (e.g. [[0, 1], [2, 3]]) splits the world into independent tensor-parallel groups.
# ----------------------------------------------------------------------------------------

def _group(blocks: list[list[int]] | None):
    return split_groups(blocks) if blocks else None


def lecture_forward(rank: int, world_size: int, config: MLPConfig = LECTURE,
                    blocks: list[list[int]] | None = None) -> LectureForward:
    """The lecture's forward, as written there: slice, GELU, all-gather a list, concatenate."""
    group = _group(blocks)
    t, r = group_size(group), group_rank(group)
    device = rank_device()
    x = make_batch(config).to(device)
    local = config.hidden // t
    # Lecture convention: x @ W with W of shape (in, out); rank r owns out-columns r·h/t … .
    params = [m.weight.detach()[r * local:(r + 1) * local].T.to(device)
              for m in make_mlp(config) if isinstance(m, nn.Linear)]
    with counting() as log:
        for w in params:
            x = F.gelu(x @ w)                                   # batch × h/t
            activations = [torch.empty_like(x) for _ in range(t)]
            start = time.perf_counter()
            dist.all_gather(activations, x, group=group)        # counted as one all-gather
            record("all_gather", "forward", torch.cat(activations, dim=0), start, group)
            x = torch.cat(activations, dim=1)                   # batch × h
    return LectureForward(x.cpu(), summarize(log), (config.batch, local), tuple(params[0].shape))


def _add_biases(reference: nn.Sequential, config: MLPConfig) -> None:
    """Give every Linear of make_mlp's model a bias (the bias tests; seeded from config.seed)."""
    gen = torch.Generator().manual_seed(config.seed + 100)
    for i, m in enumerate(list(reference)):
        if isinstance(m, nn.Linear):
            new = nn.Linear(m.in_features, m.out_features, bias=True)
            with torch.no_grad():
                new.weight.copy_(m.weight)
                new.bias.copy_(torch.randn(m.out_features, generator=gen) * 0.1)
            reference[i] = new


def _build(layout: str, config: MLPConfig, bias: bool, group=None):
    """This rank's model shard and input (requiring a gradient)."""
    device = rank_device()
    reference = make_mlp(config)
    if bias:
        _add_biases(reference, config)
    model = shard_mlp(reference, layout, group).to(device)
    x = make_batch(config).to(device)
    if layout == "sequence":  # each rank starts (and ends) with its own tokens only
        x = my_slice(x, 0, group)
    return model, x.requires_grad_(True)


def _grads_by_param(model: nn.Sequential) -> dict[Param, torch.Tensor]:
    """Each shard's gradient, named after the reference parameter it is a slice of."""
    linears = [m for m in model if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))]
    return {Param(i, name): p.grad for i, m in enumerate(linears) for name, p in m.named_parameters()}


def train_step(rank: int, world_size: int, layout: str = "megatron", config: MLPConfig = LECTURE,
               bias: bool = False, blocks: list[list[int]] | None = None) -> StepResult:
    """One forward + backward of the sharded MLP; returns output, loss, grads and counts.

    The loss is the lecture's (`mlp_loss`); a sequence-parallel rank holds batch/t rows of the
    output and passes the full output's numel, so the ranks' losses add up to the whole.
    The input requires a gradient too (as if the MLP sat inside a deeper network), so every
    conjugate collective runs and the input gradient can be checked.
    """
    model, x = _build(layout, config, bias, _group(blocks))
    with counting() as log, saved_activations(model) as saved:
        y = model(x)
    forward_log = list(log)
    with counting() as log:
        loss = mlp_loss(y, numel=config.batch * config.hidden)
        loss.backward()
    return StepResult(y, loss, x.grad, _grads_by_param(model), summarize(forward_log + log),
                      sum(saved.values())).cpu()


def run_step(ranks, t: int, layout: str = "megatron", config: MLPConfig = LECTURE,
             bias: bool = False, implementation: str = "helpers") -> list[StepResult]:
    """Check the configuration in the parent, then run one training step on t live ranks.

    implementation: "helpers" (this module's layers) or "torch" (parallelize_module).
    """
    check_config(t, config, layout)
    check_choice("implementation", implementation, ("helpers", "torch"))
    if implementation == "torch" and bias:
        raise ValueError("bias must be False for implementation='torch' (only wired for 'helpers')")
    ranks.resize(t)
    if implementation == "torch":
        return ranks.run(torch_tp_step, layout, config)
    return ranks.run(train_step, layout, config, bias=bias)


def run_lecture_forward(ranks, t: int = 4, config: MLPConfig = LECTURE) -> list[LectureForward]:
    check_config(t, config, "lecture")
    ranks.resize(t)
    return ranks.run(lecture_forward, config)


def _counted_step(model: nn.Module, x: torch.Tensor, config: MLPConfig, logs: list):
    """One forward + backward, its collectives' log appended to `logs` (one list per call)."""
    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with counting() as log:
            mlp_loss(model(x), numel=config.batch * config.hidden).backward()
        logs.append(log)
    return step


def _sync_for(x: torch.Tensor):
    """What a clock read waits for: every rank done (and, on a GPU, its queued kernels)."""
    return (lambda: (torch.cuda.synchronize(), dist.barrier())) if x.is_cuda else dist.barrier


def _timed(what: str, times: list[float], logs: list) -> TimedSteps:
    timed = [summarize(log) for log in logs]
    return TimedSteps(Measurement(what, tuple(times)), timed[-1],
                      tuple(s.seconds / dt for s, dt in zip(timed, times)))


def timed_steps(rank: int, world_size: int, layout: str = "megatron", config: MLPConfig = LECTURE,
                repeat: int = 10, warmup: int = 2, threads: int | None = None) -> TimedSteps:
    """Time forward + backward steps (barrier before each clock read, so a step ends when
    every rank is done); count the collectives and the seconds spent inside them.
    `threads` overrides this rank's intra-op threads for the timing (restored afterwards)."""
    with intra_op_threads(threads):
        model, x = _build(layout, config, bias=False)
        logs: list = []
        m = measure(_counted_step(model, x, config, logs), f"{layout} t={world_size} step",
                    repeat=repeat, warmup=warmup, sync=_sync_for(x))
    return _timed(m.what, list(m.times_s), logs[warmup:])


def time_degrees(rank: int, world_size: int, config: MLPConfig = LECTURE, repeat: int = 8,
                 warmup: int = 2, threads: int | None = 1) -> dict[int, TimedSteps]:
    """Megatron steps at t = 1 and t = world_size on the same ranks, one step of each in turn,
    the order swapping every round (as `helpers.labs.dp.time_interleaved` does), so that load
    which comes and goes slows both alike. t = 1 is the unsharded MLP on rank 0 while the other
    ranks wait at the barrier that ends every step; `threads` intra-op threads per rank (1: a
    rank is one device with one core). {t: TimedSteps}, rank 0's the one to read."""
    with intra_op_threads(threads):
        model, x = _build("megatron", config, bias=False)
        logs: dict[int, list] = {1: [], world_size: []}
        steps = {world_size: _counted_step(model, x, config, logs[world_size]),
                 1: lambda: logs[1].append([])}  # the ranks that wait: no step, no collective
        if rank == 0:
            whole = make_mlp(config).to(x.device)
            steps[1] = _counted_step(whole, make_batch(config).to(x.device).requires_grad_(True),
                                     config, logs[1])
        sync, times = _sync_for(x), {t: [] for t in steps}
        for round_ in range(warmup + repeat):
            for t in (sorted(steps) if round_ % 2 else sorted(steps, reverse=True)):
                sync()
                start = time.perf_counter()
                steps[t]()
                sync()
                if round_ >= warmup:
                    times[t].append(time.perf_counter() - start)
    return {t: _timed(f"megatron t={t} step", times[t], logs[t][warmup:]) for t in steps}


def compare_degrees(ranks, t: int = 2, config: MLPConfig = LECTURE, repeat: int = 8,
                    warmup: int = 2, threads: int | None = 1) -> dict[int, TimedSteps]:
    """Check in the parent, then `time_degrees` on t live ranks: {1: ..., t: ...} (rank 0's)."""
    check_config(t, config, "megatron")
    check_int("t (a tensor-parallel group to time against t = 1)", t, 2)
    check_int("repeat", repeat, 1)
    check_int("warmup", warmup, 0)
    ranks.resize(t)
    return ranks.run(time_degrees, config, repeat, warmup, threads)[0]


FIT_SIZES = (16 * 1024, 128 * 1024, 512 * 1024, 2 * 1024**2)  # around one activation, 512 KiB


def fit_all_reduce_here(ranks, world_size: int, sizes=FIT_SIZES, iters: int = 10,
                        rounds: int = 3) -> SavedFit:
    """Notebook 02's all-reduce fit, small: a sweep of `sizes` bytes on `world_size` live ranks
    (their threads as `helpers.ranks` sets them), α and β fitted to each size's 10th percentile
    (`helpers.cost.bench.fit_sweep`). Under a second on 2 ranks; what this notebook prices
    this machine's link with when notebook 02 has not saved its fit, or in another regime."""
    from helpers.cost.bench import fit_sweep
    from helpers.labs.bench import run_sweep
    from helpers.ranks import cpu_cores
    records = run_sweep(ranks, ("all_reduce",), sizes, (world_size,), iters=iters, warmup=2,
                        rounds=rounds, progress=False)
    cores = None if ranks.backend == "nccl" else round(cpu_cores() / world_size, 3)
    return SavedFit(ranks.backend, world_size, cores, fit_sweep(records)["all_reduce"],
                    source="this notebook")


def reference_step(config: MLPConfig = LECTURE, bias: bool = False) -> StepResult:
    """The same step on one process, unsharded: the ground truth for every layout."""
    reference = make_mlp(config)
    if bias:
        _add_biases(reference, config)
    x = make_batch(config).requires_grad_(True)
    with saved_activations(reference) as saved:
        y = reference(x)
    loss = mlp_loss(y)
    loss.backward()
    return StepResult(y.detach(), loss.detach(), x.grad, _grads_by_param(reference),
                      activation_bytes=sum(saved.values()))


def assemble(results: list[StepResult], layout: str) -> StepResult:
    """Put one group's pieces back together (in group-rank order): full output, loss, input
    grad and parameter grads."""
    tokens_sharded = layout == "sequence"
    first = results[0]

    def whole(get):
        return torch.cat([get(r) for r in results]) if tokens_sharded else get(first)

    grads = {}
    for param, grad in first.grads.items():
        column = kind_of(layout, param.layer) == "column"
        if param.name == "weight":  # column: rows of the weight; row: its columns
            grads[param] = torch.cat([r.grads[param] for r in results], dim=0 if column else 1)
        elif column:
            grads[param] = torch.cat([r.grads[param] for r in results])
        else:
            grads[param] = grad  # a row-parallel bias is replicated
    loss = sum(r.loss for r in results) if tokens_sharded else first.loss
    return StepResult(whole(lambda r: r.output), loss, whole(lambda r: r.input_grad), grads)


def replicas_agree(results: list[StepResult], layout: str) -> bool:
    """Whatever is replicated must be identical on every rank, bit for bit: the output and input
    gradient (lecture, megatron) and the gradient of a row-parallel bias (all layouts)."""
    first, others = results[0], results[1:]
    replicated = [p for p in first.grads if p.name == "bias" and kind_of(layout, p.layer) == "row"]
    same = all(torch.equal(r.grads[p], first.grads[p]) for r in others for p in replicated)
    if layout != "sequence":
        same = same and all(torch.equal(r.output, first.output) and
                            torch.equal(r.input_grad, first.input_grad) for r in others)
    return same


# assert_close's float32 defaults hold on the CPU; GPU matmuls split and sum in other orders.
TOLERANCES = {"gloo": {}, "nccl": dict(rtol=1e-4, atol=1e-5)}


def compare(sharded: StepResult, reference: StepResult, **tolerances) -> dict[str, float]:
    """assert_close every tensor; return the max |difference| of each, for the notebook to show."""
    pairs = [("output", sharded.output, reference.output),
             ("loss", sharded.loss, reference.loss),
             ("input grad", sharded.input_grad, reference.input_grad)]
    pairs += [(f"grad {p}", sharded.grads[p], reference.grads[p]) for p in reference.grads]
    diffs = {}
    for name, a, b in pairs:
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}", **tolerances)
        diffs[name] = (a - b).abs().max().item()
    return diffs


# ----------------------------------------------------------------------------------------
# The same layouts with PyTorch's own tensor parallelism (DTensor), for comparison.
# ----------------------------------------------------------------------------------------

def torch_tp_plan(layout: str, layers: int) -> dict:
    """parallelize_module plan for the reference Sequential (Linear at even indices)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(layers):
        name = str(2 * i)
        if layout == "lecture":
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        elif kind_of(layout, i) == "column":
            plan[name] = (ColwiseParallel(input_layouts=Shard(0)) if layout == "sequence"
                          else ColwiseParallel())
        else:
            plan[name] = (RowwiseParallel(output_layouts=Shard(0)) if layout == "sequence"
                          else RowwiseParallel())
    return plan


def torch_tp_step(rank: int, world_size: int, layout: str = "megatron",
                  config: MLPConfig = LECTURE) -> StepResult:
    """train_step's twin built with torch.distributed.tensor.parallel.parallelize_module
    (over the whole world: t = world_size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    device = rank_device()
    model = make_mlp(config).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    parallelize_module(model, mesh, torch_tp_plan(layout, config.layers))
    x = make_batch(config).to(device)
    if layout == "sequence":
        x = my_slice(x, 0)
    x.requires_grad_(True)
    with CommDebugMode() as comm:
        y = model(x)
        loss = mlp_loss(y, numel=config.batch * config.hidden)
        loss.backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    grads = {Param(i, "weight"): _finished(model[2 * i].weight.grad.to_local())
             for i in range(config.layers)}
    return StepResult(_finished(y.detach()), loss.detach(), _finished(x.grad), grads,
                      collectives=counts).cpu()


def _finished(tensor: torch.Tensor) -> torch.Tensor:
    """DTensor hands back AsyncCollectiveTensors: wait for the collective before reading one
    (copying its memory without waiting reads a buffer the collective has not filled yet)."""
    return tensor.wait() if hasattr(tensor, "wait") else tensor


# ----------------------------------------------------------------------------------------
# Tables for the notebook: counted vs formula, per layout.
# ----------------------------------------------------------------------------------------

def layout_table(measured: dict[str, StepResult], t: int, config: MLPConfig = LECTURE,
                 bytes_per_element: int = 4) -> str:
    """One row per layout: collectives per layer, bytes per step and activations per rank,
    each counted on rank 0 of a real step (`measured[layout]` = train_step's result) next to
    its formula."""
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    layers = config.layers
    head = (f"{'layout':<9} {'collectives / layer':<40} {'bytes / step / rank':>20} "
            f"{'formula':>10} {'activations / rank':>19} {'formula':>10}")
    lines = [head, "-" * len(head)]
    for layout, result in measured.items():
        calls = formula_collectives(layout, layers)
        per_pass = [" + ".join(f"{c[i] / layers:g} {short[op]}" for op, c in calls.items() if c[i])
                    for i in (0, 1)]
        per_layer = f"fwd {per_pass[0]}, bwd {per_pass[1]}"
        lines.append(
            f"{layout:<9} {per_layer:<40} {result.comm.ring_bytes:>20,} "
            f"{formula_bytes(layout, t, config, bytes_per_element):>10,} "
            f"{result.activation_bytes:>19,} "
            f"{formula_activation_bytes(layout, t, config, bytes_per_element):>10,}")
    lines.append("AR all-reduce, AG all-gather, RS reduce-scatter; bytes sent per rank (ring), "
                 "counted on rank 0 next to the formula")
    return "\n".join(lines)


def collectives_along(rank: int, world_size: int, dim: int, shape: tuple = (2, 8, 3),
                      blocks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """reduce_scatter then all_gather of a known tensor along any dim (gloo scatters dim 0 only:
    the wrappers move `dim` to the front). Input on (global) rank r: arange + r."""
    group = _group(blocks)
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + rank
    scattered = reduce_scatter(x, dim, group=group)
    return {"scattered": scattered, "gathered": all_gather(scattered, dim, group=group)}


def measure_cpu_flops(config: MLPConfig = LECTURE, tokens: int = 512,
                      threads: float | None = None) -> float:
    """fp32 FLOP/s of this process on one layer's matmul (tokens × h by h × h), median of 5,
    threads as notebook 02's ranks had: the compute rate of 'this machine' in helpers.cost.tp.

    `threads` may be a fraction (4 ranks on 2 cores have 0.5 core each); a process runs at
    least one thread, so it is rounded and floored at 1.
    """
    check_int("tokens", tokens)
    with intra_op_threads(max(1, round(threads)) if threads else None):
        a, w = torch.randn(tokens, config.hidden), torch.randn(config.hidden, config.hidden)
        m = measure(lambda: a @ w, "matmul", repeat=5, warmup=2)
    return 2 * tokens * config.hidden**2 / m.median




# ----------------------------------------------------------------------------------------
# 2-D tensor parallelism as notebook 06's model has it: TP_model × TP_ff ranks, each holding a
# block of both matrices of every feed-forward layer (`helpers.parallel.tp2d`).
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupCount:
    """The all-reduces one rank issued on one of its two groups in a step."""
    group: str                 # "TP_model" or "TP_ff"
    calls: tuple[int, int]     # (forward, backward)
    payload_bytes: int         # elements × item size handed to torch.distributed
    ring_bytes: int            # what the ring algorithm sends of them: 2(p−1)/p × payload


@dataclass(frozen=True)
class Step2D:
    step: StepResult           # output and input gradient: (b, h/TP_model); grads: its blocks
    groups: tuple[GroupCount, ...]

    @property
    def ring_bytes(self) -> int:
        return sum(c.ring_bytes for c in self.groups)

    def by_group(self) -> dict[str, GroupCount]:
        return {c.group: c for c in self.groups}


def make_feed_forwards(config: MLPConfig = LECTURE) -> nn.Sequential:
    """The model's layers: `layers` × FeedForward (h → 4h → GELU → h, no biases), weights
    ~ N(0, 1/fan_in) drawn from `config.seed`, the same in every process."""
    generator = torch.Generator().manual_seed(config.seed)
    shape = TransformerConfig(hidden=config.hidden, heads=1, layers=config.layers)
    layers = [FeedForward(shape) for _ in range(config.layers)]
    with torch.no_grad():
        for mlp in layers:
            for linear in (mlp.up, mlp.down):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator)
                                    / math.sqrt(linear.in_features))
    return nn.Sequential(*layers)


def _group_counts(log) -> tuple[GroupCount, ...]:
    counts: dict[str, list] = {}
    for rec in log:
        entry = counts.setdefault(rec.label, [[0, 0], 0, 0])
        entry[0][rec.phase == "backward"] += 1
        entry[1] += rec.nbytes
        entry[2] += rec.ring_bytes
    return tuple(GroupCount(name, tuple(calls), payload, ring)
                 for name, (calls, payload, ring) in counts.items())


def _grads_2d(layers) -> dict[Param, torch.Tensor]:
    return {Param(i, name): getattr(layer, name).grad if isinstance(layer, FeedForward2D)
            else getattr(layer, name).weight.grad
            for i, layer in enumerate(layers) for name in ("up", "down")}


def train_step_2d(rank: int, world_size: int, grid: Grid2D, config: MLPConfig = LECTURE) -> Step2D:
    """One forward + backward of the stack on a TP_model × TP_ff grid; the all-reduces
    counted per group as handed to torch.distributed. The input requires a gradient (as if
    the stack sat inside a deeper network), so the first layer's backward all-reduce runs
    too: 2L all-reduces on each group, as the model counts them."""
    model_group, ff_group = build_groups(grid)
    device = rank_device()
    model = shard_feed_forwards(make_feed_forwards(config), model_group, ff_group).to(device)
    x = my_slice(make_batch(config), 1, model_group).to(device).requires_grad_(True)
    with counting() as log:
        y = model(x)
        # Each rank holds h/TP_model of the output: the TP_model group's losses add up.
        loss = mlp_loss(y, numel=config.batch * config.hidden)
        loss.backward()
    step = StepResult(y, loss, x.grad, _grads_2d(model), summarize(log)).cpu()
    return Step2D(step, _group_counts(log))


def reference_step_2d(config: MLPConfig = LECTURE) -> StepResult:
    """The same step on one process, unsharded."""
    model = make_feed_forwards(config)
    x = make_batch(config).requires_grad_(True)
    y = model(x)
    loss = mlp_loss(y)
    loss.backward()
    return StepResult(y.detach(), loss.detach(), x.grad, _grads_2d(model))


def run_step_2d(ranks, grid: Grid2D, config: MLPConfig = LECTURE) -> list[Step2D]:
    """Check the grid in the parent, then one training step on its ranks."""
    grid.check(config)
    ranks.resize(grid.world_size)
    return ranks.run(train_step_2d, grid, config)


def assemble_2d(results: list[Step2D], grid: Grid2D) -> StepResult:
    """The whole output, loss, input gradient and weight gradients from the blocks (results in
    rank order: rank = ff_index · tp_model + model_index)."""
    steps = [r.step for r in results]
    at = [[steps[i * grid.tp_model + j] for j in range(grid.tp_model)] for i in range(grid.tp_ff)]
    row = at[0]  # one TP_ff index: between them the ranks hold every h slice

    def blocks(param, rows_by_ff):
        grid_of = at if rows_by_ff else list(zip(*at))
        return torch.cat([torch.cat([s.grads[param] for s in line], dim=1) for line in grid_of])

    grads = {p: blocks(p, p.name == "up") for p in steps[0].grads}
    return StepResult(torch.cat([s.output for s in row], dim=1), sum(s.loss for s in row),
                      torch.cat([s.input_grad for s in row], dim=1), grads)


def replicas_agree_2d(results: list[Step2D], grid: Grid2D) -> bool:
    """The ranks of a TP_ff group hold the same h slice of the output and the input gradient,
    bit for bit (the all-reduce hands every member the same sum)."""
    steps = [r.step for r in results]
    return all(torch.equal(steps[r].output, steps[group[0]].output)
               and torch.equal(steps[r].input_grad, steps[group[0]].input_grad)
               for group in grid.ff_groups() for r in group)


@dataclass(frozen=True)
class OnTheWire:
    """One 2-D step on emulated nodes: what crossed the link against the model."""
    placement: tuple[int, ...]
    tp_model: tuple[int, int]   # (inside a node, across nodes)
    tp_ff: tuple[int, int]
    wire_bytes: int             # counted by the link's shapers, headers included, less TCP's resent segments
    formula_bytes: int          # the model's bytes on the outer level, summed over the ranks
    results: list[Step2D]

    @property
    def overhead(self) -> float:
        return self.wire_bytes / self.formula_bytes - 1


def run_on_nodes_2d(ranks, grid: Grid2D, placement: tuple[int, ...],
                    config: MLPConfig = LECTURE) -> OnTheWire:
    """Place rank r on node placement[r] (`LiveRanks(..., nodes=2)`), run one step and read
    the bytes that crossed between nodes; the model's are its per-rank bytes on the outer level
    (`model_bytes_2d`) times the ranks: every byte a rank sends there crosses the link once."""
    tp_model, tp_ff = split_on_nodes(grid, placement)
    grid.check(config)
    ranks.resize(grid.world_size)
    ranks.place(placement)
    ranks.run(build_groups_only, grid)  # start the ranks on their nodes before counting
    before = ranks.wire_bytes(resent=False)
    results = ranks.run(train_step_2d, grid, config)
    crossed = ranks.wire_bytes(resent=False) - before
    _, outer = model_bytes_2d(config, tp_model, tp_ff)
    return OnTheWire(tuple(placement), tp_model, tp_ff, crossed, grid.world_size * outer, results)


def build_groups_only(rank: int, world_size: int, grid: Grid2D) -> None:
    build_groups(grid)


def run_across_nodes_2d(grid: Grid2D, config: MLPConfig = LECTURE, link_bps: float = 1e9,
                        placements=((0, 0, 1, 1), (0, 1, 0, 1))) -> tuple[list[OnTheWire], str | None]:
    """`run_on_nodes_2d` for each placement on two emulated nodes of its own; ([], why) where
    they cannot be made here (not root, no iproute2, not Linux)."""
    from helpers.ranks import LiveRanks  # only here: every rank imports this module, and needs none

    missing = cluster.missing()
    if missing:
        return [], missing
    with LiveRanks(grid.world_size, nodes=2, link_bps=link_bps) as ranks:
        return [run_on_nodes_2d(ranks, grid, p, config) for p in placements], None
