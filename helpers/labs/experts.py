"""Notebook 09's expert-parallel runs: one MoE step on the e ranks of a group, checked against
the one-process layer with groups = e; timed steps, with real compute or in wait mode, their
time in the all-to-alls split into waiting for the last rank and moving bytes; notebook 07's
decoder with an MoE layer in every block, expert-parallel; the router's load per expert, in one
process. The layer and its all-to-alls are `helpers.parallel.experts`; the byte formulas
`helpers.cost.experts`."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_divisible, check_int, check_number
from helpers.configs import MOE, TRANSFORMER, MoEConfig, TransformerConfig
from helpers.cost.experts import check_expert_degree
from helpers.launch.host import intra_op_threads
from helpers.models import (MoE, MoEStats, lm_loss, make_moe_batch, make_moe_transformer,
                            make_tokens, moe_loss)
from helpers.parallel.experts import ExpertParallelMoE, counting, exchange_counts, local_name
from helpers.parallel.groups import group_rank, group_size
from helpers.parallel.wait_mode import waiting
from helpers.timing import times_of

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
    moved = [x for x in log if x.label != "counts"]
    return MoEStep(y.detach(), total.item(), grads, layer.stats,
                   sum(x.nbytes for x in moved), sum(x.nbytes for x in log) -
                   sum(x.nbytes for x in moved), sum(x.seconds for x in moved))


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


# ----------------------------------------------------------------------------------------
# Timing (benchmarks) and notebook 07's decoder with expert-parallel MLPs.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimedMoE:
    step_s: float            # median forward + backward, slowest rank
    comm_s: float            # median time inside dispatch and combine (this rank)
    sent_bytes: int
    dropped: int             # this rank's dropped slots
    waiting_s: float = 0.0   # median, of comm_s: before the last rank reached each all-to-all
    moving_s: float = 0.0    # median, of comm_s: from the last rank's arrival to this rank's end
    expert_rows: int = 0     # rows this rank's experts took in a step, from every rank


def check_timed(steps: int, expert_row_s: float | None) -> None:
    check_int("steps", steps, 1, 1000)
    if expert_row_s is not None:
        check_number("expert_row_s", expert_row_s, 0, 0.01, low_inclusive=False, unit="s")


def run_timed_ep_steps(ranks, e: int, config: MoEConfig = MOE, steps: int = 5,
                       expert_row_s: float | None = None) -> list[TimedMoE]:
    """`timed_ep_steps` on e live ranks, one thread each (checked first); every rank's result."""
    config = check_ep(e, config)
    check_timed(steps, expert_row_s)
    return ranks.resize(e).run(timed_ep_steps, config, steps, 1, expert_row_s)


def timed_ep_steps(rank: int, world_size: int, config: MoEConfig = MOE, steps: int = 5,
                   threads: int | None = 1, expert_row_s: float | None = None,
                   group=None) -> TimedMoE:
    """Rank function: `steps` forward + backward steps after one warm-up, each between barriers
    (`threads` torch threads per rank meanwhile, as `ring_attention.intra_op_threads`).
    `expert_row_s`: wait mode, every expert waits that long per row it takes instead of
    computing (`WaitingExpert`)."""
    check_timed(steps, expert_row_s)
    with intra_op_threads(threads):
        return _timed_ep_steps(config, steps, group, expert_row_s)


class WaitingExpert(nn.Module):
    """Wait mode's expert: forward + backward wait `row_s` per row (its matmuls' time alone on
    one core, `expert_row_seconds`), leaving the core free; rows pass through unchanged, the
    parameters get zero gradients (`wait_mode.waiting`)."""

    def __init__(self, ffn: nn.Module, row_s: float):
        super().__init__()
        self.ffn, self.row_s = ffn, row_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return waiting(x, self.row_s * x.shape[0], list(self.ffn.parameters()))


def expert_row_seconds(config: MoEConfig = MOE, repeat: int = 7, threads: int | None = 1) -> float:
    """One expert's forward + backward per row, this process, `threads` threads: median over
    `repeat` runs (after a warm-up) on a balanced expert's n·k/E rows."""
    check_int("repeat", repeat, 1, 1000)
    rows = max(1, config.tokens * config.top_k // config.experts)
    ffn = MoE(config).experts[0]
    x = torch.randn(rows, config.hidden, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    with intra_op_threads(threads):
        times = times_of(lambda: ffn(x).sum().backward(), repeat + 1)[1:]
    return statistics.median(times) / rows


def _timed_ep_steps(config: MoEConfig, steps: int, group, expert_row_s: float | None) -> TimedMoE:
    e, r = group_size(group), group_rank(group)
    layer = ExpertParallelMoE(MoE(config), group)
    if expert_row_s is not None:
        layer.experts = nn.ModuleList(WaitingExpert(f, expert_row_s) for f in layer.experts)
    x = make_moe_batch(config).chunk(e)[r].requires_grad_()

    def step() -> tuple[float, list]:
        layer.zero_grad()
        dist.barrier(group=group)
        start = time.perf_counter()
        with counting() as log:
            y = layer(x)
            moe_loss(y, layer.aux_loss, config, numel=y.numel() * e, share=1 / e).backward()
        slowest = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        return slowest.item(), [x for x in log if x.label != "counts"]

    step()   # warm-up
    times, comm, split = [], [], []
    for _ in range(steps):
        seconds, moved = step()
        times.append(seconds)
        comm.append(sum(x.seconds for x in moved))
        split.append(waiting_and_moving(moved, group))
    return TimedMoE(statistics.median(times), statistics.median(comm),
                    sum(x.nbytes for x in moved), layer.stats.dropped,
                    statistics.median(w for w, _ in split), statistics.median(m for _, m in split),
                    _rows_taken(layer, group))


def waiting_and_moving(moved: list, group) -> tuple[float, float]:
    """This rank's seconds inside the step's all-to-alls, split at the moment the last rank
    reached each one: before it, waiting (for that rank's experts, or for a core); after it,
    moving the bytes. The ranks share one machine, so their perf_counter clocks (the system's
    monotonic clock) can be compared."""
    mine = torch.tensor([[x.start, x.start + x.seconds] for x in moved], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(every, mine, group=group)
    last = torch.stack(every)[:, :, 0].max(0).values          # each all-to-all's last arrival
    waiting = (last - mine[:, 0]).sum().item()
    return waiting, (mine[:, 1] - last).sum().item()


def _rows_taken(layer: ExpertParallelMoE, group) -> int:
    """Rows this rank's experts took in the last step, from every rank (the counts' exchange)."""
    per_expert = torch.tensor(layer.stats.kept[0]).view(group_size(group), layer.local)
    return int(exchange_counts(per_expert, group).sum())


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
                   sum(x.nbytes for x in log if x.label != "counts"))


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


