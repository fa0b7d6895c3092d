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

On a cluster of equal nodes a *placement* is the node of each rank. The rank order being fixed,
it decides which groups cross the link between nodes: `splits` says, per kind, how many members
of a group sit on each node and on how many nodes (a `Split`: the simulator's degree on each of
two network levels); `crossing_hops` which pipeline boundaries cross; `placement_of` builds the
placement of a simulator split; `placements` lists those that differ for a layout.
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


# ----------------------------------------------------------------------------------------
# Placement: the node of each rank, on a cluster of equal nodes.
# ----------------------------------------------------------------------------------------

class Split(NamedTuple):
    """How one group lies on the nodes: `per_node` members on each of `nodes` nodes.

    On a network of two levels (inside a node; the link between nodes) this is the cost
    simulator's placement of one degree, `place[type] = (degree on level 0, degree on level 1)`
    (`helpers.simulator.reference.placements`, docs/cost_model.md §4, §6): per_node · nodes is
    the group's size, and the group crosses the link when nodes > 1."""
    per_node: int
    nodes: int

    @property
    def ranks(self) -> int:
        return self.per_node * self.nodes

    @property
    def crosses(self) -> bool:
        return self.nodes > 1

    def __str__(self) -> str:
        return f"across {self.nodes} nodes" if self.crosses else "inside a node"


def check_placement(layout: Layout, placement) -> tuple[int, ...]:
    """`placement[r]` is rank r's node: one entry per rank, every node 0 … n−1 holding as
    many ranks."""
    placement = tuple(placement)
    nodes = max(placement, default=-1) + 1
    ok = (len(placement) == layout.world
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in placement)
          and len({placement.count(n) for n in range(nodes)}) == 1)
    if not ok:
        raise ValueError(f"placement must give each of the {layout.world} ranks of {layout} a "
                         f"node 0 … n−1, as many ranks on every node, got {placement!r}")
    return placement


def splits(layout: Layout, placement) -> Groups:
    """How each kind of group (dp, tp, pp) lies on the nodes of `placement`: one `Split` per
    kind. Every group of a kind must lie the same way (as many members on each node it
    touches, as many nodes): what a placement built by `placement_of` always does."""
    placement = check_placement(layout, placement)
    out = []
    for kind, blocks in zip(Groups._fields, layout.groups()):
        found = set()
        for block in blocks:
            counts = [sum(placement[r] == n for r in block)
                      for n in sorted({placement[r] for r in block})]
            if len(set(counts)) != 1:
                raise ValueError(f"the {kind} group {block} has unequal shares on its nodes "
                                 f"{[placement[r] for r in block]}")
            found.add(Split(counts[0], len(counts)))
        if len(found) != 1:
            raise ValueError(f"the {kind} groups lie on the nodes in different ways: "
                             f"{sorted(found)}")
        out.append(found.pop())
    return Groups(*out)


def crossing_hops(layout: Layout, placement) -> tuple[bool, ...]:
    """For each of the p−1 stage boundaries (stage j → j+1), whether a pipeline hop over it
    crosses nodes in any PP group (the stage then waits for that hop). With one block per stage
    and a placement from `placement_of`, as many cross as the simulator's
    `helpers.simulator.comm.pp_frequencies` puts on the outer level."""
    placement = check_placement(layout, placement)
    return tuple(any(placement[g[j]] != placement[g[j + 1]] for g in layout.groups().pp)
                 for j in range(layout.p - 1))


def placement_of(layout: Layout, per_node: Groups) -> tuple[int, ...]:
    """The node of each rank when each node holds a box of per_node.dp × per_node.tp ×
    per_node.pp of the mesh: the simulator's inner-level degrees turned into ranks. Nodes are
    numbered in the mesh's own order (pp slowest, tp fastest), so that filling tp first, then
    dp, then pp gives consecutive ranks on each node, as a launcher places them."""
    for kind, degree in zip(Groups._fields, (layout.d, layout.t, layout.p)):
        inner = getattr(per_node, kind)
        check_int(f"per_node.{kind}", inner)
        if degree % inner:
            raise ValueError(f"per_node.{kind} must divide the {kind} degree {degree}, got {inner}")
    outer_dp, outer_tp = layout.d // per_node.dp, layout.t // per_node.tp
    nodes = []
    for rank in range(layout.world):
        c = layout.coords(rank)
        nodes.append((c.pp // per_node.pp * outer_dp + c.dp // per_node.dp) * outer_tp
                     + c.tp // per_node.tp)
    return tuple(nodes)


def placements(layout: Layout, nodes: int) -> list[tuple[int, ...]]:
    """Every placement of `layout` on `nodes` equal nodes that differs in which groups cross
    the link, one per way (`placement_of` each split of the node's ranks into dp × tp × pp
    degrees), TP filled inside a node first: the first one is the launcher's (consecutive
    ranks on a node)."""
    check_int("nodes", nodes)
    if layout.world % nodes:
        raise ValueError(f"nodes must divide the {layout.world} ranks of {layout}, got {nodes}")
    k = layout.world // nodes
    out, seen = [], set()
    for tp in _divisors(k):
        for dp in _divisors(k // tp):
            pp = k // (tp * dp)
            inner = Groups(dp=dp, tp=tp, pp=pp)
            if layout.d % dp or layout.t % tp or layout.p % pp:
                continue
            placed = placement_of(layout, inner)
            key = (splits(layout, placed), crossing_hops(layout, placed))
            if key not in seen:
                seen.add(key)
                out.append((-tp, -dp, placed))
    return [placed for *_, placed in sorted(out)]


def placement_name(layout: Layout, placement) -> str:
    """'tp inside · dp across': where each kind of group of degree > 1 lies."""
    parts = [f"{kind} {'across' if split.crosses else 'inside'}"
             for kind, split in zip(Groups._fields, splits(layout, placement)) if split.ranks > 1]
    order = {"tp": 0, "dp": 1, "pp": 2}
    return " · ".join(sorted(parts, key=lambda part: order[part.split()[0]])) or "one rank"


def blocks_on(placement, split: Split) -> list[list[int]]:
    """Groups of split.ranks ranks side by side covering every rank of `placement`, each
    split.per_node ranks from each of split.nodes neighbouring nodes (ranks in order): the
    groups a calibration times a split on."""
    placement = tuple(placement)
    on = [[r for r, n in enumerate(placement) if n == node] for node in sorted(set(placement))]
    if len(on) % split.nodes or len(on[0]) % split.per_node:
        raise ValueError(f"{len(on)} nodes of {len(on[0])} ranks cannot hold groups of "
                         f"{split.per_node} ranks on each of {split.nodes} nodes")
    out = []
    for first in range(0, len(on), split.nodes):
        for j in range(0, len(on[0]), split.per_node):
            out.append(sorted(r for node in on[first:first + split.nodes]
                              for r in node[j:j + split.per_node]))
    return sorted(out)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
