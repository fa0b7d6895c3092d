"""The 3-D layout's process groups: `build_groups(layout)`, called on every rank, turns the
rank lists of `helpers.layout.Layout` (pure arithmetic) into one DP, one TP and one PP group."""
from __future__ import annotations

import torch.distributed as dist

from helpers.layout import Groups, Layout
from helpers.parallel.groups import split_groups


def build_groups(layout: Layout) -> Groups:
    """On every rank: create every DP, then every TP, then every PP group (the same calls in
    the same order everywhere, as group creation is a collective over the world) and return
    this rank's three process groups."""
    layout.check_world_size(dist.get_world_size())
    return Groups(*(split_groups(blocks) for blocks in layout.groups()))
