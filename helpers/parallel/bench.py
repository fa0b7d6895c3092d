"""Timing a collective on any process group, as nccl-tests does (notebook 02's block).

* Calls run back to back, as in nccl-tests (one barrier before each batch, none per call); each
  call is timed alone (perf_counter on CPU, CUDA events on GPU). An iteration's time is the
  slowest member's: a collective is done when every member has its result.
* Sizes are visited in rounds (every size a few calls, then again), so a burst of load from
  elsewhere hits every size alike rather than a few neighbours.

Every function runs inside a rank on `group` (None: the whole world); starting the ranks and
choosing what to time is notebook 02's lab. torch is imported inside the functions, so a parent
that only plans a sweep imports this module cheaply.
"""
from __future__ import annotations

from helpers.checks import check_choice
from helpers.cost.alpha_beta import COST_MODELS
from helpers.cost.bench import ELEMENT_BYTES, Timing, per_round
from helpers.timing import times_of


def collective_call(op: str, nbytes: int, group, device):
    """A zero-argument function that runs `op` once on preallocated n-byte buffers.

    Ranks and sizes are the group's; the root (member 0) and the ring neighbours of
    send_recv are handed to torch as global ranks.
    """
    import torch
    import torch.distributed as dist

    from helpers.parallel.groups import (all_gather_into, global_rank, group_rank, group_size,
                                         reduce_scatter_into)

    rank, size = group_rank(group), group_size(group)
    numel = nbytes // ELEMENT_BYTES
    chunk = numel // size
    buf = torch.zeros(numel, device=device)
    root = global_rank(group, 0)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        mine = torch.zeros(chunk, device=device)
        return lambda: all_gather_into(buf, mine, group=group)
    if op == "reduce_scatter":
        mine = torch.zeros(chunk, device=device)
        return lambda: reduce_scatter_into(mine, buf, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(buf, src=root, group=group)
    if op == "reduce":
        return lambda: dist.reduce(buf, dst=root, group=group)
    if op == "all_to_all":
        out = torch.zeros(numel, device=device)
        return lambda: dist.all_to_all_single(out, buf, group=group)
    if op == "send_recv":
        inbox = torch.zeros(numel, device=device)
        right = global_rank(group, (rank + 1) % size)
        left = global_rank(group, (rank - 1) % size)

        def ring_shift():
            ops = [dist.P2POp(dist.isend, buf, right, group), dist.P2POp(dist.irecv, inbox, left, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return ring_shift
    check_choice("op", op, sorted(COST_MODELS))


def back_to_back(call, count: int, cuda: bool) -> list[float]:
    """`count` calls in a row, each timed alone (seconds)."""
    if cuda:
        import torch
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    return times_of(call, count)


def time_on_group(op: str, sizes, iters: int = 20, warmup: int = 5, rounds: int = 1,
                  group=None) -> list[Timing]:
    """Time `op` at each message size (bytes; one int or several) on `group`; one Timing per
    size, the same on every member of the group (its `world_size` is the group's size N)."""
    import torch
    import torch.distributed as dist

    from helpers.parallel.groups import group_size, rank_device

    sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
    device = rank_device()
    cuda = device.type == "cuda"
    calls = [collective_call(op, n, group, device) for n in sizes]
    for call in calls:                 # first calls set up connections, buffers, caches
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(rounds):            # every size in every round: load hits all sizes alike
        for n, call, mine in zip(sizes, calls, times):
            dist.barrier(group=group)  # start together; then calls back to back, no barrier
            mine += back_to_back(call, per_round(n, iters, rounds), cuda)
    # An iteration's time is its slowest member's (exchanged after the timing, not timed).
    slowest = torch.tensor([t for mine in times for t in mine], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    slowest = slowest.cpu().tolist()
    records, start = [], 0
    for n, mine in zip(sizes, times):
        records.append(Timing(op, group_size(group), n, backend=dist.get_backend(group),
                              times_s=tuple(slowest[start:start + len(mine)]),
                              threads_per_rank=torch.get_num_threads()))
        start += len(mine)
    return records
