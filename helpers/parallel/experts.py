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

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_divisible, check_int
from helpers.configs import MOE, TRANSFORMER, MoEConfig, TransformerConfig
from helpers.cost.experts import capacity as expert_capacity
from helpers.cost.experts import check_expert_degree, moe_step_bytes, sent_bytes
from helpers.models import (MoE, MoEStats, kept_slots, lm_loss, make_moe_batch,
                            make_moe_transformer, make_tokens, moe_loss, route, stats_of)
from helpers.parallel.groups import CallLog, group_rank, group_size
from helpers.parallel.ring_attention import intra_op_threads

# ----------------------------------------------------------------------------------------
# Counting what each all-to-all sends.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Exchange:
    """One all-to-all on this rank."""
    what: str           # "counts", "dispatch" or "combine"
    phase: str          # "forward" or "backward"
    sent_bytes: int     # handed to other ranks
    seconds: float
    start: float        # time.perf_counter() when it began


_LOG = CallLog()          # every all-to-all this module issues, while someone counts
counting = _LOG.counting  # `with counting() as log:` → a list of Exchange, on this rank


def _all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], what: str,
                phase: str, group) -> torch.Tensor:
    """Rows send_rows[j] of x (in order) to member j; returns what the members sent here."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, x, recv_rows, send_rows, group=group)
    if _LOG.on:
        row_bytes = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        _LOG.add(Exchange(what, phase, sent_bytes(send_rows, group_rank(group), row_bytes),
                             time.perf_counter() - start, start))
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


# ----------------------------------------------------------------------------------------
# One training step, on ranks and on one process.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEStep:
    """One forward + backward of the layer: this rank's outputs, loss and gradients."""
    output: torch.Tensor                 # this rank's tokens' outputs (all tokens on one process)
    loss: float                          # the whole batch's loss
    grads: dict[str, torch.Tensor]       # single-process names (the router's summed over ranks),
                                         # and "input": this rank's tokens' gradient
    stats: MoEStats
    sent_bytes: int = 0                  # dispatch + combine, forward and backward
    count_bytes: int = 0                 # the counts' all-to-all
    comm_seconds: float = 0.0            # inside the dispatch and combine all-to-alls


def check_ep(e: int, config: MoEConfig) -> MoEConfig:
    """Checks in the parent; returns the config with one capacity group per rank."""
    check_int("e", e, 1, 64)
    check_expert_degree(e, config.experts)
    check_divisible("tokens", config.tokens, e, f"each of the e={e} ranks routes tokens/e tokens")
    return config.with_(groups=e)


def ep_step(rank: int, world_size: int, config: MoEConfig = MOE, group=None) -> MoEStep:
    """Rank function: build the layer from the seed, keep this rank's experts, route this
    rank's 1/e of the batch, forward + backward with `moe_loss`."""
    e, r = group_size(group), group_rank(group)
    layer = ExpertParallelMoE(MoE(config), group)
    x = make_moe_batch(config).chunk(e)[r].requires_grad_()   # as inside a network
    with counting() as log:
        y = layer(x)
        loss = moe_loss(y, layer.aux_loss, config, numel=y.numel() * e, share=1 / e)
        loss.backward()
    dist.all_reduce(layer.router.weight.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {local_name(n, layer.first): p.grad for n, p in layer.named_parameters()}
    grads["input"] = x.grad
    moved = [x for x in log if x.what != "counts"]
    return MoEStep(y.detach(), total.item(), grads, layer.stats,
                   sum(x.sent_bytes for x in moved), sum(x.sent_bytes for x in log) -
                   sum(x.sent_bytes for x in moved), sum(x.seconds for x in moved))


def run_ep_step(ranks, e: int, config: MoEConfig = MOE) -> list[MoEStep]:
    """`ep_step` on e live ranks (checked first: e divides the experts and the tokens)."""
    config = check_ep(e, config)
    return ranks.resize(e).run(ep_step, config)


def reference_step(config: MoEConfig = MOE) -> MoEStep:
    """The one-process layer on the whole batch, with config.groups capacity groups."""
    layer = MoE(config)
    x = make_moe_batch(config).requires_grad_()
    y = layer(x)
    loss = moe_loss(y, layer.aux_loss, config)
    loss.backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return MoEStep(y.detach(), loss.item(), {**grads, "input": x.grad}, layer.stats)


def compare(steps: list[MoEStep], reference: MoEStep) -> float:
    """Largest absolute difference between the ranks and one process: outputs, loss and
    every gradient (each expert's from the rank that holds it)."""
    worst = (torch.cat([s.output for s in steps]) - reference.output).abs().max().item()
    worst = max(worst, abs(steps[0].loss - reference.loss))
    inputs = torch.cat([s.grads["input"] for s in steps])
    worst = max(worst, (inputs - reference.grads["input"]).abs().max().item())
    for step in steps:
        for name, grad in step.grads.items():
            if name != "input":
                worst = max(worst, (grad - reference.grads[name]).abs().max().item())
    return worst


def formula_bytes(e: int, config: MoEConfig = MOE, bytes_per_element: int = 4) -> float:
    """Per-rank bytes of one step with a balanced router and no drops."""
    return moe_step_bytes(e, config.tokens // e, config.top_k, config.hidden, bytes_per_element)


# ----------------------------------------------------------------------------------------
# Timing (benchmarks) and notebook 07's decoder with expert-parallel MLPs.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimedMoE:
    step_s: float            # median forward + backward, slowest rank
    comm_s: float            # median time inside dispatch and combine (this rank)
    sent_bytes: int
    dropped: int             # this rank's dropped slots


def timed_ep_steps(rank: int, world_size: int, config: MoEConfig = MOE, steps: int = 5,
                   threads: int | None = 1, group=None) -> TimedMoE:
    """Rank function: `steps` forward + backward steps after one warm-up, each between barriers
    (`threads` torch threads per rank meanwhile, as `ring_attention.intra_op_threads`)."""
    with intra_op_threads(threads):
        return _timed_ep_steps(config, steps, group)


def _timed_ep_steps(config: MoEConfig, steps: int, group) -> TimedMoE:
    e, r = group_size(group), group_rank(group)
    layer = ExpertParallelMoE(MoE(config), group)
    x = make_moe_batch(config).chunk(e)[r].requires_grad_()
    times, comm = [], []
    for i in range(steps + 1):
        layer.zero_grad()
        dist.barrier(group=group)
        start = time.perf_counter()
        with counting() as log:
            y = layer(x)
            moe_loss(y, layer.aux_loss, config, numel=y.numel() * e, share=1 / e).backward()
        slowest = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        if i:
            times.append(slowest.item())
            comm.append(sum(x.seconds for x in log if x.what != "counts"))
    return TimedMoE(statistics.median(times), statistics.median(comm),
                    sum(x.sent_bytes for x in log if x.what != "counts"), layer.stats.dropped)


def ep_transformer_step(rank: int, world_size: int, config: TransformerConfig = TRANSFORMER,
                        moe: MoEConfig = MOE, group=None) -> MoEStep:
    """Rank function: `make_moe_transformer` with every block's MoE expert-parallel over the
    group and the batch's sequences split over it (expert parallelism rides on data
    parallelism: everything but the experts is replicated and its gradient summed).
    Returns this rank's loss share summed to the whole batch's, and the gradients."""
    e, r = group_size(group), group_rank(group)
    model = make_moe_transformer(config, moe)
    firsts = {}
    for j, block in enumerate(model.blocks):
        block.mlp = ExpertParallelMoE(block.mlp, group)
        firsts[f"blocks.{j}.mlp."] = block.mlp.first
    tokens = make_tokens(config)
    inputs, targets = tokens.inputs.chunk(e)[r], tokens.targets.chunk(e)[r]
    with counting() as log:
        logits = model(inputs)
        loss = (lm_loss(logits, targets, numel=config.tokens)
                + sum(b.mlp.config.aux_weight * b.mlp.aux_loss for b in model.blocks) / e)
        loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        prefix = next((p for p in firsts if name.startswith(p)), None)
        if prefix is not None and ".experts." in name:
            grads[prefix + local_name(name[len(prefix):], firsts[prefix])] = param.grad
        else:
            dist.all_reduce(param.grad, group=group)
            grads[name] = param.grad
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    stats = model.blocks[0].mlp.stats
    return MoEStep(logits.detach(), total.item(), grads, stats,
                   sum(x.sent_bytes for x in log if x.what != "counts"))


@dataclass(frozen=True)
class RouterLoad:
    """Where one process's routing of the whole batch puts the tokens, as e ranks would see it."""
    e: int
    kept: tuple[int, ...]        # per expert, summed over the e groups
    dropped: tuple[int, ...]     # per expert
    capacity: int                # per expert and group: e · capacity per expert in all
    aux_loss: float

    @property
    def per_rank(self) -> tuple[int, ...]:
        """Rows each rank's experts compute (kept slots)."""
        local = len(self.kept) // self.e
        return tuple(sum(self.kept[r * local:(r + 1) * local]) for r in range(self.e))


def router_load(config: MoEConfig = MOE, e: int = 4) -> RouterLoad:
    """Route `make_moe_batch` on one process with e capacity groups (what `ep_step` on e ranks
    does), no backward: the loads the widget draws."""
    config = check_ep(e, config)
    layer = MoE(config)
    with torch.no_grad():
        layer(make_moe_batch(config))
    stats = layer.stats
    load = [sum(g[i] for g in stats.load) for i in range(config.experts)]
    kept = [sum(g[i] for g in stats.kept) for i in range(config.experts)]
    return RouterLoad(e, tuple(kept), tuple(a - b for a, b in zip(load, kept)), stats.capacity,
                      layer.aux_loss.item())
