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

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_int, check_number
from helpers.configs import RING, TRANSFORMER, RingConfig, TransformerConfig
from helpers.cost.context import LAYOUTS, block_pairs, check_split, chunks_of, ring_bytes
from helpers.models import Attention, lm_loss, make_tokens, make_transformer
from helpers.parallel.groups import global_rank, group_rank, group_size

# ----------------------------------------------------------------------------------------
# What each rank did when: compute spans, waits and bytes sent (timelines, idle time).
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    kind: str        # "compute" or "wait"
    phase: str       # "forward" or "backward"
    step: int        # ring step 0 … c − 1
    start: float     # time.perf_counter() (one clock for every process of this machine)
    end: float


_SPANS: list[Span] | None = None
_SENT: list[int] | None = None


@contextlib.contextmanager
def recording():
    """Record this rank's spans and sent bytes inside the block: yields (spans, sent)."""
    global _SPANS, _SENT
    previous, (_SPANS, _SENT) = (_SPANS, _SENT), ([], [])
    try:
        yield _SPANS, _SENT
    finally:
        _SPANS, _SENT = previous


def _span(kind: str, phase: str, step: int, start: float) -> None:
    if _SPANS is not None:
        _SPANS.append(Span(kind, phase, step, start, time.perf_counter()))


class _Shift:
    """One hop around the ring in flight: my tensor to the next rank, the previous rank's here."""

    def __init__(self, tensor: torch.Tensor, tag: int, group):
        c, r = group_size(group), group_rank(group)
        self.inbox = torch.empty_like(tensor)
        self.works = [dist.isend(tensor, global_rank(group, (r + 1) % c), group=group, tag=tag),
                      dist.irecv(self.inbox, global_rank(group, (r - 1) % c), group=group, tag=tag)]
        if _SENT is not None:
            _SENT.append(tensor.numel() * tensor.element_size())

    def wait(self, phase: str, step: int) -> torch.Tensor:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        _span("wait", phase, step, start)
        return self.inbox


# ----------------------------------------------------------------------------------------
# Blocks and the online softmax.
# ----------------------------------------------------------------------------------------

def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
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
            shift = _Shift(kv, 0, group) if step < c - 1 else None
            start = time.perf_counter()
            theirs = chunks_of((r - step) % c, c, layout)
            ks, vs = kv[0].split(size, dim=2), kv[1].split(size, dim=2)
            for i, j, diagonal in block_pairs(mine, theirs):
                if pause_s:   # wait mode: the block's time, no arithmetic
                    time.sleep(pause_s * (0.5 if diagonal else 1.0))
                    continue
                s = _scores(qs[i], ks[j], diagonal)
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
            shift = _Shift(kv, 0, group) if step < c - 1 else None
            start = time.perf_counter()
            theirs = chunks_of((r - step) % c, c, ctx.layout)
            ks, vs = kv[0].split(size, dim=2), kv[1].split(size, dim=2)
            part = torch.zeros_like(kv)
            dks, dvs = part[0].split(size, dim=2), part[1].split(size, dim=2)
            for i, j, diagonal in block_pairs(mine, theirs):
                if ctx.pause_s:   # a backward block costs about twice a forward one
                    time.sleep(2 * ctx.pause_s * (0.5 if diagonal else 1.0))
                    continue
                p = torch.exp(_scores(qs[i], ks[j], diagonal) - lses[i][..., None])
                dvs[j].add_(p.transpose(-1, -2) @ dos[i])
                ds = p * (dos[i] @ vs[j].transpose(-1, -2) - deltas[i][..., None])
                dqs[i].add_(ds @ ks[j] * scale)
                dks[j].add_(ds.transpose(-1, -2) @ qs[i] * scale)
            _span("compute", "backward", step, start)
            if travelling is not None:   # what the ranks before me added to this block
                part += travelling.wait("backward", step)
            travelling = _Shift(part, 1, group) if c > 1 else None
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


def make_qkv(config: RingConfig = RING) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient for the output, (b, heads, s, d); the same everywhere."""
    generator = torch.Generator().manual_seed(config.seed)
    shape = (config.batch, config.heads, config.seq, config.head_dim)
    return tuple(torch.randn(shape, generator=generator) for _ in range(4))


@dataclass(frozen=True)
class RingStep:
    out: torch.Tensor            # this rank's outputs (b, heads, s/c, d)
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
    with recording() as (spans, sent):
        out = ring_attention(q, k, v, layout, group, pause_s)
        out.backward(g)
    dist.barrier(group=group)
    return RingStep(out.detach(), (q.grad, k.grad, v.grad), sum(sent), tuple(spans))


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


def formula_bytes(c: int, config: RingConfig = RING) -> int:
    return ring_bytes(c, config.batch, config.heads, config.seq, config.head_dim)


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


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """This rank's torch threads set to `threads` inside the block (None: left as they are).
    Timings use 1: one rank stands for one device, and a rank alone on the machine would
    otherwise get every core and look faster than a rank of many for that reason alone."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    """One ring step's parts, median seconds on the slowest rank."""
    comm_s: float        # one K/V hop alone
    compute_s: float     # one full block of attention alone (forward)
    both_s: float        # the hop started, the block computed, the hop waited for

    @property
    def hidden_share(self) -> float:
        """How much of the hop the overlap hid: (comm + compute − both) / comm, in [0, 1]."""
        return min(max((self.comm_s + self.compute_s - self.both_s) / self.comm_s, 0.0), 1.0)


def ring_step_parts(rank: int, world_size: int, config: RingConfig = RING, repeat: int = 7,
                    threads: int | None = 1, group=None) -> Overlap:
    """Rank function: time a hop, a block's attention and the two overlapped, c = group size."""
    c = group_size(group)
    q, k, v, _ = (x.chunk(c, dim=2)[0].contiguous() for x in make_qkv(config))
    kv = torch.stack([k, v])

    def compute():
        s = _scores(q, k, False)
        lse = s.logsumexp(-1)
        return torch.exp(s - lse[..., None]) @ v

    def timed(fn):
        times = []
        for _ in range(repeat + 1):
            dist.barrier(group=group)
            start = time.perf_counter()
            fn()
            slowest = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            times.append(slowest.item())
        return statistics.median(times[1:])

    def both():
        shift = _Shift(kv, 0, group)
        compute()
        shift.wait("forward", 0)

    with intra_op_threads(threads):
        return Overlap(timed(lambda: _Shift(kv, 0, group).wait("forward", 0)), timed(compute),
                       timed(both))


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
