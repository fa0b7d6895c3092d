"""Notebook 03's runs: the lecture's MLP trained by each data-parallel wrapper on live ranks,
checked against one process training on the whole batch; a traced step's timeline; step times
of every wrapper and of PyTorch's DDP, taken in turns. The wrappers are `helpers.parallel.dp`."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import check_choice, check_divisible, check_int, check_number
from helpers.configs import LECTURE, MLPConfig
from helpers.cost.memory import FP32_ADAM_BYTES, zero_memory_per_rank
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.optimizers import make_optimizer, optimizer_spec
from helpers.parallel.dp import VARIANTS, shard, wrap
from helpers.parallel.groups import all_reduce_mean, group_rank, group_size, rank_device
from helpers.parallel.trace import Span
from helpers.parallel.zero import ShardedOptimizer, optimizer_state_bytes
from helpers.parallel.wait_mode import waiting
from helpers.timing import Measurement

TIMED = VARIANTS + ("torch", "compute")  # what a training step can be timed with


@dataclass
class TrainResult:
    """What one rank (or the single process) ends a training run with."""
    losses: list[float]          # the loss of each step (a rank's: of its slice of the batch)
    params: list[torch.Tensor]   # the parameters after training, on the CPU
    all_reduces_per_step: int    # 0 for the single process


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


def timeline(rank: int, world_size: int, variant: str, config: MLPConfig = LECTURE,
             bucket_size_mb: float = 4.0, warmup: int = 2, traced: int = 5,
             group=None) -> list[Span]:
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
            model.trace += [Span("forward", start, forward_end),
                            Span("backward", forward_end, backward_end),
                            Span("wait", backward_end, sync_end, "finish_gradient_synchronization")]
            recorded.append(model.trace)
    model.trace = None
    dist.barrier(group=group)
    lengths = torch.tensor([max(e.end for e in ev) - min(e.start for e in ev) for ev in recorded],
                           device=device)  # NCCL reduces only tensors on the GPU
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)  # a step lasts as long as its slowest rank
    return recorded[int(lengths.argsort()[len(recorded) // 2].item())]


def overlap_seconds(events: list[Span]) -> float:
    """How long all-reduces were in flight while backward was still computing."""
    backward = [e for e in events if e.kind == "backward"]
    return sum(max(0.0, min(e.end, b.end) - max(e.start, b.start))
               for e in events if e.kind == "all_reduce" for b in backward)


class WaitLinear(nn.Module):
    """Wait mode's stand-in for a bias-free square `nn.Linear`: the same `weight` parameter (so
    the wrappers' hooks fire and their all-reduces carry the real gradient bytes), a forward +
    backward that waits `seconds` (`helpers.parallel.wait_mode.waiting`: sleeps, no CPU) and a
    zero gradient. A wait-mode step measures time, not learning."""

    def __init__(self, linear: nn.Linear, seconds: float):
        super().__init__()
        self.weight, self.seconds = linear.weight, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return waiting(x, self.seconds, [self.weight])


def wait_mode_mlp(config: MLPConfig, layer_seconds: float) -> nn.Module:
    """The lecture MLP with every Linear a `WaitLinear` of `layer_seconds` (parameter names and
    shapes unchanged: '0.weight', '2.weight', ...)."""
    model = make_mlp(config)
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):
            model[i] = WaitLinear(layer, layer_seconds)
    return model


def layer_seconds(rank: int, world_size: int, config: MLPConfig = LECTURE, repeat: int = 9,
                  group=None) -> float:
    """Rank function: the median time of one layer's forward + backward on this rank's slice
    (the whole model's, divided by its Linear layers), every rank computing at once, as in a
    compute-mode step: wait mode's `layer_seconds`."""
    model = make_mlp(config).to(rank_device())
    x = shard(make_batch(config), group_rank(group), group_size(group)).to(rank_device())
    times = []
    for _ in range(repeat + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        mlp_loss(model(x)).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    layers = sum(isinstance(m, nn.Linear) for m in model)
    return sorted(times[1:])[repeat // 2] / layers


def small_all_reduce_seconds(rank: int, world_size: int, repeat: int = 50, group=None) -> float:
    """Rank function: the median time of a blocking all-reduce of one float on `group`: the
    α–β model's per-message cost 2(N−1)·α of a ring over N ranks, as this machine pays it now."""
    x = torch.zeros(1, device=rank_device())
    times = []
    for _ in range(repeat + 5):
        dist.barrier(group=group)
        start = time.perf_counter()
        all_reduce_mean(x, group)
        times.append(time.perf_counter() - start)
    return sorted(times[5:])[repeat // 2]


def _training_step(variant: str, bucket_size_mb: float, config: MLPConfig, group=None,
                   wait_s: float | None = None):
    """One training step (forward, backward, sync, SGD step) of `variant`, as a closure.

    variant: one of VARIANTS, "torch" (torch.nn.parallel.DistributedDataParallel with
    bucket_cap_mb=bucket_size_mb) or "compute" (no gradient synchronisation at all: the
    compute-only baseline, run with the same ranks busy at the same time).
    wait_s: None (compute mode, the real MLP) or each layer's forward + backward in seconds
    (wait mode: `wait_mode_mlp`, the cores left free for the communication)."""
    check_choice("variant", variant, TIMED)
    device = rank_device()
    model = (make_mlp(config) if wait_s is None else wait_mode_mlp(config, wait_s)).to(device)
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
                     group=None, wait_s: float | None = None,
                     clock=time.perf_counter) -> list[list[float]]:
    """Rank function: seconds per training step of several (variant, bucket_size_mb) setups
    (see _training_step), one step of each in turn (the order rotating every round), so that a
    machine whose load changes from second to second slows every variant alike. A barrier ends
    every step, so a step lasts as long as its slowest rank. Returns the times per setup.
    wait_s: wait mode (see _training_step). clock: what a step is measured in (seconds of the
    wall clock; `core_waits` reads the scheduler's)."""
    steps = [_training_step(v, mb, config, group, wait_s) for v, mb in setups]
    times: list[list[float]] = [[] for _ in setups]
    for round_ in range(warmup + repeat):
        for i in [(round_ + k) % len(steps) for k in range(len(steps))]:
            _end_of_step(group)
            start = clock()
            steps[i]()
            _end_of_step(group)
            if round_ >= warmup:
                times[i].append(clock() - start)
    return times


def _seconds_waiting_for_a_core() -> float:
    """This process's threads' time runnable but without a core, summed (Linux schedstat)."""
    from helpers.labs.bench import thread_clocks
    return sum(clocks[1] for clocks in thread_clocks().values()) / 1e9


def core_waits(rank: int, world_size: int, variants: tuple[str, ...] = ("naive", "flat"),
               bucket_size_mb: float = 8.0, config: MLPConfig = LECTURE, repeat: int = 9,
               warmup: int = 2, group=None) -> dict[str, float]:
    """Rank function: for each variant, the median seconds per training step that this rank's
    threads (the training thread and gloo's) spent runnable but waiting for a core, as the
    Linux scheduler counts it (/proc/self/task/*/schedstat): `time_interleaved`'s steps, read
    on that clock. On a machine with a core per thread it is about 0; on 2 cores shared by two
    ranks it is where a blocking call's extra time goes."""
    import os
    if not os.path.exists("/proc/self/task"):
        return {v: float("nan") for v in variants}  # no per-thread scheduler counts off Linux
    waits = time_interleaved(rank, world_size, [(v, bucket_size_mb) for v in variants], config,
                             repeat, warmup, group, clock=_seconds_waiting_for_a_core)
    return {v: sorted(w)[len(w) // 2] for v, w in zip(variants, waits)}


def measure_core_waits(ranks, variants: tuple[str, ...] = ("naive", "flat"),
                       bucket_size_mb: float = 8.0, config: MLPConfig = LECTURE,
                       repeat: int = 9) -> list[dict[str, float]]:
    """`core_waits` on every rank of `ranks`, its arguments checked here first."""
    for v in variants:
        check_choice("variant", v, VARIANTS + ("compute",))
    check_number("bucket_size_mb", bucket_size_mb, low=0, low_inclusive=False, unit="MiB")
    check_int("repeat", repeat, 1)
    check_divisible("batch", config.batch, ranks.world_size, "d ranks share its rows")
    return ranks.run(core_waits, tuple(variants), bucket_size_mb, config, repeat)


def compare_step_times(ranks, variants=("compute",) + VARIANTS + ("torch",),
                       config: MLPConfig = LECTURE, bucket_size_mb: float = 8.0,
                       repeat: int = 5, warmup: int = 1, wait_s: float | None = None) -> dict:
    """Time a step for each variant on `ranks` (taking turns, see time_interleaved); print one
    measurement line each, with comm_share = (step - compute-only step) / step when "compute"
    is among the variants. wait_s: wait mode, each layer's forward + backward waiting that
    long ("torch" then wraps the wait-mode model too). Returns {variant: Measurement}."""
    for v in variants:
        check_choice("variant", v, TIMED)
    check_number("bucket_size_mb", bucket_size_mb, low=0, low_inclusive=False, unit="MiB")
    check_divisible("batch", config.batch, ranks.world_size, "d ranks share its rows")
    times = ranks.run(time_interleaved, [(v, bucket_size_mb) for v in variants], config,
                      repeat, warmup, wait_s=wait_s)[0]
    mode = "" if wait_s is None else ", wait mode"
    results = {v: Measurement(f"{v:<9} step, d={ranks.world_size}{mode}", tuple(ts))
               for v, ts in zip(variants, times)}
    compute = results["compute"].median if "compute" in results else None
    for v, m in results.items():
        share = f"  comm_share {max(0.0, 1 - compute / m.median):.2f}" if compute else ""
        print(f"{m}{share}")
    return results




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
    optimizer (helpers.optimizers) and one with ShardedOptimizer around it over `group`.
    (No data parallelism here: every rank sees the same batch, so only the optimizer differs.)"""
    cls, kwargs = optimizer_spec(optimizer)
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
        plain_state_bytes=optimizer_state_bytes(plain),
        sharded_state_bytes=optimizer_state_bytes(sharded),
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


