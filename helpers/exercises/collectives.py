"""Notebook 01's coding exercise: an all-reduce built from point-to-point sends and receives, the
ring algorithm (a reduce-scatter, then an all-gather, each n − 1 steps to the next rank)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.exercises.coding import Case, Exercise, Mistake, register

P2P = {"send", "recv", "isend", "irecv"}


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`, on every rank, sending only to the next rank of the ring
    and receiving only from the previous one: 2(n − 1) steps of one chunk each."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(x.clone().tensor_split(n))  # uneven sizes: the first chunks are one longer
    # Reduce-scatter: at step s, pass chunk rank − s on and add the incoming chunk rank − s − 1.
    # After n − 1 steps this rank holds the full sum of chunk rank + 1.
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[into])
        sending = dist.isend(chunks[out], right)  # isend: every rank sends and receives at once
        dist.recv(incoming, left)
        sending.wait()
        chunks[into] += incoming
    # All-gather: pass the finished chunks around the ring, n − 1 steps again.
    for step in range(n - 1):
        out, into = (rank + 1 - step) % n, (rank - step) % n
        sending = dist.isend(chunks[out], right)
        dist.recv(chunks[into], left)
        sending.wait()
    return torch.cat(chunks)


def _given(rank: int, case: Case, group) -> tuple:
    g = case.generator(rank)
    return (torch.randint(-9, 10, (case.size,), generator=g).float(),)


def _want(case: Case) -> dict:
    total = sum(_given(r, case, None)[0] for r in range(case.world))
    return {r: total for r in range(case.world)}


def _comm(case: Case, calls: list) -> str | None:
    n, nbytes = case.world, case.size * 4
    for rank, made in enumerate(calls):
        other = sorted({c.op for c in made} - P2P)
        if other:
            return (f"rank {rank} called {other[0]}: build the all-reduce from send and recv "
                    "only (the collective itself is what is being built)")
        for c in made:
            if c.op in ("send", "isend") and c.peer not in ((rank + 1) % n, (rank - 1) % n):
                return (f"rank {rank} sent to rank {c.peer}, which is not its neighbour in the "
                        "ring: each rank talks only to the next and the previous")
    sent = sum(c.nbytes for made in calls for c in made if c.op in ("send", "isend"))
    ring = 2 * (n - 1) * nbytes  # each of the n chunks travels n − 1 times in each phase
    if sent != ring:
        return (f"the ranks sent {sent} bytes in all, a ring sends 2(n − 1) × {nbytes} = {ring}: "
                + ("more than a ring: whole tensors instead of chunks?" if sent > ring else
                   "fewer than a ring: a phase left out?"))
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _calls_the_collective(x):
    dist.all_reduce(x)
    return x


def _reduce_scatter_only(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.clone().tensor_split(n))
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[into])
        sending = dist.isend(chunks[out], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        sending.wait()
        chunks[into] += incoming
    return torch.cat(chunks)


def _receives_from_the_right(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.clone().tensor_split(n))
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[into])
        sending = dist.isend(chunks[out], (rank + 1) % n)
        dist.recv(incoming, (rank + 1) % n)  # the right neighbour never sends this way
        sending.wait()
        chunks[into] += incoming
    return torch.cat(chunks)


def _sends_everything_to_everyone(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    total, sending = x.clone(), []
    for other in range(n):
        if other != rank:
            sending.append(dist.isend(x, other))
    for other in range(n):
        if other != rank:
            incoming = torch.empty_like(x)
            dist.recv(incoming, other)
            total += incoming
    for request in sending:
        request.wait()
    return total


def _scales_its_own(x):
    return x * dist.get_world_size()


register(Exercise(
    id="ring_all_reduce", notebook="01", title="An all-reduce from send and recv: the ring",
    form="variation", solution=ring_all_reduce,
    cases=(Case(world=3, seed=0, size=10), Case(world=2, seed=1, size=7),
           Case(world=4, seed=2, size=10)),
    given=_given, want=_want, comm=_comm,
    mistakes=(
        Mistake("used the collective the lesson replaces", _calls_the_collective,
                "called all_reduce"),
        Mistake("skipped a phase", _reduce_scatter_only, "a phase left out"),
        Mistake("wrong neighbour", _receives_from_the_right, "deadlock"),
        Mistake("sent the whole tensor to every rank", _sends_everything_to_everyone,
                "whole tensors instead of chunks"),
        Mistake("computed locally without communicating", _scales_its_own,
                "made no call"),
    ),
))
