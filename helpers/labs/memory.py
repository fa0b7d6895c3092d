"""Notebook 08's runs: train notebook 07's decoder under each ZeRO stage and measure a rank.

`train_stage` (a rank function) builds the model, wraps it in `zero.ZeroDP` (stages 0-2) or
`fsdp.FSDP` (stage 3) over the group, trains a few steps on its 1/d of the batch and returns
whole parameters (to check against `train_reference`, one process with plain AdamW) and, for
its last step, what `helpers.parallel.memory` measured: state bytes, saved activations, the
profiler's peak and the bytes handed to each collective. `train_torch_fsdp` is the same
training under PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`). With a
`fsdp.MixedPrecision`, stage 3 computes in bf16 (or fp16) on fp32 masters, and
`train_reference` is one process that casts the same way.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from helpers.checks import check_choice, check_divisible, check_int
from helpers.configs import SMALL, TransformerConfig
from helpers.cost.alpha_beta import COST_MODELS
from helpers.launch.host import intra_op_threads
from helpers.cost.memory import (FP32_RUN, MIXED_RUN, STAGES, ZeroMemory, comm_volume,
                                 mixed_precision_bytes, reduction_tolerance, zero_memory_for,
                                 zero_memory_per_rank)
from helpers.models import lm_loss, make_tokens, make_transformer, transformer_forward
from helpers.optimizers import OPTIMIZERS, optimizer_spec
from helpers.parallel import trace
from helpers.parallel.dp import shard
from helpers.parallel.fsdp import FSDP, MixedPrecision
from helpers.parallel.groups import group_rank, group_size
from helpers.parallel.memory import PeakMemory, Phase, SavedActivations, state_bytes
from helpers.parallel.zero import ZeroDP

# Every run here trains with helpers.optimizers' "exact" setting (small steps; why: there).
SETTING = "exact"


def check_run(stage: int, d: int, config: TransformerConfig, steps: int = 3,
              optimizer: str = "adamw", precision: MixedPrecision | None = None) -> None:
    """What a run needs, checked in the parent before any rank starts."""
    check_choice("stage", stage, STAGES)
    if precision is not None and stage != 3:
        raise ValueError(f"precision: mixed precision is built for stage 3 (FSDP) only, "
                         f"got stage {stage}")
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_int("d (data-parallel ranks)", d)
    check_divisible("batch", config.batch, d, f"d={d} ranks share its sequences")
    check_int("steps", steps)


@dataclass
class StageRun:
    """What one rank of `train_stage` brings back."""
    stage: int
    d: int
    losses: list[float]                            # this rank's loss, every step
    params: dict[str, torch.Tensor] = field(repr=False)  # whole, after training
    state: ZeroMemory | None = None                # after the last step, before zero_grad
    activations: int = 0                           # saved for backward by the last forward
    peak_bytes: int = 0                            # the last step's, from the profiler
    peak_curve: list[tuple[float, int]] = field(default_factory=list, repr=False)
    phases: list[Phase] = field(default_factory=list)   # forward, backward, optimizer step
    comm: dict[str, int] = field(default_factory=dict)  # bytes handed per op, last step
    step_s: list[float] = field(default_factory=list)   # the steps before the measured one
    precision: MixedPrecision | None = None

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())

    def wire_bytes(self) -> float:
        """What a ring would send per rank: each op's n, as counted at its call site, times
        the op's bus factor. A count, not a measurement of a link."""
        return sum(n * COST_MODELS[op].bus_factor(self.d) for op, n in self.comm.items())


def wrap_zero_stage(stage: int, model, group=None, prefetch: bool = False,
                    optimizer: str = "adamw", precision: MixedPrecision | None = None):
    """The model under `stage`, owning its optimizer (one of helpers.optimizers.OPTIMIZERS):
    ZeroDP for 0-2, FSDP for 3 (in mixed precision when `precision` is given)."""
    cls, kwargs = optimizer_spec(optimizer, SETTING)
    if stage == 3:
        return FSDP(model, optimizer_cls=cls, prefetch=prefetch, group=group,
                    precision=precision, **kwargs)
    return ZeroDP(model, stage, cls, group=group, **kwargs)


def held_state(model) -> ZeroMemory:
    """What the wrapped model keeps between steps, by the formula's three terms: in mixed
    precision the compute-dtype shards are the parameters, the fp32 masters go with the
    optimizer state, and the gradients are the reduced shards."""
    if getattr(model, "precision", None) is not None:
        return state_bytes(model.compute_shards, model.optimizer,
                           masters=list(model.parameters()), grads=model.gradient_shards)
    return state_bytes(model.parameters(), model.optimizer)


def train_stage(rank: int, world_size: int, stage: int, steps: int = 3,
                config: TransformerConfig = SMALL, prefetch: bool = False, measure_last=True,
                optimizer: str = "adamw", group=None,
                precision: MixedPrecision | None = None) -> StageRun:
    """Rank function: `steps` AdamW steps under `stage` over `group`, the last one measured
    (when `measure_last`): the profiler's allocator records around the whole step, the
    saved-tensor hooks around the forward, the event log (`trace.recording`) around it too.
    One intra-op thread, as `train_reference` uses: a kernel that splits a reduction over
    threads adds in an order the thread count sets, and the OpenMP runtime may change that
    count with the machine's load, which would make d = 1 differ from one process by a bit."""
    with intra_op_threads(1):
        return _train_stage(stage, steps, config, prefetch, measure_last, optimizer, group,
                            precision)


def _train_stage(stage, steps, config, prefetch, measure_last, optimizer, group,
                 precision) -> StageRun:
    r, d = group_rank(group), group_size(group)
    tokens = make_tokens(config)
    ids, targets = shard(tokens.inputs, r, d), shard(tokens.targets, r, d)
    model = wrap_zero_stage(stage, make_transformer(config), group, prefetch, optimizer,
                            precision)
    run = StageRun(stage, d, [], {}, precision=precision)
    for step in range(steps):
        measured = measure_last and step == steps - 1
        start = held_state(model).total
        saved = SavedActivations()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        with (PeakMemory(start) if measured else contextlib.nullcontext() as peak,
              trace.recording("zero", "fsdp") as log):
            with saved if measured else contextlib.nullcontext(), record_function("forward"):
                loss = lm_loss(model(ids), targets)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer step"):
                model.step()
        dist.barrier(group=group)
        if not measured:
            run.step_s.append(time.perf_counter() - t0)
        else:
            run.state = held_state(model)
            run.activations, run.peak_bytes = saved.bytes, peak.bytes
            run.peak_curve, run.phases = peak.curve, peak.phases
            run.comm = trace.bytes_by_op(log)
        model.zero_grad()
        run.losses.append(loss.item())
    run.params = (model.full_parameters() if stage == 3 else
                  {n: p.detach().to("cpu", copy=True) for n, p in model.module.named_parameters()})
    return run


def train_reference(steps: int = 3, config: TransformerConfig = SMALL,
                    optimizer: str = "adamw",
                    precision: MixedPrecision | None = None) -> dict[str, torch.Tensor]:
    """One process, the whole batch, the plain optimizer: the parameters every stage must
    reach. With `precision`, each step casts the way FSDP does (`mixed_precision_gradients`)
    and the optimizer steps the fp32 parameters, the masters. One intra-op thread, as each
    rank's `train_stage`."""
    with intra_op_threads(1):
        return _train_reference(steps, config, optimizer, precision)


def _train_reference(steps, config, optimizer, precision) -> dict[str, torch.Tensor]:
    model = make_transformer(config)
    cls, kwargs = optimizer_spec(optimizer, SETTING)
    optimizer = cls(model.parameters(), **kwargs)
    tokens = make_tokens(config)
    for _ in range(steps):
        if precision is None:
            lm_loss(model(tokens.inputs), tokens.targets).backward()
        else:
            grads = mixed_precision_gradients(model, tokens.inputs, tokens.targets, precision)
            for name, p in model.named_parameters():
                # through the reduce dtype, as FSDP's reduce-scatter of one rank carries it
                p.grad = grads[name].to(precision.reduce_dtype).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def mixed_precision_gradients(model, ids: torch.Tensor, targets: torch.Tensor,
                              precision: MixedPrecision) -> dict[str, torch.Tensor]:
    """One process casting as FSDP does: a copy of `model` in the compute dtype runs forward
    and backward, its output cast to the output dtype for the loss; the gradients, by name,
    in the compute dtype."""
    low = copy.deepcopy(model).to(precision.compute_dtype)
    lm_loss(low(ids).to(precision.output_dtype), targets).backward()
    return {n: p.grad for n, p in low.named_parameters()}


@dataclass
class TorchRun:
    """train_torch_fsdp's answer on one rank."""
    params: dict[str, torch.Tensor] = field(repr=False)
    step_s: list[float] = field(default_factory=list)


def train_torch_fsdp(rank: int, world_size: int, steps: int = 3,
                     config: TransformerConfig = SMALL, group=None) -> TorchRun:
    """Rank function: the same training under PyTorch's FSDP2, `fully_shard` per block and
    then on the whole model (which takes the embedding and head), over `group`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    r, d = group_rank(group), group_size(group)
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
    model = make_transformer(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cls, kwargs = optimizer_spec("adamw", SETTING)
    optimizer = cls(model.parameters(), **kwargs)
    tokens = make_tokens(config)
    ids, targets = shard(tokens.inputs, r, d), shard(tokens.targets, r, d)
    run = TorchRun({})
    for _ in range(steps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        lm_loss(model(ids), targets).backward()
        optimizer.step()
        dist.barrier(group=group)
        run.step_s.append(time.perf_counter() - t0)
        optimizer.zero_grad()
    run.params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return run


# ----------------------------------------------------------------------------------------
# In the parent: runs over a LiveRanks, and their tables.
# ----------------------------------------------------------------------------------------

@dataclass
class StageResult:
    """One (stage, d) run: every rank's StageRun, and how it compares with one process."""
    stage: int
    d: int
    config: TransformerConfig
    ranks: list[StageRun] = field(repr=False)
    max_diff: float          # largest |parameter − reference| over ranks and parameters
    bit_identical: bool      # every parameter torch.equal to the reference

    @property
    def run(self) -> StageRun:
        """Rank 0's run (every rank holds the same bytes, up to the padding of the last shard)."""
        return self.ranks[0]

    def formula(self, precision: str = FP32_RUN):
        """The ZeRO formula's bytes per rank for this run's Ψ and d."""
        return zero_memory_for(self.config.parameters, self.d, self.stage, precision)


def run_stages(ranks, stages=(0, 1, 2, 3), degrees=(1, 2, 4), steps: int = 3,
               config: TransformerConfig = SMALL, prefetch: bool = False,
               optimizer: str = "adamw") -> list[StageResult]:
    """train_stage for every (stage, d) on `ranks` (resized to d), checked against
    train_reference with torch.testing.assert_close; one StageResult each."""
    for d in degrees:
        for stage in stages:
            check_run(stage, d, config, steps, optimizer)
    reference = train_reference(steps, config, optimizer)
    results = []
    for d in degrees:
        ranks.resize(d)
        for stage in stages:
            runs = ranks.run(train_stage, stage, steps, config, prefetch, optimizer=optimizer)
            for run in runs:
                torch.testing.assert_close(run.params, reference)
            diff = max((run.params[n] - ref).abs().max().item()
                       for run in runs for n, ref in reference.items())
            same = all(torch.equal(run.params[n], ref) for run in runs for n, ref in reference.items())
            results.append(StageResult(stage, d, config, runs, diff, same))
    return results


def rel_error(measured: float, formula: float) -> float:
    return (measured - formula) / formula


def _mb(n: float) -> str:
    return f"{n / 1e6:8.3f}"


def memory_table(results: list[StageResult]) -> str:
    """Measured state bytes per rank (rank 0) next to the fp32 formula, its relative error,
    and the lecture's mixed-precision formula for the same Ψ and d (a GPU run), in MB."""
    lines = [f"{'stage':>5}{'d':>3} |{'params':>9}{'grads':>9}{'optim':>9}{'total':>9} |"
             f"{'formula':>9}{'error':>8} | {'mixed-precision':>15}",
             f"{'':>8} | {'measured (fp32 AdamW), MB':^35} | {'fp32, MB':^17} | {'formula, MB':>15}"]
    for res in results:
        s, f = res.run.state, res.formula()
        mixed = res.formula(MIXED_RUN)
        lines.append(f"{res.stage:>5}{res.d:>3} |{_mb(s.params)} {_mb(s.grads)} {_mb(s.optimizer)}"
                     f" {_mb(s.total)} |{_mb(f.total)} {rel_error(s.total, f.total):+7.2%} |"
                     f" {_mb(mixed.total):>15}")
    return "\n".join(lines)


def comm_table(results: list[StageResult]) -> str:
    """Bytes handed to each collective per step per rank (n, as counted at the call sites),
    in units of Ψ·4 bytes; their sum weighted by each op's bus factor (what a ring would
    send, counted, not measured) next to 2Ψ(d−1)/d or 3Ψ(d−1)/d."""
    lines = [f"{'stage':>5}{'d':>3} | {'handed to the collectives, in Ψ·4 bytes':<46}|"
             f"{'counted × bus factor, MB':>25} |{'formula, MB':>12}"]
    for res in results:
        if res.d == 1:
            continue
        psi4 = 4 * res.config.parameters
        run = res.run
        parts = ", ".join(f"{op} {n / psi4:.4f}" for op, n in run.comm.items())
        formula = comm_volume(res.stage, res.d, res.config.parameters)
        lines.append(f"{res.stage:>5}{res.d:>3} | {parts:<45}|{_mb(run.wire_bytes()):>25} |"
                     f"{_mb(formula):>12}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Activation checkpointing, on one process.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckpointRun:
    """One forward + backward with or without activation checkpointing."""
    checkpointed: bool
    saved_bytes: int        # what autograd keeps after the forward (SavedActivations)
    forward_s: float        # median forward
    step_s: float           # median forward + backward (backward recomputes when checkpointed)
    grads: dict[str, torch.Tensor] = field(repr=False, compare=False)


def checkpointing(config: TransformerConfig = SMALL, repeat: int = 5) -> list[CheckpointRun]:
    """Saved bytes, and medians of a forward and of a forward + backward, without and with
    `torch.utils.checkpoint` per block; same model, same batch (gradients equal). The two take
    turns, `repeat` times, so that a shared machine's changing load hits both alike."""
    check_int("repeat", repeat)
    model = make_transformer(config)
    tokens = make_tokens(config)

    def forward(checkpointed: bool):
        return lm_loss(transformer_forward(model, tokens.inputs, checkpointed), tokens.targets)

    saved, grads, times = {}, {}, {False: ([], []), True: ([], [])}
    for checkpointed in (False, True):
        with SavedActivations() as held:
            loss = forward(checkpointed)
        loss.backward()
        saved[checkpointed] = held.bytes
        grads[checkpointed] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
    for _ in range(repeat):
        for checkpointed in (False, True):
            forwards, steps = times[checkpointed]
            t0 = time.perf_counter()
            loss = forward(checkpointed)
            t1 = time.perf_counter()
            loss.backward()
            steps.append(time.perf_counter() - t0)
            forwards.append(t1 - t0)
            model.zero_grad()
    return [CheckpointRun(c, saved[c], statistics.median(times[c][0]),
                          statistics.median(times[c][1]), grads[c]) for c in (False, True)]


def peak_table(results: list[StageResult], d: int) -> str:
    """Rank 0's peak at data degree d, term by term (MB): what the step starts with
    (parameters + optimizer state), the saved activations, the end of the forward as the
    profiler saw it, the forward's and the backward's excursions above that, next to the
    sizes that explain them: the logits (b·s·V·4 bytes on this rank), the gradient formula,
    and the largest unit gathered whole (stage 3)."""
    lines = [f"{'stage':>5} |{'start':>8}{'+ act.':>8}{'= fwd end':>10} |{'fwd +':>7}"
             f"{'logits':>8} |{'bwd +':>7}{'grads':>8}{'unit':>7} |{'peak':>8}"]
    for res in results:
        if res.d != d:
            continue
        run, config = res.run, res.config
        forward, backward, _ = run.phases
        logits = config.batch // d * config.seq * config.vocab * 4
        grads = res.formula().grads
        unit = 4 * max(config.vocab * config.hidden + config.hidden * config.seq,
                       12 * config.hidden ** 2 + 4 * config.hidden)
        lines.append(
            f"{res.stage:>5} |{_mb(forward.start_bytes)}{_mb(run.activations)}"
            f"{_mb(forward.end_bytes):>10} |{forward.peak_bytes / 1e6 - forward.end_bytes / 1e6:7.3f}"
            f"{_mb(logits)} |{(backward.peak_bytes - forward.end_bytes) / 1e6:7.3f}"
            f"{_mb(grads)}{unit / 1e6 if res.stage == 3 else 0:7.3f} |{_mb(run.peak_bytes)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Mixed precision at d > 1: the averaged gradient against its exact value.
# ----------------------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16", the name helpers.cost.memory's tables use."""
    return str(dtype).removeprefix("torch.")


def mixed_formula(psi: float, d: int, precision: MixedPrecision) -> ZeroMemory:
    """ZeRO-3's bytes per rank with `precision`'s dtypes (fp32 masters): (2 + 2 + 12)Ψ/d in
    bf16, (2 + 4 + 12)Ψ/d when the gradients are reduced in fp32."""
    return zero_memory_per_rank(psi, d, 3, *mixed_precision_bytes(
        dtype_name(precision.compute_dtype), dtype_name(precision.reduce_dtype)))


def fsdp_gradients(rank: int, world_size: int, precision: MixedPrecision | None,
                   config: TransformerConfig = SMALL, group=None) -> dict[str, torch.Tensor] | None:
    """Rank function: one forward and backward of FSDP on this rank's 1/d of the batch; the
    averaged gradient whole, from group rank 0 (None from the others). One thread, as the
    reference slices are computed: a matmul split over another number of threads may sum in
    another order, and a bf16 result can then round the other way."""
    r, d = group_rank(group), group_size(group)
    tokens = make_tokens(config)
    model = FSDP(make_transformer(config), group=group, precision=precision)
    with intra_op_threads(1):
        lm_loss(model(shard(tokens.inputs, r, d)), shard(tokens.targets, r, d)).backward()
    model.finish_gradient_synchronization()
    grads = model.full_gradients()
    return grads if r == 0 else None


@dataclass(frozen=True)
class GradientCheck:
    """FSDP's averaged gradient ĝ at data degree d against g = (1/d)·Σ_r g_r, the mean (in
    float64) of what one process casting the same way computes on each rank's slice."""
    d: int
    precision: MixedPrecision
    tolerance: float        # τ of cost.reduction_tolerance: |ĝ − g| ≤ τ·(1/d)·Σ_r|g_r|
    worst: float            # max over elements of |ĝ − g| / (τ·(1/d)·Σ_r|g_r|): ≤ 1 holds
    reduction_error: float  # max |ĝ − g| / max |g|: what the reduction rounded
    compute_error: float    # max |g − g₃₂| / max |g₃₂|, g₃₂ the fp32 gradient: what bf16 costs

    @property
    def holds(self) -> bool:
        return self.worst <= 1


def check_mixed_gradients(ranks, d: int, precision: MixedPrecision,
                          config: TransformerConfig = SMALL) -> GradientCheck:
    """fsdp_gradients on `ranks` (resized to d) against the derived bound, every element."""
    check_run(3, d, config, precision=precision)
    got = ranks.resize(d).run(fsdp_gradients, precision, config)[0]
    return compare_gradients(got, d, precision, config)


def compare_gradients(got: dict[str, torch.Tensor], d: int, precision: MixedPrecision,
                      config: TransformerConfig = SMALL) -> GradientCheck:
    """FSDP's averaged gradient `got` (fsdp_gradients at d) against the mean of one process
    casting the same way on each rank's slice, and against the fp32 gradient."""
    tokens = make_tokens(config)
    model = make_transformer(config)
    with intra_op_threads(1):
        slices = [mixed_precision_gradients(model, shard(tokens.inputs, r, d),
                                            shard(tokens.targets, r, d), precision)
                  for r in range(d)]
    lm_loss(model(tokens.inputs), tokens.targets).backward()
    fp32 = {n: p.grad.double() for n, p in model.named_parameters()}
    tau = reduction_tolerance(d, dtype_name(precision.reduce_dtype))
    worst = reduction = compute = top = top32 = 0.0
    for name, g32 in fp32.items():
        parts = torch.stack([s[name].double() for s in slices])
        exact, scale = parts.sum(0) / d, parts.abs().sum(0) / d
        error = (got[name].double() - exact).abs()
        # where every g_r is 0 the bound is 0 and so must the error be
        ratio = torch.where(error == 0, torch.zeros_like(error), error / (tau * scale))
        worst = max(worst, ratio.max().item())
        reduction = max(reduction, error.max().item())
        compute = max(compute, (exact - g32).abs().max().item())
        top, top32 = max(top, exact.abs().max().item()), max(top32, g32.abs().max().item())
    return GradientCheck(d, precision, tau, worst, reduction / top, compute / top32)


# ----------------------------------------------------------------------------------------
# Mixed precision in the parent: runs at several d, and their tables.
# ----------------------------------------------------------------------------------------

def precision_label(precision: MixedPrecision) -> str:
    """"bf16, reduce fp32": the compute dtype and the reduce dtype, short."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
             torch.float64: "fp64"}
    return f"{short[precision.compute_dtype]}, reduce {short[precision.reduce_dtype]}"


@dataclass
class MixedResult:
    """One (precision, d) run of FSDP in mixed precision: every rank's StageRun."""
    precision: MixedPrecision
    d: int
    config: TransformerConfig
    ranks: list[StageRun] = field(repr=False)
    bit_identical: bool      # every rank's masters torch.equal one process casting the same way
    gradients: GradientCheck | None = None   # the first step's gradient (d > 1)

    @property
    def run(self) -> StageRun:
        return self.ranks[0]

    def formula(self) -> ZeroMemory:
        return mixed_formula(self.config.parameters, self.d, self.precision)

    def formula_comm(self) -> dict[str, float]:
        """What FSDP hands to each collective per step: the weights twice in the compute
        dtype, the gradients once in the reduce dtype (Ψ values each)."""
        compute, reduce, _ = mixed_precision_bytes(dtype_name(self.precision.compute_dtype),
                                                   dtype_name(self.precision.reduce_dtype))
        psi = self.config.parameters
        return {"all_gather": 2 * compute * psi, "reduce_scatter": reduce * psi}


def run_mixed(ranks, precisions, degrees=(4, 2, 1), steps: int = 3,
              config: TransformerConfig = SMALL) -> list[MixedResult]:
    """train_stage (stage 3, each precision) on `ranks` resized to each d in turn (the order
    given: growing the ranks starts processes, shrinking them does not), each rank's masters
    compared with train_reference casting the same way; at d > 1 also fsdp_gradients, checked
    by compare_gradients."""
    for d in degrees:
        for precision in precisions:
            check_run(3, d, config, steps, precision=precision)
    references = [train_reference(steps, config, precision=p) for p in precisions]
    results = []
    for d in degrees:
        ranks.resize(d)
        for precision, reference in zip(precisions, references):
            runs = ranks.run(train_stage, 3, steps, config, precision=precision)
            same = all(torch.equal(run.params[n], ref) for run in runs
                       for n, ref in reference.items())
            check = None
            if d > 1:
                got = ranks.run(fsdp_gradients, precision, config)[0]
                check = compare_gradients(got, d, precision, config)
            results.append(MixedResult(precision, d, config, runs, same, check))
    return results


def mixed_memory_table(results: list[MixedResult]) -> str:
    """Measured state per rank (rank 0, MB) against mixed_formula, term by term, and the
    bytes handed to the collectives in units of Ψ bytes against the formula's."""
    lines = [f"{'precision':<18}{'d':>2} |{'params':>8}{'grads':>8}{'optim':>8}{'total':>8} |"
             f"{'formula':>8}{'error':>8} | {'handed to the collectives, Ψ bytes':<36}",
             f"{'':<20} | {'measured, MB':^31} | {'MB':^15} | "
             f"{'all-gather, reduce-scatter (formula)':<36}"]
    for res in sorted(results, key=lambda r: (precision_label(r.precision), r.d)):
        s, f, psi = res.run.state, res.formula(), res.config.parameters
        comm, formula_comm = res.run.comm, res.formula_comm()
        handed = ", ".join(f"{comm.get(op, 0) / psi:.3f} ({formula_comm[op] / psi:g})"
                           for op in ("all_gather", "reduce_scatter"))
        lines.append(f"{precision_label(res.precision):<18}{res.d:>2} |{s.params / 1e6:8.3f}"
                     f"{s.grads / 1e6:8.3f}{s.optimizer / 1e6:8.3f}{s.total / 1e6:8.3f} |"
                     f"{f.total / 1e6:8.3f}{rel_error(s.total, f.total):+8.3%} | "
                     f"{handed if res.d > 1 else 'none at d = 1':<36}")
    return "\n".join(lines)


def gradient_table(checks: list[GradientCheck]) -> str:
    """One line per GradientCheck: τ, the worst element's share of its bound, and the two
    errors relative to the largest gradient."""
    lines = [f"{'precision':<18}{'d':>2} |{'τ':>10}{'worst / bound':>15} |"
             f"{'reduction':>11}{'bf16 compute':>14}",
             f"{'':<20} |{'':>25} | {'error, share of max |g|':^24}"]
    for c in checks:
        lines.append(f"{precision_label(c.precision):<18}{c.d:>2} |{c.tolerance:10.2e}"
                     f"{c.worst:15.3f} |{c.reduction_error:11.2e}{c.compute_error:14.2e}")
    return "\n".join(lines)


def dtype_step_times(config: TransformerConfig = SMALL,
                     dtypes=(torch.float32, torch.bfloat16, torch.float16),
                     repeat: int = 3) -> dict[torch.dtype, float]:
    """Median forward + backward of the model on the whole batch with every weight in each
    dtype, one process on one thread (one core, as one device); the dtypes take turns,
    `repeat` times, so that a shared machine's changing load hits them alike (the first
    turn, which allocates, is left out)."""
    check_int("repeat", repeat)
    tokens = make_tokens(config)
    models = {dtype: make_transformer(config).to(dtype) for dtype in dtypes}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in dtypes}
    with intra_op_threads(1):
        for turn in range(repeat + 1):
            for dtype, model in models.items():
                t0 = time.perf_counter()
                lm_loss(model(tokens.inputs).float(), tokens.targets).backward()
                if turn:
                    times[dtype].append(time.perf_counter() - t0)
                model.zero_grad()
    return {dtype: statistics.median(t) for dtype, t in times.items()}
