"""The eight collectives under one call, on any process group: `collective(op, x, group)`.

Inside a group, the rooted collectives' root is the group's member 0 (given to torch as its
global rank). Collectives that cut a tensor into one chunk per member need a length divisible
by the group's size. Also here: a reduce-scatter that accepts any layout on every backend.
Notebook 01's runs on live ranks are in `helpers.labs.collectives`; its drawings in
`helpers.views.collectives`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.parallel.groups import (all_gather_into, global_rank, group_rank, group_size,
                                     reduce_scatter_into)

OPS = ("broadcast", "scatter", "gather", "reduce",
       "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Collectives that cut a tensor into one chunk per rank need a length divisible by the ranks.
SPLITTING_OPS = ("scatter", "reduce_scatter", "all_to_all")
ROOT = 0  # the source / destination of the rooted collectives: member 0 of the group


def collective(op: str, x: torch.Tensor, group=None) -> torch.Tensor | None:
    """Run `op` on this member's 1-D `x`; return what this member holds afterwards, or None
    where it holds nothing (non-root members of a gather or a reduce)."""
    rank, size = group_rank(group), group_size(group)
    root = global_rank(group, ROOT)
    length = x.numel()
    chunks = list(x.chunk(size)) if op in SPLITTING_OPS else None
    if op == "broadcast":
        dist.broadcast(x, src=root, group=group)
        return x
    if op == "scatter":
        after = torch.empty(length // size, device=x.device)
        dist.scatter(after, [c.contiguous() for c in chunks] if rank == ROOT else None,
                     src=root, group=group)
        return after
    if op == "gather":
        bucket = [torch.empty_like(x) for _ in range(size)] if rank == ROOT else None
        dist.gather(x, bucket, dst=root, group=group)
        return torch.cat(bucket) if rank == ROOT else None
    if op == "reduce":
        dist.reduce(x, dst=root, op=dist.ReduceOp.SUM, group=group)
        return x if rank == ROOT else None  # other ranks' buffers are unspecified
    if op == "all_gather":
        after = torch.empty(length * size, device=x.device)
        all_gather_into(after, x, group=group)
        return after
    if op == "reduce_scatter":
        after = torch.empty(length // size, device=x.device)
        reduce_scatter_into(after, x, group=group)
        return after
    if op == "all_reduce":
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x
    if op == "all_to_all":  # chunk j of rank r goes to rank j, which stacks them in rank order
        after = torch.empty_like(x)
        dist.all_to_all_single(after, x, group=group)
        return after
    raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")


def reduce_scatter_rows(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter that accepts any layout: gloo checks dim 0, NCCL only the element count.

    Flattening both sides makes the split happen over the flat memory, which is what
    NCCL does anyway, so the result is the same on every backend.
    """
    reduce_scatter_into(output.view(-1), input.contiguous().view(-1), group=group)
    return output
