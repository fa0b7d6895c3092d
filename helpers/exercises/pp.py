"""Notebook 05's coding exercises: a pipeline's two passes from send and recv, each stage
relu(x @ W) with an h × h weight that only its rank holds.

* `pipeline_forward` ("reveal": asked before the notebook prints the lecture's
  `lecture_forward`, which is then ours to compare with): rank 0 alone holds the m micro-batches;
  each stage receives a micro-batch from rank r − 1, applies its stage and sends the result to
  rank r + 1, one message per micro-batch, and the last rank returns the whole batch's output.
* `pipeline_backward` ("variation": the notebook's backward runs inside the schedule loop, not
  in this form): gradients travel the other way, from rank r + 1 to rank r − 1, and each stage
  sums its own weight's gradient over the micro-batches, with no collective.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from helpers.exercises.coding import Case, Exercise, Mistake, register

P2P = {"send", "recv", "isend", "irecv"}
H = 4  # hidden size h: each stage is relu(x @ W) with W of h × h


def pipeline_forward(weight: torch.Tensor, micro_batches: list[torch.Tensor] | None, m: int,
                     b: int) -> torch.Tensor | None:
    """Stage `rank` of p = world size: relu(x @ weight) on each of the m micro-batches (b × h),
    taken from `micro_batches` on rank 0 and received from rank − 1 elsewhere, then sent to
    rank + 1. The last rank returns its m outputs in order, concatenated (m·b × h)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    outputs = []
    for k in range(m):
        if rank == 0:
            x = micro_batches[k]
        else:  # blocks until the previous stage has sent micro-batch k
            x = weight.new_empty(b, weight.shape[0])
            dist.recv(x, src=rank - 1)
        y = torch.relu(x @ weight)
        if rank + 1 < p:  # blocks until the next stage has it: one message per micro-batch
            dist.send(y, dst=rank + 1)
        else:
            outputs.append(y)
    return torch.cat(outputs) if outputs else None


# -- what each rank is handed, and the single-process reference ----------------------------

def _b(case: Case) -> int:
    return 2 + case.seed % 2  # micro-batch size b: 2 or 3 rows, so shapes differ between cases


def _weight(case: Case, rank: int) -> torch.Tensor:
    g = case.generator(rank)
    return torch.randn(H, H, generator=g)


def _micro_batches(case: Case) -> list[torch.Tensor]:
    g = case.generator(999)
    return list(torch.randn(case.size * _b(case), H, generator=g).split(_b(case)))


def _given(rank: int, case: Case, group) -> tuple:
    """Rank r: its stage's weight only; rank 0 also the m micro-batches (case.size is m)."""
    return (_weight(case, rank), _micro_batches(case) if rank == 0 else None, case.size,
            _b(case))


def _run(case: Case, skipped=(), order=None) -> torch.Tensor:
    """The whole pipeline in one process; `skipped` stages pass their input on unchanged and
    `order` permutes the micro-batches (the hint's guesses at what went wrong)."""
    xs = _micro_batches(case)
    outputs = []
    for k in (order or range(case.size)):
        x = xs[k]
        for stage in range(case.world):
            x = x if stage in skipped else torch.relu(x @ _weight(case, stage))
        outputs.append(x)
    return torch.cat(outputs)


def _want(case: Case) -> dict:
    want = {r: None for r in range(case.world)}
    want[case.world - 1] = _run(case)
    return want


class _Described(str):
    """A value shown by its description (a tensor where None was due: not its 40 numbers)."""

    def __repr__(self) -> str:
        return str(self)


def _result(args: tuple, returned):
    if isinstance(returned, torch.Tensor) and dist.get_rank() + 1 < dist.get_world_size():
        return _Described(f"a tensor of shape {list(returned.shape)}")
    return returned


# -- what the checker says ---------------------------------------------------------------

def _hint(case: Case, rank: int, got, want, given) -> str | None:
    if want is None:
        return "only the last stage returns the output; the other ranks return None"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return ("return the m outputs of the last stage as one tensor, micro-batch 0 first: "
                "torch.cat(outputs), m·b rows of h")
    b, m = _b(case), case.size
    rows = list(want.split(b))
    found = [next((j for j, w in enumerate(rows) if torch.allclose(g, w, atol=1e-5)), None)
             for g in got.split(b)]
    if None not in found and found != list(range(m)):
        return (f"the right micro-batches in the wrong order (output micro-batch 0 is input "
                f"micro-batch {found[0]}): micro-batch k must go through the stages k-th")
    stages = range(case.world)
    for n in range(1, case.world):
        for skipped in itertools.combinations(stages, n):
            if torch.allclose(got, _run(case, skipped), atol=1e-5):
                return (f"it is the pipeline without the work of rank(s) {list(skipped)}: did "
                        "they send on what they received instead of what their stage made?")
    return None


def _comm(case: Case, calls: list) -> str | None:
    p, m, nbytes = case.world, case.size, _b(case) * H * 4
    for rank, made in enumerate(calls):
        other = sorted({c.op for c in made} - P2P)
        if other:
            return (f"rank {rank} called {other[0]}: a stage hands its activations to the next "
                    "stage only, point to point with send and recv (no collective)")
        for c in made:
            sends = c.op in ("send", "isend")
            right = rank + 1 if sends else rank - 1
            if c.peer != right:
                return (f"rank {rank} {'sent to' if sends else 'received from'} rank {c.peer}: "
                        f"stage {rank} {'sends only to' if sends else 'receives only from'} "
                        f"rank {right}" + (", the one after it" if sends else ", the one before"))
        sent = [c.nbytes for c in made if c.op in ("send", "isend")]
        if rank + 1 < p and sent != [nbytes] * m:
            return (f"rank {rank} sent {len(sent)} message(s) of {sum(sent)} bytes in all; a "
                    f"pipeline sends one per micro-batch, m = {m} of b × h × 4 = {nbytes} bytes, "
                    "so the next stage can start while this one works on the next")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _waits_on_the_last_rank(weight, micro_batches, m, b):
    # A ring, as in notebook 01: rank 0 also waits for the last rank, and every rank waits.
    rank, p = dist.get_rank(), dist.get_world_size()
    outputs = []
    for k in range(m):
        x = torch.empty(b, weight.shape[0])
        dist.recv(x, src=(rank - 1) % p)
        y = torch.relu(x @ weight)
        if rank + 1 < p:
            dist.send(y, dst=rank + 1)
        else:
            outputs.append(y)
    return torch.cat(outputs) if outputs else None


def _pops_the_last_first(weight, micro_batches, m, b):
    # list.pop() takes the last micro-batch first: the outputs come out reversed.
    rank, p = dist.get_rank(), dist.get_world_size()
    outputs = []
    for k in range(m):
        if rank == 0:
            x = micro_batches.pop()
        else:
            x = torch.empty(b, weight.shape[0])
            dist.recv(x, src=rank - 1)
        y = torch.relu(x @ weight)
        if rank + 1 < p:
            dist.send(y, dst=rank + 1)
        else:
            outputs.append(y)
    return torch.cat(outputs) if outputs else None


def _sends_its_input_on(weight, micro_batches, m, b):
    rank, p = dist.get_rank(), dist.get_world_size()
    outputs = []
    for k in range(m):
        if rank == 0:
            x = micro_batches[k]
        else:
            x = torch.empty(b, weight.shape[0])
            dist.recv(x, src=rank - 1)
        y = torch.relu(x @ weight)
        if rank + 1 < p:
            dist.send(x, dst=rank + 1)  # x, not y: this stage's work is lost
        else:
            outputs.append(y)
    return torch.cat(outputs) if outputs else None


def _broadcasts_every_activation(weight, micro_batches, m, b):
    # Right numbers, but every stage's output goes to every rank: p − 1 copies where one will do.
    rank, p = dist.get_rank(), dist.get_world_size()
    outputs = []
    for k in range(m):
        x = micro_batches[k] if rank == 0 else torch.empty(b, weight.shape[0])
        for stage in range(p):
            if stage == rank:
                x = torch.relu(x @ weight)
            if stage + 1 < p:
                dist.broadcast(x, src=stage)
        if rank == p - 1:
            outputs.append(x)
    return torch.cat(outputs) if outputs else None


register(Exercise(
    id="pipeline_forward", notebook="05", title="A pipeline's forward pass from send and recv",
    form="reveal", solution=pipeline_forward,
    cases=(Case(world=3, seed=0, size=5), Case(world=2, seed=1, size=3),
           Case(world=4, seed=2, size=3)),
    given=_given, want=_want, result=_result, comm=_comm, hint=_hint,
    mistakes=(
        Mistake("wrong neighbour", _waits_on_the_last_rank, "deadlock"),
        Mistake("wrong order", _pops_the_last_first, "wrong order"),
        Mistake("skipped a phase", _sends_its_input_on, "without the work of rank"),
        Mistake("sent the whole tensor to every rank", _broadcasts_every_activation,
                "called broadcast"),
    ),
))


# == The backward: each stage's gradient goes back from rank + 1 to rank − 1 ==================

def pipeline_backward(weight: torch.Tensor, inputs: list[torch.Tensor],
                      grad_outputs: list[torch.Tensor] | None, m: int) -> torch.Tensor:
    """Stage `rank`'s backward of y = relu(x @ weight) over the m micro-batches, micro-batch 0
    first. `inputs` are the m inputs x this stage saw in the forward; the gradient of its
    output y comes from `grad_outputs` on the last rank and from rank + 1 elsewhere; the
    gradient of x goes to rank − 1. Returns the weight's gradient, summed over the m."""
    rank, p = dist.get_rank(), dist.get_world_size()
    grad_weight = torch.zeros_like(weight)
    for k in range(m):
        x = inputs[k]
        if rank == p - 1:
            grad_y = grad_outputs[k]
        else:  # rank + 1's input gradient is this stage's output gradient
            grad_y = weight.new_empty(x.shape[0], weight.shape[1])
            dist.recv(grad_y, src=rank + 1)
        grad_pre = grad_y * (x @ weight > 0)  # relu lets the gradient through where it was > 0
        grad_weight += x.T @ grad_pre
        if rank > 0:  # rank 0's input is the data: no one waits for its gradient
            dist.send(grad_pre @ weight.T, dst=rank - 1)
    return grad_weight


def _stage_inputs(case: Case) -> list[list[torch.Tensor]]:
    """What each stage saw in the forward: the m micro-batches, through the stages before it."""
    xs, seen = _micro_batches(case), []
    for stage in range(case.world):
        seen.append(xs)
        xs = [torch.relu(x @ _weight(case, stage)) for x in xs]
    return seen


def _grad_outputs(case: Case) -> list[torch.Tensor]:
    g = case.generator(998)
    return list(torch.randn(case.size * _b(case), H, generator=g).split(_b(case)))


def _given_backward(rank: int, case: Case, group) -> tuple:
    """Rank r: its weight and its stage's m inputs; the last rank also the m output gradients."""
    last = rank == case.world - 1
    return (_weight(case, rank), _stage_inputs(case)[rank],
            _grad_outputs(case) if last else None, case.size)


def _want_backward(case: Case) -> dict:
    """Autograd through the whole pipeline in one process, loss Σ_k ⟨y_k, grad_outputs[k]⟩."""
    weights = [_weight(case, s).requires_grad_() for s in range(case.world)]
    loss = 0
    for x, g in zip(_micro_batches(case), _grad_outputs(case)):
        for w in weights:
            x = torch.relu(x @ w)
        loss = loss + (x * g).sum()
    loss.backward()
    return {r: w.grad for r, w in enumerate(weights)}


def _replay(case: Case, through=(), popped=False, only=None) -> list[torch.Tensor]:
    """The chain in one process, with the hint's guesses: stages in `through` send back the
    gradient they received; `popped` pairs micro-batch k's gradient with input m − 1 − k;
    `only` keeps that micro-batch's weight gradient alone."""
    m, inputs = case.size, _stage_inputs(case)
    grads = [torch.zeros(H, H) for _ in range(case.world)]
    for k, g in enumerate(_grad_outputs(case)):
        for s in reversed(range(case.world)):
            x, w = inputs[s][m - 1 - k if popped else k], _weight(case, s)
            pre = g * (x @ w > 0)
            grads[s] += x.T @ pre if only in (None, k) else 0
            g = g if s in through else pre @ w.T
    return grads


def _hint_backward(case: Case, rank: int, got, want, given) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "return this stage's weight gradient, h × h like its weight"
    close = lambda other: torch.allclose(got, other, rtol=1e-4, atol=1e-5)  # noqa: E731
    if close(sum(_want_backward(case).values())):
        return ("it is the sum of every stage's weight gradient: an all-reduce across the "
                "stages? Each stage owns different weights; only copies of one stage (data "
                "parallelism) add theirs")
    if close(_replay(case, only=case.size - 1)[rank]):
        return ("it is the last micro-batch's weight gradient alone: add up all m "
                "(grad_weight += ..., not =)")
    if close(_replay(case, popped=True)[rank]):
        return ("micro-batch k's gradient met micro-batch m − 1 − k's input, the wrong order: "
                "the saved inputs taken last first (inputs.pop()?) while the gradients come "
                "micro-batch 0 first")
    for n in range(1, case.world):
        for through in itertools.combinations(range(1, case.world), n):
            if close(_replay(case, through)[rank]):
                return (f"rank(s) {list(through)} sent back the gradient they received, not "
                        "the gradient of their input (through the relu, then @ weight.T)")
    return None


def _comm_backward(case: Case, calls: list) -> str | None:
    m, nbytes = case.size, _b(case) * H * 4
    for rank, made in enumerate(calls):
        other = sorted({c.op for c in made} - P2P)
        if other:
            return (f"rank {rank} called {other[0]}: the stages pass only their input's "
                    "gradient back to the previous stage, with send and recv; each stage's "
                    "weight gradient is its own")
        for c in made:
            sends = c.op in ("send", "isend")
            right = rank - 1 if sends else rank + 1
            if c.peer != right:
                return (f"rank {rank} {'sent to' if sends else 'received from'} rank {c.peer}: "
                        f"in the backward stage {rank} {'sends to' if sends else 'receives from'}"
                        f" rank {right} only")
        sent = [c.nbytes for c in made if c.op in ("send", "isend")]
        if rank > 0 and sent != [nbytes] * m:
            return (f"rank {rank} sent {len(sent)} message(s) of {sum(sent)} bytes in all; the "
                    f"backward sends one input gradient per micro-batch, m = {m} of b × h × 4 = "
                    f"{nbytes} bytes")
    return None


# -- wrong answers ------------------------------------------------------------------------

def _sends_back_what_it_got(weight, inputs, grad_outputs, m):
    rank, p = dist.get_rank(), dist.get_world_size()
    grad_weight = torch.zeros_like(weight)
    for k in range(m):
        x = inputs[k]
        grad_y = grad_outputs[k] if rank == p - 1 else torch.empty(x.shape[0], weight.shape[1])
        if rank < p - 1:
            dist.recv(grad_y, src=rank + 1)
        grad_pre = grad_y * (x @ weight > 0)
        grad_weight += x.T @ grad_pre
        if rank > 0:
            dist.send(grad_y, dst=rank - 1)  # the output's gradient, not the input's
    return grad_weight


def _all_reduces_the_weights(weight, inputs, grad_outputs, m):
    grad_weight = pipeline_backward(weight, inputs, grad_outputs, m)
    dist.all_reduce(grad_weight)  # a data-parallel habit, over the pipeline's stages
    return grad_weight


def _pops_the_inputs(weight, inputs, grad_outputs, m):
    rank, p = dist.get_rank(), dist.get_world_size()
    grad_weight = torch.zeros_like(weight)
    for k in range(m):
        x = inputs.pop()  # the last saved first, while the gradients come micro-batch 0 first
        grad_y = grad_outputs[k] if rank == p - 1 else torch.empty(x.shape[0], weight.shape[1])
        if rank < p - 1:
            dist.recv(grad_y, src=rank + 1)
        grad_pre = grad_y * (x @ weight > 0)
        grad_weight += x.T @ grad_pre
        if rank > 0:
            dist.send(grad_pre @ weight.T, dst=rank - 1)
    return grad_weight


def _own_output_as_the_loss(weight, inputs, grad_outputs, m):
    # Every stage but the last takes Σ y as its loss: no gradient ever comes back.
    rank, p = dist.get_rank(), dist.get_world_size()
    w = weight.clone().requires_grad_()
    for k in range(m):
        y = torch.relu(inputs[k] @ w)
        y.backward(grad_outputs[k] if rank == p - 1 else torch.ones_like(y))
    return w.grad


register(Exercise(
    id="pipeline_backward", notebook="05", title="A pipeline's backward pass from send and recv",
    form="variation", solution=pipeline_backward,
    cases=(Case(world=3, seed=3, size=5), Case(world=2, seed=4, size=2),
           Case(world=4, seed=5, size=3)),
    given=_given_backward, want=_want_backward, comm=_comm_backward, hint=_hint_backward,
    rtol=1e-4, atol=1e-5,
    mistakes=(
        Mistake("skipped a phase", _sends_back_what_it_got, "sent back the gradient they received"),
        Mistake("wrong group", _all_reduces_the_weights, "an all-reduce across the stages"),
        Mistake("wrong order", _pops_the_inputs, "wrong order"),
        Mistake("computed locally without communicating", _own_output_as_the_loss,
                "made no call"),
    ),
))
