"""ZeRO-1: shard the optimizer state across the data-parallel ranks.

In data parallelism every rank holds the same parameters, gradients and optimizer state.
Adam's state (two moments, plus an fp32 master copy in mixed precision) is the biggest of
the three, and every rank updates every parameter identically: wasted memory and work.
`ShardedOptimizer` gives each of the group's d ranks about 1/d of the parameters (by size); a
rank keeps the optimizer state of, and steps, only its own; then each owner broadcasts its
updated parameters. The arithmetic per parameter is exactly the unsharded optimizer's, so
results are bit for bit the same on CPU.

The memory model for ZeRO stages 0-3 is `helpers.cost.memory`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from helpers.checks import check_int
from helpers.cost.memory import FP32_ADAM_BYTES, zero_memory_per_rank
from helpers.models import LECTURE, MLPConfig, make_batch, make_mlp, mlp_loss
from helpers.parallel.dp import OPTIMIZERS
from helpers.parallel.groups import global_rank, group_rank, group_size, rank_device


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


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in an optimizer's state on this rank (a ShardedOptimizer: its shard's)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer = optimizer.local_optimizer
    if optimizer is None:  # a rank that owns no parameter
        return 0
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------
# Rank functions for the notebook and tests.
# ----------------------------------------------------------------------------------------

@dataclass
class ShardingCheck:
    """sharded_vs_plain's answer on one rank."""
    equal: bool                 # sharded and plain parameters torch.equal after training
    params: list[torch.Tensor]  # the sharded copy's parameters, on the CPU
    plain_state_bytes: int
    sharded_state_bytes: int
    owned_elements: int         # parameter elements this rank steps


def sharded_vs_plain(rank: int, world_size: int, optimizer: str = "adamw", steps: int = 3,
                     config: MLPConfig = LECTURE, group=None) -> ShardingCheck:
    """Rank function: train two copies of the MLP on the same data, one with the plain
    optimizer (dp.OPTIMIZERS) and one with ShardedOptimizer around it over `group`.
    (No data parallelism here: every rank sees the same batch, so only the optimizer differs.)"""
    cls, kwargs = OPTIMIZERS[optimizer]
    device = rank_device()
    plain_model, sharded_model = make_mlp(config).to(device), make_mlp(config).to(device)
    plain = cls(plain_model.parameters(), **kwargs)
    sharded = ShardedOptimizer(sharded_model.parameters(), cls, group=group, **kwargs)
    x = make_batch(config).to(device)
    for _ in range(steps):
        for model, opt in ((plain_model, plain), (sharded_model, sharded)):
            mlp_loss(model(x)).backward()
            opt.step()
            opt.zero_grad()
    return ShardingCheck(
        equal=all(torch.equal(a, b) for a, b in zip(plain_model.parameters(),
                                                    sharded_model.parameters())),
        params=[p.detach().to("cpu", copy=True) for p in sharded_model.parameters()],
        plain_state_bytes=state_bytes(plain), sharded_state_bytes=state_bytes(sharded),
        owned_elements=sharded.load[sharded.rank])


@dataclass(frozen=True)
class StateBytesRow:
    """measure_state_bytes at one data degree d."""
    d: int
    per_rank: list[int]   # sharded AdamW state bytes on each rank
    plain: int            # the plain AdamW's state bytes
    equal: bool           # sharded = plain, bit for bit, on every rank


def measure_state_bytes(ranks, degrees=(1, 2, 4), config: MLPConfig = LECTURE,
                        steps: int = 2) -> list[StateBytesRow]:
    """Run sharded_vs_plain (AdamW) on d = each of `degrees` ranks; one row per d."""
    for d in degrees:
        check_int("d (in degrees)", d)
    rows = []
    for d in degrees:
        results = ranks.resize(d).run(sharded_vs_plain, "adamw", steps, config)
        rows.append(StateBytesRow(d, [r.sharded_state_bytes for r in results],
                                  results[0].plain_state_bytes, all(r.equal for r in results)))
    return rows


def state_bytes_table(rows: list[StateBytesRow], psi: int) -> str:
    """Measured optimizer state per rank next to the model: fp32 AdamW keeps m and v, K = 8."""
    lines = [f"{'d':>3}{'per rank (measured)':>22}{'8Ψ/d (model)':>16}{'plain / max rank':>18}"
             f"{'bit-identical':>15}"]
    for row in rows:
        worst = max(row.per_rank)
        model = zero_memory_per_rank(psi, row.d, 1, optimizer_bytes=FP32_ADAM_BYTES).optimizer
        lines.append(f"{row.d:>3}{worst:>22,}{round(model):>16,}"
                     f"{row.plain / worst:>18.2f}{str(row.equal):>15}")
    return "\n".join(lines)
