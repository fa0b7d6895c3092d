"""Tensor parallelism, forward and backward: the code behind notebook 04.

Every rank holds every layer, but only a slice of each weight; activations move instead.
Three layouts of the lecture's deep MLP (batch b, hidden h, L layers of h×h, GELU after each):

* "lecture"  — each layer is cut by output columns; after every layer the slices are
  all-gathered so every rank holds the full activation again (the lecture's forward).
* "megatron" — layers go in pairs: column-parallel then row-parallel. The first needs the
  full input and produces a column slice; the second takes that slice and produces a partial
  sum of the full output. One all-reduce per pair forward (g), one backward (f).
* "sequence" — Megatron's pairs, but between pairs each rank keeps only its own tokens: the
  all-reduce becomes reduce-scatter (forward) / all-gather (backward) after the pair, and an
  all-gather / reduce-scatter before it.

Conventions used throughout:
* Weights are `nn.Linear` weights, shape (out, in); rank r of t holds rows r·h/t … (r+1)·h/t of
  a column-parallel weight and the same columns of a row-parallel one.
* Activations are (tokens, h) with tokens = b·s; the lecture's MLP has s = 1. Sequence
  parallelism cuts the token dimension (dim 0).
* Bytes are counted per rank under the ring convention (see `RING_FACTOR`).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.models import make_mlp

LAYOUTS = ("lecture", "megatron", "sequence")
DEFAULTS = dict(batch=128, hidden=1024, layers=4)  # the lecture's running example


# ----------------------------------------------------------------------------------------
# Checks: one clear error, in the parent, before any process starts.
# ----------------------------------------------------------------------------------------

def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_config(t: int, hidden: int, batch: int = 128, layers: int = 4,
                 layout: str = "megatron") -> None:
    """Raise ValueError/TypeError naming the bad argument; return None when all is well."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_int("t", t)
    _check_int("hidden", hidden)
    _check_int("batch", batch)
    _check_int("layers", layers)
    if hidden % t:
        raise ValueError(f"hidden must be divisible by the tensor degree t: hidden={hidden} is "
                         f"not a multiple of t={t} (allowed: multiples of {t})")
    if layout != "lecture" and layers % 2:
        raise ValueError(f"layers must be even for layout={layout!r} (column/row pairs), got {layers}")
    if layout == "sequence" and batch % t:
        raise ValueError(f"batch must be divisible by t for layout='sequence' (each rank keeps "
                         f"batch/t tokens): batch={batch}, t={t}")


# ----------------------------------------------------------------------------------------
# The unsharded reference: the lecture's deep MLP.
# ----------------------------------------------------------------------------------------

# The unsharded model every layout is checked against: the lecture's MLP of notebook 03.
reference_mlp = make_mlp


def reference_batch(batch: int = 128, hidden: int = 1024, seed: int = 1):
    """(input, target), both (batch, hidden), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, hidden, generator=gen), torch.randn(batch, hidden, generator=gen)


def mse_sum(y: torch.Tensor, target: torch.Tensor, total: int) -> torch.Tensor:
    """Σ (y − target)² / total: a mean whose pieces add up across ranks holding token shards."""
    return ((y - target) ** 2).sum() / total


# ----------------------------------------------------------------------------------------
# Counting what we hand to torch.distributed.
# ----------------------------------------------------------------------------------------

# Per-rank bytes sent by the ring algorithm, as a fraction of the buffer n we pass:
#   all-reduce of n bytes: reduce-scatter + all-gather, 2(t−1) steps of n/t  → 2(t−1)/t · n
#   all-gather whose OUTPUT is n bytes: t−1 steps of n/t                     → (t−1)/t · n
#   reduce-scatter whose INPUT is n bytes: t−1 steps of n/t                  → (t−1)/t · n
RING_FACTOR = {
    "all_reduce": lambda t: 2 * (t - 1) / t,
    "all_gather": lambda t: (t - 1) / t,
    "reduce_scatter": lambda t: (t - 1) / t,
}


@dataclass(frozen=True)
class CommRecord:
    op: str
    phase: str          # "forward" or "backward"
    shape: tuple
    payload_bytes: int  # the full buffer n (AR: the tensor; AG: the output; RS: the input)
    t: int
    seconds: float

    @property
    def ring_bytes(self) -> int:
        """Bytes this rank sends under the ring convention (exact: n is a multiple of t)."""
        num = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[self.op] * (self.t - 1)
        return self.payload_bytes * num // self.t


_LOG: list[CommRecord] | None = None


@contextlib.contextmanager
def counting():
    """Record every collective this module issues inside the block (on this rank)."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def _record(op: str, phase: str, tensor: torch.Tensor, start: float) -> None:
    if _LOG is not None:
        if tensor.is_cuda:  # NCCL returns before the data moved: wait, so time means something
            torch.cuda.synchronize(tensor.device)
        _LOG.append(CommRecord(op, phase, tuple(tensor.shape), tensor.numel() * tensor.element_size(),
                               dist.get_world_size(), time.perf_counter() - start))


def summarize(log: list[CommRecord]) -> dict:
    """Picklable totals of a log: what a rank sends back to the notebook."""
    per_op: dict[str, dict] = {}
    for rec in log:
        key = f"{rec.op} ({rec.phase})"
        entry = per_op.setdefault(key, {"calls": 0, "payload_bytes": 0, "ring_bytes": 0})
        entry["calls"] += 1
        entry["payload_bytes"] += rec.payload_bytes
        entry["ring_bytes"] += rec.ring_bytes
    return {"calls": len(log), "ring_bytes": sum(r.ring_bytes for r in log),
            "payload_bytes": sum(r.payload_bytes for r in log),
            "seconds": sum(r.seconds for r in log), "per_op": per_op}


# The three collectives, each a thin counted wrapper. t = 1 moves nothing, so skip the call.

def all_reduce(x: torch.Tensor, phase: str = "forward") -> torch.Tensor:
    if dist.get_world_size() == 1:
        return x
    x = x.contiguous()
    start = time.perf_counter()
    dist.all_reduce(x)
    _record("all_reduce", phase, x, start)
    return x


def all_gather(x: torch.Tensor, dim: int, phase: str = "forward") -> torch.Tensor:
    """Concatenate every rank's x along `dim`."""
    t = dist.get_world_size()
    if t == 1:
        return x
    # all_gather_single stacks along dim 0; gather there and move the pieces after.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((t * x0.shape[0],) + tuple(x0.shape[1:]))
    start = time.perf_counter()
    _all_gather_single(out, x0)
    _record("all_gather", phase, out, start)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, phase: str = "forward") -> torch.Tensor:
    """Sum x over ranks and keep this rank's 1/t slice along `dim`."""
    t = dist.get_world_size()
    if t == 1:
        return x
    # gloo (and the single-tensor API in general) scatters the flat buffer along dim 0:
    # bring the scattered dimension to the front and make it contiguous first.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // t,) + tuple(x0.shape[1:]))
    start = time.perf_counter()
    _reduce_scatter_single(out, x0)
    _record("reduce_scatter", phase, x0, start)
    return out.movedim(0, dim).contiguous()


def _all_gather_single(out, x):
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)


def _reduce_scatter_single(out, x):
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x)


def _my_slice(x: torch.Tensor, dim: int) -> torch.Tensor:
    t, r = dist.get_world_size(), dist.get_rank()
    return x.chunk(t, dim=dim)[r].contiguous()


# ----------------------------------------------------------------------------------------
# Conjugate operators: each is an identity on one pass and a collective on the other.
# ----------------------------------------------------------------------------------------

class _F(torch.autograd.Function):
    """f: identity forward, all-reduce backward (enters a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each rank used the full x against its own weight slice: the gradients are partial sums.
        return all_reduce(grad.clone(), phase="backward")


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaves a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x.clone(), phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return grad  # the output is replicated: every rank already has the whole gradient


class _GatherLastDim(torch.autograd.Function):
    """All-gather column slices forward; keep this rank's slice backward (the lecture's layout)."""

    @staticmethod
    def forward(ctx, x):
        return all_gather(x, dim=-1, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, dim=-1)


class _GatherTokens(torch.autograd.Function):
    """Sequence parallel: all-gather token shards forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x):
        return all_gather(x, dim=0, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        # Every rank's full-sequence gradient is a partial sum (its weight slice only).
        return reduce_scatter(grad, dim=0, phase="backward")


class _ScatterTokens(torch.autograd.Function):
    """Sequence parallel: reduce-scatter partial sums to token shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter(x, dim=0, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, dim=0, phase="backward")


def f(x): return _F.apply(x)
def g(x): return _G.apply(x)
def gather_columns(x): return _GatherLastDim.apply(x)
def gather_tokens(x): return _GatherTokens.apply(x)
def scatter_tokens(x): return _ScatterTokens.apply(x)


# ----------------------------------------------------------------------------------------
# Parallel linear layers, each built from the nn.Linear it replaces.
# ----------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Y_r = X · A_rᵀ: this rank's rows of the weight, i.e. its slice of the output columns.

    Needs the full input X. Entering through f (or, sequence-parallel, through an all-gather of
    token shards) makes the input gradient whole again in the backward pass.
    """

    def __init__(self, linear: nn.Linear, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(_my_slice(linear.weight.detach(), dim=0))
        self.bias = (nn.Parameter(_my_slice(linear.bias.detach(), dim=0))
                     if linear.bias is not None else None)

    def forward(self, x):
        x = gather_tokens(x) if self.sequence_parallel else f(x)
        y = F.linear(x, self.weight, self.bias)
        return gather_columns(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = Σ_r Y_r · B_rᵀ: this rank's columns of the weight, applied to its input slice.

    Each rank's product is a partial sum of the full output; g all-reduces it (or,
    sequence-parallel, a reduce-scatter leaves each rank the full sum for its own tokens).
    """

    def __init__(self, linear: nn.Linear, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(_my_slice(linear.weight.detach(), dim=1))
        # The bias is added once, after the sum, so every rank keeps all of it.
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, y):
        z = F.linear(y, self.weight)
        z = scatter_tokens(z) if self.sequence_parallel else g(z)
        if self.bias is not None:
            # Sequence-parallel: each rank saw only its tokens, so the bias gradient is partial;
            # f all-reduces it in the backward pass.
            z = z + (f(self.bias) if self.sequence_parallel else self.bias)
        return z


class GatherColumns(nn.Module):
    """The lecture's all-gather + concatenate, as a layer (backward: keep my slice)."""

    def forward(self, y):
        return gather_columns(y)


def shard_mlp(reference: nn.Sequential, layout: str) -> nn.Sequential:
    """This rank's piece of the reference MLP in the given layout (call inside a process group)."""
    linears = [m for m in reference if isinstance(m, nn.Linear)]
    modules: list[nn.Module] = []
    for i, linear in enumerate(linears):
        if layout == "lecture":  # slice, GELU on the slice, then gather (the lecture's order)
            modules += [ColumnParallelLinear(linear), nn.GELU(), GatherColumns()]
            continue
        if i % 2 == 0:
            modules.append(ColumnParallelLinear(linear, sequence_parallel=layout == "sequence"))
        else:
            modules.append(RowParallelLinear(linear, sequence_parallel=layout == "sequence"))
        modules.append(nn.GELU())
    return nn.Sequential(*modules)


# ----------------------------------------------------------------------------------------
# Formulas: what the counter should find, and what each rank keeps for the backward pass.
# ----------------------------------------------------------------------------------------

def formula_collectives(layout: str, layers: int = 4) -> dict[str, tuple[int, int]]:
    """op → (calls forward, calls backward) for one step with t > 1 (input needs a gradient)."""
    pairs = layers // 2
    if layout == "lecture":
        return {"all_gather": (layers, 0), "all_reduce": (0, layers)}
    if layout == "megatron":
        return {"all_reduce": (pairs, pairs)}
    return {"all_gather": (pairs, pairs), "reduce_scatter": (pairs, pairs)}


def formula_bytes(layout: str, t: int, tokens: int = 128, hidden: int = 1024, layers: int = 4,
                  bytes_per_element: int = 4) -> int:
    """Per-rank bytes sent in one training step (forward + backward), ring convention.

    Every collective here moves a full activation n = tokens·h·bytes (gathered output,
    reduce-scattered input, or all-reduced tensor):
      lecture : L all-gathers + L all-reduces = 3L(t−1)/t · n
      megatron: L/2 + L/2 all-reduces          = 2L(t−1)/t · n
      sequence: L all-gathers + L reduce-scatters = 2L(t−1)/t · n
    """
    n = tokens * hidden * bytes_per_element
    factor = {"lecture": 3 * layers, "megatron": 2 * layers, "sequence": 2 * layers}[layout]
    return factor * (t - 1) * n // t


def formula_activation_bytes(layout: str, t: int, tokens: int = 128, hidden: int = 1024,
                             layers: int = 4, bytes_per_element: int = 4) -> int:
    """Activations one rank keeps for the backward pass (weights excluded).

    Per layer (n = tokens·h·bytes, one full activation):
      lecture : the full input (n) and its own pre-GELU slice (n/t)            → n + n/t
      megatron: per pair, full input n, two slices n/t, full pre-GELU sum n    → (2n + 2n/t)/2
      sequence: per pair, gathered input n, two slices n/t, pre-GELU shard n/t → (n + 3n/t)/2
    """
    n = tokens * hidden * bytes_per_element
    if layout == "lecture":
        return layers * (n + n // t)
    if layout == "megatron":
        return layers // 2 * (2 * n + 2 * n // t)
    return layers // 2 * (n + 3 * n // t)


@contextlib.contextmanager
def saved_activations(model: nn.Module):
    """Count distinct storages autograd saves for backward inside the block, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen


# ----------------------------------------------------------------------------------------
# Rank functions (run through helpers.ranks): the lecture's forward, and a full training step.
# ----------------------------------------------------------------------------------------

def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lecture_forward(rank: int, t: int, batch: int = 128, hidden: int = 1024, layers: int = 4,
                    seed: int = 0) -> dict:
    """The lecture's forward, as written there: slice, GELU, all-gather a list, concatenate."""
    device = _device()
    reference = reference_mlp(hidden, layers, seed)
    x = reference_batch(batch, hidden)[0].to(device)
    local = hidden // t
    # Lecture convention: x @ W with W of shape (in, out); rank r owns out-columns r·h/t … .
    params = [m.weight.detach()[rank * local:(rank + 1) * local].T.to(device)
              for m in reference if isinstance(m, nn.Linear)]
    with counting() as log:
        for w in params:
            x = F.gelu(x @ w)                                   # batch × h/t
            activations = [torch.empty_like(x) for _ in range(t)]
            start = time.perf_counter()
            dist.all_gather(activations, x)                     # counted as one all-gather
            _record("all_gather", "forward", torch.cat(activations, dim=0), start)
            x = torch.cat(activations, dim=1)                   # batch × h
    return {"output": x, "comm": summarize(log), "local_shape": (batch, local),
            "weight_shape": tuple(params[0].shape)}


def train_step(rank: int, t: int, layout: str = "megatron", batch: int = 128,
               hidden: int = 1024, layers: int = 4, seed: int = 0, bias: bool = False) -> dict:
    """One forward + backward of the sharded MLP; returns output, loss, grads and counts.

    The input requires a gradient too (as if the MLP sat inside a deeper network), so every
    conjugate collective runs and the input gradient can be checked.
    """
    model, x, target = _build(layout, batch, hidden, layers, seed, bias)
    with counting() as log, saved_activations(model) as saved:
        y = model(x)
    forward_log = list(log)
    with counting() as log:
        loss = mse_sum(y, target, batch * hidden)
        loss.backward()
    return {
        "output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
        "grads": _grads_by_reference_name(model),
        "comm": summarize(forward_log + log), "activation_bytes": sum(saved.values()),
    }


def run_step(ranks, t: int, layout: str = "megatron", batch: int = 128, hidden: int = 1024,
             layers: int = 4, bias: bool = False, implementation: str = "helpers") -> list[dict]:
    """Check the configuration in the parent, then run one training step on t live ranks.

    implementation: "helpers" (this module's layers) or "torch" (parallelize_module).
    """
    check_config(t, hidden, batch, layers, layout)
    if implementation not in ("helpers", "torch"):
        raise ValueError(f"implementation must be 'helpers' or 'torch', got {implementation!r}")
    ranks.resize(t)
    if implementation == "torch":
        if bias:
            raise ValueError("bias=True is only wired for implementation='helpers'")
        return ranks.run(torch_tp_step, layout, batch, hidden, layers)
    return ranks.run(train_step, layout, batch, hidden, layers, bias=bias)


def run_lecture_forward(ranks, t: int = 4, batch: int = 128, hidden: int = 1024,
                        layers: int = 4) -> list[dict]:
    check_config(t, hidden, batch, layers, "lecture")
    ranks.resize(t)
    return ranks.run(lecture_forward, batch, hidden, layers)


def _build(layout, batch, hidden, layers, seed, bias=False):
    """This rank's model shard, input (requiring a gradient) and target."""
    device = _device()
    reference = reference_mlp(hidden, layers, seed)
    if bias:
        _add_biases(reference, seed)
    model = shard_mlp(reference, layout).to(device)
    x, target = (v.to(device) for v in reference_batch(batch, hidden))
    if layout == "sequence":  # each rank starts (and ends) with its own tokens only
        x, target = _my_slice(x, 0), _my_slice(target, 0)
    return model, x.requires_grad_(True), target


def timed_steps(rank: int, t: int, layout: str = "megatron", batch: int = 128,
                hidden: int = 1024, layers: int = 4, repeat: int = 10, warmup: int = 2,
                threads: int | None = None) -> dict:
    """Time forward + backward steps (barrier before each clock read, so a step ends when
    every rank is done); count the collectives and the seconds spent inside them.
    `threads` overrides this rank's intra-op threads for the timing (restored afterwards)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _timed_steps(t, layout, batch, hidden, layers, repeat, warmup)
    finally:
        torch.set_num_threads(previous)


def _timed_steps(t, layout, batch, hidden, layers, repeat, warmup) -> dict:
    from helpers.timing import measure
    model, x, target = _build(layout, batch, hidden, layers, seed=0)
    sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if x.is_cuda else dist.barrier
    logs = []

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with counting() as log:
            mse_sum(model(x), target, batch * hidden).backward()
        logs.append(log)

    m = measure(step, f"{layout} t={t} step", repeat=repeat, warmup=warmup, sync=sync)
    timed = [summarize(log) for log in logs[warmup:]]
    shares = [s["seconds"] / dt for s, dt in zip(timed, m.times_s)]
    return {"measurement": m, "comm": timed[-1], "comm_shares": shares,
            "comm_share": statistics.median(shares)}


def _grads_by_reference_name(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """Name each shard's gradient after the reference parameter it is a slice of."""
    parallel = [m for m in model if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return {f"{2 * i}.{name}": p.grad for i, m in enumerate(parallel)
            for name, p in m.named_parameters()}


def _add_biases(reference: nn.Sequential, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 100)
    for i, m in enumerate(list(reference)):
        if isinstance(m, nn.Linear):
            new = nn.Linear(m.in_features, m.out_features, bias=True)
            with torch.no_grad():
                new.weight.copy_(m.weight)
                new.bias.copy_(torch.randn(m.out_features, generator=gen) * 0.1)
            reference[i] = new


def reference_step(batch: int = 128, hidden: int = 1024, layers: int = 4, seed: int = 0,
                   bias: bool = False) -> dict:
    """The same step on one process, unsharded: the ground truth for every layout."""
    reference = reference_mlp(hidden, layers, seed)
    if bias:
        _add_biases(reference, seed)
    x, target = reference_batch(batch, hidden)
    x.requires_grad_(True)
    with saved_activations(reference) as saved:
        y = reference(x)
    loss = mse_sum(y, target, batch * hidden)
    loss.backward()
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": {name: p.grad for name, p in reference.named_parameters()},
            "activation_bytes": sum(saved.values())}


def assemble(results: list[dict], layout: str) -> dict:
    """Put the ranks' pieces back together: full output, loss, input grad and parameter grads."""
    tokens_sharded = layout == "sequence"
    first = results[0]
    output = (torch.cat([r["output"] for r in results]) if tokens_sharded else first["output"])
    input_grad = (torch.cat([r["input_grad"] for r in results]) if tokens_sharded
                  else first["input_grad"])
    loss = sum(r["loss"] for r in results) if tokens_sharded else first["loss"]
    grads = {}
    for name, grad in first["grads"].items():
        layer, kind = name.split(".")
        column = _kind_of(layout, int(layer)) == "column"
        if kind == "weight":  # column: rows of the weight; row: its columns
            grads[name] = torch.cat([r["grads"][name] for r in results], dim=0 if column else 1)
        elif column:
            grads[name] = torch.cat([r["grads"][name] for r in results])
        else:
            grads[name] = grad  # a row-parallel bias is replicated
    return {"output": output, "loss": loss, "input_grad": input_grad, "grads": grads}


def _kind_of(layout: str, module_index: int) -> str:
    """'column' or 'row' for the Linear at this index of the reference Sequential."""
    if layout == "lecture":
        return "column"
    return "column" if (module_index // 2) % 2 == 0 else "row"


def replicas_agree(results: list[dict], layout: str) -> bool:
    """Whatever is replicated must be identical on every rank, bit for bit: the output and input
    gradient (lecture, megatron) and the gradient of a row-parallel bias (all layouts)."""
    keys = [] if layout == "sequence" else ["output", "input_grad"]
    replicated = [name for name in results[0]["grads"]
                  if name.endswith("bias") and _kind_of(layout, int(name.split(".")[0])) == "row"]
    return all(torch.equal(r[key], results[0][key]) for r in results[1:] for key in keys) and all(
        torch.equal(r["grads"][n], results[0]["grads"][n]) for r in results[1:] for n in replicated)


# assert_close's float32 defaults hold on the CPU; GPU matmuls split and sum in other orders.
TOLERANCES = {"gloo": {}, "nccl": dict(rtol=1e-4, atol=1e-5)}


def compare(sharded: dict, reference: dict, **tolerances) -> dict[str, float]:
    """assert_close every tensor; return the max |difference| of each, for the notebook to show."""
    pairs = [("output", sharded["output"], reference["output"]),
             ("loss", sharded["loss"], reference["loss"]),
             ("input grad", sharded["input_grad"], reference["input_grad"])]
    pairs += [(f"grad {n}", sharded["grads"][n], reference["grads"][n]) for n in reference["grads"]]
    diffs = {}
    for name, a, b in pairs:
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}", **tolerances)
        diffs[name] = (a - b).abs().max().item()
    return diffs


# ----------------------------------------------------------------------------------------
# The same layouts with PyTorch's own tensor parallelism (DTensor), for comparison.
# ----------------------------------------------------------------------------------------

def torch_tp_plan(layout: str, layers: int = 4) -> dict:
    """parallelize_module plan for the reference Sequential (Linear at even indices)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(layers):
        name = str(2 * i)
        if layout == "lecture":
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        elif i % 2 == 0:
            plan[name] = (ColwiseParallel(input_layouts=Shard(0)) if layout == "sequence"
                          else ColwiseParallel())
        else:
            plan[name] = (RowwiseParallel(output_layouts=Shard(0)) if layout == "sequence"
                          else RowwiseParallel())
    return plan


def torch_tp_step(rank: int, t: int, layout: str = "megatron", batch: int = 128,
                  hidden: int = 1024, layers: int = 4, seed: int = 0) -> dict:
    """train_step's twin built with torch.distributed.tensor.parallel.parallelize_module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    device = _device()
    model = reference_mlp(hidden, layers, seed).to(device)
    mesh = init_device_mesh(device.type, (t,))
    parallelize_module(model, mesh, torch_tp_plan(layout, layers))
    x, target = (v.to(device) for v in reference_batch(batch, hidden))
    if layout == "sequence":
        x, target = _my_slice(x, 0), _my_slice(target, 0)
    x.requires_grad_(True)
    with CommDebugMode() as comm:
        y = model(x)
        loss = mse_sum(y, target, batch * hidden)
        loss.backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    grads = {f"{2 * i}.weight": _finished(model[2 * i].weight.grad.to_local())
             for i in range(layers)}
    return {"output": _finished(y.detach()), "loss": loss.detach(),
            "input_grad": _finished(x.grad), "grads": grads, "collectives": counts}


def _finished(tensor: torch.Tensor) -> torch.Tensor:
    """DTensor hands back AsyncCollectiveTensors: wait for the collective before reading one
    (copying its memory without waiting reads a buffer the collective has not filled yet)."""
    return tensor.wait() if hasattr(tensor, "wait") else tensor


# ----------------------------------------------------------------------------------------
# Tables for the notebook: counted vs formula, per layout.
# ----------------------------------------------------------------------------------------

def layout_table(measured: dict[str, dict], t: int, tokens: int = 128, hidden: int = 1024,
                 layers: int = 4, bytes_per_element: int = 4) -> str:
    """One row per layout: collectives per layer, bytes per step and activations per rank,
    each counted on rank 0 of a real step (`measured[layout]` = train_step's result) next to
    its formula."""
    kw = dict(tokens=tokens, hidden=hidden, layers=layers, bytes_per_element=bytes_per_element)
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    head = (f"{'layout':<9} {'collectives / layer':<40} {'bytes / step / rank':>20} "
            f"{'formula':>10} {'activations / rank':>19} {'formula':>10}")
    lines = [head, "-" * len(head)]
    for layout, result in measured.items():
        calls = formula_collectives(layout, layers)
        per_pass = [" + ".join(f"{c[i] / layers:g} {short[op]}" for op, c in calls.items() if c[i])
                    for i in (0, 1)]
        per_layer = f"fwd {per_pass[0]}, bwd {per_pass[1]}"
        lines.append(
            f"{layout:<9} {per_layer:<40} {result['comm']['ring_bytes']:>20,} "
            f"{formula_bytes(layout, t, **kw):>10,} {result['activation_bytes']:>19,} "
            f"{formula_activation_bytes(layout, t, **kw):>10,}")
    lines.append("AR all-reduce, AG all-gather, RS reduce-scatter; bytes sent per rank (ring), "
                 "counted on rank 0 next to the formula")
    return "\n".join(lines)


def collectives_along(rank: int, t: int, dim: int, shape: tuple = (2, 8, 3)) -> dict:
    """reduce_scatter then all_gather of a known tensor along any dim (gloo scatters dim 0 only:
    the wrappers move `dim` to the front). Input on rank r: arange + r."""
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + rank
    scattered = reduce_scatter(x, dim)
    return {"scattered": scattered, "gathered": all_gather(scattered, dim)}


def layout_schedule(layout: str, layers: int = 4) -> list[tuple]:
    """The route of one step through the sharded MLP: a list of items, each either
    ("layer", i, "column"|"row"), ("comm", forward op, backward op, operator name) or
    ("state", activation)
    — what each rank holds there: b×h, b×h/t (its features), b/t×h (its tokens) or a partial
    sum of b×h that the next collective completes."""
    items: list[tuple] = [("state", "b/t×h" if layout == "sequence" else "b×h")]
    for i in range(layers):
        kind = "column" if layout == "lecture" or i % 2 == 0 else "row"
        if kind == "column":
            items.append(("comm", "AG", "RS", "") if layout == "sequence" else ("comm", "", "AR", "f"))
            items += [("state", "b×h")] if layout == "sequence" else []
        items += [("layer", i, kind), ("state", "b×h/t" if kind == "column" else "partial b×h")]
        if layout == "lecture":
            items += [("comm", "AG", "", ""), ("state", "b×h")]
        elif kind == "row":
            items += [("comm", "AR", "", "g") if layout == "megatron" else ("comm", "RS", "AG", ""),
                      ("state", "b×h" if layout == "megatron" else "b/t×h")]
    return items


def plot_layouts(layers: int = 4):
    """One strip per layout: the layers, what each rank holds between them, and the collectives
    on the way forward (above) and backward (below)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(LAYOUTS), 1, figsize=(12, 1.25 * len(LAYOUTS) + 0.4))
    for ax, layout in zip(axes, LAYOUTS):
        x = 0.0
        for item in layout_schedule(layout, layers):
            if item[0] == "layer":
                color = "C0" if item[2] == "column" else "C1"
                ax.add_patch(plt.Rectangle((x, -0.35), 1.1, 0.7, color=color, alpha=0.25))
                ax.text(x + 0.55, 0, f"{item[2]}\nW{item[1]}", ha="center", va="center", fontsize=8)
                x += 1.3
            elif item[0] == "comm":
                ax.axvline(x + 0.15, color="0.4", lw=0.8, ls="--", ymin=0.1, ymax=0.9)
                ax.text(x + 0.15, 0.62, item[1], ha="center", color="C2", fontsize=9, weight="bold")
                ax.text(x + 0.15, -0.72, item[2], ha="center", color="C3", fontsize=9, weight="bold")
                ax.text(x + 0.22, 0.3, item[3], ha="left", color="0.3", fontsize=9, style="italic")
                x += 0.3
            else:
                ax.text(x + 0.45, 0, item[1], ha="center", va="center", fontsize=8, color="0.25")
                x += 0.9
        ax.set(xlim=(-0.1, x), ylim=(-0.9, 0.9), yticks=[], xticks=[])
        ax.set_ylabel(layout, rotation=0, ha="right", va="center")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    axes[0].set_title("forward collectives above (green), backward below (red); "
                      "AG all-gather, RS reduce-scatter, AR all-reduce", fontsize=9)
    fig.tight_layout()
    return fig
