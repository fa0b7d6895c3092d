"""Notebook 03's coding exercises, one per lesson.

* `average_in_buckets`: data parallelism's one change to training, the gradients averaged over
  the d ranks of the data group, done as `BucketedDDP` does it: the gradients flattened into
  buckets of at most `bucket_bytes`, filled from the last gradient (the order backward produces
  them), one all-reduce per bucket, on the group that was handed over (not the world).
* `zero1_sgd_step`: ZeRO-1 the way real implementations run it (notebook 03's ShardedOptimizer
  broadcasts instead): reduce-scatter the gradient, so each rank gets the average of only the
  shard it updates, step that shard, all-gather the parameters. Same bytes as the one all-reduce
  of plain DP, which the checker calls wrong here: it sends twice what the shard update needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.exercises.coding import Case, Exercise, Mistake, register

REDUCE_SCATTERS = {"reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"}
ALL_GATHERS = {"all_gather", "all_gather_single", "all_gather_into_tensor"}


# == average_in_buckets ========================================================================

def average_in_buckets(grads: list[torch.Tensor], bucket_bytes: int, group=None) -> None:
    """Average every tensor of `grads` in place over the ranks of `group`: the gradients go,
    last one first, into buckets of at most `bucket_bytes` (a bigger one alone), one
    all-reduce per bucket."""
    d = dist.get_world_size(group)  # the data group's d, not the world's size
    buckets, size = [], 0
    for g in reversed(grads):  # backward produces the last layer's gradient first
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])  # a copy: one message per bucket
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= d
        offset = 0
        for g in bucket:  # write the average back into the tensors the caller holds
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _bucket_bytes(case: Case) -> int:
    return 4 * (8 + case.seed % 3)  # 8 to 10 float32 elements


def _shapes(case: Case) -> list[tuple]:
    """The gradients' shapes: the same on every rank (the model is), uneven, one of them bigger
    than a bucket; `case.size` of them."""
    g = torch.Generator().manual_seed(case.seed)
    numels = torch.randint(1, 7, (case.size,), generator=g).tolist()
    numels[1] = _bucket_bytes(case) // 4 + 2  # goes alone
    return [(2, k // 2) if k % 2 == 0 and k >= 4 else (k,) for k in numels]


def _given_grads(rank: int, case: Case, group) -> tuple:
    g = case.generator(rank)
    grads = [torch.randint(-9, 10, shape, generator=g).float() for shape in _shapes(case)]
    return grads, _bucket_bytes(case), group


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _averaged(args: tuple, returned) -> torch.Tensor:
    return _flat(args[0])  # in place: what the caller's tensors hold afterwards


def _want_grads(case: Case) -> dict:
    mean = sum(_flat(_given_grads(r, case, None)[0]) for r in case.members()) / len(case.members())
    return {r: mean for r in case.members()}


def _buckets(case: Case, last_first: bool = True) -> list[int]:
    """The bytes of each bucket, in launch order."""
    sizes = [torch.Size(s).numel() * 4 for s in _shapes(case)]
    out = []
    for nbytes in (sizes[::-1] if last_first else sizes):
        if not out or out[-1] + nbytes > _bucket_bytes(case):
            out.append(0)
        out[-1] += nbytes
    return out


def _comm_grads(case: Case, calls: list) -> str | None:
    want, first_first = _buckets(case), _buckets(case, last_first=False)
    tensors, cap = len(_shapes(case)), _bucket_bytes(case)
    for rank, made in zip(case.members(), calls):
        other = sorted({c.op for c in made} - {"all_reduce"})
        if other:
            return f"rank {rank} called {other[0]}: average with all-reduces, one per bucket"
        wrong = [c for c in made if c.group != case.group]
        if wrong:
            where = f"group {list(wrong[0].group)}" if wrong[0].group else "the whole world"
            return (f"rank {rank} all-reduced on {where}, the data group is "
                    f"{list(case.members())}: pass group=group")
        sizes = [c.nbytes for c in made]
        if sizes == want:
            continue
        if sizes == first_first:
            return (f"rank {rank}'s buckets carried {sizes} bytes, filled from the first "
                    f"gradient: backward produces the last one first, so fill them from the end "
                    f"({want} bytes), or the first bucket waits for the whole backward pass")
        if len(sizes) == tensors:
            return (f"rank {rank} made {tensors} all-reduces, one per tensor: pack the gradients "
                    f"into buckets of at most {cap} bytes, one all-reduce per bucket "
                    f"({len(want)} here)")
        return (f"rank {rank}'s all-reduces carried {sizes} bytes; buckets of at most {cap} "
                f"bytes, filled from the last gradient, carry {want}")
    return None


def _hint_grads(case: Case, rank: int, got, want, given) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    n, world = len(case.members()), case.world
    if case.group is not None and torch.allclose(got, want * n / world):
        return (f"it is {n}/{world} of the reference: divided by the world's {world} ranks, "
                f"not the data group's {n} (dist.get_world_size(group))")
    if torch.allclose(got, _flat(given[0])):
        return ("the gradients are this rank's own, unchanged: write each averaged bucket back "
                "into them (torch.cat makes a copy; the caller reads the tensors it handed over)")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _reduce(bucket: list[torch.Tensor], group, d: int, write_back: bool = True) -> None:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, group=group)
    flat /= d
    if write_back:
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _fill(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets, size = [], 0
    for g in grads:
        if not buckets or size + g.numel() * 4 > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * 4
    return buckets


def _sums(grads, bucket_bytes, group=None):
    for bucket in _fill(grads[::-1], bucket_bytes):
        _reduce(bucket, group, 1)


def _divides_by_the_world(grads, bucket_bytes, group=None):
    for bucket in _fill(grads[::-1], bucket_bytes):
        _reduce(bucket, group, dist.get_world_size())


def _fills_from_the_first(grads, bucket_bytes, group=None):
    for bucket in _fill(grads, bucket_bytes):
        _reduce(bucket, group, dist.get_world_size(group))


def _never_writes_back(grads, bucket_bytes, group=None):
    for bucket in _fill(grads[::-1], bucket_bytes):
        _reduce(bucket, group, dist.get_world_size(group), write_back=False)


def _divides_its_own(grads, bucket_bytes, group=None):
    for g in grads:
        g /= dist.get_world_size(group)


register(Exercise(
    id="average_in_buckets", notebook="03",
    title="Average the gradients over the data group, one all-reduce per bucket",
    form="variation", solution=average_in_buckets,
    cases=(Case(world=4, seed=0, size=6, group=(1, 2, 3)), Case(world=4, seed=1, size=5,
                                                                  group=(0, 2)),
           Case(world=2, seed=2, size=7), Case(world=3, seed=3, size=6)),
    given=_given_grads, want=_want_grads, result=_averaged, comm=_comm_grads, hint=_hint_grads,
    mistakes=(
        Mistake("forgot to divide by d", _sums, "did you average"),
        Mistake("divided by the world, not the group", _divides_by_the_world,
                "not the data group's 3"),
        Mistake("wrong order", _fills_from_the_first, "filled from the first gradient"),
        Mistake("skipped a phase", _never_writes_back, "write each averaged bucket back"),
        Mistake("computed locally without communicating", _divides_its_own, "made no call"),
    ),
))


# == zero1_sgd_step ============================================================================

def zero1_sgd_step(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step of ZeRO-1 on a flat parameter vector (the same on every rank) given this
    rank's gradient: reduce-scatter the gradient, step only this rank's shard with its
    average, all-gather the shards; return the whole new parameter vector."""
    rank, d, n = dist.get_rank(), dist.get_world_size(), param.numel()
    shard = -(-n // d)  # the vector padded with zeros to d equal shards
    mine = slice(rank * shard, (rank + 1) * shard)  # rank r owns shard r
    average = grad.new_empty(shard)
    dist.reduce_scatter_single(average, F.pad(grad, (0, d * shard - n)), op=dist.ReduceOp.SUM)
    average /= d  # each rank's gradient is the mean over its own rows: average, not sum
    padded = F.pad(param, (0, d * shard - n))
    stepped = padded[mine] - lr * average  # a new tensor: the all-gather's input, not a view
    dist.all_gather_single(padded, stepped)
    return padded[:n]


LR = 0.1


def _given_step(rank: int, case: Case, group) -> tuple:
    same = torch.Generator().manual_seed(case.seed)  # the parameters: one copy on every rank
    own = case.generator(rank)  # the gradient: this rank's
    return (torch.randint(-9, 10, (case.size,), generator=same).float(),
            torch.randint(-9, 10, (case.size,), generator=own).float(), LR)


def _mean_grad(case: Case) -> torch.Tensor:
    return sum(_given_step(r, case, None)[1] for r in range(case.world)) / case.world


def _want_step(case: Case) -> dict:
    new = _given_step(0, case, None)[0] - LR * _mean_grad(case)
    return {r: new for r in range(case.world)}


def _comm_step(case: Case, calls: list) -> str | None:
    d, n = case.world, case.size
    shard_bytes = -(-n // d) * 4
    for rank, made in enumerate(calls):
        ops = [c.op for c in made]
        if "all_reduce" in ops:
            return (f"rank {rank} called all_reduce: right numbers, but every rank then holds "
                    "the whole averaged gradient while it steps only its shard; a "
                    "reduce-scatter sends it just that shard's average, half the all-reduce's "
                    "bytes (an all-reduce is a reduce-scatter plus an all-gather)")
        other = sorted(set(ops) - REDUCE_SCATTERS - ALL_GATHERS)
        if other:
            return (f"rank {rank} called {other[0]}: ZeRO-1's step is one reduce-scatter of "
                    "the gradient and one all-gather of the parameters")
        scatters = [c for c in made if c.op in REDUCE_SCATTERS]
        gathers = [c for c in made if c.op in ALL_GATHERS]
        if not scatters and any(c.nbytes >= n * 4 for c in gathers):
            return (f"rank {rank} all-gathered whole gradients and averaged them itself: {d}× "
                    "the bytes, and every rank ends with every gradient; a reduce-scatter hands "
                    "each rank only its shard's average")
        if len(scatters) != 1 or len(gathers) != 1:
            return (f"rank {rank} made {len(scatters)} reduce-scatter(s) and {len(gathers)} "
                    "all-gather(s): ZeRO-1's step is one of each")
        if gathers[0].nbytes > shard_bytes:
            return (f"rank {rank} all-gathered {gathers[0].nbytes} bytes, more than its "
                    f"shard's {shard_bytes}: each rank hands over only the shard it updated")
        if abs(gathers[0].total - _stepped_shard_sum(case, rank)) > 1e-3:
            return (f"rank {rank}'s all-gather carried something other than its stepped "
                    "parameter shard (the averaged gradient's?): in ZeRO-1 a rank steps only "
                    "its shard, then all-gathers the new parameters")
    return None


def _stepped_shard_sum(case: Case, rank: int) -> float:
    """The sum of rank `rank`'s shard of the new parameters, padding included (zeros)."""
    d, n = case.world, case.size
    shard = -(-n // d)
    new = F.pad(_want_step(case)[rank], (0, d * shard - n))
    return float(new[rank * shard:(rank + 1) * shard].double().sum())


def _shifted(case: Case, shift: int) -> torch.Tensor:
    """Shard j of the parameters' shard j + shift stepped with gradient shard j: what an
    off-by-one shard index produces."""
    d, n = case.world, case.size
    s = -(-n // d)
    param = F.pad(_given_step(0, case, None)[0], (0, d * s - n)).view(d, s)
    grad = F.pad(_mean_grad(case), (0, d * s - n)).view(d, s)
    return (param.roll(-shift, 0) - LR * grad).reshape(-1)[:n]


def _hint_step(case: Case, rank: int, got, want, given) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    param, grad, lr = given
    d, s = case.world, -(-case.size // case.world)
    took = (param - got) / lr  # the gradient the step used
    if torch.allclose(took, _mean_grad(case) * d, atol=1e-4):
        return (f"the step used {d}× the averaged gradient: divide the reduce-scattered sum by "
                f"d = {d} (each rank's gradient is a mean over its own rows)")
    if torch.allclose(took, grad, atol=1e-4):
        return "it stepped with this rank's own gradient: the gradients were never averaged"
    mine = torch.zeros(case.size, dtype=torch.bool)
    mine[rank * s:(rank + 1) * s] = True
    if mine.any() and torch.equal(got[~mine], param[~mine]) and not torch.equal(got, param):
        last = min((rank + 1) * s, case.size) - 1
        return (f"only this rank's shard (elements {rank * s} to {last}) moved, the rest are "
                "the old parameters: all-gather the updated shards")
    for shift in (1, -1):
        if torch.allclose(got, _shifted(case, shift), atol=1e-4):
            sign = "+" if shift > 0 else "−"
            return (f"shard j of the result is parameter shard j {sign} 1 stepped with gradient "
                    "shard j: the reduce-scatter hands rank r the average of shard r, so update "
                    f"parameter shard r (not r {sign} 1)")
    return None


# -- wrong answers -------------------------------------------------------------------------

def _step(param, grad, lr, reduce, divide=True, owner_shift=0, gather=True):
    rank, d, n = dist.get_rank(), dist.get_world_size(), param.numel()
    s = -(-n // d)
    average = reduce(F.pad(grad, (0, d * s - n)), rank, s)
    if divide:
        average /= d
    padded = F.pad(param, (0, d * s - n))
    owner = (rank + owner_shift) % d
    shard = padded[owner * s:(owner + 1) * s] - lr * average
    if not gather:
        padded[rank * s:(rank + 1) * s] = shard
        return padded[:n]
    dist.all_gather_single(padded, shard)
    return padded[:n]


def _scatter(flat, rank, s):
    out = torch.empty(s)
    dist.reduce_scatter_single(out, flat)
    return out


def _all_reduce(flat, rank, s):
    dist.all_reduce(flat)
    return flat[rank * s:(rank + 1) * s].clone()


def _with_all_reduce(param, grad, lr):
    return _step(param, grad, lr, _all_reduce)


def _sums_the_shard(param, grad, lr):
    return _step(param, grad, lr, _scatter, divide=False)


def _steps_the_next_shard(param, grad, lr):
    return _step(param, grad, lr, _scatter, owner_shift=1)  # the ring of notebook 01 ends so


def _never_gathers(param, grad, lr):
    return _step(param, grad, lr, _scatter, gather=False)


def _steps_with_its_own(param, grad, lr):
    return param - lr * grad


register(Exercise(
    id="zero1_sgd_step", notebook="03",
    title="ZeRO-1: reduce-scatter the gradient, step your shard, all-gather the parameters",
    form="variation", solution=zero1_sgd_step,
    cases=(Case(world=3, seed=0, size=10), Case(world=2, seed=1, size=7),
           Case(world=4, seed=2, size=10), Case(world=4, seed=3, size=13)),
    given=_given_step, want=_want_step, comm=_comm_step, hint=_hint_step,
    mistakes=(
        Mistake("used the collective the lesson replaces", _with_all_reduce,
                "called all_reduce"),
        Mistake("forgot to divide by d", _sums_the_shard, "divide the reduce-scattered sum"),
        Mistake("off-by-one chunk", _steps_the_next_shard, "update parameter shard r"),
        Mistake("skipped a phase", _never_gathers, "all-gather the updated shards"),
        Mistake("computed locally without communicating", _steps_with_its_own,
                "made no call"),
    ),
))
