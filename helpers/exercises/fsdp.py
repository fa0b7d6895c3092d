"""Notebook 08's coding exercise: one linear layer under FSDP, by hand.

Each rank holds only its shard of the layer's flat weight (the course's rule,
`helpers.parallel.zero.FlatBucket`: the weight flattened, zero-padded to a multiple of d, rank r
keeping the r-th of d equal slices), its own micro-batch x and the upstream gradient dy. It must
gather the weight just before using it, and reduce-scatter the weight's gradient so that it
keeps only its shard of the average over the d ranks: FSDP's two collectives, without the hooks
that notebook 08 prints. An all-reduce of the gradient gets the same numbers, with d× the
memory kept and twice the bytes sent, and is called wrong for that.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.exercises.coding import Case, Exercise, Mistake, register
from helpers.parallel.zero import FlatBucket

GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_single"}
SCATTERS = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}
BATCH = 3  # rows of x per rank: b


def fsdp_linear(w_shard: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
                shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x @ Wᵀ for this rank's micro-batch, and this rank's shard of the weight's gradient
    averaged over the d ranks, holding the whole W (and the whole dW) only while it is used."""
    d = dist.get_world_size()
    out_features, in_features = shape
    # Gather: every shard has the same length (the padding sits at the end of the last ones).
    shards = [torch.empty_like(w_shard) for _ in range(d)]
    dist.all_gather(shards, w_shard)
    w = torch.cat(shards)[:out_features * in_features].view(out_features, in_features)
    y = x @ w.T
    # dW of this micro-batch, laid out as the weight is: flat, zero-padded to d equal chunks.
    grad = w_shard.new_zeros(d * w_shard.numel())
    grad[:w.numel()] = (dy.T @ x).flatten()
    mine = torch.empty_like(w_shard)
    dist.reduce_scatter(mine, list(grad.chunk(d)))  # sums chunk r of every rank into rank r
    return y, mine / d


# -- what each rank is handed, and the single-process reference -------------------------------

def _shape(case: Case) -> tuple[int, int]:
    return case.size, case.size + 2  # out × in; the cases pick sizes whose numel d leaves over


def _weight(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + case.seed)
    return torch.randint(-4, 5, _shape(case), generator=g).float()


def _bucket(case: Case, rank: int) -> FlatBucket:
    return FlatBucket([_weight(case)], case.world, rank)


def _shard(case: Case, rank: int, flat: torch.Tensor) -> torch.Tensor:
    """Rank's slice of a flat buffer of the weight's numel, padded as the course pads."""
    bucket = _bucket(case, rank)
    padded = torch.zeros(bucket.padded)
    padded[:flat.numel()] = flat
    return bucket.mine(padded).clone()


def _given(rank: int, case: Case, group) -> tuple:
    out_features, in_features = _shape(case)
    g = case.generator(rank)
    x = torch.randint(-4, 5, (BATCH, in_features), generator=g).float()
    dy = torch.randint(-4, 5, (BATCH, out_features), generator=g).float()
    return _shard(case, rank, _weight(case).flatten()), x, dy, _shape(case)


def _local_grad(case: Case, rank: int) -> torch.Tensor:
    _, x, dy, _ = _given(rank, case, None)
    return (dy.T @ x).flatten()


def _mean_grad(case: Case) -> torch.Tensor:
    return sum(_local_grad(case, r) for r in range(case.world)) / case.world


def _want(case: Case) -> dict:
    w, mean = _weight(case), _mean_grad(case)
    return {r: (_given(r, case, None)[1] @ w.T, _shard(case, r, mean))
            for r in range(case.world)}


# -- what the checker says -------------------------------------------------------------------

def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def _hint(case: Case, rank: int, got, want, given) -> str | None:
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and
            all(isinstance(t, torch.Tensor) for t in got)):
        return "return two tensors: (y, this rank's shard of the averaged gradient)"
    (y, grad), (y_want, grad_want), d = got, want, case.world
    w_shard, x, _, shape = given
    if not _same(y, y_want):
        own = torch.zeros(shape[0] * shape[1])
        start = rank * w_shard.numel()
        own[start:start + w_shard.numel()] = w_shard[:max(0, own.numel() - start)]
        if _same(y, x @ own.view(shape).T):
            return ("y was computed from this rank's own shard of W alone (the rest zeros): "
                    "all-gather the whole weight before the matmul")
        return ("y is wrong: W is the all-gathered flat weight cut to its out × in values "
                "(the padding dropped) and viewed as out × in; y = x @ Wᵀ")
    if grad.numel() != grad_want.numel():
        if grad.numel() in (shape[0] * shape[1], d * grad_want.numel()):
            return (f"that is the whole gradient: a rank keeps only its shard, "
                    f"{grad_want.numel()} values (a reduce-scatter, not an all-reduce)")
        return None
    mean = _mean_grad(case)
    if _same(grad, d * grad_want):
        return (f"the gradient shard is {d}× the reference: the reduce-scatter sums the d "
                f"ranks' dW; divide by d = {d} to average")
    for other in range(d):
        if other != rank and _same(grad, _shard(case, other, mean)):
            return (f"it is rank {other}'s shard of the averaged gradient, not rank {rank}'s: "
                    "a chunk index off by one?")
    mine = _shard(case, rank, _local_grad(case, rank))
    if _same(grad, mine) or _same(grad, mine / d):
        return ("it is this rank's own dW shard: the gradients were never summed over the d "
                "ranks (reduce-scatter them)")
    return None


def _comm(case: Case, calls: list) -> str | None:
    shard_bytes = _bucket(case, 0).shard_numel * 4
    for rank, made in enumerate(calls):
        ops = [c.op for c in made]
        if "all_reduce" in ops:
            return (f"rank {rank} called all_reduce: an all-reduce of the gradient gets the "
                    f"right numbers, but leaves every rank the whole gradient ({case.world}× the "
                    "shard FSDP keeps) and sends twice a reduce-scatter's bytes: reduce-scatter "
                    "it, so each rank receives only its own shard")
        other = sorted(set(ops) - GATHERS - SCATTERS)
        if other:
            return (f"rank {rank} called {other[0]}: this block needs one all-gather of the "
                    "weight and one reduce-scatter of the gradient, nothing else")
        gathers = [c for c in made if c.op in GATHERS]
        scatters = [c for c in made if c.op in SCATTERS]
        if len(gathers) != 1:
            return (f"rank {rank} made {len(gathers)} all-gathers: gather the weight once "
                    "(dW = dyᵀ·x does not need W; FSDP's second gather serves dx)")
        if gathers[0].nbytes != shard_bytes:
            return (f"rank {rank} handed the all-gather {gathers[0].nbytes} bytes: its weight "
                    f"shard is {shard_bytes} (gather the shards, not something larger)")
        if len(scatters) != 1:
            return (f"rank {rank} made {len(scatters)} reduce-scatters: one, of the whole "
                    "padded gradient, hands each rank its shard")
        if scatters[0].nbytes != case.world * shard_bytes:
            return (f"rank {rank} handed the reduce-scatter {scatters[0].nbytes} bytes: the "
                    f"padded gradient is {case.world * shard_bytes}")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _gather(w_shard: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    shards = [torch.empty_like(w_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, w_shard)
    return torch.cat(shards)[:shape[0] * shape[1]].view(shape)


def _padded_grad(w_shard, x, dy) -> torch.Tensor:
    grad = torch.zeros(dist.get_world_size() * w_shard.numel())
    grad[:x.shape[1] * dy.shape[1]] = (dy.T @ x).flatten()
    return grad


def _all_reduces_the_gradient(w_shard, x, dy, shape):
    d, rank = dist.get_world_size(), dist.get_rank()
    y = x @ _gather(w_shard, shape).T
    grad = _padded_grad(w_shard, x, dy)
    dist.all_reduce(grad)  # every rank now holds all of it
    return y, grad.chunk(d)[rank] / d


def _sums_without_averaging(w_shard, x, dy, shape):
    y = x @ _gather(w_shard, shape).T
    mine = torch.empty_like(w_shard)
    dist.reduce_scatter(mine, list(_padded_grad(w_shard, x, dy).chunk(dist.get_world_size())))
    return y, mine


def _keeps_the_next_chunk(w_shard, x, dy, shape):
    y = x @ _gather(w_shard, shape).T
    chunks = list(_padded_grad(w_shard, x, dy).chunk(dist.get_world_size()))
    mine = torch.empty_like(w_shard)
    dist.reduce_scatter(mine, chunks[1:] + chunks[:1])  # counts the ranks' chunks from 1
    return y, mine / dist.get_world_size()


def _uses_its_own_shard(w_shard, x, dy, shape):
    d, rank = dist.get_world_size(), dist.get_rank()
    w = torch.zeros(d * w_shard.numel())
    w[rank * w_shard.numel():(rank + 1) * w_shard.numel()] = w_shard  # no gather
    y = x @ w[:shape[0] * shape[1]].view(shape).T
    mine = torch.empty_like(w_shard)
    dist.reduce_scatter(mine, list(_padded_grad(w_shard, x, dy).chunk(d)))
    return y, mine / d


def _never_reduces(w_shard, x, dy, shape):
    y = x @ _gather(w_shard, shape).T
    return y, _padded_grad(w_shard, x, dy).chunk(dist.get_world_size())[dist.get_rank()]


register(Exercise(
    id="fsdp_linear", notebook="08", title="One linear layer under FSDP, by hand",
    form="variation", solution=fsdp_linear,
    # out × in = size × (size + 2): 35 values on 3 ranks, 15 on 2 and on 4 (padded to 36, 16,
    # 16), then 24 on 2 (no padding)
    cases=(Case(world=3, seed=0, size=5), Case(world=2, seed=1, size=3),
           Case(world=2, seed=3, size=4), Case(world=4, seed=2, size=3)),
    given=_given, want=_want, hint=_hint, comm=_comm,
    mistakes=(
        Mistake("used the collective the lesson replaces", _all_reduces_the_gradient,
                "called all_reduce"),
        Mistake("forgot to divide by d", _sums_without_averaging, "divide by d"),
        Mistake("off-by-one chunk", _keeps_the_next_chunk, "off by one"),
        Mistake("computed locally without communicating", _uses_its_own_shard,
                "own shard of W alone"),
        Mistake("skipped a phase", _never_reduces, "never summed"),
    ),
))
