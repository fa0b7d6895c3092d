"""Measuring what a rank holds and what it hands to the collectives, on the rank itself.

* `state_bytes(params, optimizer)`: parameters, gradients and optimizer state, from the
  tensors' own storage. A storage is counted once however many tensors view it (a ZeRO
  shard is a view of its flat bucket; a module's weights are views of it too).
* `SavedActivations`: what autograd keeps for backward, through
  `torch.autograd.graph.saved_tensors_hooks`: every saved tensor's storage, once, except
  parameters (a matmul saves its weight, which is state, not an activation).
* `PeakMemory`: the profiler's allocator records (`torch.profiler`, `profile_memory=True`):
  every allocation and free of a step in time order; their running sum, plus what was
  allocated when it started, peaks at the step's peak.
The bytes a rank hands to each collective are counted at the call sites, as elements ×
itemsize of the collective's buffer (nccl-tests' n: the all-reduced tensor, the all-gathered
output, the reduce-scattered input), in the course's event log (`helpers.parallel.trace`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from helpers.cost.memory import ZeroMemory
from helpers.parallel.groups import fd2_muted


def storage_bytes(tensors: Iterable[torch.Tensor], skip: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each counted once; a storage freed to
    size 0 counts 0). `skip`: storages (data_ptr) already counted elsewhere."""
    seen = set(skip or ())
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _pointers(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


def state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                masters: Iterable[torch.Tensor] = (),
                grads: Iterable[torch.Tensor] | None = None) -> ZeroMemory:
    """Parameters (`params` and whatever the optimizer steps), their `.grad`s, and every
    tensor in the optimizer's state (AdamW: exp_avg, exp_avg_sq and a 4-byte `step`), in the
    formula's own structure; a storage counts once, in the first of the three it is in.

    Mixed precision: `params` are the weights in the compute dtype, `masters` the fp32 copies
    the optimizer steps, counted with the optimizer state (as the formula's 12 bytes count
    them), and `grads` the gradients as kept (default: the `.grad` of params and masters)."""
    masters = list(masters)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = list(params) + [p for p in stepped if not any(p is m for m in masters)]
    if grads is None:
        grads = [p.grad for p in tensors + masters if p.grad is not None]
    grads = list(grads)
    moments = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)] + masters
    param_bytes = storage_bytes(tensors)
    grad_bytes = storage_bytes(grads, skip=_pointers(tensors))
    return ZeroMemory(param_bytes, grad_bytes,
                      storage_bytes(moments, skip=_pointers(tensors) | _pointers(grads)))


def is_parameter_like(t: torch.Tensor) -> bool:
    """A leaf that requires grad, or a view of one: a weight, not an activation."""
    base = t if t._base is None else t._base
    return base.is_leaf and base.requires_grad


class SavedActivations:
    """`with SavedActivations() as saved: loss = model(x)…` → `saved.bytes`, what autograd
    keeps for backward (distinct storages, parameters excluded); `saved.tensors`: one
    (shape, dtype, bytes) per storage, in the order they were saved."""

    def __init__(self):
        self._storages: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not is_parameter_like(t):
            storage = t.untyped_storage()
            self._storages.setdefault(storage.data_ptr(),
                                      (tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def tensors(self) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        return list(self._storages.values())

    @property
    def bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._storages.values())


@dataclass(frozen=True)
class Phase:
    """A `torch.profiler.record_function` range inside a PeakMemory block: bytes live when
    it started and ended, and its highest point."""
    name: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int


@dataclass
class PeakMemory:
    """`with PeakMemory(baseline) as peak: …one step…` → `peak.bytes`: `baseline` (what was
    allocated before, e.g. state_bytes(...).total) plus the highest running sum of the
    allocator's records during the block. `peak.curve`: (seconds, bytes) after each record;
    `peak.phases`: one Phase per `record_function` range named in `phases` opened inside it.

    The allocator cannot see frees of blocks allocated before the block started (it warns
    so): those, if any, are missing, which can only make the peak read high, never low."""
    baseline: int = 0
    bytes: int = 0
    curve: list[tuple[float, int]] = field(default_factory=list)
    names: tuple[str, ...] = ("forward", "backward", "optimizer step")
    phases: list[Phase] = field(default_factory=list)

    def __enter__(self) -> "PeakMemory":
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        # kineto logs its start and stop, and the allocator warns that it cannot see the
        # frees of blocks allocated before, straight to fd 2: mute it for the block
        self._muted = fd2_muted()
        self._muted.__enter__()
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._profile.__exit__(*exc)
        finally:
            self._muted.__exit__(*exc)
        events = self._profile.profiler.kineto_results.events()
        records = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
        ranges = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                        if e.is_user_annotation() and e.name() in self.names)
        t0 = records[0][0] if records else 0
        live, times, lives = self.baseline, [], []
        for start_ns, nbytes in records:
            live += nbytes
            times.append(start_ns)
            lives.append(live)
        self.curve = [(0.0, self.baseline)] + [((t - t0) / 1e9, b) for t, b in zip(times, lives)]
        self.bytes = max([self.baseline] + lives)
        self.phases = []
        for start, end, name in ranges:
            before = [b for t, b in zip(times, lives) if t < start]
            inside = [b for t, b in zip(times, lives) if start <= t <= end]
            at_start = before[-1] if before else self.baseline
            at_end = inside[-1] if inside else at_start
            self.phases.append(Phase(name, at_start, max([at_start] + inside), at_end))
