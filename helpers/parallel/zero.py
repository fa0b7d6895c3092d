"""ZeRO-1 and ZeRO-2: shard the optimizer state, then the gradients too, over the DP ranks.

In data parallelism every rank holds the same parameters, gradients and optimizer state.
Adam's state (two moments, plus an fp32 master copy in mixed precision) is the biggest of
the three, and every rank updates every parameter identically: wasted memory and work.
`ShardedOptimizer` gives each of the group's d ranks about 1/d of the parameters (by size); a
rank keeps the optimizer state of, and steps, only its own; then each owner broadcasts its
updated parameters. The arithmetic per parameter is exactly the unsharded optimizer's, so
results are bit for bit the same on CPU.

`ZeroDP` (notebook 08) runs stages 0, 1 and 2 on flat gradient buckets: stage 2 reduce-scatters
each bucket during backward and keeps only its shard. ZeRO-3 is `helpers.parallel.fsdp`.

The memory model for ZeRO stages 0-3 is `helpers.cost.memory`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_number
from helpers.parallel import trace
from helpers.parallel.dp import broadcast_from_rank0
from helpers.parallel.groups import (all_gather_into, global_rank, group_rank, group_size,
                                     reduce_scatter_into)


class ShardedOptimizer(torch.optim.Optimizer):
    """`ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, group=None)`.

    A real `torch.optim.Optimizer`: `param_groups`, `zero_grad` and `add_param_group` work
    over all parameters (so LR schedulers do too); the wrapped optimizer, holding only this
    rank's shard and its state, is `local_optimizer`. Shards are numbered by group rank.
    Gradients must already be averaged across the group (e.g. by a DDP wrapper) when
    `step()` is called.
    """

    def __init__(self, params, optimizer_cls: type, *, group=None, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs a process group: build it inside a rank "
                               "function (helpers.ranks.spawn / LiveRanks.run)")
        self.process_group = group
        self.rank, self.d = group_rank(group), group_size(group)
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.local_optimizer: torch.optim.Optimizer | None = None
        self.owner: dict[torch.Tensor, int] = {}   # parameter -> the group rank that steps it
        self.load = [0] * self.d                   # elements owned by each group rank
        self._local_groups: list[dict | None] = [] # param_groups[i]'s counterpart, if any here
        super().__init__(params, defaults=dict(kwargs))  # calls add_param_group per group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validates and fills defaults
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            # Each parameter goes to the least-loaded rank so far: ~1/d of the elements each.
            # Every rank runs this same deterministic loop, so all agree on the owners.
            owner = min(range(self.d), key=lambda r: self.load[r])
            self.owner[p] = owner
            self.load[owner] += p.numel()
            if owner == self.rank:
                mine.append(p)
        local = None
        if mine:
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            if self.local_optimizer is None:
                self.local_optimizer = self.optimizer_cls([{"params": mine, **options}],
                                                          **self.optimizer_kwargs)
            else:
                self.local_optimizer.add_param_group({"params": mine, **options})
            local = self.local_optimizer.param_groups[-1]
        self._local_groups.append(local)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Hyperparameters may have changed (an LR scheduler writes param_groups): pass them on.
        for group, local in zip(self.param_groups, self._local_groups):
            if local is not None:
                local.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        if self.local_optimizer is not None:
            self.local_optimizer.step()
        self._share_updated_parameters()
        return loss

    def _share_updated_parameters(self) -> None:
        """Each owner broadcasts its parameters, flattened: one broadcast per rank (and dtype)."""
        if self.d == 1:
            return
        shards: dict[tuple, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                shards.setdefault((self.owner[p], p.dtype, p.device), []).append(p)
        pending = []
        for (owner, dtype, device), params in shards.items():  # same order on every rank
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            work = dist.broadcast(flat, src=global_rank(self.process_group, owner),
                                  group=self.process_group, async_op=True)
            pending.append((owner, params, flat, work))
        for owner, params, flat, work in pending:
            work.wait()
            if owner != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def state_dict(self):
        raise NotImplementedError("ShardedOptimizer's state is spread over the ranks: each rank's "
                                  "shard is local_optimizer.state_dict()")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in an optimizer's state on this rank (a ShardedOptimizer: its shard's)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer = optimizer.local_optimizer
    if optimizer is None:  # a rank that owns no parameter
        return 0
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------
# Notebook 08: ZeRO stages 0, 1 and 2 on flat buckets.
# ----------------------------------------------------------------------------------------

ZERO_DP_STAGES = (0, 1, 2)


class FlatBucket:
    """Some parameters laid end to end in one flat buffer of `padded` elements, a multiple of
    d (the pad is zeros); member r of the group owns elements [r·shard_numel, (r+1)·shard_numel).
    The layout only: the buffers themselves belong to whoever uses it (ZeroDP, FSDP)."""

    def __init__(self, params: list[torch.Tensor], d: int, rank: int):
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // d) * d
        self.shard_numel = self.padded // d
        self.start = rank * self.shard_numel
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()

    def empty(self, zero: bool = False) -> torch.Tensor:
        """A buffer of the whole bucket (padded)."""
        make = torch.zeros if zero else torch.empty
        return make(self.padded, dtype=self.dtype, device=self.device)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece of a flat buffer, in its shape."""
        n = self.shapes[i].numel()
        return flat[self.offsets[i]:self.offsets[i] + n].view(self.shapes[i])

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat buffer (a view)."""
        return flat[self.start:self.start + self.shard_numel]


def consecutive_groups(params: list[torch.Tensor], cap_bytes: float) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, at most cap_bytes each (a larger one
    goes alone)."""
    groups, size = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if groups and size + nbytes <= cap_bytes and (p.dtype, p.device) == (
                groups[-1][0].dtype, groups[-1][0].device):
            groups[-1].append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups


class ZeroDP(nn.Module):
    """Data parallelism under ZeRO stage 0, 1 or 2 over `group`'s d ranks; owns its optimizer.

    `model = ZeroDP(module, stage=2, lr=1e-2)`, then per step `loss.backward(); model.step();
    model.zero_grad()`. The module's parameters become views of flat buckets (in reverse
    order, the order backward produces them). A post-accumulate-grad hook copies each gradient
    into its bucket's flat gradient buffer as backward makes it; a full bucket is launched at
    once, asynchronously:

    * stage 0: all-reduce of the bucket (every rank keeps every gradient), the optimizer steps
      every parameter;
    * stage 1: reduce-scatter of the bucket; the full gradient buffer stays (as after a plain
      backward) but only this rank's slice is averaged and stepped, then the updated slices
      are all-gathered into the flat parameters;
    * stage 2: the same, but the gradient buffer is dropped as soon as it is reduce-scattered
      (and `.grad` never stays): a rank keeps only its 1/d of the gradients.

    The optimizer of stages 1-2 steps one tensor per bucket, a view of this rank's slice of
    the flat parameters, so its state is ~1/d. `self.log` records every collective in the
    course's event log (`helpers.parallel.trace`, block "zero").
    Gradients are averaged over the group (SUM, then divide by d): each rank's loss is the
    mean over its own slice of the batch.
    """

    def __init__(self, module: nn.Module, stage: int, optimizer_cls: type = torch.optim.AdamW,
                 *, bucket_size_mb: float = 0.25, group=None, **optimizer_kwargs: Any):
        super().__init__()
        check_choice("stage", stage, ZERO_DP_STAGES)
        check_number("bucket_size_mb", bucket_size_mb, low=0, low_inclusive=False, unit="MiB")
        if not dist.is_initialized():
            raise RuntimeError("ZeroDP needs a process group: build it inside a rank function "
                               "(helpers.ranks.spawn / LiveRanks.run)")
        self.module, self.stage, self.process_group = module, stage, group
        self.rank, self.d = group_rank(group), group_size(group)
        self.log = trace.Recorder("zero")
        broadcast_from_rank0(module, group)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [FlatBucket(ps, self.d, self.rank)
                        for ps in consecutive_groups(trainable[::-1], bucket_size_mb * 2**20)]
        self._where = {}   # parameter -> (bucket index, position in it)
        self._flat: list[torch.Tensor] = []      # each bucket's flat parameters
        self._grad: list[torch.Tensor | None] = [None] * len(self.buckets)  # flat gradients
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple | None] = [None] * len(self.buckets)
        self._next = 0
        shards = []
        with torch.no_grad():
            for b, bucket in enumerate(self.buckets):
                flat = bucket.empty(zero=True)
                for i, p in enumerate(bucket.params):
                    bucket.view(flat, i).copy_(p)
                    p.data = bucket.view(flat, i)   # the same Parameter, now a view of `flat`
                    self._where[p] = (b, i)
                    p.register_post_accumulate_grad_hook(self._on_gradient)
                self._flat.append(flat)
                shards.append(nn.Parameter(bucket.mine(flat)))  # a view: stepping it updates flat
        self.shards = shards if stage >= 1 else []
        self.optimizer = optimizer_cls(trainable if stage == 0 else shards, **optimizer_kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _on_gradient(self, p: torch.Tensor) -> None:
        b, i = self._where[p]
        bucket = self.buckets[b]
        if self._grad[b] is None:
            self._grad[b] = bucket.empty(zero=True)
        piece = bucket.view(self._grad[b], i)
        piece.copy_(p.grad)
        # Stages 0-1 keep every gradient, as a view of the flat buffer (no second copy);
        # stage 2 keeps none beyond this bucket's buffer, which goes once it is reduce-scattered.
        p.grad = piece if self.stage < 2 else None
        self._ready[b] += 1
        # Launch in bucket order only: every rank must issue collectives in the same order.
        while (self._next < len(self.buckets)
               and self._ready[self._next] == len(self.buckets[self._next].params)):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket, grad = self.buckets[b], self._grad[b]
        if grad is None:  # no parameter of the bucket got a gradient: join with zeros
            grad = self._grad[b] = bucket.empty(zero=True)
        self._next = b + 1
        if self.stage == 0:
            self.log.add("all_reduce", grad)
            work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group,
                                   async_op=True)
            self._pending[b] = (work, grad)
        else:
            out = torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
            self.log.add("reduce_scatter", grad)
            self._pending[b] = (reduce_scatter_into(out, grad, self.process_group,
                                                    async_op=True), out)
        if self.stage == 2:
            self._grad[b] = None  # the collective holds it until it completes
        if b > 0:  # the previous bucket's collective, and the copies gloo made for it, go
            self._settle(b - 1)

    def _settle(self, b: int) -> None:
        """Wait for bucket b's collective and drop it (and with it the buffer it read)."""
        work, reduced = self._pending[b]
        if work is not None:
            work.wait()
            self._pending[b] = (None, reduced)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what backward has not, wait, average; stage 1-2: hand each shard its slice."""
        while self._next < len(self.buckets):
            self._launch(self._next)
        for b, bucket in enumerate(self.buckets):
            self._settle(b)
            _, reduced = self._pending[b]
            reduced /= self.d
            if self.stage == 1:
                bucket.mine(self._grad[b]).copy_(reduced)
                self.shards[b].grad = bucket.mine(self._grad[b])
            elif self.stage == 2:
                self.shards[b].grad = reduced
            self._pending[b], self._ready[b] = None, 0
        self._next = 0

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient synchronization, step, and (stages 1-2) all-gather the
        updated slices into every rank's flat parameters."""
        self.finish_gradient_synchronization()
        self.optimizer.step()
        if self.stage == 0:
            return
        works = []
        for bucket, flat, shard in zip(self.buckets, self._flat, self.shards):
            self.log.add("all_gather", flat)
            works.append(all_gather_into(flat, shard.detach().clone(), self.process_group,
                                         async_op=True))
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        """Drop every gradient (module and shards) and the flat gradient buffers."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        for shard in self.shards:
            shard.grad = None
        self._grad = [None] * len(self.buckets)
