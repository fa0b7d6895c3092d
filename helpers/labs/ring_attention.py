"""Notebook 09's context-parallel runs: one ring-attention step (forward and backward) on the c
ranks of a group, naive or zig-zag causal split, checked against one process; the bytes, the
idle share and one ring step's overlap measured; notebook 07's decoder with its attention
context-parallel. The ring, its online softmax and the split are `helpers.parallel.ring_attention`;
the byte and work formulas `helpers.cost.context`."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_int, check_number
from helpers.configs import RING, TRANSFORMER, RingConfig, TransformerConfig
from helpers.cost.context import LAYOUTS, check_split
from helpers.launch.host import intra_op_threads
from helpers.models import lm_loss, make_tokens, make_transformer
from helpers.parallel import trace
from helpers.parallel.groups import group_rank, group_size
from helpers.parallel.ring_attention import (ContextParallelAttention, Shift, assemble, local,
                                             ring_attention, scores)
from helpers.parallel.trace import Span
from helpers.timing import wait


def make_qkv(config: RingConfig = RING) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient for the output, (b, heads, s, d_head); the same everywhere."""
    generator = torch.Generator().manual_seed(config.seed)
    shape = (config.batch, config.heads, config.seq, config.head_dim)
    return tuple(torch.randn(shape, generator=generator) for _ in range(4))


@dataclass(frozen=True)
class RingStep:
    out: torch.Tensor            # this rank's outputs (b, heads, s/c, d_head)
    grads: tuple                 # dq, dk, dv of this rank's rows
    sent_bytes: int
    spans: tuple[Span, ...]


def check_ring(c: int, config: RingConfig, layout: str, pause_s: float | None = None) -> None:
    check_int("c", c, 1, 64)
    check_choice("layout", layout, LAYOUTS)
    check_split(config.seq, c, layout)
    if pause_s is not None:
        check_number("pause_s", pause_s, 0, 1, low_inclusive=False, unit="s")


def ring_step(rank: int, world_size: int, config: RingConfig = RING, layout: str = "zigzag",
              pause_s: float | None = None, group=None) -> RingStep:
    """Rank function: forward and backward of ring attention on this rank's rows, upstream
    gradient from `make_qkv`; between barriers, so that the spans make one timeline.
    `pause_s`: wait mode (`ring_attention`)."""
    c, r = group_size(group), group_rank(group)
    q, k, v, g = (local(x, r, c, layout) for x in make_qkv(config))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dist.barrier(group=group)
    with trace.recording("ring") as log:
        out = ring_attention(q, k, v, layout, group, pause_s)
        out.backward(g)
    dist.barrier(group=group)
    return RingStep(out.detach(), (q.grad, k.grad, v.grad),
                    sum(c.nbytes for c in trace.comms(log)), tuple(trace.spans(log)))


def run_ring_step(ranks, c: int, config: RingConfig = RING, layout: str = "zigzag",
                  pause_s: float | None = None) -> list[RingStep]:
    check_ring(c, config, layout, pause_s)
    return ranks.resize(c).run(ring_step, config, layout, pause_s)


def reference(config: RingConfig = RING) -> RingStep:
    """Full causal attention on one process (PyTorch's own), its output and gradients."""
    q, k, v, g = make_qkv(config)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    return RingStep(out.detach(), (q.grad, k.grad, v.grad), 0, ())


def compare(steps: list[RingStep], ref: RingStep, layout: str) -> float:
    """Largest absolute difference of output, dq, dk and dv from full attention."""
    worst = (assemble([s.out for s in steps], layout) - ref.out).abs().max().item()
    for i, whole in enumerate(ref.grads):
        got = assemble([s.grads[i] for s in steps], layout)
        worst = max(worst, (got - whole).abs().max().item())
    return worst


# ----------------------------------------------------------------------------------------
# Idle time and overlap, measured.
# ----------------------------------------------------------------------------------------

def idle_share(steps: list[RingStep]) -> float:
    """The share of the ranks' ring time spent waiting for another rank, forward and backward
    apart: a rank's idle time is its waits for a neighbour's block, plus the time before its
    first span and after its last while another rank is still in the same pass; its busy time
    is its compute spans. Time between the passes (autograd's own) counts for neither."""
    idle = busy = 0.0
    for phase in ("forward", "backward"):
        spans = [[s for s in step.spans if s.phase == phase] for step in steps]
        if not any(spans):
            continue
        first = min(s.start for mine in spans for s in mine)
        last = max(s.end for mine in spans for s in mine)
        for mine in spans:
            idle += sum(s.end - s.start for s in mine if s.kind == "wait")
            idle += (last - first) - (max(s.end for s in mine) - min(s.start for s in mine))
            busy += sum(s.end - s.start for s in mine if s.kind == "compute")
    return idle / (idle + busy)


@dataclass(frozen=True)
class RingTiming:
    step_s: float        # median forward + backward wall time (first start to last end)
    idle_share: float    # median over the same steps
    sent_bytes: int


def timed_ring_steps(rank: int, world_size: int, config: RingConfig = RING,
                     layout: str = "zigzag", steps: int = 3, threads: int | None = 1,
                     pause_s: float | None = None, group=None) -> list[RingStep]:
    """Rank function: `steps` + 1 `ring_step`s (the first warms up); this rank's records."""
    with intra_op_threads(threads):
        return [ring_step(rank, world_size, config, layout, pause_s, group)
                for _ in range(steps + 1)][1:]


def summarize(per_rank: list[list[RingStep]]) -> RingTiming:
    """Median step time and idle share over the steps of `timed_ring_steps`."""
    walls, idles = [], []
    for steps in zip(*per_rank):
        spans = [s for step in steps for s in step.spans]
        walls.append(max(s.end for s in spans) - min(s.start for s in spans))
        idles.append(idle_share(list(steps)))
    return RingTiming(statistics.median(walls), statistics.median(idles), per_rank[0][0].sent_bytes)


@dataclass(frozen=True)
class Overlap:
    """One ring step's parts, seconds on the slowest rank: medians over rounds in which each
    part runs once, in turn (`ring_step_parts`)."""
    comm_s: float        # one K/V hop alone
    compute_s: float     # one full block of attention alone (forward)
    both_s: float        # the hop started, the block computed, the hop waited for
    post_s: float        # a hop of one number alone: posting a hop and waiting for it, no bytes to speak of
    exposed_s: float     # both − block, round by round: what of the hop still showed
    error_s: float       # standard error of exposed_s − post_s (`median_error` of each)
    rounds: int

    @property
    def hidden_share(self) -> float:
        """How much of the hop the overlap hid: (hop − (both − block)) / hop, not clamped: 1 when
        the hop was hidden completely, 0 when overlapping saved nothing, below 0 when the two
        together took longer than one after the other."""
        return (self.comm_s - self.exposed_s) / self.comm_s

    @property
    def overhead_s(self) -> float:
        """both − (hop + block): above 0, overlapping cost more than doing the two in turn."""
        return self.exposed_s - self.comm_s



def replay_s(computed: Overlap, free: Overlap) -> float:
    """The overlapped step with a processor for each rank and another for its copies: the longer
    of the hop (`free`, wait mode: nobody else wants the core) and the block (`computed`), plus
    posting a hop and waiting for it (`free.post_s`), which run on the rank's own thread before
    and after the block and cannot hide."""
    return max(free.comm_s, computed.compute_s) + free.post_s


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """One block of attention as the ring computes it: scores, their log-sum-exp, the softmax
    times V."""
    s = scores(q, k, diagonal)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse[..., None]) @ v


def check_parts(repeat: int, pause_s: float | None) -> None:
    check_int("repeat", repeat, 3, 1000)
    if pause_s is not None:
        check_number("pause_s", pause_s, 0, 1, low_inclusive=False, unit="s")


def run_ring_step_parts(ranks, config: RingConfig = RING, repeat: int = 20,
                        pause_s: float | None = None) -> Overlap:
    """`ring_step_parts` on 2 live ranks (checked first)."""
    check_parts(repeat, pause_s)
    check_split(config.seq, 2, "naive")
    return ranks.resize(2).run(ring_step_parts, config, repeat, 1, pause_s)[0]


def ring_step_parts(rank: int, world_size: int, config: RingConfig = RING, repeat: int = 20,
                    threads: int | None = 1, pause_s: float | None = None, group=None) -> Overlap:
    """Rank function: time a hop, a block's attention, the two overlapped and a one-number hop,
    c = group size, `repeat` rounds (after one warm-up) of the four in a rotating order, so
    that a change in the machine's load falls on all four alike. `pause_s`: wait mode, the
    block sleeps that long instead of computing (the core is free)."""
    check_parts(repeat, pause_s)
    c = group_size(group)
    q, k, v, _ = (x.chunk(c, dim=2)[0].contiguous() for x in make_qkv(config))
    kv, one = torch.stack([k, v]), torch.zeros(1)

    def compute():
        if pause_s:
            wait(pause_s)
        else:
            _attend(q, k, v, False)

    def both():
        shift = Shift(kv, 0, group)
        compute()
        shift.wait("forward", 0)

    parts = [lambda: Shift(kv, 0, group).wait("forward", 0), compute, both,
             lambda: Shift(one, 0, group).wait("forward", 0)]
    with intra_op_threads(threads):
        times = torch.tensor(_rounds(parts, repeat, group), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)   # each round's slowest rank
    times = times[1:]
    hop, block, overlapped, tiny = times.median(0).values.tolist()
    shown = times[:, 2] - times[:, 1]
    error = (median_error(shown) ** 2 + median_error(times[:, 3]) ** 2) ** 0.5
    return Overlap(hop, block, overlapped, tiny, shown.median().item(), error, repeat)


def median_error(x: torch.Tensor) -> float:
    """The standard error of x's median, 1.2533 · σ / √n, with σ = 1.4826 · the median absolute
    deviation: another process's time slice in a few rounds moves neither."""
    deviation = (x - x.median()).abs().median().item()
    return 1.2533 * 1.4826 * deviation / len(x) ** 0.5


def _rounds(parts, repeat: int, group) -> list[list[float]]:
    """1 + `repeat` rounds; in each, every part once between barriers, starting with part
    round mod len(parts). Seconds, [round][part], this rank."""
    times = []
    for round_ in range(repeat + 1):
        row = [0.0] * len(parts)
        for i in [(round_ + j) % len(parts) for j in range(len(parts))]:
            dist.barrier(group=group)
            start = time.perf_counter()
            parts[i]()
            row[i] = time.perf_counter() - start
        times.append(row)
    return times


@dataclass(frozen=True)
class BlockCosts:
    """One process, one thread: the attention blocks of a whole sequence at c = 1, forward,
    median seconds. The naive split computes one s × s block under the causal mask; the
    zig-zag split three (s/2) × (s/2) blocks (two masked diagonals, one full)."""
    seq: int
    planes: int              # b · heads score matrices per block
    naive_s: float           # the s × s block, masked
    naive_unmasked_s: float  # the same block without the mask
    zigzag_s: float          # the three half blocks

    @property
    def naive_entries(self) -> int:
        return self.planes * self.seq ** 2

    @property
    def zigzag_entries(self) -> int:
        return self.planes * 3 * (self.seq // 2) ** 2

    def ns_per_entry(self, which: str) -> float:
        seconds = {"naive": self.naive_s, "naive unmasked": self.naive_unmasked_s,
                   "zigzag": self.zigzag_s}[which]
        entries = self.zigzag_entries if which == "zigzag" else self.naive_entries
        return seconds / entries * 1e9


def block_costs(config: RingConfig = RING, repeat: int = 7, threads: int | None = 1) -> BlockCosts:
    """Time c = 1's blocks of both layouts on this process (see `BlockCosts`)."""
    q, k, v, _ = make_qkv(config)
    half = config.seq // 2
    qs, ks, vs = q.split(half, 2), k.split(half, 2), v.split(half, 2)

    def timed(fn):
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    with intra_op_threads(threads):
        return BlockCosts(
            config.seq, config.batch * config.heads, timed(lambda: _attend(q, k, v, True)),
            timed(lambda: _attend(q, k, v, False)),
            timed(lambda: [_attend(qs[0], ks[0], vs[0], True), _attend(qs[1], ks[0], vs[0], False),
                           _attend(qs[1], ks[1], vs[1], True)]))


@dataclass(frozen=True)
class TransformerStep:
    loss: float
    grads: dict[str, torch.Tensor]


def cp_transformer_step(rank: int, world_size: int, config: TransformerConfig = TRANSFORMER,
                        layout: str = "zigzag", group=None) -> TransformerStep:
    """Rank function: notebook 07's decoder, context-parallel over the group: this rank embeds
    its chunks of every sequence (with their positions), every block attends over the ring,
    the rest is per token; gradients summed over the group (every weight is replicated)."""
    c, r = group_size(group), group_rank(group)
    model = make_transformer(config)
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, layout, group)
    tokens = make_tokens(config)
    inputs, targets = (local(x, r, c, layout, dim=1) for x in tokens)
    where = local(torch.arange(config.seq), r, c, layout, dim=0)
    x = model.embed.tokens(inputs) + model.embed.positions(where)
    for block in model.blocks:
        x = block(x)
    loss = lm_loss(model.head(x), targets, numel=config.tokens)
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return TransformerStep(total.item(), {n: p.grad for n, p in model.named_parameters()})


def reference_transformer_step(config: TransformerConfig = TRANSFORMER) -> TransformerStep:
    model = make_transformer(config)
    tokens = make_tokens(config)
    loss = lm_loss(model(tokens.inputs), tokens.targets)
    loss.backward()
    return TransformerStep(loss.item(), {n: p.grad for n, p in model.named_parameters()})


def torch_context_parallel(rank: int, world_size: int, config: RingConfig = RING) -> str:
    """Rank function: try PyTorch's own `context_parallel` (torch.distributed.tensor.experimental)
    on this backend with full causal SDPA; returns "ran, max error …" or the error's first line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v, _ = make_qkv(config)
    want = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v = q.clone(), k.clone(), v.clone()
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as error:  # what the reader should see is the library's own words
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0] if text else ''}"
    return f"ran, output shape {tuple(out.shape)} of {tuple(want.shape)}"


