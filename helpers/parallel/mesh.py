"""The 3-D mesh of notebook 07: which ranks do data, tensor and pipeline parallelism together.

`Mesh(d, t, p)` is pure arithmetic (no processes): d·t·p ranks laid out as a p × d × t array,
each rank with coordinates (dp, tp, pp) and one group per dimension, the ranks it talks to
for that kind of parallelism. `build_groups(mesh)`, called on every rank, turns those rank
lists into process groups.

The layout: mesh shape (p, d, t), dimension names ("pp", "dp", "tp"), rank = (pp·d + dp)·t + tp.
TP varies fastest, then DP, then PP, as in Megatron-LM (its default order "tp-cp-ep-dp-pp"
lists the fastest-varying dimension first) and torchtitan (its device mesh is
("pp", "dp_replicate", "dp_shard", "cp", "tp"), innermost last). The reason is bandwidth:

* TP all-reduces activations inside every block, forward and backward, on the critical path:
  the most traffic, the most often. Consecutive ranks share a node (a launcher puts ranks
  0 … 7 on the first 8-GPU node), so TP groups stay on the node's fast links ("TP inside a node").
* DP all-reduces gradients once per step and can hide that behind the backward pass.
* PP only sends activations point-to-point between neighbouring stages: the least traffic, so
  it takes the slowest links, across nodes.

The rank order is exactly `torch.distributed.device_mesh.init_device_mesh("cpu", mesh.shape,
mesh_dim_names=mesh.names)`'s (the tests check every group against `mesh.get_group(name)`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.distributed as dist

from helpers.checks import check_int
from helpers.parallel.groups import split_groups


class Coords(NamedTuple):
    """Where a rank sits: its index along the data, tensor and pipeline dimensions."""
    dp: int
    tp: int
    pp: int


class Groups(NamedTuple):
    """One entry per kind of parallelism: every block of ranks (`Mesh.groups`), one rank's
    fellow members (`Mesh.groups_of`) or its process groups (`build_groups`)."""
    dp: Any
    tp: Any
    pp: Any


@dataclass(frozen=True)
class Mesh:
    """d-way data × t-way tensor × p-way pipeline parallelism over d·t·p ranks."""
    d: int
    t: int
    p: int

    names = ("pp", "dp", "tp")  # the mesh's dimensions, outermost (slowest-varying) first

    def __post_init__(self):
        for name in ("d", "t", "p"):
            check_int(name, getattr(self, name))

    @property
    def world(self) -> int:
        return self.d * self.t * self.p

    @property
    def shape(self) -> tuple[int, int, int]:
        """(p, d, t): the mesh shape to give `init_device_mesh` with `names`."""
        return (self.p, self.d, self.t)

    def __str__(self) -> str:
        return f"d={self.d} · t={self.t} · p={self.p} = {self.world} ranks"

    def check_world_size(self, world_size: int) -> int:
        """The mesh must cover the world exactly."""
        check_int("world_size", world_size)
        if world_size != self.world:
            raise ValueError(f"world_size must be d·t·p = {self.d}·{self.t}·{self.p} = "
                             f"{self.world}, got {world_size}")
        return world_size

    def rank(self, dp: int, tp: int, pp: int) -> int:
        """The global rank at coordinates (dp, tp, pp)."""
        check_int("dp", dp, low=0, high=self.d - 1)
        check_int("tp", tp, low=0, high=self.t - 1)
        check_int("pp", pp, low=0, high=self.p - 1)
        return (pp * self.d + dp) * self.t + tp

    def coords(self, rank: int) -> Coords:
        check_int("rank", rank, low=0, high=self.world - 1)
        return Coords(dp=rank // self.t % self.d, tp=rank % self.t, pp=rank // (self.t * self.d))

    def groups(self) -> Groups:
        """Every group of each dimension, as lists of global ranks (the blocks `split_groups`
        takes), each list in rank order and the lists ordered by their first rank."""
        dp, tp, pp = range(self.d), range(self.t), range(self.p)
        return Groups(dp=[[self.rank(i, k, j) for i in dp] for j in pp for k in tp],
                      tp=[[self.rank(i, k, j) for k in tp] for j in pp for i in dp],
                      pp=[[self.rank(i, k, j) for j in pp] for i in dp for k in tp])

    def groups_of(self, rank: int) -> Groups:
        """The ranks in each of `rank`'s three groups (itself included)."""
        return Groups(*(next(block for block in blocks if rank in block)
                        for blocks in self.groups()))


def factorizations(world_size: int) -> list[Mesh]:
    """Every mesh d·t·p = world_size, in order of d, then t."""
    check_int("world_size", world_size)
    return [Mesh(d, t, world_size // (d * t))
            for d in range(1, world_size + 1) if world_size % d == 0
            for t in range(1, world_size // d + 1) if world_size // d % t == 0]


def build_groups(mesh: Mesh) -> Groups:
    """On every rank: create every DP, then every TP, then every PP group (the same calls in
    the same order everywhere, as group creation is a collective over the world) and return
    this rank's three process groups."""
    mesh.check_world_size(dist.get_world_size())
    return Groups(*(split_groups(blocks) for blocks in mesh.groups()))


@dataclass(frozen=True)
class RankPlace:
    """What one rank learned from `place`: its coordinates and the global ranks of its
    groups, as torch.distributed reports them."""
    rank: int
    coords: Coords
    members: Groups


def place(rank: int, world_size: int, d: int, t: int, p: int) -> RankPlace:
    """Rank function: build the mesh's groups and report where this rank sits in them."""
    groups = build_groups(Mesh(d, t, p))
    members = Groups(*(dist.get_process_group_ranks(g) for g in groups))
    return RankPlace(rank=rank, coords=Mesh(d, t, p).coords(rank), members=members)
