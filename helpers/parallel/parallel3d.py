"""3-D parallelism's blocks: data × tensor × pipeline at once, on notebook 07's decoder (its
runs are `helpers.labs.parallel3d`).

On world = d·t·p ranks laid out by `Layout(d, t, p, m)` (TP fastest, then DP, then PP):

* pipeline: the rank's pp coordinate is its stage; stage s of p owns blocks
  [s·L/p, (s+1)·L/p) (`pp.stage_range`), stage 0 also the embedding, the last stage also the
  head and the loss. Micro-batches run Megatron's 1F1B (`schedules.make_plan("1f1b")`),
  activations and their gradients, (b, s, h) each, travel through `pp.Mailbox` between the
  ranks of the PP group with the same (dp, tp) coordinates;
* tensor: every block of the stage is sharded over the TP group
  (`tp_transformer.shard_block`: heads split, Megatron's f and g around attention and MLP);
  embedding, LayerNorms and head stay replicated on it;
* data: each DP replica (the d ranks with the same (tp, pp)) takes its 1/d of the batch of
  sequences (`dp.shard`) and cuts it into m micro-batches of b = batch/(d·m) sequences; the
  stage module is wrapped in `dp.BucketedDDP` on the DP group, and every backward but the
  last micro-batch's runs inside `no_sync()`, so gradients are all-reduced once per step.

Every micro-batch's loss is `lm_loss(..., numel=batch·s/d)`: they add up to the replica's
mean over its tokens, and DDP's mean over the d replicas makes it the whole batch's mean, so
loss, gradients and parameters equal single-process training (`labs.parallel3d.reference_3d`)
up to float rounding. A rank's shards are named after the single-process parameters (`Shard`,
`stage_shards`).

`Clock` records what a rank did when, as `Span`s on the machine-wide
`time.perf_counter` clock, in seconds from a common start (a world barrier right before the
recorded step): "compute" (forward and backward, with the TP collectives inside them cut out),
"tp_comm" (each collective of `helpers.parallel.tp`, from its `counting()` log), "pp_comm"
(waiting for a micro-batch's activations or gradient, and for the sends at the end) and
"dp_comm" (waiting for DDP's all-reduces after the last backward) and "optimizer" (its step,
the last thing of a step).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from helpers.models import Block, Transformer, lm_loss
from helpers.parallel.dp import BucketedDDP
from helpers.parallel.pp import Mailbox, stage_range
from helpers.parallel.tp_transformer import shard_dim
from helpers.parallel.trace import Span

SPAN_KINDS = ("compute", "tp_comm", "pp_comm", "dp_comm", "optimizer")


# ----------------------------------------------------------------------------------------
# Results.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """Where a rank's tensor sits in the single-process parameter of the same name: slice
    `index` of `parts` equal slices along `dim`, or (dim None) the whole of it."""
    dim: int | None
    index: int = 0
    parts: int = 1

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard's piece of the whole tensor."""
        return whole if self.dim is None else whole.chunk(self.parts, self.dim)[self.index]


# ----------------------------------------------------------------------------------------
# The stage module.
# ----------------------------------------------------------------------------------------

class Stage(nn.Module):
    """Pipeline stage `index` of p: its blocks, each passed through `shard` (e.g.
    `tp_transformer.shard_block` on the TP group; None keeps them whole), plus the embedding
    (stage 0) and the head (last stage). Parameter names are the single-process model's
    ("embed.tokens.weight", "blocks.5.attn.q.weight", "head.out.weight" …)."""

    def __init__(self, model: Transformer, index: int, p: int,
                 shard: Callable[[Block], Block] | None = None):
        super().__init__()
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleDict({str(i): shard(model.blocks[i]) if shard else model.blocks[i]
                                     for i in stage_range(index, p, model.config)})
        self.head = model.head if index == p - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (b, s) on stage 0, else activations (b, s, h) → activations, or logits
        (b, s, V) on the last stage."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(x)


def stage_shards(stage: Stage, t: int, tp_rank: int) -> dict[str, Shard]:
    return {name: Shard(dim, tp_rank, t) if (dim := shard_dim(name)) is not None else Shard(None)
            for name, _ in stage.named_parameters()}


# ----------------------------------------------------------------------------------------
# The timeline.
# ----------------------------------------------------------------------------------------

class Clock:
    """Records Spans (when enabled) in seconds from `t0`; compute spans are cut around the TP
    collectives that `log` (tp.counting's list of `trace.Comm`) recorded inside them."""

    def __init__(self, enabled: bool, log: list | None = None):
        self.enabled, self.log = enabled, log
        self.spans: list[Span] = []
        self.t0 = 0.0

    @contextlib.contextmanager
    def span(self, kind: str, label: str = ""):
        if not self.enabled:
            yield
            return
        seen, start = len(self.log), time.perf_counter()
        yield
        end = time.perf_counter()
        if kind != "compute":
            self.spans.append(Span(kind, start - self.t0, end - self.t0, label))
            return
        for record in self.log[seen:]:  # compute, collective, compute, …
            self.spans.append(Span("compute", start - self.t0, record.start - self.t0, label))
            start = record.start + record.seconds
            self.spans.append(Span("tp_comm", record.start - self.t0, start - self.t0,
                                   f"{record.op} {record.phase}"))
        self.spans.append(Span("compute", start - self.t0, end - self.t0, label))


# ----------------------------------------------------------------------------------------
# The rank function.
# ----------------------------------------------------------------------------------------

def pipeline_step(model: BucketedDDP, plan, stage: int, p: int, inputs, targets, numel: int,
                   mail: Mailbox, clock: Clock) -> float | None:
    """One step's forwards and backwards through this stage (1F1B plan); gradients are left
    accumulated in `.grad`, DDP synchronising on the last backward. Returns the replica's
    loss on the last stage."""
    last = p - 1
    final_backward = max(i for i, a in enumerate(plan) if a.kind == "B")
    saved, loss = {}, 0.0
    for i, a in enumerate(plan):
        if i + 1 < len(plan):
            mail.post(plan[i + 1])  # the next input travels while this action runs
        received = None
        if mail.source(a) is not None:  # a pipeline end needs no message
            with clock.span("pp_comm", f"wait {a.kind} {a.mb}"):
                received = mail.take(a)
        if a.kind == "F":
            with clock.span("compute", f"F {a.mb}"):
                inp = inputs[a.mb] if stage == 0 else received.requires_grad_()
                out = model(inp)
                if stage == last:
                    out = lm_loss(out, targets[a.mb], numel=numel)
                    loss += out.item()
            saved[a.mb] = (inp, out)
            if stage < last:
                mail.send(out.detach(), stage + 1, "F", a.mb)
        else:
            inp, out = saved.pop(a.mb)
            sync = contextlib.nullcontext() if i == final_backward else model.no_sync()
            with sync, clock.span("compute", f"B {a.mb}"):
                out.backward(None if stage == last else received)
            if stage > 0:
                mail.send(inp.grad, stage - 1, "B", a.mb)
    with clock.span("pp_comm", "sends"):
        mail.flush()
    return loss if stage == last else None


