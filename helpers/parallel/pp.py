"""Pipeline parallelism's blocks: which layers a stage holds, and the mailbox that carries
activations forward and gradients back between stages.

Every block takes `group=None`: the stage is `group_rank(group)`, p = `group_size(group)`, and
messages go to the neighbours' *global* ranks, so several pipelines can run side by side in
one world (notebook 07 runs one per data and tensor coordinate). Notebook 05's runs (GPipe,
1F1B and interleaved 1F1B on live ranks, the one-process reference, PyTorch's pipelining) are
`helpers.labs.pp`; the schedules themselves (lists of actions, the simulator) are
`helpers.cost.schedules`, the bubble arithmetic `helpers.cost.bubble`, the pictures
`helpers.views.pp`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from helpers.configs import MLPConfig
from helpers.cost.schedules import Action, stage_of
from helpers.parallel.groups import global_rank, group_rank, group_size


def stage_range(stage: int, stages: int, config: MLPConfig) -> range:
    """The layers of `stage` when the model is cut into `stages` equal stages."""
    per_stage = config.layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


class _Message(NamedTuple):
    member: int  # the sending or receiving stage's rank inside the group
    tag: int


class Mailbox:
    """One rank's asynchronous messages inside its pipeline group.

    Every message gets a distinct tag per (kind, stage, micro-batch), so activations can
    never be mistaken for another micro-batch's, or for a gradient, whatever order they
    arrive in. Receives are posted ahead of need (`post`); sends go out with isend and are
    only waited for at the end (`flush`). A message to oneself (stage s and s ± 1 on the
    same rank, which happens when p = 1 with interleaving) never leaves the process.
    Peers are group members; the calls themselves name their global ranks.
    """

    def __init__(self, m: int, v: int, shape: tuple, group=None):
        self.group, self.me, self.p = group, group_rank(group), group_size(group)
        self.m, self.stages, self.shape = m, self.p * v, shape
        self.posted: dict[Action, tuple] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.sends: list = []

    def tag(self, kind: str, stage: int, mb: int) -> int:
        return ((kind == "B") * self.stages + stage) * self.m + mb

    def source(self, a: Action) -> _Message | None:
        """Who sends what action `a` consumes, or None at the pipeline's ends."""
        s = stage_of(a, self.me, self.p)
        if a.kind == "F" and s > 0:
            return _Message((s - 1) % self.p, self.tag("F", s, a.mb))
        if a.kind == "B" and s < self.stages - 1:
            return _Message((s + 1) % self.p, self.tag("B", s, a.mb))
        return None

    def post(self, a: Action) -> None:
        """Start receiving what `a` will need, without waiting for it."""
        src = self.source(a)
        if src is not None and src.member != self.me and a not in self.posted:
            buffer = torch.empty(self.shape)
            work = dist.irecv(buffer, src=global_rank(self.group, src.member), group=self.group,
                              tag=src.tag)
            self.posted[a] = (work, buffer)

    def take(self, a: Action):
        """Block until the input of `a` has arrived and return it (None if it needs none)."""
        src = self.source(a)
        if src is None:
            return None
        if src.member == self.me:
            return self.local.pop(src.tag)
        self.post(a)
        work, buffer = self.posted.pop(a)
        work.wait()
        return buffer

    def send(self, tensor, stage: int, kind: str, mb: int) -> None:
        """Hand `tensor` to whoever runs `stage` and return at once."""
        dst, tag = stage % self.p, self.tag(kind, stage, mb)
        if dst == self.me:
            self.local[tag] = tensor
        else:  # keep the tensor alive until the send completes
            work = dist.isend(tensor, dst=global_rank(self.group, dst), group=self.group, tag=tag)
            self.sends.append((work, tensor))

    def flush(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


