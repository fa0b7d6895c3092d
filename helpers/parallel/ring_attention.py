"""Ring attention (context parallelism): causal attention over a sequence split across the c
ranks of a group, for notebook 09.

Each rank keeps the queries of its share of the sequence for the whole computation and sees
every key/value block in turn: the K/V blocks travel around the ring, one hop per step, and
while block i is attended to, block i + 1 is already on its way (`isend`/`irecv` started
before the step's attention, waited for after it). After c steps every query has met every key.

* **Online softmax.** Attention over all keys is softmax over one long row, but a rank only
  ever holds one block of it. Each block gives an output o_b = softmax_b · V_b and the
  log-sum-exp l_b of its scores; two partial results combine exactly as
  l = log(e^{l_1} + e^{l_2}),  o = e^{l_1 − l} o_1 + e^{l_2 − l} o_2  (`merge`).
* **Causal masking by chunks.** The sequence is cut into equal chunks (`helpers.cost.context`):
  a query chunk attends fully to an earlier key chunk, with the causal triangle to its own,
  and not at all to a later one, which is skipped, not masked. With the naive split (rank r
  holds chunk r) the last rank works c times as long as the first; the zig-zag split (rank r
  holds chunks r and 2c − 1 − r) gives every rank the same work.
* **Backward** (`RingAttention.backward`) is a second ring, FlashAttention's backward block by
  block: the saved output and log-sum-exp rebuild each block's probabilities, dQ stays home,
  and the block's dK/dV accumulator travels with it, each rank adding its queries' share, until
  the last hop brings it back to the block's owner. No rank ever holds the s × s scores.

Point-to-point calls name *global* ranks (`global_rank`), so rings of several groups can share
one world.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from helpers.cost.context import block_pairs, chunks_of
from helpers.models import Attention
from helpers.parallel import trace
from helpers.parallel.groups import global_rank, group_rank, group_size

# ----------------------------------------------------------------------------------------
# What each rank did when: compute spans, waits and bytes sent (timelines, idle time).
# ----------------------------------------------------------------------------------------

def _span(kind: str, phase: str, step: int, start: float) -> None:
    """Log a "compute" or "wait" span of ring step `step` (0 … c − 1) that began at `start`."""
    if trace.recording_for("ring"):
        trace.record("ring", trace.Span(kind, start, time.perf_counter(), phase=phase, step=step))


class Shift:
    """One hop around the ring in flight: my tensor to the next rank, the previous rank's here."""

    def __init__(self, tensor: torch.Tensor, tag: int, group):
        c, r = group_size(group), group_rank(group)
        self.inbox = torch.empty_like(tensor)
        self.works = [dist.isend(tensor, global_rank(group, (r + 1) % c), group=group, tag=tag),
                      dist.irecv(self.inbox, global_rank(group, (r - 1) % c), group=group, tag=tag)]
        if trace.recording_for("ring"):
            trace.record("ring", trace.Comm("ring", "send", tensor.numel() * tensor.element_size(),
                                            group_size=c, start=time.perf_counter()))

    def wait(self, phase: str, step: int) -> torch.Tensor:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        _span("wait", phase, step, start)
        return self.inbox


# ----------------------------------------------------------------------------------------
# Blocks and the online softmax.
# ----------------------------------------------------------------------------------------

def scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if diagonal:  # the same chunk: query i sees keys 0 … i only
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two partial softmax results over disjoint keys (log-sum-exp weights)."""
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]
    return out, new


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, layout, group, pause_s):
        c, r = group_size(group), group_rank(group)
        mine = chunks_of(r, c, layout)
        size = q.shape[2] // len(mine)
        qs = q.split(size, dim=2)
        outs = [torch.zeros_like(x) for x in qs]
        lses = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype) for x in qs]
        kv = torch.stack([k, v])
        for step in range(c):
            shift = Shift(kv, 0, group) if step < c - 1 else None
            start = time.perf_counter()
            theirs = chunks_of((r - step) % c, c, layout)
            ks, vs = kv[0].split(size, dim=2), kv[1].split(size, dim=2)
            for i, j, diagonal in block_pairs(mine, theirs):
                if pause_s:   # wait mode: the block's time, no arithmetic
                    time.sleep(pause_s * (0.5 if diagonal else 1.0))
                    continue
                s = scores(qs[i], ks[j], diagonal)
                lse = s.logsumexp(-1)
                outs[i], lses[i] = merge(outs[i], lses[i], torch.exp(s - lse[..., None]) @ vs[j], lse)
            _span("compute", "forward", step, start)
            if shift is not None:
                kv = shift.wait("forward", step)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.pause_s = layout, group, pause_s
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, c, r = ctx.group, group_size(ctx.group), group_rank(ctx.group)
        mine = chunks_of(r, c, ctx.layout)
        size, scale = q.shape[2] // len(mine), 1 / math.sqrt(q.shape[-1])
        qs, dos = q.split(size, dim=2), dout.split(size, dim=2)
        lses = lse.split(size, dim=2)
        deltas = (dout * out).sum(-1).split(size, dim=2)   # rowsum(dO ∘ O)
        dqs = [torch.zeros_like(x) for x in qs]
        kv, travelling = torch.stack([k, v]), None
        for step in range(c):
            shift = Shift(kv, 0, group) if step < c - 1 else None
            start = time.perf_counter()
            theirs = chunks_of((r - step) % c, c, ctx.layout)
            ks, vs = kv[0].split(size, dim=2), kv[1].split(size, dim=2)
            part = torch.zeros_like(kv)
            dks, dvs = part[0].split(size, dim=2), part[1].split(size, dim=2)
            for i, j, diagonal in block_pairs(mine, theirs):
                if ctx.pause_s:   # a backward block costs about twice a forward one
                    time.sleep(2 * ctx.pause_s * (0.5 if diagonal else 1.0))
                    continue
                p = torch.exp(scores(qs[i], ks[j], diagonal) - lses[i][..., None])
                dvs[j].add_(p.transpose(-1, -2) @ dos[i])
                ds = p * (dos[i] @ vs[j].transpose(-1, -2) - deltas[i][..., None])
                dqs[i].add_(ds @ ks[j] * scale)
                dks[j].add_(ds.transpose(-1, -2) @ qs[i] * scale)
            _span("compute", "backward", step, start)
            if travelling is not None:   # what the ranks before me added to this block
                part += travelling.wait("backward", step)
            travelling = Shift(part, 1, group) if c > 1 else None
            if shift is not None:
                kv = shift.wait("backward", step)
        dkv = travelling.wait("backward", c - 1) if c > 1 else part
        return torch.cat(dqs, dim=2), dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "zigzag",
                   group=None, pause_s: float | None = None) -> torch.Tensor:
    """(b, heads, s/c, d) local q, k, v in `layout`'s chunk order → this rank's outputs.

    `pause_s` (wait mode, as notebook 05's pipeline): every full block of the forward sleeps
    that long instead of computing (a diagonal half as long, the backward twice), while the
    blocks still travel for real; the outputs are then meaningless but the schedule's timing is
    exact, even with more ranks than cores."""
    return RingAttention.apply(q, k, v, layout, group, pause_s)


# ----------------------------------------------------------------------------------------
# Splitting a sequence, and one step checked against full attention.
# ----------------------------------------------------------------------------------------

def local(x: torch.Tensor, rank: int, c: int, layout: str, dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s rows of x (its chunks along `dim`, in order)."""
    chunks = x.chunk(c * len(chunks_of(0, c, layout)), dim=dim)
    return torch.cat([chunks[i] for i in chunks_of(rank, c, layout)], dim=dim)


def assemble(pieces: list[torch.Tensor], layout: str, dim: int = 2) -> torch.Tensor:
    """The inverse of `local`: every rank's rows back in sequence order."""
    c = len(pieces)
    n = c * len(chunks_of(0, c, layout))
    order: list[torch.Tensor | None] = [None] * n
    for rank, piece in enumerate(pieces):
        mine = chunks_of(rank, c, layout)
        for index, chunk in zip(mine, piece.chunk(len(mine), dim=dim)):
            order[index] = chunk
    return torch.cat(order, dim=dim)


# ----------------------------------------------------------------------------------------
# Notebook 07's decoder with ring attention in every block.
# ----------------------------------------------------------------------------------------

class ContextParallelAttention(nn.Module):
    """An `Attention` whose causal attention runs over the ring: (b, s/c, h) in and out,
    this rank's rows of the sequence in `layout`'s order. The weights are the same."""

    def __init__(self, attention: Attention, layout: str = "zigzag", group=None):
        super().__init__()
        self.q, self.k, self.v, self.out = attention.q, attention.k, attention.v, attention.out
        self.heads, self.layout, self.group = attention.heads, layout, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape

        def split(y):  # (b, s, heads·d) → (b, heads, s, d)
            return y.view(b, s, self.heads, width // self.heads).transpose(1, 2)

        out = ring_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), self.layout,
                             self.group)
        return self.out(out.transpose(1, 2).reshape(b, s, width))


