"""Data parallelism: every rank holds the whole model and a slice of the batch.

After `backward()` each rank has the gradient of *its* slice; averaging the gradients across
ranks gives the gradient of the whole batch, so one optimizer step keeps every copy identical.
The wrappers below do that averaging four ways, from the lecture's loop to what
`torch.nn.parallel.DistributedDataParallel` does:

* `NaiveDDP`     one all-reduce per parameter, after the backward pass (the lecture);
* `FlatDDP`      one all-reduce over all gradients flattened into one buffer;
* `OverlapDDP`   one asynchronous all-reduce per parameter, launched by a hook the moment
                 its gradient is accumulated, so communication overlaps the rest of backward;
* `BucketedDDP`  the same, but gradients are grouped (in reverse parameter order, the order
                 backward produces them) into buckets of at most `bucket_size_mb`.

All four share one mechanism: a *bucket* is a flat buffer holding some gradients plus one
"had a gradient" flag per parameter. Buckets are summed (the flags must be counted, and gloo
had no `ReduceOp.AVG` before 2025) and divided by the world size. The flags make two awkward cases work: a parameter with no gradient
on a rank contributes zeros (so every rank still joins every collective and nothing hangs),
and a parameter with no gradient on *any* rank keeps `grad = None`, as in plain training.
Buckets are always launched in the same order on every rank (a bucket waits for the ones
before it), because collectives are matched by the order ranks issue them.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.models import make_batch, make_mlp, mlp_loss

VARIANTS = ("naive", "flat", "overlap", "bucketed")


def check_variant(variant: Any, allowed: tuple[str, ...] = VARIANTS) -> str:
    if variant not in allowed:
        raise ValueError(f"variant must be one of {allowed}, got {variant!r}")
    return variant


def check_bucket_size_mb(bucket_size_mb: Any) -> float:
    if (isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float))
            or not bucket_size_mb > 0):
        raise ValueError(f"bucket_size_mb must be a number of MiB > 0, got {bucket_size_mb!r}")
    return float(bucket_size_mb)


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank start from rank 0's weights: parameters (frozen ones too) and buffers."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(tensor.data, src=0)


class _Bucket:
    """Some parameters' gradients, flattened, followed by one 'had a gradient' flag each."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.ready = 0      # how many of its gradients backward has produced so far
        self.work = None    # the async all-reduce handle, once launched

    def pack(self) -> None:
        offset, flags = 0, self.buffer[self.numel:]
        for i, p in enumerate(self.params):
            chunk = self.buffer[offset:offset + p.numel()]
            if p.grad is None:
                chunk.zero_()
                flags[i] = 0
            else:
                chunk.copy_(p.grad.reshape(-1))
                flags[i] = 1
            offset += p.numel()

    def unpack(self, world_size: int) -> None:
        offset, flags = 0, self.buffer[self.numel:].tolist()
        for p, flag in zip(self.params, flags):
            total = self.buffer[offset:offset + p.numel()].view_as(p)
            if flag == 0:           # no rank produced a gradient: leave it as plain training would
                p.grad = None
            elif p.grad is None:    # other ranks did: take the average
                p.grad = total / world_size
            else:                   # the SUM divided by d, straight into .grad
                torch.div(total, world_size, out=p.grad)
            offset += p.numel()


def _split_into_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[_Bucket]:
    """Consecutive parameters, at most cap_bytes of gradient each (a bigger one goes alone)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = not current or (p.dtype, p.device) == (current[0].dtype, current[0].device)
        if current and (size + nbytes > cap_bytes or not same_kind):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


class _DataParallel(nn.Module):
    """What the four wrappers share; subclasses choose the buckets and whether hooks launch them."""

    overlap = False  # launch buckets from post-accumulate-grad hooks during backward?

    def __init__(self, module: nn.Module, bucket_cap_bytes: float):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs a process group: build it inside a "
                               "rank function (helpers.ranks.spawn / LiveRanks.run)")
        self.module = module
        self.world_size = dist.get_world_size()
        self.trace: list | None = None  # set to [] to record (kind, label, start, end) events
        broadcast_from_rank0(module)
        # parameters() lists a tied (shared) parameter once, so it is reduced once.
        trainable = [p for p in module.parameters() if p.requires_grad]
        # Backward produces gradients roughly last layer first: bucket in that order.
        self._buckets = _split_into_buckets(trainable[::-1], bucket_cap_bytes)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._names = {p: n for n, p in module.named_parameters()}
        self._next = 0  # index of the next bucket to launch
        if self.overlap:
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _record(self, kind: str, label: str, start: float, end: float) -> None:
        if self.trace is not None:
            self.trace.append((kind, label, start, end))

    def _on_gradient_ready(self, p: torch.Tensor) -> None:
        now = time.perf_counter()
        self._record("grad", self._names[p], now, now)
        bucket = self._bucket_of[p]
        if bucket.work is not None or bucket.ready == len(bucket.params):
            raise RuntimeError(f"{type(self).__name__}: a second backward before "
                               "finish_gradient_synchronization(); call it after every backward")
        bucket.ready += 1
        # Launch in bucket order only: every rank must issue collectives in the same order.
        while (self._next < len(self._buckets)
               and self._buckets[self._next].ready == len(self._buckets[self._next].params)):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        bucket.pack()
        self._next = index + 1
        start = time.perf_counter()
        label = f"bucket {index}" if len(bucket.params) > 1 else self._names[bucket.params[0]]
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=self.overlap)
        if not self.overlap:
            self._record("all_reduce", label, start, time.perf_counter())
        elif self.trace is not None:
            # The future completes on gloo's own thread when the data has arrived; the callback
            # may run just after wait() returns, so it writes into this step's list, bound now.
            trace = self.trace
            bucket.work.get_future().then(
                lambda _f: trace.append(("all_reduce", label, start, time.perf_counter())))

    def finish_gradient_synchronization(self) -> None:
        """Launch what backward has not, wait for everything, average. Call before step()."""
        while self._next < len(self._buckets):
            self._launch(self._next)  # buckets with a parameter that got no gradient
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.unpack(self.world_size)
            bucket.work, bucket.ready = None, 0
        self._next = 0


class NaiveDDP(_DataParallel):
    """The lecture's version: after backward, one blocking all-reduce per parameter."""

    def __init__(self, module: nn.Module):
        super().__init__(module, bucket_cap_bytes=0)  # every parameter alone


class FlatDDP(_DataParallel):
    """After backward, one blocking all-reduce over all gradients (one buffer per dtype)."""

    def __init__(self, module: nn.Module):
        super().__init__(module, bucket_cap_bytes=float("inf"))


class OverlapDDP(_DataParallel):
    """Each gradient all-reduced asynchronously as soon as backward has accumulated it."""

    overlap = True

    def __init__(self, module: nn.Module):
        super().__init__(module, bucket_cap_bytes=0)


class BucketedDDP(_DataParallel):
    """Gradients in buckets of at most bucket_size_mb MiB, each all-reduced when full."""

    overlap = True

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        self.bucket_size_mb = check_bucket_size_mb(bucket_size_mb)
        super().__init__(module, bucket_cap_bytes=self.bucket_size_mb * 2**20)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]


def wrap(variant: str, module: nn.Module, bucket_size_mb: float = 25.0) -> _DataParallel:
    check_variant(variant)
    if variant == "bucketed":
        return BucketedDDP(module, bucket_size_mb)
    return {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP}[variant](module)


# ----------------------------------------------------------------------------------------
# Training on the lecture's MLP: single process, the lecture's loop, and the wrappers.
# ----------------------------------------------------------------------------------------

def rank_device() -> torch.device:
    """Where this rank computes: its own GPU under NCCL (helpers.ranks puts rank r on cuda:r)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's contiguous slice of the batch (the batch must split evenly)."""
    if batch.shape[0] % world_size:
        raise ValueError(f"batch must be divisible by world_size={world_size}, got {batch.shape[0]}")
    local = batch.shape[0] // world_size
    return batch[rank * local:(rank + 1) * local]


def make_optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD (momentum 0.9, lr 10) or AdamW (lr 1e-2). The lecture's loss is small (~0.01), so
    these large steps are what moves the weights visibly (~1e-2) in three steps: a wrong
    average then lands far outside assert_close's tolerance instead of hiding inside it."""
    check_variant(name, ("sgd", "adamw"))
    if lr is None:
        lr = 10.0 if name == "sgd" else 1e-2
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def train_single_process(steps: int = 3, hidden: int = 1024, layers: int = 4, batch: int = 128,
                         seed: int = 0, optimizer: str = "sgd", lr: float | None = None) -> dict:
    """The reference: one process, the whole batch."""
    model = make_mlp(hidden, layers, seed)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    x, losses = make_batch(batch, hidden, seed), []
    for _ in range(steps):
        loss = mlp_loss(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def lecture_train(rank: int, world_size: int, steps: int = 3, hidden: int = 1024, layers: int = 4,
                  batch: int = 128, seed: int = 0, lr: float | None = None,
                  seed_per_rank: bool = False) -> dict:
    """Rank function: the lecture's data parallelism, with SUM-then-divide so gloo can run it.

    Every rank builds the model from `seed`, as the lecture does; nothing is broadcast, so with
    `seed_per_rank=True` (rank r uses seed + r) the copies start apart and never meet.
    """
    device = rank_device()
    model = make_mlp(hidden, layers, seed + rank if seed_per_rank else seed).to(device)
    opt = make_optimizer("sgd", model.parameters(), lr)
    x, losses = shard(make_batch(batch, hidden, seed), rank, world_size).to(device), []
    for _ in range(steps):
        loss = mlp_loss(model(x))
        loss.backward()
        for param in model.parameters():  # "the only difference from standard training"
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(world_size)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def ddp_train(rank: int, world_size: int, variant: str, steps: int = 3, hidden: int = 1024,
              layers: int = 4, batch: int = 128, seed: int = 0, optimizer: str = "sgd",
              lr: float | None = None, bucket_size_mb: float = 1.0) -> dict:
    """Rank function: train with a wrapper. Each rank initialises with its own seed (seed + rank)
    on purpose: the wrapper's broadcast must make them all start from rank 0's weights."""
    device = rank_device()
    model = wrap(variant, make_mlp(hidden, layers, seed + rank).to(device), bucket_size_mb)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    x, losses = shard(make_batch(batch, hidden, seed), rank, world_size).to(device), []
    for _ in range(steps):
        loss = mlp_loss(model(x))
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    calls = len(model._buckets)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "all_reduces_per_step": calls}


def max_difference(result: dict, reference: dict) -> float:
    return max((a - b).abs().max().item() for a, b in zip(result["params"], reference["params"]))


def compare_with_single_process(ranks, variants=("lecture",) + VARIANTS, steps: int = 3,
                                hidden: int = 1024, layers: int = 4, batch: int = 128,
                                bucket_size_mb: float = 1.0) -> list[dict]:
    """Train each variant on `ranks` and check every rank's parameters against one process
    training on the whole batch (torch.testing.assert_close). One row per variant."""
    for v in variants:
        check_variant(v, ("lecture",) + VARIANTS)
    check_bucket_size_mb(bucket_size_mb)
    if batch % ranks.world_size:
        raise ValueError(f"batch must be divisible by the world size {ranks.world_size}, got {batch}")
    common = dict(steps=steps, hidden=hidden, layers=layers, batch=batch)
    reference = train_single_process(**common)
    rows = []
    for v in variants:
        if v == "lecture":
            results = ranks.run(lecture_train, **common)
            calls = len(reference["params"])  # the lecture all-reduces every parameter once
        else:
            results = ranks.run(ddp_train, v, bucket_size_mb=bucket_size_mb, **common)
            calls = results[0]["all_reduces_per_step"]
        for r in results:
            torch.testing.assert_close(r["params"], reference["params"])
        same = all(torch.equal(a, b) for r in results for a, b in zip(r["params"], results[0]["params"]))
        rows.append({"variant": v, "all_reduces_per_step": calls, "ranks_identical": same,
                     "max_diff": max(max_difference(r, reference) for r in results),
                     "rank_losses": [r["losses"][0] for r in results]})
    return rows


def comparison_table(rows: list[dict]) -> str:
    """compare_with_single_process's rows as text (no times, no machine-dependent digits)."""
    lines = [f"{'variant':<10}{'all-reduces/step':>18}{'ranks bit-identical':>21}"
             f"{'= single process (assert_close)':>33}"]
    for row in rows:
        lines.append(f"{row['variant']:<10}{row['all_reduces_per_step']:>18}"
                     f"{str(row['ranks_identical']):>21}{'passed':>33}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# A measured timeline: when does backward compute, when is an all-reduce in flight?
# ----------------------------------------------------------------------------------------

def timeline(rank: int, world_size: int, variant: str, hidden: int = 1024, layers: int = 4,
             batch: int = 128, bucket_size_mb: float = 4.0, warmup: int = 2,
             traced: int = 5) -> list[tuple]:
    """Rank function: a traced training step; events (kind, label, start, end) in seconds of
    the machine-wide monotonic clock, so ranks' timestamps are comparable.

    `traced` steps are recorded and the typical one returned: the step of median length (its
    slowest rank's), agreed by all ranks, so a moment of load on a shared machine is not
    mistaken for the picture."""
    device = rank_device()
    model = wrap(variant, make_mlp(hidden, layers).to(device), bucket_size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = shard(make_batch(batch, hidden), rank, world_size).to(device)
    recorded = []
    for step in range(warmup + traced):
        model.trace = []
        dist.barrier()
        start = time.perf_counter()
        loss = mlp_loss(model(x))
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        model.finish_gradient_synchronization()
        sync_end = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if step >= warmup:  # the list itself: a late completion callback still lands in it
            model.trace += [("forward", "", start, forward_end),
                            ("backward", "", forward_end, backward_end),
                            ("wait", "finish_gradient_synchronization", backward_end, sync_end)]
            recorded.append(model.trace)
    model.trace = None
    dist.barrier()
    lengths = torch.tensor([max(e for *_, e in ev) - min(s for _, _, s, _ in ev) for ev in recorded],
                           device=rank_device())  # NCCL reduces only tensors on the GPU
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return recorded[int(lengths.argsort()[len(recorded) // 2].item())]


def overlap_seconds(events: list[tuple]) -> float:
    """How long all-reduces were in flight while backward was still computing."""
    backward = [(s, e) for kind, _, s, e in events if kind == "backward"]
    total = 0.0
    for kind, _, s, e in events:
        if kind == "all_reduce":
            for bs, be in backward:
                total += max(0.0, min(e, be) - max(s, bs))
    return total


def plot_timeline(traces: dict[str, list[list[tuple]]], ax=None):
    """traces: {variant: [events of rank 0, events of rank 1, ...]} -> one row per (variant, rank):
    compute on the upper lane, all-reduces in flight on the lower one, ticks where a gradient
    became ready. Time 0 is the first rank's start of that variant's step (they left a barrier)."""
    import matplotlib.pyplot as plt

    rows = [(v, r, ev) for v, per_rank in traces.items() for r, ev in enumerate(per_rank)]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2))
    colors = {"forward": "#9ecae1", "backward": "#3182bd", "all_reduce": "#e6550d"}
    starts = {v: min(s for ev in per_rank for _, _, s, _ in ev) for v, per_rank in traces.items()}
    for y, (v, r, events) in enumerate(rows):
        t0, n_reduce = starts[v], 0
        for kind, _, s, e in sorted(events, key=lambda ev: ev[2]):
            x, w = 1e3 * (s - t0), 1e3 * (e - s)
            if kind in ("forward", "backward"):
                ax.broken_barh([(x, w)], (y - 0.4, 0.4), color=colors[kind])
            elif kind == "all_reduce":  # alternate two sub-lanes: several can be in flight
                ax.broken_barh([(x, w)], (y + 0.02 + 0.19 * (n_reduce % 2), 0.17),
                               facecolor=colors[kind], alpha=0.6, edgecolor="black", linewidth=0.5)
                n_reduce += 1
            elif kind == "grad":
                ax.plot([x, x], [y - 0.42, y + 0.02], color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{v} rank {r}" for v, r, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started (first rank)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.6 if k == "all_reduce" else 1)
               for k, c in colors.items()] + [plt.Line2D([], [], color="black")]
    ax.legend(handles, ["forward", "backward", "all-reduce in flight", "gradient ready (hook)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    return ax


# ----------------------------------------------------------------------------------------
# Timing a training step (the benchmark and the notebook's small comparison).
# ----------------------------------------------------------------------------------------

def _training_step(variant: str, bucket_size_mb: float, hidden: int, layers: int, batch: int,
                   rank: int, world_size: int):
    """One training step (forward, backward, sync, SGD step) of `variant`, as a closure.

    variant: one of VARIANTS, "torch" (torch.nn.parallel.DistributedDataParallel with
    bucket_cap_mb=bucket_size_mb) or "compute" (no gradient synchronisation at all: the
    compute-only baseline, run with the same ranks busy at the same time)."""
    check_variant(variant, VARIANTS + ("torch", "compute"))
    device = rank_device()
    model = make_mlp(hidden, layers).to(device)
    if variant == "torch":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_size_mb)
    elif variant != "compute":
        model = wrap(variant, model, bucket_size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = shard(make_batch(batch, hidden), rank, world_size).to(device)

    def step():
        mlp_loss(model(x)).backward()
        if variant in VARIANTS:
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return step


def _end_of_step() -> None:
    """Count GPU work where it happens, and end every step on the slowest rank."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    dist.barrier()


def time_steps(rank: int, world_size: int, variant: str, bucket_size_mb: float = 25.0,
               hidden: int = 1024, layers: int = 4, batch: int = 128, repeat: int = 5,
               warmup: int = 2) -> tuple[float, ...]:
    """Rank function: seconds per training step of one variant (see _training_step).
    A barrier ends every step, so a step lasts as long as its slowest rank."""
    from helpers.timing import measure

    step = _training_step(variant, bucket_size_mb, hidden, layers, batch, rank, world_size)
    return measure(step, variant, repeat=repeat, warmup=warmup, sync=_end_of_step).times_s


def time_interleaved(rank: int, world_size: int, configs: list[tuple[str, float]],
                     hidden: int = 1024, layers: int = 4, batch: int = 128, repeat: int = 10,
                     warmup: int = 2) -> list[list[float]]:
    """Rank function: like time_steps for several (variant, bucket_size_mb) at once, one step of
    each in turn (the order rotating every round), so that a machine whose load changes from
    second to second slows every variant alike. Returns the times per config, in order."""
    steps = [_training_step(v, mb, hidden, layers, batch, rank, world_size) for v, mb in configs]
    times: list[list[float]] = [[] for _ in configs]
    for round_ in range(warmup + repeat):
        for i in [(round_ + k) % len(steps) for k in range(len(steps))]:
            _end_of_step()
            start = time.perf_counter()
            steps[i]()
            _end_of_step()
            if round_ >= warmup:
                times[i].append(time.perf_counter() - start)
    return times


def compare_step_times(ranks, variants=("compute",) + VARIANTS + ("torch",), hidden: int = 1024,
                       layers: int = 4, batch: int = 128, bucket_size_mb: float = 8.0,
                       repeat: int = 5, warmup: int = 1) -> dict:
    """Time a step for each variant on `ranks` (taking turns, see time_interleaved); print one
    measurement line each, with comm_share = (step - compute-only step) / step when "compute"
    is among the variants."""
    from helpers.timing import Measurement

    for v in variants:
        check_variant(v, VARIANTS + ("torch", "compute"))
    check_bucket_size_mb(bucket_size_mb)
    if batch % ranks.world_size:
        raise ValueError(f"batch must be divisible by the world size {ranks.world_size}, got {batch}")
    times = ranks.run(time_interleaved, [(v, bucket_size_mb) for v in variants], hidden, layers,
                      batch, repeat, warmup)[0]
    results = {v: Measurement(f"{v:<9} step, d={ranks.world_size}", tuple(ts))
               for v, ts in zip(variants, times)}
    compute = results["compute"].median if "compute" in results else None
    for v, m in results.items():
        share = f"  comm_share {max(0.0, 1 - compute / m.median):.2f}" if compute else ""
        print(f"{m}{share}")
    return results
