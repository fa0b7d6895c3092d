"""Notebook 04's coding exercises: the Megatron MLP (Shoeybi et al., 2019) and the
sequence-parallel MLP (Megatron-SP, Korthikanti et al., 2022), both written from torch.distributed
calls.

The MLP h → 4h → GELU → h is cut as Megatron cuts it: `up` column-parallel (rank r keeps 4h/t
output features), `down` row-parallel (the same 4h/t input features).

* `megatron_mlp` ("reveal": asked before section 3 prints `ColumnParallelLinear.forward` and
  `RowParallelLinear.forward`, which are then ours to compare with): every rank holds the whole
  input, as after f; it multiplies by its shards, GELU between them, and g's one all-reduce adds
  the t partial sums, so every rank returns the whole y.
* `sequence_parallel_mlp` ("variation"): between blocks each of the t ranks holds only its s/t
  rows (tokens) of the activations. The block all-gathers x along the sequence, multiplies by its
  shards, and reduce-scatters the t partial sums along the sequence: one all-gather and one
  reduce-scatter where Megatron's layout all-reduces, the same bytes, and no rank ever holds the
  whole of y. The notebook shows the two layers' forwards through the course's wrappers
  (`gather_tokens`, `scatter_tokens`); the exercise is the whole block from the collectives
  themselves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.exercises.coding import Case, Exercise, Mistake, register

H = 6                 # hidden size h; the MLP's inner size is 4h = 24 (divisible by t = 2, 3, 4)
GATHERS = {"all_gather", "all_gather_single", "all_gather_into_tensor"}
SCATTERS = {"reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"}


def sequence_parallel_mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """This rank's s/t rows of y = GELU(X upᵀ) downᵀ, X all s rows: all-gather the rows of x,
    multiply by this rank's shards, reduce-scatter the partial sums back to rows."""
    t = dist.get_world_size()
    # The column-parallel `up` needs every token: gather the t row blocks, in rank order.
    x_all = x.new_empty((t * x.shape[0], x.shape[1]))
    dist.all_gather_single(x_all, x.contiguous())
    # 4h/t hidden features are this rank's alone: GELU acts on them before `down`.
    partial = F.linear(F.gelu(F.linear(x_all, up)), down)  # (s, h): one term of the sum
    # Sum the t partials and keep this rank's rows: half the bytes of an all-reduce.
    y = x.new_empty(x.shape)
    dist.reduce_scatter_single(y, partial.contiguous())
    return y


def _weights(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole `up` (4h, h) and `down` (h, 4h), as nn.Linear stores them; the same on every
    rank (seeded by the case alone), so the shards fit together."""
    g = torch.Generator().manual_seed(7919 * case.seed + 1)
    up = torch.randn(4 * H, H, generator=g) / H ** 0.5
    down = torch.randn(H, 4 * H, generator=g) / (4 * H) ** 0.5
    return up, down


def _given(rank: int, case: Case, group) -> tuple:
    """Rank r's s/t rows of x, its 4h/t rows of `up` and the same 4h/t columns of `down`."""
    t = case.world
    g = case.generator(rank)
    x = torch.randn(case.size // t, H, generator=g)
    up, down = _weights(case)
    return x, up.chunk(t, dim=0)[rank].clone(), down.chunk(t, dim=1)[rank].clone()


def _x_all(case: Case) -> torch.Tensor:
    return torch.cat([_given(r, case, None)[0] for r in range(case.world)])


def _feedforward(case: Case, x: torch.Tensor) -> torch.Tensor:
    """The course's unsharded layer (helpers.models.FeedForward, h → 4h → GELU → h) with the
    case's whole weights, on x, in one process."""
    from types import SimpleNamespace

    from helpers.models import FeedForward
    mlp = FeedForward(SimpleNamespace(hidden=H))
    up, down = _weights(case)
    with torch.no_grad():
        mlp.up.weight.copy_(up)
        mlp.down.weight.copy_(down)
        return mlp(x)


def _want(case: Case) -> dict:
    """The unsharded layer on all s rows, cut into the ranks' row blocks."""
    return dict(enumerate(_feedforward(case, _x_all(case)).chunk(case.world, dim=0)))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _hint(case: Case, rank: int, got, want, given) -> str | None:
    """Name the usual wrong blocks by recomputing each from every rank's shards."""
    if not isinstance(got, torch.Tensor):
        return None
    t, x_all = case.world, _x_all(case)
    shards = [_given(r, case, None) for r in range(t)]
    rows = slice(rank * (case.size // t), (rank + 1) * (case.size // t))
    wants = _want(case)
    for other in range(t):
        if other != rank and _close(got, wants[other]):
            return (f"these are rank {other}'s rows of y: the rows came back out of order "
                    "(all-gather and reduce-scatter both go in rank order: block r is rank r's)")
    mine = F.linear(F.gelu(F.linear(x_all, shards[rank][1])), shards[rank][2])[rows]
    if _close(got, mine):
        return (f"it is this rank's partial sum alone, from its {4 * H // t} of the {4 * H} hidden "
                "features: the t partial sums must be added up (the reduce-scatter)")
    own_rows = sum(F.linear(F.gelu(F.linear(x, u)), d) for x, u, d in shards)
    if _close(got, own_rows):
        return ("each rank multiplied only its own s/t rows, so the sum adds up different "
                "tokens: all-gather x first, so every shard of `up` sees every token")
    up, down = _weights(case)
    if _close(got, F.gelu(F.linear(F.linear(x_all, up), down))[rows]):
        return "GELU came after `down`: it acts on the hidden features, between the two matmuls"
    if _close(got, F.linear(F.linear(x_all, up), down)[rows]):
        return "there is no GELU in it: GELU acts on the hidden features, between the two matmuls"
    return None


def _comm(case: Case, made_by: list) -> str | None:
    """One all-gather of the rank's rows of x, one reduce-scatter of an (s, h) partial sum."""
    t = case.world
    n = case.size * H * 4  # one activation, s × h float32: what Megatron's g all-reduces
    for rank, made in enumerate(made_by):
        for c in made:
            if c.op == "all_reduce":
                return (f"rank {rank} called all_reduce on {c.nbytes} B and kept its rows: the "
                        f"right numbers, but a ring all-reduce sends 2(t − 1)/t · n = "
                        f"{2 * (t - 1) * n // t} B per rank, where a reduce-scatter sends half, "
                        f"(t − 1)/t · n = {(t - 1) * n // t} B, and leaves each rank its rows: "
                        "sequence parallelism splits Megatron's all-reduce (g) exactly there")
            if c.op not in GATHERS | SCATTERS:
                return (f"rank {rank} called {c.op}: the block needs one all-gather of x and one "
                        "reduce-scatter of the partial sums, nothing else")
        gathers = [c for c in made if c.op in GATHERS]
        scatters = [c for c in made if c.op in SCATTERS]
        if any(c.nbytes != n // t for c in gathers):
            other = next(c for c in gathers if c.nbytes != n // t)
            return (f"rank {rank} all-gathered {other.nbytes} B, but its rows of x are "
                    f"s/t × h × 4 = {n // t} B: the weights? Tensor parallelism leaves every "
                    "weight shard where it is and moves the activations")
        if len(gathers) != 1 or len(scatters) != 1:
            return (f"rank {rank} made {len(gathers)} all-gather(s) and {len(scatters)} "
                    "reduce-scatter(s): the block needs exactly one of each")
        if scatters[0].nbytes != n:
            return (f"rank {rank} reduce-scattered {scatters[0].nbytes} B, the partial sums of y "
                    f"are s × h × 4 = {n} B")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _gather(x):
    x_all = x.new_empty((dist.get_world_size() * x.shape[0], x.shape[1]))
    dist.all_gather_single(x_all, x.contiguous())
    return x_all


def _all_reduce_then_slice(x, up, down):
    partial = F.linear(F.gelu(F.linear(_gather(x), up)), down)
    dist.all_reduce(partial)  # Megatron's g, then throw away all rows but this rank's
    return partial.chunk(dist.get_world_size())[dist.get_rank()]


def _own_rows_only(x, up, down):
    partial = F.linear(F.gelu(F.linear(x, up)), down)  # no gather: only this rank's tokens
    dist.all_reduce(partial)  # a reduce-scatter of s/t rows would not even fit
    return partial


def _rows_reversed(x, up, down):
    t = dist.get_world_size()
    pieces = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(pieces, x)
    partial = F.linear(F.gelu(F.linear(torch.cat(pieces[::-1]), up)), down)
    y = torch.empty_like(x)
    dist.reduce_scatter_single(y, partial.contiguous())
    return y


def _no_reduce_scatter(x, up, down):
    partial = F.linear(F.gelu(F.linear(_gather(x), up)), down)
    return partial.chunk(dist.get_world_size())[dist.get_rank()]  # one term of the sum


def _gathers_the_weights(x, up, down):
    t = dist.get_world_size()
    whole_up = up.new_empty((t * up.shape[0], up.shape[1]))
    dist.all_gather_single(whole_up, up.contiguous())
    columns = down.t().contiguous()  # gather along dim 0, then turn back
    whole_down = columns.new_empty((t * columns.shape[0], columns.shape[1]))
    dist.all_gather_single(whole_down, columns)
    return F.linear(F.gelu(F.linear(x, whole_up)), whole_down.t())


register(Exercise(
    id="sequence_parallel_mlp", notebook="04",
    title="The sequence-parallel MLP: all-gather, two sharded matmuls, reduce-scatter",
    form="variation", solution=sequence_parallel_mlp,
    cases=(Case(world=2, seed=0, size=6), Case(world=3, seed=1, size=6),
           Case(world=4, seed=2, size=8)),
    given=_given, want=_want, comm=_comm, hint=_hint, rtol=1e-4, atol=1e-5,
    mistakes=(
        Mistake("used the collective the lesson replaces", _all_reduce_then_slice,
                "a reduce-scatter sends half"),
        Mistake("skipped a phase", _own_rows_only, "all-gather x first"),
        Mistake("wrong order", _rows_reversed, "out of order"),
        Mistake("computed locally without communicating", _no_reduce_scatter,
                "partial sum alone"),
        Mistake("sent the whole tensor to every rank", _gathers_the_weights,
                "moves the activations"),
    ),
))


# == the Megatron MLP: f, column-parallel `up`, GELU, row-parallel `down`, g =================

def megatron_mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The whole y = GELU(x upᵀ) downᵀ on every rank, x being the same on each (after f): this
    rank's partial sum from its 4h/t hidden features, then g, one all-reduce adding the t."""
    # Column-parallel `up`: 4h/t hidden features, whole on this rank, so GELU acts on them here.
    hidden = F.gelu(F.linear(x, up))
    # Row-parallel `down` on the same 4h/t features: one term of y = Σ_r GELU(x up_rᵀ) down_rᵀ.
    y = F.linear(hidden, down)
    dist.all_reduce(y)  # g: the t terms added (ReduceOp.SUM, the default), in place, on every rank
    return y


def _mlp_given(rank: int, case: Case, group) -> tuple:
    """The whole x (rows × h, the same on every rank, as f leaves it), rank r's 4h/t rows of
    `up` and the same 4h/t columns of `down`."""
    t = case.world
    x = torch.randn(case.size, H, generator=case.generator(999))
    up, down = _weights(case)
    return x, up.chunk(t, dim=0)[rank].clone(), down.chunk(t, dim=1)[rank].clone()


def _mlp_want(case: Case) -> dict:
    """The unsharded FeedForward on x, in one process: the same whole y on every rank."""
    y = _feedforward(case, _mlp_given(0, case, None)[0])
    return {r: y for r in range(case.world)}


def _mlp_hint(case: Case, rank: int, got, want, given) -> str | None:
    """Name the usual wrong blocks by recomputing each from every rank's shards."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    t, x = case.world, given[0]
    shards = [_mlp_given(r, case, None)[1:] for r in range(t)]
    up, down = _weights(case)

    def partial(r, inputs=x):
        return F.linear(F.gelu(F.linear(inputs, shards[r][0])), shards[r][1])
    if _close(got, partial(rank)):
        return (f"it is this rank's partial sum alone, from its {4 * H // t} of the {4 * H} hidden "
                "features: the t partial sums must be added (g's all-reduce, which sums in "
                "place: return the tensor you handed it, not a copy)")
    if _close(got, want / t):
        return (f"it is 1/{t} of the reference: the t partial sums are terms of one sum, to be "
                "added, not averaged (no division, and ReduceOp.SUM, all_reduce's default)")
    if _close(got, want * t):
        return (f"it is {t}× the reference: summed twice? After one all-reduce every rank holds "
                f"the whole y; a second adds the {t} copies")
    if _close(got, F.gelu(F.linear(F.linear(x, up), down))):
        return ("GELU came after the all-reduce, on y: it acts on this rank's hidden features, "
                "between `up` and `down`, before the sum (the GELU of a sum is not the sum of "
                "the GELUs)")
    if _close(got, sum(F.gelu(F.linear(F.linear(x, u), d)) for u, d in shards)):
        return ("GELU came after `down`: it acts on the hidden features, between the two "
                "matmuls, before the sum")
    if _close(got, F.linear(F.linear(x, up), down)):
        return "there is no GELU in it: GELU acts on the hidden features, between the two matmuls"
    hidden = sum(F.gelu(F.linear(x, u)) for u, _ in shards)
    if _close(got, F.linear(hidden, shards[rank][1])):
        return ("the hidden features were all-reduced: this rank's 4h/t of them are its own, "
                "whole, not terms of a sum, and go through its columns of `down`; g adds the "
                "partial sums of y")
    if any(_close(got, guess) for guess in (sum(partial(r, t * x) for r in range(t)),
                                            partial(rank, t * x))):
        return (f"the input was all-reduced, so the layer saw {t}·x: f is the identity in the "
                "forward pass (x is already whole on every rank); the all-reduce is g's, on "
                "the partial sums of y")
    return None


def _mlp_comm(case: Case, made_by: list) -> str | None:
    """Exactly one all-reduce (SUM) of the (rows × h) partial sum, nothing else."""
    t = case.world
    n = case.size * H * 4  # the partial sum of y, rows × h float32: what g all-reduces
    shard = 4 * H // t * H * 4  # one rank's shard of `up` or `down`
    for rank, made in enumerate(made_by):
        ops = {c.op for c in made}
        gathers = [c for c in made if c.op in GATHERS]
        if ops & SCATTERS:
            return (f"rank {rank} called {sorted(ops & SCATTERS)[0]}: a reduce-scatter and an "
                    "all-gather are an all-reduce taken apart (notebook 01), the same bytes in "
                    "two calls; g is one all-reduce, with every rank holding the whole y (the "
                    "sequence-parallel MLP of the exercises at the end keeps the halves apart)")
        if gathers and all(c.nbytes == shard for c in gathers):
            return (f"rank {rank} all-gathered {gathers[0].nbytes} B, a weight shard: the right "
                    "numbers, from the whole weights on every rank, which tensor parallelism is "
                    "there to avoid: each weight shard stays where it is, the activations move")
        if gathers:
            return (f"rank {rank} all-gathered its partial sum and added the {t} pieces itself: "
                    f"the right numbers, but every rank receives the other ranks' whole partial "
                    f"sums, (t − 1) · n = {(t - 1) * n} B, and holds all t, {t * n} B, where g's "
                    f"ring all-reduce sends and receives 2(t − 1)/t · n = {2 * (t - 1) * n // t} B "
                    f"per rank and holds n = {n} B: t/2 times the bytes (equal only at t = 2) "
                    "and t× the memory. g is one all_reduce")
        other = sorted(ops - {"all_reduce"})
        if other:
            return (f"rank {rank} called {', '.join(other)}: g is one all_reduce of the partial "
                    "sum, and nothing else moves (x is already whole on every rank, f being the "
                    "identity forward, and every weight shard stays where it is)")
        reduces = [c for c in made if c.op == "all_reduce"]
        if len(reduces) != 1:
            return (f"rank {rank} made {len(reduces)} all-reduces: the block needs exactly one, "
                    "g's, of the partial sum (f is the identity in the forward pass)")
        if reduces[0].nbytes != n:
            return (f"rank {rank} all-reduced {reduces[0].nbytes} B, shape "
                    f"{list(reduces[0].shape)}: g all-reduces the partial sum of y, rows × h × 4 "
                    f"= {n} B")
        if reduces[0].reduce_op != "SUM":
            return (f"rank {rank} all-reduced with {reduces[0].reduce_op}: g adds the partial "
                    "sums (ReduceOp.SUM, the default)")
    return None


def _mlp_crash(op: str, text: str) -> str | None:
    if op == "all_reduce" and "AVG" in text.upper():
        return ("gloo has no ReduceOp.AVG, and g needs none: the t partial sums are terms of "
                "one sum, to be added (ReduceOp.SUM, all_reduce's default)")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _all_reduces_a_copy(x, up, down):
    y = F.linear(F.gelu(F.linear(x, up)), down)
    dist.all_reduce(y.clone())  # cloned as _G.forward clones: the sum lands in the copy, dropped
    return y


def _averages(x, up, down):
    y = F.linear(F.gelu(F.linear(x, up)), down)
    dist.all_reduce(y)
    return y / dist.get_world_size()  # data parallelism's habit: averaged, where g only adds


def _gelu_after_g(x, up, down):
    y = F.linear(F.linear(x, up), down)
    dist.all_reduce(y)
    return F.gelu(y)  # on the sum: GELU belongs to the hidden features, before `down`


def _gathers_the_partials(x, up, down):
    y = F.linear(F.gelu(F.linear(x, up)), down)
    pieces = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, y)  # every rank receives every partial sum, whole
    return torch.stack(pieces).sum(dim=0)


register(Exercise(
    id="megatron_mlp", notebook="04",
    title="The Megatron MLP: two sharded matmuls, GELU between, one all-reduce (g)",
    form="reveal", solution=megatron_mlp,
    cases=(Case(world=4, seed=3, size=8), Case(world=2, seed=4, size=6),
           Case(world=3, seed=5, size=5)),
    given=_mlp_given, want=_mlp_want, comm=_mlp_comm, hint=_mlp_hint, crash=_mlp_crash,
    rtol=1e-4, atol=1e-5,
    mistakes=(
        Mistake("computed locally without communicating", _all_reduces_a_copy,
                "return the tensor you handed it"),
        Mistake("averaged where a sum was asked", _averages,
                "to be added, not averaged"),
        Mistake("wrong order", _gelu_after_g, "GELU came after the all-reduce"),
        Mistake("sent the whole tensor to every rank", _gathers_the_partials,
                "receives the other ranks' whole partial sums"),
    ),
))
