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

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_divisible, check_number
from helpers.parallel.groups import PendingMean, all_reduce_mean, all_reduce_mean_async, global_rank
from helpers.parallel.trace import Span

VARIANTS = ("naive", "flat", "overlap", "bucketed")


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
        # Set to [] to record this step's `Span`s, in seconds of the machine-wide monotonic clock:
        # "all_reduce" (a bucket's, launch to completion) and "grad" (a gradient-ready hook fired,
        # start == end), labelled with the bucket or parameter; the lab adds "forward",
        # "backward" and "wait" (inside finish_gradient_synchronization).
        self.trace: list[Span] | None = None
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

    def _record(self, event: Span) -> None:
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
        self._record(Span("grad", now, now, self._names[p]))
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
            self._record(Span("all_reduce", start, time.perf_counter(), label))
            return
        bucket.pending = all_reduce_mean_async(bucket.buffer, self.process_group)
        if self.trace is not None:
            # The future completes on gloo's own thread when the data has arrived; the callback
            # may run just after wait() returns, so it writes into this step's list, bound now.
            trace = self.trace
            bucket.pending.work.get_future().then(
                lambda _f: trace.append(Span("all_reduce", start, time.perf_counter(), label)))

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


def shard(batch: torch.Tensor, rank: int, d: int) -> torch.Tensor:
    """Rank r's contiguous slice of the batch, of d (the batch must split evenly)."""
    check_divisible("batch", batch.shape[0], d, "d ranks share its rows")
    local = batch.shape[0] // d
    return batch[rank * local:(rank + 1) * local]
