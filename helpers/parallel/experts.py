"""Expert parallelism: notebook 09's mixture-of-experts layer on the e ranks of a group.

Every rank holds its own tokens and a copy of the router; the E experts are split, rank r of e
keeping experts r·E/e … (r+1)·E/e − 1. One layer forward:

1. route this rank's n tokens (`helpers.models.route`, its own capacity: one group per rank);
2. **counts**: how many rows go to each expert, exchanged with an all-to-all of e·(E/e)
   integers, so every rank knows how many rows it will receive, and for which of its experts;
3. **dispatch**: an all-to-all of the token rows with uneven split sizes (rank j's chunk is the
   rows for its experts);
4. each local expert runs on the rows it received, from every rank at once;
5. **combine**: the second all-to-all sends every result back to the rank its token lives on,
   which weights it by the gate and adds it to the token's output.

Backward runs the two all-to-alls the other way (`AllToAll.backward`): the gradient of a row
goes back to where the row came from. The router is replicated: its gradient is partial on each
rank (from that rank's tokens) and is summed across the group, as data parallelism would.

The one-process layer with groups = e (`MoE`, GShard's capacity groups) makes exactly the same
routing decisions, sends every expert the same rows in the same order, and so computes the same
loss and gradients; the tests check it for e = 2 and 4, top-1 and top-2, with drops.
Bytes are counted per rank as what it hands to the network: every row it sends to another rank
(its own chunk stays in the process), `helpers.cost.experts.sent_bytes`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from helpers.cost.experts import capacity as expert_capacity
from helpers.cost.experts import check_expert_degree, sent_bytes
from helpers.models import MoE, MoEStats, kept_slots, route, stats_of
from helpers.parallel import trace
from helpers.parallel.groups import group_rank, group_size

# ----------------------------------------------------------------------------------------
# Counting what each all-to-all sends.
# ----------------------------------------------------------------------------------------

def counting():
    """`with counting() as log:` → this module's all-to-alls as `trace.Comm`s, on this rank:
    `label` says what travelled ("counts", "dispatch" or "combine"), `nbytes` what this rank
    handed to other ranks."""
    return trace.recording("experts")


def _all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], what: str,
                phase: str, group) -> torch.Tensor:
    """Rows send_rows[j] of x (in order) to member j; returns what the members sent here."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, x, recv_rows, send_rows, group=group)
    if trace.recording_for("experts"):
        row_bytes = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        trace.record("experts", trace.Comm(
            "experts", "all_to_all", sent_bytes(send_rows, group_rank(group), row_bytes), phase,
            group_size(group), start, time.perf_counter() - start, what))
    return out


class AllToAll(torch.autograd.Function):
    """all-to-all forward; the reverse all-to-all of the gradients backward."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, what, group):
        ctx.rows, ctx.what, ctx.group = (send_rows, recv_rows), what, group
        return _all_to_all(x, send_rows, recv_rows, what, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.rows
        return _all_to_all(grad, recv_rows, send_rows, ctx.what, "backward", ctx.group), None, None, None, None


def exchange_counts(per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """(e, E/e) rows for each expert, grouped by rank → (e, E/e): row j is what member j will
    send for each of this rank's experts."""
    return _all_to_all(per_expert, [1] * per_expert.shape[0], [1] * per_expert.shape[0],
                       "counts", "forward", group)


# ----------------------------------------------------------------------------------------
# The layer.
# ----------------------------------------------------------------------------------------

class ExpertParallelMoE(nn.Module):
    """This rank's piece of an `MoE`: the whole router, experts r·E/e … (r+1)·E/e − 1.

    forward takes this rank's tokens (…, h) and returns their outputs; afterwards `aux_loss`
    and `stats` describe this rank's routing, like `MoE`'s for one group.
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        e, r = group_size(group), group_rank(group)
        self.config, self.group = moe.config, group
        check_expert_degree(e, self.config.experts)
        self.local = self.config.experts // e
        self.first = r * self.local
        self.router = moe.router
        self.register_buffer("router_bias", moe.router_bias, persistent=False)
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + self.local])
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        c, e = self.config, group_size(self.group)
        capacity = expert_capacity(x.shape[0], c.experts, c.top_k, c.capacity_factor)
        routing = route(self.router(x) + self.router_bias, c.top_k, capacity)
        self.aux_loss, self.stats = routing.aux_loss, stats_of([routing], capacity)
        slots = kept_slots(routing)                          # sorted by expert
        per_expert = torch.bincount(slots.expert, minlength=c.experts).view(e, self.local)
        incoming = exchange_counts(per_expert, self.group)   # (source, my expert)
        send_rows, recv_rows = per_expert.sum(1).tolist(), incoming.sum(1).tolist()
        rows = AllToAll.apply(x[slots.token], send_rows, recv_rows, "dispatch", self.group)
        # rows arrive source by source, each source's rows expert by expert
        pieces = list(rows.split(incoming.flatten().tolist()))
        for j, ffn in enumerate(self.experts):
            mine = slice(j, None, self.local)                # expert j's piece from every source
            sizes = [len(p) for p in pieces[mine]]
            outs = ffn(torch.cat(pieces[mine])).split(sizes)
            pieces[mine] = outs
        back = AllToAll.apply(torch.cat(pieces), recv_rows, send_rows, "combine", self.group)
        y = torch.zeros_like(x).index_add(0, slots.token, slots.gate[:, None] * back)
        return y.view(shape)


def local_name(name: str, first: int) -> str:
    """An EP parameter's single-process name: local expert j is expert first + j."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(int(parts[i]) + first)
    return ".".join(parts)


