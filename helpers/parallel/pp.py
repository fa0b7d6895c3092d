"""Pipeline parallelism's blocks: which layers a stage holds, the mailbox that carries
activations forward and gradients back between stages, and a stage's backward split in two
(B, the gradient of its input; W, the gradient of its weights) for the zero-bubble schedules.

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
from torch import nn

from helpers.configs import MLPConfig
from helpers.cost.schedules import Action, rank_of_stage, stage_of
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
    Peers are group members; the calls themselves name their global ranks. `layout` says which
    rank runs which stage (`helpers.cost.schedules.placement`: "loop", or DualPipeV's "v").
    """

    def __init__(self, m: int, v: int, shape: tuple, group=None, layout: str = "loop"):
        self.group, self.me, self.p = group, group_rank(group), group_size(group)
        self.m, self.stages, self.shape, self.layout = m, self.p * v, shape, layout
        self.posted: dict[Action, tuple] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.sends: list = []

    def tag(self, kind: str, stage: int, mb: int) -> int:
        return ((kind == "B") * self.stages + stage) * self.m + mb

    def source(self, a: Action) -> _Message | None:
        """Who sends what action `a` consumes, or None at the pipeline's ends."""
        s = stage_of(a, self.me, self.p, self.layout)
        if a.kind == "F" and s > 0:
            return _Message(rank_of_stage(s - 1, self.p, self.layout), self.tag("F", s, a.mb))
        if a.kind == "B" and s < self.stages - 1:
            return _Message(rank_of_stage(s + 1, self.p, self.layout), self.tag("B", s, a.mb))
        return None  # a W needs nothing from anyone

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
        dst, tag = rank_of_stage(stage, self.p, self.layout), self.tag(kind, stage, mb)
        if dst == self.me:
            self.local[tag] = tensor
        else:  # keep the tensor alive until the send completes
            work = dist.isend(tensor, dst=global_rank(self.group, dst), group=self.group, tag=tag)
            self.sends.append((work, tensor))

    def flush(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()




# ------------------------------------------------------------------------------------------
# The backward in two: B (input gradient) now, W (weight gradients) later.
# ------------------------------------------------------------------------------------------

class Tape(NamedTuple):
    """A stage's forward of one micro-batch, kept for its backward: the input (None when no
    gradient flows into it: the first stage), the output (or the loss, on the last stage), and
    every module that holds parameters with the output it produced."""
    inp: torch.Tensor | None
    out: torch.Tensor
    weighted: tuple[tuple[nn.Module, torch.Tensor], ...]


class WeightWork(NamedTuple):
    """What B leaves for W: each parameter-holding module, its output and that output's
    gradient."""
    weighted: tuple[tuple[nn.Module, torch.Tensor], ...]
    grads: tuple[torch.Tensor, ...]


def record_forward(layers: nn.Sequential, inp: torch.Tensor | None, x: torch.Tensor) -> Tape:
    """Run `layers` on `x` module by module, keeping each parameter-holding module's output
    (the point where W will pick its gradient up). `inp` is `x` when the stage must return
    the gradient of its input, None otherwise."""
    weighted = []
    for module in layers:
        x = module(x)
        if any(True for _ in module.parameters(recurse=False)):
            weighted.append((module, x))
    return Tape(inp, x, tuple(weighted))


def backward_input(tape: Tape, grad: torch.Tensor | None = None):
    """B: the gradients of the stage's input and of every weighted module's output, and no
    weight gradient. Returns (input gradient or None, the `WeightWork` W will finish).

    `torch.autograd.grad` runs only the graph's edges that lead to the tensors asked for, so
    the weights' matmuls are skipped; the graph is kept (retain_graph) for W."""
    outs = [out for _, out in tape.weighted]
    wanted = ([tape.inp] if tape.inp is not None else []) + outs
    grads = torch.autograd.grad(tape.out, wanted, grad_outputs=grad, retain_graph=True)
    grad_in = grads[0] if tape.inp is not None else None
    return grad_in, WeightWork(tape.weighted, tuple(grads[len(wanted) - len(outs):]))


def backward_weight(work: WeightWork) -> None:
    """W: each weighted module's parameter gradients from its output's gradient, added to
    `.grad` as `backward()` would. One call per module: asked for all modules' weights at
    once, autograd would also push each output's gradient down into the earlier modules."""
    for (module, out), grad in zip(work.weighted, work.grads):
        params = list(module.parameters(recurse=False))
        for param, g in zip(params, torch.autograd.grad(out, params, grad_outputs=grad)):
            param.grad = g if param.grad is None else param.grad.add_(g)
