"""The one record of a 3-D layout: d-way data × t-way tensor × p-way pipeline parallelism over
d·t·p ranks, with m micro-batches per step. Torch-free: the cost model prices it
(`helpers.cost.parallel3d`), `helpers.parallel.mesh.build_groups` turns it into process groups
on every rank, the labs run it and the views draw it. It is validated where it is made.

The ranks: mesh shape (p, d, t), dimension names ("pp", "dp", "tp"), rank = (pp·d + dp)·t + tp.
TP varies fastest, then DP, then PP, as in Megatron-LM (its default order "tp-cp-ep-dp-pp"
lists the fastest-varying dimension first) and torchtitan (its device mesh is
("pp", "dp_replicate", "dp_shard", "cp", "tp"), innermost last). The reason is bandwidth:

* TP all-reduces activations inside every block, forward and backward, on the critical path:
  the most traffic, the most often. Consecutive ranks share a node (a launcher puts ranks
  0 … 7 on the first 8-GPU node), so TP groups stay on the node's fast links ("TP inside a node").
* DP all-reduces gradients once per step and can hide that behind the backward pass.
* PP only sends activations point-to-point between neighbouring stages: the least traffic, so
  it takes the slowest links, across nodes.

The rank order is exactly `torch.distributed.device_mesh.init_device_mesh("cpu", layout.shape,
mesh_dim_names=layout.names)`'s (the tests check every group against `mesh.get_group(name)`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from helpers.checks import check_int


class Coords(NamedTuple):
    """Where a rank sits: its index along the data, tensor and pipeline dimensions."""
    dp: int
    tp: int
    pp: int


class Groups(NamedTuple):
    """One entry per kind of parallelism: every block of ranks (`Layout.groups`), one rank's
    fellow members (`Layout.groups_of`) or its process groups (`build_groups`)."""
    dp: Any
    tp: Any
    pp: Any


@dataclass(frozen=True, order=True)
class Layout:
    """d-way data × t-way tensor × p-way pipeline parallelism, m micro-batches per step."""
    d: int
    t: int
    p: int
    m: int = 1

    names = ("pp", "dp", "tp")  # the mesh's dimensions, outermost (slowest-varying) first

    def __post_init__(self):
        for name in ("d", "t", "p", "m"):
            check_int(name, getattr(self, name))

    @property
    def world(self) -> int:
        return self.d * self.t * self.p

    @property
    def shape(self) -> tuple[int, int, int]:
        """(p, d, t): the mesh shape to give `init_device_mesh` with `names`."""
        return (self.p, self.d, self.t)

    def __str__(self) -> str:
        return f"{self.d}·{self.t}·{self.p} m={self.m}"

    def describe(self) -> str:
        return f"d={self.d} · t={self.t} · p={self.p} = {self.world} ranks"

    def check_world_size(self, world_size: int) -> int:
        """The layout must cover the world exactly."""
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

    def problem(self, config) -> str | None:
        """Why this layout cannot run `config` (in the wording of helpers.checks), or None if it
        can: t must divide the heads, p the blocks, d·m the sequences of the batch."""
        for name, value, by, why in (
                ("heads", config.heads, self.t, f"each of the t={self.t} TP ranks keeps whole heads"),
                ("layers", config.layers, self.p, f"each of the p={self.p} stages gets as many blocks"),
                ("batch", config.batch, self.d * self.m,
                 f"d·m = {self.d}·{self.m} equal micro-batches of whole sequences")):
            if value % by:
                return f"{name} must be a multiple of {by} ({why}), got {value}"
        return None

    def check(self, config) -> "Layout":
        """This layout, or ValueError naming what `config` cannot split."""
        problem = self.problem(config)
        if problem:
            raise ValueError(problem)
        return self


def factorizations(world_size: int) -> list[Layout]:
    """Every layout d·t·p = world_size (m = 1), in order of d, then t."""
    check_int("world_size", world_size)
    return [Layout(d, t, world_size // (d * t))
            for d in range(1, world_size + 1) if world_size % d == 0
            for t in range(1, world_size // d + 1) if world_size // d % t == 0]
