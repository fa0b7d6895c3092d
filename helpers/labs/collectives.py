"""Notebook 01's runs: the eight collectives on real ranks, checked against their definition.

Every rank starts from the lecture's tensor, `arange(length) + rank` (so with 4 ranks and
length 4, rank r holds [0, 1, 2, 3] + r); all-to-all uses `10 * rank + arange(length)`.
`run_collective` is the rank function; `expected` computes the same answer in one process, so
the notebook and the tests can check the real collective against what it is supposed to do.

Every rank function takes `group=None` (the whole world): inside a group, `rank` and the
number of ranks are the group's, and the rooted collectives' root is the group's member 0
(given to torch as its global rank). The collectives themselves are `helpers.parallel.collectives`;
the drawings are in `helpers.views.collectives`.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.checks import check_choice, check_divisible, check_int
from helpers.parallel.collectives import OPS, ROOT, SPLITTING_OPS, collective, reduce_scatter_rows
from helpers.parallel.groups import (all_gather_into, all_reduce_mean, fd2_muted, group_rank,
                                     group_size, rank_device, reduce_scatter_into)


def check_op(op: str, world_size: int, length: int) -> None:
    check_choice("op", op, OPS)
    check_int("length", length, 1)
    if op in SPLITTING_OPS:
        check_divisible("length", length, world_size,
                        f"{op} cuts the tensor into one chunk per rank of {world_size}")


def start_tensor(rank: int, length: int, op: str = "") -> torch.Tensor:
    """The lecture's `arange(length) + rank`; for all-to-all, `10 * rank + arange(length)`.

    All-to-all transposes the (rank, chunk) grid, and the lecture's tensor is symmetric
    under that transpose (element i of rank r is i + r), so it would look unchanged.
    """
    if op == "all_to_all":
        return torch.arange(length, dtype=torch.float32) + 10 * rank
    return torch.arange(length, dtype=torch.float32) + rank


@dataclass(frozen=True)
class BeforeAfter:
    """One rank's tensor before a collective and the collective's result on that rank
    (None: the rank holds nothing there, e.g. non-root ranks after a gather)."""
    before: torch.Tensor | None
    after: torch.Tensor | None


def run_collective(rank: int, world_size: int, op: str, length: int = 4,
                   group=None) -> BeforeAfter:
    """Rank function: one collective on `arange(length) + rank`; returns before and after.

    `rank` is the group's (`group_rank(group)`); `None` stands for "this rank holds nothing
    here" (e.g. non-root ranks of a gather).
    """
    rank, size = group_rank(group), group_size(group)
    check_op(op, size, length)
    x = start_tensor(rank, length, op).to(rank_device())
    before = x.clone() if op != "scatter" or rank == ROOT else None
    return BeforeAfter(before, collective(op, x, group))


def expected(op: str, world_size: int, length: int = 4) -> list[BeforeAfter]:
    """What `run_collective` must return on each rank, computed in one process."""
    check_op(op, world_size, length)
    xs = [start_tensor(r, length, op) for r in range(world_size)]
    total = torch.stack(xs).sum(0)
    out = []
    for r, x in enumerate(xs):
        before, after = x, None
        if op == "broadcast":
            after = xs[ROOT]
        elif op == "scatter":
            before = x if r == ROOT else None
            after = xs[ROOT].chunk(world_size)[r]
        elif op == "gather":
            after = torch.cat(xs) if r == ROOT else None
        elif op == "reduce":
            after = total if r == ROOT else None
        elif op == "all_gather":
            after = torch.cat(xs)
        elif op == "reduce_scatter":
            after = total.chunk(world_size)[r]
        elif op == "all_reduce":
            after = total
        else:
            after = torch.cat([y.chunk(world_size)[r] for y in xs])
        out.append(BeforeAfter(before, after))
    return out


def mismatch(got: list[BeforeAfter], want: list[BeforeAfter]) -> str | None:
    """The first rank whose before/after differs from `expected`, in words; None if all agree."""
    for rank, (g, w) in enumerate(zip(got, want)):
        for key in ("before", "after"):
            mine, theirs = getattr(g, key), getattr(w, key)
            if (mine is None) != (theirs is None) or (
                    mine is not None and not torch.equal(mine.cpu(), theirs)):
                return f"rank {rank} {key} is {mine}, expected {theirs}"
    return None


def all_reduce_two_ways(rank: int, world_size: int, length: int = 4, group=None) -> dict:
    """Rank function: all-reduce, and reduce-scatter followed by all-gather, on the same data."""
    rank, size = group_rank(group), group_size(group)
    check_op("reduce_scatter", size, length)
    direct = start_tensor(rank, length).to(rank_device())
    dist.all_reduce(direct, group=group)
    piece = torch.empty(length // size, device=direct.device)
    reduce_scatter_into(piece, start_tensor(rank, length).to(direct.device), group=group)
    rebuilt = torch.empty(length, device=direct.device)
    all_gather_into(rebuilt, piece, group=group)
    return {"all_reduce": direct, "reduce_scatter": piece, "then_all_gather": rebuilt}


def lecture_example(rank: int, world_size: int, group=None) -> dict:
    """The lecture's running example: rank r holds [0, 1, 2, 3] + r."""
    result = all_reduce_two_ways(rank, world_size, length=4, group=group)
    return {k: v.tolist() for k, v in result.items()}


# ---------------------------------------------------------------------------------------
# Gaps between backends: probe what this torch's backend does, and the portable way.
# ---------------------------------------------------------------------------------------

def probe_backend(rank: int, world_size: int, group=None, on_gloo: bool = False) -> dict:
    """Rank function: try the calls some backends refuse, and the course's portable forms.

    {call: "works" or "fails: <the backend's reason>"}. Every message is reduced to its
    deterministic part (no times, no pids, no paths). `on_gloo=True` probes a gloo group even
    where the default backend is NCCL, so the answer is the same on every machine.
    """
    if on_gloo and dist.get_backend(group) != "gloo":
        group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD),
                               backend="gloo")
    world = group_size(group)  # N, the number of ranks
    device = rank_device() if dist.get_backend(group) != "gloo" else torch.device("cpu")
    x = start_tensor(group_rank(group), 4).to(device)

    def attempt(call):
        try:
            with fd2_muted():
                call()
            return "works"
        except (RuntimeError, ValueError) as error:
            first = str(error).strip().splitlines()[0]
            # Drop the C++ prefix "[rank0]:[F1129 12:00:00.0 File.cpp:123] " (time, path).
            return "fails: " + re.sub(r"^\[rank\d+\]:\[[^\]]*\]\s*", "", first)[:90]

    def reduce_scatter(input_shape, output_shape):
        out = torch.empty(output_shape, device=device)
        return lambda: reduce_scatter_into(out, torch.ones(input_shape, device=device), group)

    lecture_input = torch.randn(world, 4, device=device)   # the lecture's 2-D input
    report = {
        "backend": dist.get_backend(group),
        "all_reduce(op=AVG)":
            attempt(lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.AVG, group=group)),
        "reduce_scatter(2-D input (w, n) -> output (n,))": attempt(reduce_scatter((world, 4), (4,))),
        f"reduce_scatter (N·2, 3) = ({2 * world}, 3) -> (2, 3)": attempt(
            reduce_scatter((2 * world, 3), (2, 3))),
        f"reduce_scatter (2, N·3) = (2, {3 * world}) -> (2, 3)": attempt(
            reduce_scatter((2, 3 * world), (2, 3))),
        "reduce_scatter_rows (flattened)": attempt(lambda: reduce_scatter_rows(
            torch.empty(4, device=device), lecture_input, group=group)),
        "all_reduce_mean": attempt(lambda: all_reduce_mean(x.clone(), group=group)),
    }
    dist.barrier(group=group)
    return report


# ---------------------------------------------------------------------------------------
# Every collective on live ranks, checked (notebook 01's figure and widget draw the result).
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveRun:
    """What `run_all` ran: per op, each rank's before/after; and the ops it had to leave out."""

    world_size: int
    length: int
    results: dict[str, list[dict]]
    skipped: tuple[str, ...]


def run_all(live, world_size: int, length: int, ops=OPS) -> CollectiveRun:
    """Run `ops` on `live` ranks resized to `world_size`; check each against `expected`.

    Ops that cannot cut `length` into `world_size` chunks are left out (named in `skipped`)
    rather than failing the rest; AssertionError names the first rank that differs.
    """
    from helpers.ranks import check_world_size
    check_world_size(world_size)
    check_int("length", length, 1)
    for op in ops:
        check_choice("op", op, OPS)
    live.resize(world_size)
    results, skipped = {}, []
    for op in ops:
        if op in SPLITTING_OPS and length % world_size:
            skipped.append(op)
            continue
        got = live.run(run_collective, op, length)
        wrong = mismatch(got, expected(op, world_size, length))
        if wrong:
            raise AssertionError(f"{op}: {wrong}")
        results[op] = got
    return CollectiveRun(world_size, length, results, tuple(skipped))


# ---------------------------------------------------------------------------------------
# Small rank functions of notebook 01 and the benchmarks.
# ---------------------------------------------------------------------------------------

def all_reduce_once(rank: int, world_size: int, numel: int = 4, group=None) -> float:
    """Rank function: one small all-reduce; the unit of interactivity in benchmarks."""
    x = start_tensor(group_rank(group), numel).to(rank_device())
    dist.all_reduce(x, group=group)
    return float(x[0])


def forgetful_all_reduce(rank: int, world_size: int, group=None) -> str:
    """Rank function: every rank but the last calls all_reduce; the rest wait for it forever.

    The rule it breaks: every rank of a group must call every collective, in the same order.
    """
    if group_rank(group) == group_size(group) - 1:
        return "returned without calling all_reduce"
    x = start_tensor(group_rank(group), 4).to(rank_device())
    dist.all_reduce(x, group=group)
    return "done"


def barrier_demo(rank: int, world_size: int, seconds_per_rank: float = 0.2, group=None) -> dict:
    """Rank function: ranks arrive at a barrier at different times and leave it together.

    arrived_s / left_s: seconds since this rank started, rounded; arrived_at / left_at: the
    machine-wide monotonic clock (the same for every rank), to compare ranks with each other."""
    start = time.monotonic()
    time.sleep(seconds_per_rank * group_rank(group))
    arrived_at = time.monotonic()
    dist.barrier(group=group)
    left_at = time.monotonic()
    return {"arrived_s": round(arrived_at - start, 2), "left_s": round(left_at - start, 2),
            "arrived_at": arrived_at, "left_at": left_at}
