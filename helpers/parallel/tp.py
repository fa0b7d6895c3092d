"""Tensor parallelism, forward and backward: the code behind notebook 04.

Every rank holds every layer, but only a slice of each weight; activations move instead.
Three layouts of the lecture's deep MLP (`helpers.models`: batch b, hidden h, L layers of h×h,
GELU after each):

* "lecture"  — each layer is cut by output columns; after every layer the slices are
  all-gathered so every rank holds the full activation again (the lecture's forward).
* "megatron" — layers go in pairs: column-parallel then row-parallel. The first needs the
  full input and produces a column slice; the second takes that slice and produces a partial
  sum of the full output. One all-reduce per pair forward (g), one backward (f).
* "sequence" — Megatron's pairs, but between pairs each rank keeps only its own tokens: the
  all-reduce becomes reduce-scatter (forward) / all-gather (backward) after the pair, and an
  all-gather / reduce-scatter before it.

Conventions used throughout:
* Every building block takes `group=None` (the whole world): t = `group_size(group)` ranks
  share each layer and `group_rank(group)` says which slice is mine.
* Weights are `nn.Linear` weights, shape (out, in); rank r of t holds rows r·h/t … (r+1)·h/t of
  a column-parallel weight and the same columns of a row-parallel one.
* Activations are (tokens, h) with tokens = b·s; the lecture's MLP has s = 1. Sequence
  parallelism cuts the token dimension (dim 0).
* Bytes are counted per rank as the ring algorithm sends them: `helpers.cost.alpha_beta`'s
  bus factor of the op times the buffer handed to torch.distributed.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.checks import check_choice, check_divisible, check_int
from helpers.cost.alpha_beta import OPS
from helpers.cost.tp import LAYOUTS, check_degree, formula_collectives
from helpers.configs import LECTURE, MLPConfig
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.parallel.groups import (CallLog, all_gather_into, group_rank, group_size,
                                     rank_device, reduce_scatter_into, split_groups)
from helpers.timing import Measurement, measure


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


# ----------------------------------------------------------------------------------------
# Counting what we hand to torch.distributed.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommRecord:
    op: str
    phase: str          # "forward" or "backward"
    shape: tuple
    payload_bytes: int  # the full buffer n (AR: the tensor; AG: the output; RS: the input)
    t: int              # ranks in the group
    seconds: float
    start: float = 0.0  # time.perf_counter() when the call began (timelines place it)

    @property
    def ring_bytes(self) -> int:
        """Bytes this rank sends under the ring algorithm: alpha_beta's bus factor × n."""
        return round(OPS[self.op].bus_factor(self.t) * self.payload_bytes)


@dataclass(frozen=True)
class CommCount:
    """The collectives of one kind in one pass, totalled."""
    op: str
    phase: str
    calls: int
    payload_bytes: int
    ring_bytes: int


@dataclass(frozen=True)
class CommSummary:
    """Picklable totals of a log: what a rank sends back to the notebook."""
    counts: tuple[CommCount, ...]   # one per (op, phase), in the order first issued
    seconds: float                  # inside the collective calls

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.counts)

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.counts)

    @property
    def ring_bytes(self) -> int:
        return sum(c.ring_bytes for c in self.counts)

    def calls_by_op(self) -> dict[str, tuple[int, int]]:
        """op → (calls forward, calls backward), the shape of `formula_collectives`."""
        out: dict[str, list[int]] = {}
        for c in self.counts:
            out.setdefault(c.op, [0, 0])[c.phase == "backward"] += c.calls
        return {op: tuple(calls) for op, calls in out.items()}


_LOG = CallLog()          # every collective this module issues, while someone counts
counting = _LOG.counting  # `with counting() as log:` → a list of CommRecord, on this rank


def _record(op: str, phase: str, tensor: torch.Tensor, start: float, group=None) -> None:
    if _LOG.on:
        if tensor.is_cuda:  # NCCL returns before the data moved: wait, so time means something
            torch.cuda.synchronize(tensor.device)
        _LOG.add(CommRecord(op, phase, tuple(tensor.shape), tensor.numel() * tensor.element_size(),
                               group_size(group), time.perf_counter() - start, start))


def summarize(log: list[CommRecord]) -> CommSummary:
    totals: dict[tuple[str, str], list[int]] = {}
    for rec in log:
        entry = totals.setdefault((rec.op, rec.phase), [0, 0, 0])
        entry[0] += 1
        entry[1] += rec.payload_bytes
        entry[2] += rec.ring_bytes
    return CommSummary(tuple(CommCount(op, phase, *entry) for (op, phase), entry in totals.items()),
                       sum(r.seconds for r in log))


# The three collectives, each a thin counted wrapper. t = 1 moves nothing, so skip the call.

def all_reduce(x: torch.Tensor, phase: str = "forward", group=None) -> torch.Tensor:
    """Sum x over the group's ranks."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    start = time.perf_counter()
    dist.all_reduce(x, group=group)
    _record("all_reduce", phase, x, start, group)
    return x


def all_gather(x: torch.Tensor, dim: int, phase: str = "forward", group=None) -> torch.Tensor:
    """Concatenate every group rank's x along `dim`, in group-rank order."""
    t = group_size(group)
    if t == 1:
        return x
    # all_gather_into stacks along dim 0; gather there and move the pieces after.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((t * x0.shape[0],) + tuple(x0.shape[1:]))
    start = time.perf_counter()
    all_gather_into(out, x0, group=group)
    _record("all_gather", phase, out, start, group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, phase: str = "forward", group=None) -> torch.Tensor:
    """Sum x over the group's ranks and keep this rank's 1/t slice along `dim`."""
    t = group_size(group)
    if t == 1:
        return x
    # gloo (and the single-tensor API in general) scatters the flat buffer along dim 0:
    # bring the scattered dimension to the front and make it contiguous first.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // t,) + tuple(x0.shape[1:]))
    start = time.perf_counter()
    reduce_scatter_into(out, x0, group=group)
    _record("reduce_scatter", phase, x0, start, group)
    return out.movedim(0, dim).contiguous()


def my_slice(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's 1/t of x along `dim` (t = the group's size, slice = its group rank)."""
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


# ----------------------------------------------------------------------------------------
# Conjugate operators: each is an identity on one pass and a collective on the other.
# `group` rides along as a non-tensor argument (its gradient is None).
# ----------------------------------------------------------------------------------------

class _F(torch.autograd.Function):
    """f: identity forward, all-reduce backward (enters a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each rank used the full x against its own weight slice: the gradients are partial sums.
        return all_reduce(grad.clone(), phase="backward", group=ctx.group), None


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaves a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), phase="forward", group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # the output is replicated: every rank already has the whole gradient


class _GatherLastDim(torch.autograd.Function):
    """All-gather column slices forward; keep this rank's slice backward (the lecture's layout)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, dim=-1, phase="forward", group=group)

    @staticmethod
    def backward(ctx, grad):
        return my_slice(grad, dim=-1, group=ctx.group), None


class _Tokens(torch.autograd.Function):
    """Sequence parallel, both conjugates: with `gather`, all-gather token shards forward and
    reduce-scatter backward (every rank's full-sequence gradient is a partial sum: its weight
    slice only); without, reduce-scatter partial sums to token shards forward, all-gather
    backward."""

    @staticmethod
    def forward(ctx, x, group, gather):
        ctx.group, ctx.gather = group, gather
        return (all_gather if gather else reduce_scatter)(x, dim=0, phase="forward", group=group)

    @staticmethod
    def backward(ctx, grad):
        collective = reduce_scatter if ctx.gather else all_gather
        return collective(grad, dim=0, phase="backward", group=ctx.group), None, None


def f(x, group=None): return _F.apply(x, group)
def g(x, group=None): return _G.apply(x, group)
def gather_columns(x, group=None): return _GatherLastDim.apply(x, group)
def gather_tokens(x, group=None): return _Tokens.apply(x, group, True)
def scatter_tokens(x, group=None): return _Tokens.apply(x, group, False)


# ----------------------------------------------------------------------------------------
# Parallel linear layers, each built from the nn.Linear it replaces.
# ----------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Y_r = X · A_rᵀ: this rank's rows of the weight, i.e. its slice of the output columns.

    Needs the full input X. Entering through f (or, sequence-parallel, through an all-gather of
    token shards) makes the input gradient whole again in the backward pass.
    """

    def __init__(self, linear: nn.Linear, gather_output: bool = False,
                 sequence_parallel: bool = False, group=None):
        super().__init__()
        self.gather_output, self.sequence_parallel, self.group = gather_output, sequence_parallel, group
        self.weight = nn.Parameter(my_slice(linear.weight.detach(), dim=0, group=group))
        self.bias = (nn.Parameter(my_slice(linear.bias.detach(), dim=0, group=group))
                     if linear.bias is not None else None)

    def forward(self, x):
        x = gather_tokens(x, self.group) if self.sequence_parallel else f(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_columns(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = Σ_r Y_r · B_rᵀ: this rank's columns of the weight, applied to its input slice.

    Each rank's product is a partial sum of the full output; g all-reduces it (or,
    sequence-parallel, a reduce-scatter leaves each rank the full sum for its own tokens).
    """

    def __init__(self, linear: nn.Linear, sequence_parallel: bool = False, group=None):
        super().__init__()
        self.sequence_parallel, self.group = sequence_parallel, group
        self.weight = nn.Parameter(my_slice(linear.weight.detach(), dim=1, group=group))
        # The bias is added once, after the sum, so every rank keeps all of it.
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, y):
        z = F.linear(y, self.weight)
        z = scatter_tokens(z, self.group) if self.sequence_parallel else g(z, self.group)
        if self.bias is not None:
            # Sequence-parallel: each rank saw only its tokens, so the bias gradient is partial;
            # f all-reduces it in the backward pass.
            z = z + (f(self.bias, self.group) if self.sequence_parallel else self.bias)
        return z


class GatherColumns(nn.Module):
    """The lecture's all-gather + concatenate, as a layer (backward: keep my slice)."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, y):
        return gather_columns(y, self.group)


def kind_of(layout: str, layer: int) -> str:
    """'column' or 'row': how `layout` cuts layer `layer` (0 … L−1)."""
    return "column" if layout == "lecture" or layer % 2 == 0 else "row"


def shard_mlp(reference: nn.Sequential, layout: str, group=None) -> nn.Sequential:
    """This rank's piece of the reference MLP in the given layout (call inside a process group)."""
    linears = [m for m in reference if isinstance(m, nn.Linear)]
    modules: list[nn.Module] = []
    sequence = layout == "sequence"
    for i, linear in enumerate(linears):
        if layout == "lecture":  # slice, GELU on the slice, then gather (the lecture's order)
            modules += [ColumnParallelLinear(linear, group=group), nn.GELU(), GatherColumns(group)]
            continue
        if kind_of(layout, i) == "column":
            modules.append(ColumnParallelLinear(linear, sequence_parallel=sequence, group=group))
        else:
            modules.append(RowParallelLinear(linear, sequence_parallel=sequence, group=group))
        modules.append(nn.GELU())
    return nn.Sequential(*modules)


# ----------------------------------------------------------------------------------------
# Formulas: what the counter should find, and what each rank keeps for the backward pass.
# (`formula_collectives`, op → calls per pass, lives in helpers.cost.tp with the cost model.)
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
    return sum((forward + backward) * round(OPS[op].bus_factor(t) * n)
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


@contextlib.contextmanager
def saved_activations(model: nn.Module):
    """Count distinct storages autograd saves for backward inside the block, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen


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
            _record("all_gather", "forward", torch.cat(activations, dim=0), start, group)
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


def timed_steps(rank: int, world_size: int, layout: str = "megatron", config: MLPConfig = LECTURE,
                repeat: int = 10, warmup: int = 2, threads: int | None = None) -> TimedSteps:
    """Time forward + backward steps (barrier before each clock read, so a step ends when
    every rank is done); count the collectives and the seconds spent inside them.
    `threads` overrides this rank's intra-op threads for the timing (restored afterwards)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model, x = _build(layout, config, bias=False)
        sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if x.is_cuda else dist.barrier
        logs = []

        def step():
            model.zero_grad(set_to_none=True)
            x.grad = None
            with counting() as log:
                mlp_loss(model(x), numel=config.batch * config.hidden).backward()
            logs.append(log)

        m = measure(step, f"{layout} t={world_size} step", repeat=repeat, warmup=warmup, sync=sync)
    finally:
        torch.set_num_threads(previous)
    timed = [summarize(log) for log in logs[warmup:]]
    return TimedSteps(m, timed[-1], tuple(s.seconds / dt for s, dt in zip(timed, m.times_s)))


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
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(max(1, round(threads)))
    try:
        a, w = torch.randn(tokens, config.hidden), torch.randn(config.hidden, config.hidden)
        m = measure(lambda: a @ w, "matmul", repeat=5, warmup=2)
    finally:
        torch.set_num_threads(previous)
    return 2 * tokens * config.hidden**2 / m.median


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
