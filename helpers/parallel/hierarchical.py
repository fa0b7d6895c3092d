"""A hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes,
all-gather inside each node.

On a cluster the link between nodes is the slow level (InfiniBand against NVLink, about 9–18×),
so an all-reduce should send as few bytes across it as it can. A flat ring over all P ranks
sends 2(P−1)/P · n per hop that leaves a node. The hierarchical one first sums inside the node
(after the reduce-scatter each of the node's k ranks holds 1/k of the node's sum), then only
these shards cross: rank j of every node all-reduces shard j with rank j of the other nodes,
2(N−1)/N · n/k each; the all-gather inside the node puts the shards back together. Summing
inside the node before crossing is what NCCL's tree all-reduce does across nodes, and what the
simulator's communication model assumes (helpers/simulator/comm.py, `dp_comm`: one all-reduce
per network level, each on the degree placed there).

Works on any process group of the world's ranks given a placement (the node of each rank);
`helpers.cost.alpha_beta` predicts its time and its bytes per node uplink.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.cost.alpha_beta import cross_blocks, node_blocks
from helpers.parallel.collectives import reduce_scatter_rows
from helpers.parallel.groups import all_gather_into, group_size, split_groups


def node_groups(placement: tuple[int, ...]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node, this rank's peers across nodes): the two groups the hierarchical
    all-reduce runs on. Every rank calls it with the same placement (making a group is a
    collective over the world)."""
    inside = split_groups(node_blocks(placement))
    across = split_groups(cross_blocks(placement))
    return inside, across


def hierarchical_all_reduce(x: torch.Tensor, inside: dist.ProcessGroup,
                            across: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over every rank of the nodes, in place, sending only shards between nodes.

    `x` is contiguous and its element count divisible by the ranks per node k."""
    k = group_size(inside)
    flat = x.view(-1)
    if flat.numel() % k:
        raise ValueError(f"x must split into {k} equal shards (ranks per node); it has "
                         f"{flat.numel()} elements")
    shard = torch.empty(flat.numel() // k, dtype=x.dtype, device=x.device)
    reduce_scatter_rows(shard, flat, group=inside)   # this rank's 1/k of the node's sum
    dist.all_reduce(shard, group=across)             # the only step that crosses the link
    all_gather_into(flat, shard, group=inside)       # every rank of the node gets all k shards
    return x
