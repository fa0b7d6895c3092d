"""Rank-side plumbing that every parallel building block shares: the rank's device, process
groups and the ranks inside them, and the collectives under names that do not change.

Every building block takes `group=None`, meaning the whole world. Inside a group, ranks are
numbered 0 … size−1 (`group_rank`); point-to-point calls and `src`/`dst` arguments want the
*global* rank, which `global_rank` translates.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's index inside `group` (0 … size−1)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The world rank of member `rank_in_group` of `group`, for send/recv and src/dst."""
    if group is None:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def split_groups(blocks: list[list[int]]) -> dist.ProcessGroup:
    """Form one process group per block of world ranks and return the block this rank is in.

    Every rank must call this with the same blocks in the same order: creating a group is
    itself a collective over the whole world.
    """
    mine, _ = dist.new_subgroups_by_enumeration(blocks)
    return mine


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every member's `x` along dim 0 into `out` (size × x)."""
    return dist.all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """Sum `x` over the members and keep this member's 1/size slice (along dim 0) in `out`."""
    return dist.reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group,
                                      async_op=async_op)


def all_reduce_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Average across the group's ranks in place; SUM then divide where AVG is refused
    (older gloo builds). The course's one way to average."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor /= dist.get_world_size(group)
    return tensor


class PendingMean:
    """An asynchronous `all_reduce_mean` in flight: the sum travels now, `wait()` divides.

    `work` is the collective's handle (its `get_future()` tells when the data has arrived).
    """

    def __init__(self, work, tensor: torch.Tensor, size: int):
        self.work, self.tensor, self.size = work, tensor, size

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.tensor /= self.size
        return self.tensor


def all_reduce_mean_async(tensor: torch.Tensor, group=None) -> PendingMean:
    """`all_reduce_mean` without blocking: SUM launched asynchronously, divided by the group
    size on `wait()` (so it runs on every backend, like all_reduce_mean's fallback)."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingMean(work, tensor, dist.get_world_size(group))


@contextlib.contextmanager
def fd2_muted():
    """Silence file descriptor 2 for a moment.

    gloo logs a failed check straight to fd 2 (with a timestamp), bypassing sys.stderr, and a
    rank's fd 2 is the notebook's: the exception already carries the same words, so the
    duplicate would only add a line that changes every run.
    """
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
