"""Coding exercises: the reader writes a block of distributed code, live ranks check it.

An `Exercise` says what each rank is handed (`given`: its own shard, never the whole), what the
single-process reference expects back from each rank (`want`), and how the lesson requires the
ranks to communicate (`comm`). `check(fn)` runs the reader's function on live gloo ranks over
every `Case` (world sizes, sub-groups, uneven sizes, seeds), compares each rank's result with the
reference, reads the calls each rank made (helpers.exercises.calls), and answers in one form,
a `Verdict`: right, or what is wrong, where, and the likely cause.

* An empty body (a docstring, `...`, `pass`, `raise NotImplementedError`) answers at once,
  without starting ranks.
* A deadlock ends after `CHECK_TIMEOUT_S` with which rank waited in which call; the ranks are
  torn down and the next check starts fresh ones.
* `check(fn, first_case_only=True)` runs one case: the tests run the course's wrong answers
  (`Exercise.mistakes`) that way, and the right one over the whole sweep.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
import threading
from dataclasses import dataclass
from typing import Callable

from helpers.exercises.arithmetic import Verdict
from helpers.exercises.calls import Call, recorded_calls

# A collective that waits longer than this is a deadlock in an exercise (the cases move at most
# a few kilobytes): short enough that a check ends within seconds.
CHECK_TIMEOUT_S = 3.0

# The mistakes the wrong answers are named from: real ones, as readers and reviewers make them.
MISTAKES = {
    "forgot to divide by d": "summed the gradients (or values) but did not average them",
    "divided by the world, not the group": "averaged over every rank instead of the group's",
    "wrong neighbour": "sent to or received from the wrong rank of the ring",
    "off-by-one chunk": "sent or kept the chunk next to the right one",
    "skipped a phase": "left out one phase of a two-phase algorithm",
    "reduced before the hook fired": "communicated a gradient before backward had produced it",
    "missing wait": "used an asynchronous call's buffer before waiting for it",
    "computed locally without communicating": "got numbers without the communication asked for",
    "used the collective the lesson replaces": "called the one-line collective being built",
    "deadlock": "every rank waits for a peer that waits too",
    "wrong group": "communicated over the wrong group of ranks",
    "wrong order": "put pieces together in the wrong order",
    "sent the whole tensor to every rank": "a naive exchange: n − 1 copies of every tensor",
    "averaged where a sum was asked": "divided by the ranks what is one sum split across them",
}


@dataclass(frozen=True)
class Case:
    """One run of a check: `world` ranks, a `seed` for the data, a `size` whose meaning is the
    exercise's (elements, rows, tokens), and the sub-group the block runs on (None: all)."""
    world: int
    seed: int
    size: int
    group: tuple[int, ...] | None = None

    def members(self) -> tuple[int, ...]:
        return self.group if self.group is not None else tuple(range(self.world))

    def generator(self, stream: int):
        """A torch.Generator for one stream of this case's data (a rank's own: its rank), the
        same in the notebook and on the rank, different for every seed and stream."""
        import torch
        return torch.Generator().manual_seed(1000 * self.seed + stream)

    def __str__(self) -> str:
        group = f", group {list(self.group)}" if self.group is not None else ""
        return f"{self.world} ranks{group}, size {self.size}, seed {self.seed}"


@dataclass(frozen=True)
class Mistake:
    """A wrong answer a reader could write, named from MISTAKES, and a phrase the verdict on it
    must contain (what the checker should say)."""
    name: str
    fn: Callable
    says: str

    def __post_init__(self):
        if self.name not in MISTAKES:
            raise ValueError(f"mistake name must be one of {sorted(MISTAKES)}, got {self.name!r}")


def _returned(args: tuple, returned):
    return returned


def _no_rule(case: Case, calls: list[list[Call]]) -> str | None:
    return None


@dataclass(frozen=True)
class Exercise:
    id: str                     # the name of the function the reader writes
    notebook: str               # "01", "03", ...
    title: str
    form: str                   # "variation" (not on the page) or "reveal" (ours follows)
    solution: Callable          # the course's version
    cases: tuple[Case, ...]
    given: Callable             # (rank, case, group) -> the reader's arguments on that rank
    want: Callable              # case -> {rank: expected result} for the group's ranks
    result: Callable = _returned  # (args, returned) -> what is compared (e.g. an in-place tensor)
    comm: Callable = _no_rule   # (case, calls per member rank) -> a problem, or None
    hint: Callable | None = None  # (case, rank, got, want, given) -> a likely cause, or None
    crash: Callable | None = None  # (op, error text) of a rank that failed -> a cause, or None
    mistakes: tuple[Mistake, ...] = ()
    rtol: float = 1e-5
    atol: float = 1e-6

    def __post_init__(self):
        if self.form not in ("variation", "reveal"):
            raise ValueError(f"form must be 'variation' or 'reveal', got {self.form!r}")


EXERCISES: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    if exercise.id in EXERCISES:
        raise ValueError(f"two exercises named {exercise.id!r}")
    EXERCISES[exercise.id] = exercise
    return exercise


def exercise(name: str) -> Exercise:
    import helpers.exercises  # noqa: F401  (registers every exercise)
    try:
        return EXERCISES[name]
    except KeyError:
        raise ValueError(f"exercise must be one of {sorted(EXERCISES)}, got {name!r}") from None


# -- an empty body ---------------------------------------------------------------------------

def is_empty(fn: Callable) -> bool:
    """True when the function's body is only a docstring, `...`, `pass` or a `raise
    NotImplementedError`: the skeleton as the notebook hands it over."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for statement in node.body:
        if isinstance(statement, ast.Pass):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # the docstring, or `...`
        if isinstance(statement, ast.Raise):
            raised = statement.exc
            name = raised.func if isinstance(raised, ast.Call) else raised
            if isinstance(name, ast.Name) and name.id == "NotImplementedError":
                continue
        return False
    return True


# -- on a rank -----------------------------------------------------------------------------

def attempt(rank: int, world: int, name: str, cases: tuple[Case, ...], fn: Callable) -> list:
    """Rank function: for each case, hand the reader's function this rank's arguments only, and
    return (what it produced, the calls it made). Ranks outside a case's group only take part in
    forming the group (every rank must)."""
    import torch.distributed as dist
    ex = exercise(name)
    out = []
    for case in cases:
        group = dist.new_group(list(case.group)) if case.group is not None else None
        if rank not in case.members():
            out.append((None, []))
            continue
        args = ex.given(rank, case, group)
        with recorded_calls() as calls:
            returned = fn(*args)
        out.append((ex.result(args, returned), calls))
    return out


# -- in the notebook -----------------------------------------------------------------------

_RANKS: list = []  # one LiveRanks for every check, resized per case (a re-rendezvous, no start)
# Held from a resize to the end of the run on that size: two checks from two threads must not
# resize the ranks under each other (a case for 3 ranks run on 2 would be a silent wrong answer).
_CHECKING = threading.Lock()


def _ranks(world: int):
    from helpers.launch.live import LiveRanks
    if not _RANKS:
        _RANKS.append(LiveRanks(world, timeout=CHECK_TIMEOUT_S, check_collectives=True))
    return _RANKS[0].resize(world)


def check(fn: Callable, name: str | None = None, *, first_case_only: bool = False) -> Verdict:
    """Run the reader's `fn` on live ranks against the exercise named `name` (default: the
    function's own name) and say whether it is right, or what is wrong and why."""
    from helpers.launch.errors import RankError, RankTimeoutError
    if not callable(fn):
        raise TypeError(f"fn must be the function you wrote, got {type(fn).__name__}")
    ex = exercise(name or getattr(fn, "__name__", ""))
    if is_empty(fn):
        return Verdict(False, "the body is empty: write it, then run this cell again.")
    cases = ex.cases[:1] if first_case_only else ex.cases
    worlds = dict.fromkeys(c.world for c in cases)  # in the cases' order, once each
    for world in worlds:
        batch = tuple(c for c in cases if c.world == world)
        try:
            with _CHECKING:
                replies = _ranks(world).run(attempt, ex.id, batch, fn)
        except RankTimeoutError as error:
            what = "deadlock" if error.op else "no answer"
            return Verdict(False, f"{what} ({batch[0]}): {_stuck(error)}")
        except RankError as error:
            text = _last_exception(error.remote_traceback) or str(error)
            cause = ex.crash(error.op, text) if ex.crash else None
            where = f" in {error.op}" if error.op else ""
            return Verdict(False, f"rank {error.rank} failed{where} ({batch[0]}): "
                           + (f"{cause} ({text})" if cause else text))
        for i, case in enumerate(batch):
            problem = _judge(ex, case, [replies[r][i] for r in range(world)])
            if problem:
                return Verdict(False, f"{problem} ({case}).")
    sweep = "; ".join(str(c) for c in cases)
    return Verdict(True, f"every rank matches the single-process reference, communicating as "
                   f"the lesson asks, on {len(cases)} case(s): {sweep}.")


def _stuck(error) -> str:
    """Who waited where, and the usual cause for that kind of wait."""
    head = str(error).split("\n", 1)[0].rstrip(".")
    if error.op in ("send", "recv", "isend", "irecv"):
        return (f"{head}. Each send needs its recv on the peer, posted in an order that cannot "
                "wait in a circle (or isend, then recv, then wait).")
    if error.op:
        return (f"{head}. Every rank of a group must make the same collectives in the same "
                "order; one that skips or reorders a call leaves the others waiting.")
    return f"{head}. An endless loop, or a wait that never ends, in the function's own code?"


def _last_exception(traceback_text: str) -> str:
    """The traceback's final exception, with the lines it continues on (a mismatch's details)."""
    lines = [ln for ln in traceback_text.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if not ln.startswith(" ") and ":" in ln
              and not ln.startswith("Traceback")]
    if not starts:
        return ""
    text = " ".join(ln.strip() for ln in lines[starts[-1]:][:4])
    text = re.sub(r"\s*\[enforce fail at [^\]]*\]", "", text)  # a C++ file of torch's build
    return re.sub(r"^[\w.]+\.(\w+:)", r"\1", text)  # the exception's name, not its module


def _judge(ex: Exercise, case: Case, replies: list) -> str | None:
    calls = [replies[r][1] for r in case.members()]
    if not any(calls):
        return ("the ranks made no call to torch.distributed, yet each was handed only its own "
                "shard: the others' data cannot have reached it (call them through the module, "
                "as dist.send(...): the checker sees those)")
    want = ex.want(case)
    for rank in case.members():
        got = replies[rank][0]
        problem = compare(got, want[rank], ex.rtol, ex.atol)
        if problem:
            given = ex.given(rank, case, None)
            cause = ex.hint(case, rank, got, want[rank], given) if ex.hint else None
            cause = cause or generic_cause(case, got, want[rank], given)
            return f"rank {rank}: {problem}" + (f"; {cause}" if cause else "")
    return ex.comm(case, calls)


def compare(got, want, rtol: float, atol: float) -> str | None:
    """None when `got` matches `want` (tensors, or lists/tuples of them, or numbers); else what
    differs: the type, the shape, or the largest error and where."""
    import torch
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"returned {_kind(got)}, the reference is a list of {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            problem = compare(g, w, rtol, atol)
            if problem:
                return f"item {i}: {problem}"
        return None
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"returned {_kind(got)}, the reference is a tensor"
        if got.shape != want.shape:
            return f"returned shape {list(got.shape)}, the reference has {list(want.shape)}"
        if torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
            return None
        error = (got.double() - want.double()).abs()
        index = int(error.flatten().argmax())
        return (f"largest error {float(error.max()):.3g} at element {index} "
                f"(got {float(got.flatten()[index]):.4g}, want {float(want.flatten()[index]):.4g})")
    return None if got == want else f"returned {got!r}, the reference is {want!r}"


def _kind(value) -> str:
    return type(value).__name__ if value is not None else "None"


def generic_cause(case: Case, got, want, given) -> str | None:
    """The likely cause read from the numbers: a constant factor (averaging), the rank's own
    input unchanged (no communication), one wrong chunk (an index off by one)."""
    import torch
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or \
            got.shape != want.shape or not want.numel():
        return None
    g, w = got.double().flatten(), want.double().flatten()
    for mine in ([given] if isinstance(given, torch.Tensor) else
                 [a for a in (given if isinstance(given, (list, tuple)) else ())
                  if isinstance(a, torch.Tensor)]):
        if mine.shape == got.shape and torch.allclose(g, mine.double().flatten()):
            return "it is this rank's own input, unchanged: nothing reached it from the others"
    nonzero = w.abs() > 1e-9
    if nonzero.any():
        ratio = float((g[nonzero] / w[nonzero]).median())
        if abs(ratio - 1) > 1e-3 and torch.allclose(g, w * ratio, rtol=1e-4, atol=1e-6):
            n = len(case.members())
            if abs(ratio - n) < 1e-3:
                return f"it is {n}× the reference: did you average (divide by {n})?"
            if abs(ratio - 1 / n) < 1e-3:
                return f"it is 1/{n} of the reference: divided once too often?"
            if abs(ratio - case.world) < 1e-3 or abs(ratio - 1 / case.world) < 1e-3:
                return f"it is {ratio:g}× the reference: divided by the world, not the group?"
            return f"it is {ratio:.3g}× the reference"
    n = len(case.members())
    if g.numel() >= n:  # the chunks of torch.tensor_split: the first numel % n one longer
        sizes = [len(c) for c in g.tensor_split(n)]
        bounds = [sum(sizes[:j]) for j in range(n + 1)]
        wrong = [j for j in range(n) if not torch.allclose(g[bounds[j]:bounds[j + 1]],
                                                           w[bounds[j]:bounds[j + 1]])]
        if 0 < len(wrong) < n:
            return (f"chunk(s) {wrong} of {n} are wrong, the others right: a chunk index off by "
                    "one, or a phase left out?")
    return None


# -- the course's version, folded --------------------------------------------------------------

class Folded:
    """Source shown folded: one click opens it (HTML <details>); as text, the source itself."""

    def __init__(self, summary: str, source: str):
        self.summary, self.source = summary, source

    def _repr_html_(self) -> str:
        import html
        return (f"<details><summary>{html.escape(self.summary)}</summary>"
                f"<pre>{html.escape(self.source)}</pre></details>")

    def __repr__(self) -> str:
        return f"{self.summary}\n{self.source}"


def reveal(name: str) -> Folded:
    """The course's solution of exercise `name`, folded away until clicked."""
    ex = exercise(name)
    return Folded(f"Our {ex.id}: click to compare with yours",
                  textwrap.dedent(inspect.getsource(ex.solution)))
