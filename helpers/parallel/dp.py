"""Data parallelism: every rank holds the whole model and a slice of the batch.

After `backward()` each rank has the gradient of *its* slice; averaging the gradients across
the d ranks of the data-parallel group gives the gradient of the whole batch, so one
optimizer step keeps every copy identical. The wrappers below do that averaging four ways,
from the lecture's loop to what `torch.nn.parallel.DistributedDataParallel` does:

* `NaiveDDP`     one all-reduce per parameter, after the backward pass (the lecture);
* `FlatDDP`      one all-reduce over all gradients flattened into one buffer;
* `OverlapDDP`   one asynchronous all-reduce per parameter, launched by a hook the moment
                 its gradient is accumulated, so communication overlaps the rest of backward;
* `BucketedDDP`  the same, but gradients are grouped (in reverse parameter order, the order
                 backward produces them) into buckets of at most `bucket_size_mb`.

All four share one mechanism: a `Bucket` is a flat buffer holding some gradients plus one
"had a gradient" flag per parameter, averaged over the group with `all_reduce_mean` (or its
asynchronous form). The flags make two awkward cases work: a parameter with no gradient on a
rank contributes zeros (so every rank still joins every collective and nothing hangs), and a
parameter with no gradient on *any* rank (flag mean 0) keeps `grad = None`, as in plain
training. Buckets are always launched in the same order on every rank (a bucket waits for
the ones before it), because collectives are matched by the order ranks issue them.

Gradient accumulation (micro-batches, as a pipeline runs them): `with model.no_sync():` around
every backward but the last only adds into `.grad`; the last backward then synchronises once.

Every wrapper takes `group=None` (the whole world): the group's first member broadcasts the
starting weights, and the gradients are averaged over the group only.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_divisible, check_number
from helpers.models import LECTURE, MLPConfig, make_batch, make_mlp, mlp_loss
from helpers.parallel.groups import (PendingMean, all_reduce_mean, all_reduce_mean_async,
                                     global_rank, group_rank, group_size, rank_device)
from helpers.timing import Measurement

VARIANTS = ("naive", "flat", "overlap", "bucketed")
TIMED = VARIANTS + ("torch", "compute")  # what a training step can be timed with
# SGD takes large steps (the lecture's loss is small, ~0.01) so that the weights move visibly
# (~1e-2) in three steps: a wrong average then lands far outside assert_close's tolerance.
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 10.0, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2})}


@dataclass(frozen=True)
class TraceEvent:
    """One interval of a traced training step, in seconds of the machine-wide monotonic clock.

    kind: "forward", "backward", "wait" (inside finish_gradient_synchronization), "all_reduce"
    (launch to completion) or "grad" (a gradient-ready hook fired: start == end);
    label: the parameter or bucket an all-reduce or hook is about ("" otherwise).
    """
    kind: str
    label: str
    start: float
    end: float


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Make every rank of `group` start from its first member's weights: parameters (frozen
    ones too) and buffers."""
    src = global_rank(group, 0)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(tensor.data, src=src, group=group)


class Bucket:
    """Some parameters' gradients, flattened, followed by one 'had a gradient' flag each."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.ready = 0                          # how many of its gradients backward has produced
        self.pending: PendingMean | None = None  # the asynchronous mean, once launched

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

    def unpack(self) -> None:
        """Write the averaged buffer back into `.grad`."""
        offset, flags = 0, self.buffer[self.numel:].tolist()
        for p, flag in zip(self.params, flags):
            mean = self.buffer[offset:offset + p.numel()].view_as(p)
            if flag == 0:           # no rank produced a gradient: leave it as plain training would
                p.grad = None
            elif p.grad is None:    # other ranks did: take the average
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)
            offset += p.numel()


def split_into_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[Bucket]:
    """Consecutive parameters, at most cap_bytes of gradient each (a bigger one goes alone)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = not current or (p.dtype, p.device) == (current[0].dtype, current[0].device)
        if current and (size + nbytes > cap_bytes or not same_kind):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class _DataParallel(nn.Module):
    """What the four wrappers share; subclasses choose the buckets and whether hooks launch them."""

    overlap = False  # launch buckets from post-accumulate-grad hooks during backward?

    def __init__(self, module: nn.Module, bucket_cap_bytes: float, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs a process group: build it inside a "
                               "rank function (helpers.ranks.spawn / LiveRanks.run)")
        self.module = module
        self.process_group = group
        self.trace: list[TraceEvent] | None = None  # set to [] to record this step's events
        broadcast_from_rank0(module, group)
        # parameters() lists a tied (shared) parameter once, so it is reduced once.
        trainable = [p for p in module.parameters() if p.requires_grad]
        # Backward produces gradients roughly last layer first: bucket in that order.
        self._buckets = split_into_buckets(trainable[::-1], bucket_cap_bytes)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._names = {p: n for n, p in module.named_parameters()}
        self._next = 0  # index of the next bucket to launch
        self._sync = True  # False inside no_sync(): backward only accumulates
        if self.overlap:
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)

    @property
    def num_buckets(self) -> int:
        """All-reduces per step: one per bucket."""
        return len(self._buckets)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _record(self, event: TraceEvent) -> None:
        if self.trace is not None:
            self.trace.append(event)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside the block only add into `.grad`,
        nothing is communicated. Run every micro-batch's backward but the last inside it, the
        last one outside, then `finish_gradient_synchronization()`: one all-reduce per bucket
        per step, of the gradients summed over the micro-batches (torch DDP's `no_sync`)."""
        previous, self._sync = self._sync, False
        try:
            yield self
        finally:
            self._sync = previous

    def _on_gradient_ready(self, p: torch.Tensor) -> None:
        now = time.perf_counter()
        self._record(TraceEvent("grad", self._names[p], now, now))
        if not self._sync:
            return  # accumulating (no_sync): the bucket fills on the last backward
        bucket = self._bucket_of[p]
        if bucket.pending is not None or bucket.ready == len(bucket.params):
            raise RuntimeError(f"{type(self).__name__}: a second backward before "
                               "finish_gradient_synchronization(); call it after every backward, "
                               "or run the backwards but the last inside no_sync()")
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
        if not self.overlap:
            all_reduce_mean(bucket.buffer, self.process_group)
            self._record(TraceEvent("all_reduce", label, start, time.perf_counter()))
            return
        bucket.pending = all_reduce_mean_async(bucket.buffer, self.process_group)
        if self.trace is not None:
            # The future completes on gloo's own thread when the data has arrived; the callback
            # may run just after wait() returns, so it writes into this step's list, bound now.
            trace = self.trace
            bucket.pending.work.get_future().then(
                lambda _f: trace.append(TraceEvent("all_reduce", label, start, time.perf_counter())))

    def finish_gradient_synchronization(self) -> None:
        """Launch what backward has not, wait for everything, average. Call before step()."""
        if not self._sync:
            raise RuntimeError(f"{type(self).__name__}: finish_gradient_synchronization() inside "
                               "no_sync(); leave no_sync() for the last backward, then call it")
        while self._next < len(self._buckets):
            self._launch(self._next)  # buckets with a parameter that got no gradient
        for bucket in self._buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
            bucket.unpack()
            bucket.pending, bucket.ready = None, 0
        self._next = 0


class NaiveDDP(_DataParallel):
    """The lecture's version: after backward, one blocking all-reduce per parameter."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__(module, bucket_cap_bytes=0, group=group)  # every parameter alone


class FlatDDP(_DataParallel):
    """After backward, one blocking all-reduce over all gradients (one buffer per dtype)."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__(module, bucket_cap_bytes=float("inf"), group=group)


class OverlapDDP(_DataParallel):
    """Each gradient all-reduced asynchronously as soon as backward has accumulated it."""

    overlap = True

    def __init__(self, module: nn.Module, group=None):
        super().__init__(module, bucket_cap_bytes=0, group=group)


class BucketedDDP(_DataParallel):
    """Gradients in buckets of at most bucket_size_mb MiB, each all-reduced when full."""

    overlap = True

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, group=None):
        self.bucket_size_mb = check_number("bucket_size_mb", bucket_size_mb, low=0,
                                           low_inclusive=False, unit="MiB")
        super().__init__(module, bucket_cap_bytes=self.bucket_size_mb * 2**20, group=group)


def wrap(variant: str, module: nn.Module, bucket_size_mb: float = 25.0,
         group=None) -> _DataParallel:
    check_choice("variant", variant, VARIANTS)
    if variant == "bucketed":
        return BucketedDDP(module, bucket_size_mb, group=group)
    return {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP}[variant](module, group=group)


# ----------------------------------------------------------------------------------------
# Training on the lecture's MLP: single process, the lecture's loop, and the wrappers.
# ----------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    """What one rank (or the single process) ends a training run with."""
    losses: list[float]          # the loss of each step (a rank's: of its slice of the batch)
    params: list[torch.Tensor]   # the parameters after training, on the CPU
    all_reduces_per_step: int    # 0 for the single process


def shard(batch: torch.Tensor, rank: int, d: int) -> torch.Tensor:
    """Rank r's contiguous slice of the batch, of d (the batch must split evenly)."""
    check_divisible("batch", batch.shape[0], d, "d ranks share its rows")
    local = batch.shape[0] // d
    return batch[rank * local:(rank + 1) * local]


def make_optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    """One of OPTIMIZERS, optionally with another learning rate."""
    cls, options = OPTIMIZERS[check_choice("optimizer", name, OPTIMIZERS)]
    if lr is not None:
        options = {**options, "lr": lr}
    return cls(params, **options)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int,
           synchronize=None) -> list[float]:
    """`steps` steps of the lecture's loss on x; `synchronize()` runs between backward and step."""
    losses = []
    for _ in range(steps):
        loss = mlp_loss(model(x))
        loss.backward()
        if synchronize is not None:
            synchronize()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


def train_single_process(steps: int = 3, config: MLPConfig = LECTURE, optimizer: str = "sgd",
                         lr: float | None = None) -> TrainResult:
    """The reference: one process, the whole batch."""
    model = make_mlp(config)
    losses = _train(model, make_optimizer(optimizer, model.parameters(), lr), make_batch(config),
                    steps)
    return TrainResult(losses, _parameters(model), 0)


def lecture_train(rank: int, world_size: int, steps: int = 3, config: MLPConfig = LECTURE,
                  lr: float | None = None, seed_per_rank: bool = False,
                  group=None) -> TrainResult:
    """Rank function: the lecture's data parallelism, over `group`'s d ranks.

    Every rank builds the model from `config.seed`, as the lecture does; nothing is broadcast,
    so with `seed_per_rank=True` (group rank r uses seed + r) the copies start apart and never meet.
    """
    r, d = group_rank(group), group_size(group)
    device = rank_device()
    model = make_mlp(config.with_(seed=config.seed + r) if seed_per_rank else config).to(device)

    def average_gradients():  # "the only difference from standard training"
        for param in model.parameters():
            all_reduce_mean(param.grad, group)

    losses = _train(model, make_optimizer("sgd", model.parameters(), lr),
                    shard(make_batch(config), r, d).to(device), steps, average_gradients)
    return TrainResult(losses, _parameters(model), len(list(model.parameters())))


def ddp_train(rank: int, world_size: int, variant: str, steps: int = 3,
              config: MLPConfig = LECTURE, optimizer: str = "sgd", lr: float | None = None,
              bucket_size_mb: float = 1.0, group=None) -> TrainResult:
    """Rank function: train with a wrapper over `group`. Group rank r initialises with seed + r
    on purpose: the wrapper's broadcast must make them all start from the group's first
    member's weights (those of `config`)."""
    r, d = group_rank(group), group_size(group)
    device = rank_device()
    model = wrap(variant, make_mlp(config.with_(seed=config.seed + r)).to(device),
                 bucket_size_mb, group=group)
    x = shard(make_batch(config), r, d).to(device)
    losses = _train(model, make_optimizer(optimizer, model.parameters(), lr), x, steps,
                    model.finish_gradient_synchronization)
    return TrainResult(losses, _parameters(model), model.num_buckets)


@dataclass(frozen=True)
class VariantCheck:
    """One row of compare_with_single_process."""
    variant: str
    all_reduces_per_step: int
    ranks_identical: bool      # every rank's parameters bit for bit rank 0's
    max_diff: float            # largest |rank - single process| over parameters and ranks
    rank_losses: list[float]   # each rank's first-step loss


def compare_with_single_process(ranks, variants=("lecture",) + VARIANTS, steps: int = 3,
                                config: MLPConfig = LECTURE,
                                bucket_size_mb: float = 1.0) -> list[VariantCheck]:
    """Train each variant on `ranks` and check every rank's parameters against one process
    training on the whole batch (torch.testing.assert_close). One row per variant."""
    for v in variants:
        check_choice("variant", v, ("lecture",) + VARIANTS)
    check_number("bucket_size_mb", bucket_size_mb, low=0, low_inclusive=False, unit="MiB")
    check_divisible("batch", config.batch, ranks.world_size, "d ranks share its rows")
    reference = train_single_process(steps, config)
    rows = []
    for v in variants:
        if v == "lecture":
            results = ranks.run(lecture_train, steps, config)
        else:
            results = ranks.run(ddp_train, v, steps, config, bucket_size_mb=bucket_size_mb)
        for r in results:
            torch.testing.assert_close(r.params, reference.params)
        same = all(torch.equal(a, b) for r in results for a, b in zip(r.params, results[0].params))
        diff = max((a - b).abs().max().item()
                   for r in results for a, b in zip(r.params, reference.params))
        rows.append(VariantCheck(v, results[0].all_reduces_per_step, same, diff,
                                 [r.losses[0] for r in results]))
    return rows


def comparison_table(rows: list[VariantCheck]) -> str:
    """compare_with_single_process's rows as text (no times, no machine-dependent digits)."""
    lines = [f"{'variant':<10}{'all-reduces/step':>18}{'ranks bit-identical':>21}"
             f"{'= single process (assert_close)':>33}"]
    for row in rows:
        lines.append(f"{row.variant:<10}{row.all_reduces_per_step:>18}"
                     f"{str(row.ranks_identical):>21}{'passed':>33}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# A measured timeline: when does backward compute, when is an all-reduce in flight?
# ----------------------------------------------------------------------------------------

def timeline(rank: int, world_size: int, variant: str, config: MLPConfig = LECTURE,
             bucket_size_mb: float = 4.0, warmup: int = 2, traced: int = 5,
             group=None) -> list[TraceEvent]:
    """Rank function: a traced training step's events, in seconds of the machine-wide
    monotonic clock, so ranks' timestamps are comparable.

    `traced` steps are recorded and the typical one returned: the step of median length (its
    slowest rank's), agreed by all ranks of `group`, so a moment of load on a shared machine is
    not mistaken for the picture."""
    device = rank_device()
    model = wrap(variant, make_mlp(config).to(device), bucket_size_mb, group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = shard(make_batch(config), group_rank(group), group_size(group)).to(device)
    recorded = []
    for step in range(warmup + traced):
        model.trace = []
        dist.barrier(group=group)
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
            model.trace += [TraceEvent("forward", "", start, forward_end),
                            TraceEvent("backward", "", forward_end, backward_end),
                            TraceEvent("wait", "finish_gradient_synchronization", backward_end,
                                       sync_end)]
            recorded.append(model.trace)
    model.trace = None
    dist.barrier(group=group)
    lengths = torch.tensor([max(e.end for e in ev) - min(e.start for e in ev) for ev in recorded],
                           device=device)  # NCCL reduces only tensors on the GPU
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)  # a step lasts as long as its slowest rank
    return recorded[int(lengths.argsort()[len(recorded) // 2].item())]


def overlap_seconds(events: list[TraceEvent]) -> float:
    """How long all-reduces were in flight while backward was still computing."""
    backward = [e for e in events if e.kind == "backward"]
    return sum(max(0.0, min(e.end, b.end) - max(e.start, b.start))
               for e in events if e.kind == "all_reduce" for b in backward)


# ----------------------------------------------------------------------------------------
# Timing a training step (the benchmark and the notebook's small comparison).
# ----------------------------------------------------------------------------------------

def _training_step(variant: str, bucket_size_mb: float, config: MLPConfig, group=None):
    """One training step (forward, backward, sync, SGD step) of `variant`, as a closure.

    variant: one of VARIANTS, "torch" (torch.nn.parallel.DistributedDataParallel with
    bucket_cap_mb=bucket_size_mb) or "compute" (no gradient synchronisation at all: the
    compute-only baseline, run with the same ranks busy at the same time)."""
    check_choice("variant", variant, TIMED)
    device = rank_device()
    model = make_mlp(config).to(device)
    if variant == "torch":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_size_mb,
                                                    process_group=group)
    elif variant != "compute":
        model = wrap(variant, model, bucket_size_mb, group=group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = shard(make_batch(config), group_rank(group), group_size(group)).to(device)

    def step():
        mlp_loss(model(x)).backward()
        if variant in VARIANTS:
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return step


def _end_of_step(group=None) -> None:
    """Count GPU work where it happens, and end every step on the slowest rank."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    dist.barrier(group=group)


def time_interleaved(rank: int, world_size: int, setups: list[tuple[str, float]],
                     config: MLPConfig = LECTURE, repeat: int = 10, warmup: int = 2,
                     group=None) -> list[list[float]]:
    """Rank function: seconds per training step of several (variant, bucket_size_mb) setups
    (see _training_step), one step of each in turn (the order rotating every round), so that a
    machine whose load changes from second to second slows every variant alike. A barrier ends
    every step, so a step lasts as long as its slowest rank. Returns the times per setup."""
    steps = [_training_step(v, mb, config, group) for v, mb in setups]
    times: list[list[float]] = [[] for _ in setups]
    for round_ in range(warmup + repeat):
        for i in [(round_ + k) % len(steps) for k in range(len(steps))]:
            _end_of_step(group)
            start = time.perf_counter()
            steps[i]()
            _end_of_step(group)
            if round_ >= warmup:
                times[i].append(time.perf_counter() - start)
    return times


def compare_step_times(ranks, variants=("compute",) + VARIANTS + ("torch",),
                       config: MLPConfig = LECTURE, bucket_size_mb: float = 8.0,
                       repeat: int = 5, warmup: int = 1) -> dict:
    """Time a step for each variant on `ranks` (taking turns, see time_interleaved); print one
    measurement line each, with comm_share = (step - compute-only step) / step when "compute"
    is among the variants. Returns {variant: Measurement}."""
    for v in variants:
        check_choice("variant", v, TIMED)
    check_number("bucket_size_mb", bucket_size_mb, low=0, low_inclusive=False, unit="MiB")
    check_divisible("batch", config.batch, ranks.world_size, "d ranks share its rows")
    times = ranks.run(time_interleaved, [(v, bucket_size_mb) for v in variants], config,
                      repeat, warmup)[0]
    results = {v: Measurement(f"{v:<9} step, d={ranks.world_size}", tuple(ts))
               for v, ts in zip(variants, times)}
    compute = results["compute"].median if "compute" in results else None
    for v, m in results.items():
        share = f"  comm_share {max(0.0, 1 - compute / m.median):.2f}" if compute else ""
        print(f"{m}{share}")
    return results
