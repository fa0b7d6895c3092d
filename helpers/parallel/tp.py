"""Tensor parallelism, forward and backward: the blocks of notebook 04 (its runs are
`helpers.labs.tp`, its formulas `helpers.cost.tp`).

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

And one more, notebook 06's model's (the last section): 2-D tensor parallelism of feed-forward
layers (h → h_ff = 4h → h) over TP_model × TP_ff ranks, built from the same f and g.

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
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.cost.tp import Grid2D, kind_of
from helpers.models import FeedForward
from helpers.parallel import trace
from helpers.parallel.groups import (all_gather_into, group_rank, group_size, reduce_scatter_into,
                                     split_groups)

# ----------------------------------------------------------------------------------------
# Counting what we hand to torch.distributed.
# ----------------------------------------------------------------------------------------

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


def counting():
    """`with counting() as log:` → the `trace.Comm`s of this module's collectives, on this rank."""
    return trace.recording("tp")


def record(op: str, phase: str, tensor: torch.Tensor, start: float, group=None,
           label: str = "") -> None:
    """Log one collective this module just issued on `tensor` (its full buffer n); `label`
    names the group where a rank is in several (2-D TP), the tensor's shape otherwise."""
    if trace.recording_for("tp"):
        if tensor.is_cuda:  # NCCL returns before the data moved: wait, so time means something
            torch.cuda.synchronize(tensor.device)
        seconds = time.perf_counter() - start
        trace.record("tp", trace.Comm("tp", op, tensor.numel() * tensor.element_size(), phase,
                                      group_size(group), start, seconds,
                                      label or str(tuple(tensor.shape))))


def summarize(log: list[trace.Comm]) -> CommSummary:
    totals: dict[tuple[str, str], list[int]] = {}
    for rec in log:
        entry = totals.setdefault((rec.op, rec.phase), [0, 0, 0])
        entry[0] += 1
        entry[1] += rec.nbytes
        entry[2] += rec.ring_bytes
    return CommSummary(tuple(CommCount(op, phase, *entry) for (op, phase), entry in totals.items()),
                       sum(r.seconds for r in log))


# The three collectives, each a thin counted wrapper. t = 1 moves nothing, so skip the call.

def all_reduce(x: torch.Tensor, phase: str = "forward", group=None, label: str = "") -> torch.Tensor:
    """Sum x over the group's ranks."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    start = time.perf_counter()
    dist.all_reduce(x, group=group)
    record("all_reduce", phase, x, start, group, label)
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
    record("all_gather", phase, out, start, group)
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
    record("reduce_scatter", phase, x0, start, group)
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
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each rank used the full x against its own weight slice: the gradients are partial sums.
        return all_reduce(grad.clone(), "backward", ctx.group, ctx.label), None, None


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaves a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group, label):
        return all_reduce(x.clone(), "forward", group, label)

    @staticmethod
    def backward(ctx, grad):
        # the output is replicated: every rank already has the whole gradient
        return grad, None, None


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


def f(x, group=None, label=""): return _F.apply(x, group, label)
def g(x, group=None, label=""): return _G.apply(x, group, label)
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
# 2-D tensor parallelism, as notebook 06's model has it (docs/cost_model.md §4).
# ----------------------------------------------------------------------------------------
#
# Notebook 04's Megatron pair cuts each matrix one way over t ranks: the first by its output
# features, the second by its input features, and the full (b·s × h) activation is all-reduced
# once per pair. Erdil and Schneider-Joseph's model (docs/cost_model.md §4) cuts every matrix
# both ways over TP = TP_model · TP_ff ranks: the rank with TP_ff index i and TP_model index j
# holds the (h_ff/TP_ff) × (h/TP_model) block (i, j) of `up` and block (j, i) of `down`. Activations between layers are cut
# along h over TP_model and repeated over TP_ff. One layer, on a rank:
#
#     x          (tokens, h/TP_model)      the same on every rank of its TP_ff group
#     x · upᵀ    (tokens, h_ff/TP_ff)      a partial sum: its h/TP_model terms of each dot product
#     all-reduce over TP_model             h_ff/TP_ff words per token
#     GELU, · downᵀ  (tokens, h/TP_model)  a partial sum: its h_ff/TP_ff terms
#     all-reduce over TP_ff                h/TP_model words per token
#
# Backward mirrors it: both input gradients are partial sums over the group that summed the
# forward's, so each layer all-reduces the same two sizes again. These are the f and g above,
# each on the group it belongs to. Nothing else moves: every weight
# gradient is local.
#
# Why cut two ways: per token and pass, a layer all-reduces h_ff/TP_ff + h/TP_model words, where
# Megatron's pair all-reduces h whatever t is. With h_ff = 4h that is more at small degrees
# (2 × 2: 2.5h) and less once TP is in the tens (16 × 32: 0.19h), while each rank's share of the
# FLOP falls as 1/TP in both. Bytes per rank that fall as 1/√TP are what lets notebook 06's
# model send TP across nodes at scale.

MODEL, FF = "TP_model", "TP_ff"  # the groups' names, as the counted collectives carry them


def build_groups(grid: Grid2D) -> tuple:
    """(TP_model group, TP_ff group) of this rank. Call on every rank, in the same order:
    creating a group is a collective over the whole world."""
    return split_groups(grid.model_groups()), split_groups(grid.ff_groups())


def block_of(weight: torch.Tensor, row_group, column_group) -> torch.Tensor:
    """This rank's block of `weight`: rows cut over `row_group`, columns over `column_group`."""
    return my_slice(my_slice(weight.detach(), 0, row_group), 1, column_group)


class FeedForward2D(nn.Module):
    """One `FeedForward` (h → h_ff → GELU → h, no biases) over a TP_model × TP_ff grid.

    `up` (h_ff, h) keeps rows by TP_ff and columns by TP_model; `down` (h, h_ff) the reverse,
    so the h_ff slice `up` produces is the one `down` consumes and the h slice `down`
    produces is the one the next layer's `up` consumes."""

    def __init__(self, mlp: FeedForward, model_group, ff_group):
        super().__init__()
        self.model_group, self.ff_group = model_group, ff_group
        self.up = nn.Parameter(block_of(mlp.up.weight, ff_group, model_group))
        self.down = nn.Parameter(block_of(mlp.down.weight, model_group, ff_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is repeated over TP_ff: its gradient's partial sums are summed there (f).
        x = f(x, self.ff_group, FF)
        hidden = g(F.linear(x, self.up), self.model_group, MODEL)
        # GELU's output is repeated over TP_model: its gradient is summed there (f).
        hidden = f(F.gelu(hidden), self.model_group, MODEL)
        return g(F.linear(hidden, self.down), self.ff_group, FF)


def shard_feed_forwards(reference: nn.Sequential, model_group, ff_group) -> nn.Sequential:
    """This rank's piece of a stack of `FeedForward` layers."""
    return nn.Sequential(*(FeedForward2D(mlp, model_group, ff_group) for mlp in reference))
