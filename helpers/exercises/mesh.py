"""Notebook 07's coding exercise: a rank's DP, TP and PP groups, built from the mesh.

On d·t·p ranks laid out as the course's mesh (`helpers.layout`: rank = (pp·d + dp)·t + tp, TP
varying fastest, then DP, then PP), every rank creates every DP, TP and PP process group with
`dist.new_group`, the same groups in the same order on every rank (creating a group is a
collective over the whole world), then proves its own three by all-reducing its tensor over
each. The cases are layouts of 4 ranks and one of 2 (`MeshCase` carries d, t, p); the checker
reads the group of every all-reduce.

Groups made differently on different ranks would hang in their rendezvous (gloo pairs ranks by
the group's place in the sequence of new_group calls), and a hang says nothing of the cause. So
while the reader's function runs on a rank, `dist.new_group` first compares the ranks every
rank asked for (`_SameGroupsEverywhere`, installed by `_given_on_rank`, removed by `_result`; a
rank that raises is torn down with its patch) and a difference fails at once, naming the ranks.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.exercises.coding import Case, Exercise, Mistake, register
from helpers.layout import Layout

KINDS = ("dp", "tp", "pp")  # the order of helpers.layout.Groups, and of the checked result


def mesh_groups(x: torch.Tensor, d: int, t: int, p: int) -> dict:
    """{"dp": …, "tp": …, "pp": …}: the sum of every member's `x` over each of this rank's
    three groups of the d × t × p mesh, one all-reduce on each group made with new_group."""
    rank = dist.get_rank()

    def at(dp, tp, pp):  # the course's mesh: TP varies fastest, then DP, then PP
        return (pp * d + dp) * t + tp

    blocks = {"dp": [[at(i, k, j) for i in range(d)] for j in range(p) for k in range(t)],
              "tp": [[at(i, k, j) for k in range(t)] for j in range(p) for i in range(d)],
              "pp": [[at(i, k, j) for j in range(p)] for i in range(d) for k in range(t)]}
    mine = {}
    for kind, groups in blocks.items():
        for members in groups:
            group = dist.new_group(members)  # every rank makes every group, in the same order
            if rank in members:
                mine[kind] = group
    sums = {}
    for kind, group in mine.items():
        sums[kind] = x.clone()  # all_reduce overwrites its tensor: each sum starts from x
        dist.all_reduce(sums[kind], group=group)
    return sums


@dataclass(frozen=True)
class MeshCase(Case):
    """A case of this exercise: `world` = d·t·p ranks laid out as the mesh (d, t, p); `size` is
    the length of each rank's tensor."""
    d: int = 1
    t: int = 1
    p: int = 1

    def __str__(self) -> str:
        return f"{self.world} ranks as d·t·p = {self.d}·{self.t}·{self.p}, seed {self.seed}"


def _case(d: int, t: int, p: int, seed: int) -> MeshCase:
    return MeshCase(world=d * t * p, seed=seed, size=3, d=d, t=t, p=p)


def _given(rank: int, case: MeshCase, group) -> tuple:
    g = case.generator(rank)
    return (torch.randint(-99, 100, (case.size,), generator=g).float(), case.d, case.t, case.p)


class _SameGroupsEverywhere:
    """dist.new_group while the reader's function runs: the ranks every rank asks for are
    compared first (one all_gather_object over the world, torch's own, not logged), so that a
    rank making another group than its peers fails at once instead of hanging."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, ranks=None, *args, **kwargs):
        from torch.distributed import distributed_c10d as c10d
        if kwargs.get("use_local_synchronization"):  # only the members call: nothing to compare
            return self.real(ranks, *args, **kwargs)
        self.calls += 1
        mine = sorted(ranks) if ranks is not None else None
        asked = [None] * dist.get_world_size()
        c10d.all_gather_object(asked, mine)
        if any(other != asked[0] for other in asked):
            by = {}
            for rank, other in enumerate(asked):
                by.setdefault(str(other), []).append(rank)
            said = ", ".join(f"rank(s) {who} asked for {members}" for members, who in by.items())
            raise RuntimeError(f"new_group call {self.calls}: {said}. new_group is a collective "
                               "over the whole world: every rank makes every group, the same "
                               "groups in the same order, members or not")
        return self.real(ranks, *args, **kwargs)


def _given_on_rank(rank: int, case: MeshCase, group) -> tuple:
    """`_given`, and on a live rank the guard on new_group for the reader's call."""
    if dist.is_initialized() and not isinstance(dist.new_group, _SameGroupsEverywhere):
        dist.new_group = _SameGroupsEverywhere(dist.new_group)
    return _given(rank, case, group)


def _sum_over(case: MeshCase, ranks) -> torch.Tensor:
    return sum(_given(r, case, None)[0] for r in ranks)


def _want(case: MeshCase) -> dict:
    layout = Layout(case.d, case.t, case.p)  # the course's one record of the mesh
    return {r: [_sum_over(case, members) for members in layout.groups_of(r)]
            for r in range(case.world)}


def _result(args: tuple, returned):
    """The three sums in the order dp, tp, pp (a missing one as None); on a rank, new_group
    is torch's own again."""
    if isinstance(dist.new_group, _SameGroupsEverywhere):
        dist.new_group = dist.new_group.real
    if not isinstance(returned, dict):
        return returned
    sums = [returned.get(kind) for kind in KINDS]
    for i, j in itertools.combinations(range(3), 2):  # one tensor under two names: say so
        if all(isinstance(s, torch.Tensor) for s in (sums[i], sums[j])) and \
                sums[i].data_ptr() == sums[j].data_ptr():
            sums[j] = f"{_SAME} {KINDS[i].upper()} sum"
    return sums


_SAME = "the very tensor of its"  # a result that is another one's tensor (it crosses as text)


# -- what the checker says ------------------------------------------------------------------

def _groups_in_order(case: MeshCase, order: tuple[str, ...]) -> dict:
    """{kind: rank's group} for every rank, when the mesh's axes run in `order` (slowest first):
    the groups a reader who mixed up the axis order builds."""
    size = {"dp": case.d, "tp": case.t, "pp": case.p}
    coords = list(itertools.product(*(range(size[k]) for k in order)))  # the last: fastest
    out = {}
    for kind in KINDS:
        axis = order.index(kind)
        out[kind] = {r: [q for q, c in enumerate(coords)
                         if all(c[i] == coords[r][i] for i in range(3) if i != axis)]
                     for r in range(case.world)}
    return out


def _hint(case: MeshCase, rank: int, got, want, given) -> str | None:
    """Which ranks' tensors the wrong sum adds up: the world, the rank alone, another kind's
    group, or the group under another axis order."""
    if not isinstance(got, list) or len(got) != 3:
        return 'return a dict {"dp": …, "tp": …, "pp": …} of the three sums'
    for kind, g in zip(KINDS, got):
        if isinstance(g, str) and g.startswith(_SAME):
            return (f"its {kind.upper()} sum is {g}: all_reduce overwrites its tensor, so the "
                    "later all-reduce summed the earlier one's sums (clone x for each)")
    mine = dict(zip(KINDS, Layout(case.d, case.t, case.p).groups_of(rank)))
    for kind, g, w in zip(KINDS, got, want):
        if not isinstance(g, torch.Tensor):
            return f'its "{kind}" entry is {type(g).__name__}, not the tensor of the sum'
        if g.shape == w.shape and torch.allclose(g, w):
            continue
        name, right = kind.upper(), mine[kind]
        if torch.allclose(g, _sum_over(case, range(case.world))):
            return (f"its {name} sum adds all {case.world} ranks: all-reduced over the world, "
                    f"not over its {name} group {right}")
        if torch.allclose(g, given[0]):
            return (f"its {name} sum is its own x: no other member of its {name} group {right} "
                    "reached it")
        theirs = {tuple(m): other.upper() for other, m in mine.items() if other != kind}
        for order in itertools.permutations(("pp", "dp", "tp")):
            members = _groups_in_order(case, order)[kind][rank]
            if members != right and torch.allclose(g, _sum_over(case, members)):
                also = f" (its {theirs[tuple(members)]} group)" if tuple(members) in theirs else ""
                return (f"its {name} sum is over ranks {members}{also}, the {name} group of a "
                        f"mesh whose axes run in another order: in the course's mesh rank = "
                        f"(pp·d + dp)·t + tp, TP varies fastest, then DP, then PP, so its {name} "
                        f"group is {right}")
        for members, other in theirs.items():
            if torch.allclose(g, _sum_over(case, members)):
                return (f"its {name} sum is the sum over its {other} group {list(members)}: "
                        f"the {name} and {other} groups mixed up")
        return (f"its {name} sum is no group's sum: did an all-reduce work on x in place, so "
                "that the next one summed sums? (all_reduce overwrites its tensor: clone x)")
    return None


def _comm(case: MeshCase, calls: list) -> str | None:
    """One all-reduce per group of more than one rank, each on that group, nothing else."""
    layout, world = Layout(case.d, case.t, case.p), tuple(range(case.world))
    for rank, made in zip(case.members(), calls):
        other = sorted({c.op for c in made} - {"all_reduce"})
        if other:
            return (f"rank {rank} called {other[0]}: each sum is one all_reduce over the "
                    "group, the other ranks' tensors need not reach it")
        mine = dict(zip(KINDS, (tuple(m) for m in layout.groups_of(rank))))
        used = [tuple(sorted(c.group)) if c.group else world for c in made]
        for kind, members in mine.items():
            if len(members) > 1 and members not in used:
                return (f"rank {rank} made no all_reduce on its {kind.upper()} group "
                        f"{list(members)}")
        stray = [g for g in used if g not in mine.values()]
        if stray:
            return (f"rank {rank} all-reduced over ranks {list(stray[0])}, none of its groups "
                    f"(DP {list(mine['dp'])}, TP {list(mine['tp'])}, PP {list(mine['pp'])})")
        if len(made) > 3:
            return f"rank {rank} made {len(made)} all-reduces: one per group is all it takes"
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _own_members(d: int, t: int, p: int, order=("pp", "dp", "tp")) -> dict:
    case = _case(d, t, p, 0)
    return {kind: members[dist.get_rank()]
            for kind, members in _groups_in_order(case, order).items()}


def _sums_over(x, groups: dict) -> dict:
    sums = {}
    for kind in KINDS:
        sums[kind] = x.clone()
        dist.all_reduce(sums[kind], group=groups[kind])
    return sums


def _every_group(d, t, p, order) -> dict:
    """Every rank makes every group of the mesh whose axes run in `order`; returns its own."""
    case, rank, mine = _case(d, t, p, 0), dist.get_rank(), {}
    for kind, by_rank in _groups_in_order(case, order).items():
        for members in sorted({tuple(m) for m in by_rank.values()}):
            group = dist.new_group(list(members))
            if rank in members:
                mine[kind] = group
    return mine


def _dp_varies_fastest(x, d, t, p):
    return _sums_over(x, _every_group(d, t, p, order=("pp", "tp", "dp")))


def _over_the_world(x, d, t, p):
    sums = {}
    for kind in KINDS:
        sums[kind] = x.clone()
        dist.all_reduce(sums[kind])  # no group: every rank of the world
    return sums


def _makes_only_its_own_groups(x, d, t, p):
    # Only the groups this rank is in: rank 0 makes [0, 2] while rank 1 makes [1, 3] at the
    # same call, and each group's rendezvous waits for members that are making another one.
    groups = {kind: dist.new_group(members) for kind, members in _own_members(d, t, p).items()}
    return _sums_over(x, groups)


def _gathers_everything(x, d, t, p):
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)  # every rank's x to every rank, then sum the members here
    return {kind: sum(everyone[r] for r in members)
            for kind, members in _own_members(d, t, p).items()}


register(Exercise(
    id="mesh_groups", notebook="07", title="A rank's DP, TP and PP groups from the mesh",
    form="variation", solution=mesh_groups,
    cases=(_case(2, 2, 1, seed=0), _case(1, 2, 2, seed=1), _case(2, 1, 2, seed=2),
           _case(4, 1, 1, seed=3), _case(1, 1, 2, seed=4)),
    given=_given_on_rank, want=_want, result=_result, comm=_comm, hint=_hint,
    mistakes=(
        Mistake("wrong order", _dp_varies_fastest, "TP varies fastest"),
        Mistake("wrong group", _over_the_world, "all-reduced over the world"),
        Mistake("deadlock", _makes_only_its_own_groups,
                "new_group is a collective over the whole world"),
        Mistake("sent the whole tensor to every rank", _gathers_everything, "called all_gather"),
    ),
))
