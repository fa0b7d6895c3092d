"""ZeRO-1: shard the optimizer state across the data-parallel ranks.

In data parallelism every rank holds the same parameters, gradients and optimizer state.
Adam's state (two moments, plus an fp32 master copy in mixed precision) is the biggest of
the three, and every rank updates every parameter identically: wasted memory and work.
`ShardedOptimizer` gives each rank about 1/N of the parameters (by size); a rank keeps the
optimizer state of, and steps, only its own; then each owner broadcasts its updated
parameters. The arithmetic per parameter is exactly the unsharded optimizer's, so results
are bit for bit the same on CPU.

`zero_memory_per_rank` is the syllabus's memory model for ZeRO stages 0-3.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """`ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`.

    A real `torch.optim.Optimizer`: `param_groups`, `zero_grad` and `add_param_group` work
    over all parameters (so LR schedulers do too); the wrapped optimizer, holding only this
    rank's shard and its state, is `local_optimizer`. Gradients must already be averaged
    across ranks (e.g. by a DDP wrapper) when `step()` is called.
    """

    def __init__(self, params, optimizer_cls: type, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs a process group: build it inside a rank "
                               "function (helpers.ranks.spawn / LiveRanks.run)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.local_optimizer: torch.optim.Optimizer | None = None
        self.owner: dict[torch.Tensor, int] = {}   # parameter -> the rank that steps it
        self.load = [0] * self.world_size          # elements owned by each rank
        self._local_groups: list[dict | None] = [] # param_groups[i]'s counterpart, if any here
        super().__init__(params, defaults=dict(kwargs))  # calls add_param_group per group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validates and fills defaults
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            # Each parameter goes to the least-loaded rank so far: ~1/N of the elements each.
            # Every rank runs this same deterministic loop, so all agree on the owners.
            owner = min(range(self.world_size), key=lambda r: self.load[r])
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
        if self.world_size == 1:
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
            pending.append((owner, params, flat, dist.broadcast(flat, src=owner, async_op=True)))
        for owner, params, flat, work in pending:
            work.wait()
            if owner != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (every tensor in its shard's state)."""
        if self.local_optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for state in self.local_optimizer.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor))

    def state_dict(self):
        raise NotImplementedError("ShardedOptimizer's state is spread over the ranks: each rank's "
                                  "shard is local_optimizer.state_dict()")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in a plain optimizer's state (to compare with ShardedOptimizer)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------
# Rank functions for the notebook and tests.
# ----------------------------------------------------------------------------------------

def sharded_vs_plain(rank: int, world_size: int, optimizer: str = "adamw", steps: int = 3,
                     hidden: int = 1024, layers: int = 4, batch: int = 32, seed: int = 0) -> dict:
    """Rank function: train two copies of the MLP on the same data, one with the plain
    optimizer and one with ShardedOptimizer around it; report exact equality and state bytes.
    (No data parallelism here: every rank sees the same batch, so only the optimizer differs.)"""
    from helpers.models import make_batch, make_mlp, mlp_loss

    cls, kwargs = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                   "sgd": (torch.optim.SGD, {"lr": 1.0, "momentum": 0.9})}[optimizer]
    from helpers.parallel.dp import rank_device

    device = rank_device()
    plain_model = make_mlp(hidden, layers, seed).to(device)
    sharded_model = make_mlp(hidden, layers, seed).to(device)
    plain = cls(plain_model.parameters(), **kwargs)
    sharded = ShardedOptimizer(sharded_model.parameters(), cls, **kwargs)
    x = make_batch(batch, hidden, seed).to(device)
    for _ in range(steps):
        for model, opt in ((plain_model, plain), (sharded_model, sharded)):
            mlp_loss(model(x)).backward()
            opt.step()
            opt.zero_grad()
    return {"equal": all(torch.equal(a, b) for a, b in
                         zip(plain_model.parameters(), sharded_model.parameters())),
            "params": [p.detach().clone() for p in sharded_model.parameters()],
            "plain_state_bytes": optimizer_state_bytes(plain),
            "sharded_state_bytes": sharded.state_bytes(),
            "owned_elements": sharded.load[rank]}


# ----------------------------------------------------------------------------------------
# Memory per rank for ZeRO stages 0-3 (the syllabus's formulas, mixed-precision Adam).
# ----------------------------------------------------------------------------------------

STAGES = {0: "plain DP", 1: "ZeRO-1 (optimizer state)", 2: "ZeRO-2 (+ gradients)",
          3: "ZeRO-3 / FSDP (+ parameters)"}


def zero_memory_per_rank(psi: float, n: int, stage: int, param_bytes: float = 2,
                         grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict[str, float]:
    """Bytes per rank for Ψ parameters on N ranks: stage 0 keeps all of (2 + 2 + K)Ψ;
    ZeRO-1 shards the optimizer state K (4Ψ + KΨ/N), ZeRO-2 the gradients too
    (2Ψ + (2 + K)Ψ/N), ZeRO-3 everything ((4 + K)Ψ/N). K = 12 for mixed-precision Adam."""
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or not psi > 0:
        raise ValueError(f"psi (number of parameters) must be > 0, got {psi!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of ranks) must be an int >= 1, got {n!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    params = psi * param_bytes / (n if stage >= 3 else 1)
    grads = psi * grad_bytes / (n if stage >= 2 else 1)
    optimizer = psi * optimizer_bytes / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:9.2f} GB"


def zero_memory_table(psi: float, n: int, stage: int | None = None, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> str:
    """All four stages side by side (the chosen one marked): the widget's text."""
    lines = [f"Ψ = {psi:.3g} parameters, N = {n} ranks, bytes per parameter: "
             f"{param_bytes:g} (params) + {grad_bytes:g} (grads) + {optimizer_bytes:g} (optimizer)",
             f"  {'stage':<30}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"]
    for s, name in STAGES.items():
        m = zero_memory_per_rank(psi, n, s, param_bytes, grad_bytes, optimizer_bytes)
        mark = ">" if s == stage else " "
        lines.append(f"{mark} {name:<30}" + "".join(_gb(m[k]).rjust(12) for k in
                                                  ("params", "grads", "optimizer", "total")))
    return "\n".join(lines)


def zero_memory_widget():
    """Sliders for Ψ, N, stage and bytes per parameter over zero_memory_table."""
    import ipywidgets as w

    return w.interact(
        lambda log10_psi, n, stage, optimizer_bytes: print(
            zero_memory_table(10 ** log10_psi, n, stage, optimizer_bytes=optimizer_bytes)),
        log10_psi=w.FloatSlider(value=9.875, min=6, max=12, step=0.125, description="log10 Ψ"),
        n=w.IntSlider(value=64, min=1, max=1024, description="N"),
        stage=w.IntSlider(value=1, min=0, max=3, description="stage"),
        optimizer_bytes=w.IntSlider(value=12, min=0, max=16, description="K (opt. B/param)"))


def measure_state_bytes(ranks, world_sizes=(1, 2, 4), hidden: int = 1024, layers: int = 4,
                        batch: int = 32, steps: int = 2) -> list[dict]:
    """Run sharded_vs_plain (AdamW) at each world size; one row per size."""
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"world_sizes must hold ints >= 1, got {n!r}")
    rows = []
    for n in world_sizes:
        results = ranks.resize(n).run(sharded_vs_plain, "adamw", steps=steps, hidden=hidden,
                                      layers=layers, batch=batch)
        rows.append({"n": n, "per_rank": [r["sharded_state_bytes"] for r in results],
                     "plain": results[0]["plain_state_bytes"],
                     "equal": all(r["equal"] for r in results)})
    return rows


def state_bytes_table(rows: list[dict], psi: int) -> str:
    """Measured optimizer state per rank next to the model: fp32 AdamW keeps m and v, K = 8."""
    lines = [f"{'N':>3}{'per rank (measured)':>22}{'8Ψ/N (model)':>16}{'plain / max rank':>18}"
             f"{'bit-identical':>15}"]
    for row in rows:
        worst = max(row["per_rank"])
        lines.append(f"{row['n']:>3}{worst:>22,}{8 * psi // row['n']:>16,}"
                     f"{row['plain'] / worst:>18.2f}{str(row['equal']):>15}")
    return "\n".join(lines)
