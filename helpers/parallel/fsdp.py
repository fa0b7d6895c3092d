"""ZeRO-3 / FSDP from scratch: parameters, gradients and optimizer state all sharded.

The model is cut into *units* (for notebook 07's decoder: the embedding, each block, the
head). Each unit's parameters are laid end to end in one flat buffer (`zero.FlatBucket`,
padded to a multiple of d) and each of the group's d ranks keeps only its 1/d slice, the
`shard`: the only real parameter left, the one the optimizer steps. Around every unit:

* before its forward, all-gather the shards into the whole flat buffer and point the
  module's weights at views of it;
* after its forward, free that buffer (`untyped_storage().resize_(0)`): autograd's saved
  views still refer to the storage, now empty;
* when backward reaches the unit's output (a hook on that tensor), all-gather again into
  the same storage, so the saved views are whole again for the unit's backward;
* when the flat buffer's gradient is complete (a post-accumulate-grad hook), reduce-scatter
  it into this rank's shard gradient and free the buffer and its gradient.

With `prefetch=True`, the all-gather of the next unit (forward: the following one; backward:
the preceding one) is launched before this unit computes, so it can travel meanwhile; a rank
then holds two units at once instead of one. Works on any process group: ranks number their
shards by group rank. `self.log` records every collective in the course's event log
(`helpers.parallel.trace`, block "fsdp").

With `precision=MixedPrecision(torch.bfloat16)` the shard stays in the parameters' dtype (the
fp32 *master* weights the optimizer steps) and a copy of it in the compute dtype is what is
gathered, so forward and backward run in bf16 (or fp16); the gradient is reduce-scattered in
`reduce_dtype` (fp32, or the compute dtype) and cast to fp32 only for the optimizer step. A
rank then keeps, per parameter and divided by d, the lecture's 2 + 2 + 12 bytes: the bf16
shard, its bf16 gradient (4 bytes when reduced in fp32) and the fp32 master with Adam's two
moments. FSDP2 (`MixedPrecisionPolicy`) casts at every gather instead and keeps no bf16 shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from helpers.models import Transformer
from helpers.parallel import trace
from helpers.parallel.dp import broadcast_from_rank0
from helpers.parallel.groups import all_gather_into, group_rank, group_size, reduce_scatter_into
from helpers.parallel.zero import FlatBucket


# the floating dtypes gloo's (and NCCL's) reduce-scatter and all-gather carry: what a compute,
# reduce or output dtype may be
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes FSDP computes, reduces and answers in; the shards it steps keep the
    parameters' own dtype (fp32 master weights).

    compute_dtype: the unit's weights are gathered in it, so forward and backward run in it.
    reduce_dtype: the gradients' reduce-scatter: float32 sums the d ranks' gradients with 24
      significant bits and sends 4 bytes per value; the compute dtype sends half the bytes
      (bf16: 2) but rounds every partial sum to 8 bits, so the reduction's error grows with
      the number of additions (`helpers.cost.memory.reduction_tolerance`).
    output_dtype: the model's output is cast to it, so the loss's softmax runs in fp32.
    """
    compute_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("compute_dtype", "reduce_dtype", "output_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)}")
        if self.reduce_dtype not in (torch.float32, self.compute_dtype):
            raise ValueError("reduce_dtype must be torch.float32 or the compute dtype "
                             f"({self.compute_dtype}), got {self.reduce_dtype}")


def transformer_units(model: Transformer) -> list[nn.Module]:
    """Notebook 07's decoder cut into FSDP units: embedding, each block, head."""
    return [model.embed, *model.blocks, model.head]


class _Unit:
    """One unit's bookkeeping: where its weights live, its shard, and its gathered buffer."""

    def __init__(self, index: int, module: nn.Module, d: int, rank: int,
                 compute_dtype: torch.dtype | None = None):
        self.index, self.module = index, module
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.bucket = FlatBucket([p for _, p in named], d, rank)
        # (owning submodule, attribute) of each weight, to point it at the gathered buffer
        self.slots = [(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                      for name in self.names]
        with torch.no_grad():
            flat = self.bucket.empty(zero=True)
            for i, (_, p) in enumerate(named):
                self.bucket.view(flat, i).copy_(p)
            self.shard = nn.Parameter(self.bucket.mine(flat).clone())
            # what is gathered: the shard itself, or its copy in the compute dtype (refreshed
            # after every optimizer step)
            self.cast = compute_dtype not in (None, self.shard.dtype)
            self.compute = (self.shard.detach().to(compute_dtype) if self.cast
                            else self.shard.detach())
        for owner, attr in self.slots:
            shape = owner._parameters[attr].shape
            del owner._parameters[attr]
            # a meta placeholder: using the weights without gathering them fails loudly
            setattr(owner, attr, torch.empty(shape, device="meta"))
        self.full: torch.Tensor | None = None  # the gathered flat buffer while it exists
        self.gather = None                       # an all-gather in flight into `full`
        self.reduced = None                      # (work, shard gradient, buffer it reads)
        self.grad: torch.Tensor | None = None    # the reduced gradient kept in a narrower
                                                 # dtype than the shard (mixed precision)

    def empty_full(self) -> torch.Tensor:
        """A buffer for the whole unit, gathered in the compute dtype."""
        return torch.empty(self.bucket.padded, dtype=self.compute.dtype, device=self.compute.device)

    def bind(self) -> None:
        """Point every weight of the unit at its view of `full`."""
        for i, (owner, attr) in enumerate(self.slots):
            setattr(owner, attr, self.bucket.view(self.full, i))


class FSDP(nn.Module):
    """`model = FSDP(make_transformer(config), lr=1e-2, group=g)`, then per step
    `loss = lm_loss(model(ids), targets); loss.backward(); model.step(); model.zero_grad()`.

    `units`: the submodules to shard one by one (default: `transformer_units(module)`); every
    parameter must belong to exactly one. `parameters()` are the shards (one flat tensor per
    unit), which `optimizer` steps. Gradients are averaged over the group. `precision`: a
    MixedPrecision, or None to compute in the parameters' own dtype.
    """

    def __init__(self, module: nn.Module, units: Sequence[nn.Module] | None = None,
                 optimizer_cls: type = torch.optim.AdamW, *, prefetch: bool = False,
                 group=None, precision: MixedPrecision | None = None, **optimizer_kwargs: Any):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs a process group: build it inside a rank function "
                               "(helpers.ranks.spawn / LiveRanks.run)")
        if units is None:
            if not isinstance(module, Transformer):
                raise TypeError("units must be given for a module that is not "
                                f"helpers.models.Transformer, got {type(module).__name__}")
            units = transformer_units(module)
        self.process_group, self.prefetch, self.precision = group, prefetch, precision
        self.rank, self.d = group_rank(group), group_size(group)
        self.log = trace.Recorder("fsdp")
        broadcast_from_rank0(module, group)
        unit_params = [set(u.parameters()) for u in units]
        for p_name, p in module.named_parameters():
            owners = sum(p in s for s in unit_params)
            if owners != 1:
                raise ValueError(f"units must hold every parameter exactly once: {p_name} is "
                                 f"in {owners} of them")
        prefixes = {id(m): name for name, m in module.named_modules()}
        compute = precision.compute_dtype if precision is not None else None
        self._units = [_Unit(i, u, self.d, self.rank, compute) for i, u in enumerate(units)]
        self.unit_names = [prefixes[id(u)] for u in units]
        self.module = module
        self.shards = nn.ParameterList([u.shard for u in self._units])
        for u in self._units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.precision is not None and isinstance(out, torch.Tensor):
            out = out.to(self.precision.output_dtype)
        return out

    @property
    def compute_shards(self) -> list[torch.Tensor]:
        """What this rank contributes to each gather: the shards, or their copies in the
        compute dtype."""
        return [u.compute for u in self._units]

    @property
    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient of each shard, in the dtype it was reduced in (empty
        before the first backward and after zero_grad)."""
        return [g for u in self._units
                for g in [u.grad if u.grad is not None else u.shard.grad] if g is not None]

    # -- gathering ------------------------------------------------------------------------

    def _launch_gather(self, u: _Unit, into_existing: bool) -> None:
        """All-gather u's shards: into a new buffer (forward) or back into the storage its
        saved views refer to (backward)."""
        if u.gather is not None:
            return  # prefetched already
        if into_existing:
            u.full.untyped_storage().resize_(u.bucket.padded * u.full.element_size())
            target = u.full.data  # .data: refilling must not bump the version autograd checks
        else:
            u.full = target = u.empty_full()
        self.log.add("all_gather", target)
        u.gather = all_gather_into(target, u.compute, self.process_group, async_op=True)

    def _wait_gather(self, u: _Unit) -> None:
        u.gather.wait()
        u.gather = None

    def _pre_forward(self, u: _Unit) -> None:
        self._launch_gather(u, into_existing=False)
        if self.prefetch and u.index + 1 < len(self._units):
            self._launch_gather(self._units[u.index + 1], into_existing=False)
        self._wait_gather(u)
        u.full.requires_grad_(torch.is_grad_enabled())
        u.bind()

    def _post_forward(self, u: _Unit, out) -> None:
        u.full.untyped_storage().resize_(0)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, u=u: self._pre_backward(u))
            u.full.register_post_accumulate_grad_hook(lambda full, u=u: self._post_backward(u))

    def _pre_backward(self, u: _Unit) -> None:
        self._launch_gather(u, into_existing=True)
        if self.prefetch and u.index > 0:
            self._launch_gather(self._units[u.index - 1], into_existing=True)
        self._wait_gather(u)

    def _post_backward(self, u: _Unit) -> None:
        for other in self._units:  # earlier reduce-scatters: done, their buffers freed
            self._settle(other)
        grad, u.full.grad = u.full.grad, None
        if self.precision is not None:
            grad = grad.to(self.precision.reduce_dtype)  # no copy when it is already
        out = torch.empty(u.bucket.shard_numel, dtype=grad.dtype, device=grad.device)
        self.log.add("reduce_scatter", grad)
        u.reduced = (reduce_scatter_into(out, grad, self.process_group, async_op=True), out)
        u.full.untyped_storage().resize_(0)
        u.full = None

    @staticmethod
    def _settle(u: _Unit) -> None:
        """Wait for u's reduce-scatter, if in flight, and drop it with the buffer it read."""
        if u.reduced is not None and u.reduced[0] is not None:
            u.reduced[0].wait()
            u.reduced = (None, u.reduced[1])

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every unit's reduce-scatter and hand each shard its averaged gradient."""
        for u in self._units:
            if u.reduced is None:
                raise RuntimeError(f"FSDP: unit {self.unit_names[u.index]!r} got no gradient "
                                   "this step; every unit must take part in the loss")
            self._settle(u)
            reduced, u.reduced = u.reduced[1], None
            if reduced.dtype == u.shard.dtype:
                u.shard.grad = reduced.div_(self.d)
            else:
                # reduced in the compute dtype: kept so (the formula's 2 bytes), and cast to
                # the master's dtype before dividing, so that d need not be a power of two
                u.grad = reduced
                u.shard.grad = reduced.to(u.shard.dtype).div_(self.d)

    def step(self) -> None:
        self.finish_gradient_synchronization()
        self.optimizer.step()
        with torch.no_grad():
            for u in self._units:
                if u.cast:
                    u.compute.copy_(u.shard)  # the masters moved: cast them again
                if u.grad is not None:
                    u.shard.grad = None  # the fp32 copy only served the step

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        for u in self._units:
            u.grad = None

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by its name in the unwrapped module, on the CPU (an
        all-gather per unit: call it on every rank of the group)."""
        whole = {}
        for u, prefix in zip(self._units, self.unit_names):
            flat = u.bucket.empty()
            all_gather_into(flat, u.shard.detach(), self.process_group)
            for i, name in enumerate(u.names):
                whole[f"{prefix}.{name}"] = u.bucket.view(flat, i).to("cpu", copy=True)
        return whole

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient whole, in the masters' dtype, on the CPU: call
        it on every rank between `finish_gradient_synchronization()` and `step()`."""
        whole = {}
        for u, prefix in zip(self._units, self.unit_names):
            if u.shard.grad is None:
                raise RuntimeError("full_gradients: no gradient; call it after "
                                   "finish_gradient_synchronization() and before step()")
            flat = u.bucket.empty()
            all_gather_into(flat, u.shard.grad, self.process_group)
            for i, name in enumerate(u.names):
                whole[f"{prefix}.{name}"] = u.bucket.view(flat, i).to("cpu", copy=True)
        return whole
