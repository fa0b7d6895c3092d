"""One event log for every block: what a rank handed to torch.distributed (`Comm`) and what it
did when (`Span`), recorded only while someone asks.

A block reports through `record(...)`; a lab, a test or a timeline asks with
`with recording("tp") as log:`, and `log` fills with what the named blocks record inside the
`with` block, on this rank. Recordings nest: a record goes to the innermost recording that asks
for its block, so a step timed inside a longer run is counted once, in its own list. When nobody
records, `recording_for(block)` is False and a block skips its bookkeeping (and the
`torch.cuda.synchronize` that a time on a GPU needs).

Every accounting, timeline and check of the course reads these two records: tensor parallelism's
bytes against the formulas (04), the 3-D step's timeline (07), ZeRO's and FSDP's bytes per
collective (08), the all-to-alls of expert parallelism and the ring's sends and waits (09),
DDP's hooks and all-reduces under the backward pass (03).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from helpers.cost.alpha_beta import COST_MODELS


@dataclass(frozen=True)
class Comm:
    """One call this rank handed to torch.distributed."""
    block: str              # who issued it: "tp", "zero", "fsdp", "experts", "ring", ...
    op: str                 # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"
    nbytes: int             # the buffer handed to torch, elements × itemsize (AG: the output,
                            # RS: the input, AR: the tensor, all-to-all and send: what left here)
    phase: str = ""         # "forward" or "backward" where the block knows
    group_size: int = 1     # members of the group it ran on
    start: float = 0.0      # time.perf_counter() when the call began
    seconds: float = 0.0    # how long the call took
    label: str = ""         # what it carried: "dispatch", "counts", the tensor's shape, ...

    @property
    def ring_bytes(self) -> int:
        """Bytes this rank sends under the ring algorithm: alpha_beta's bus factor × n."""
        return round(COST_MODELS[self.op].bus_factor(self.group_size) * self.nbytes)


@dataclass(frozen=True)
class Span:
    """An interval of one rank's work, in seconds (of time.perf_counter, or from a common start
    where the recorder says so)."""
    kind: str               # "compute", "wait", "forward", "all_reduce", "tp_comm", ...
    start: float
    end: float
    label: str = ""         # "F 2" (micro-batch 2), a parameter's or bucket's name, ...
    phase: str = ""         # "forward" or "backward" where it matters
    step: int = 0           # the ring step, where there is one

    @property
    def duration(self) -> float:
        return self.end - self.start


_RECORDINGS: list[tuple[tuple[str, ...], list]] = []  # innermost last


@contextlib.contextmanager
def recording(*blocks: str):
    """Collect what `blocks` (every block, if none is named) record inside the `with` block."""
    entries: list = []
    _RECORDINGS.append((blocks, entries))
    try:
        yield entries
    finally:
        _RECORDINGS.remove(next(r for r in _RECORDINGS if r[1] is entries))


def _recording_of(block: str) -> list | None:
    for blocks, entries in reversed(_RECORDINGS):
        if not blocks or block in blocks:
            return entries
    return None


def recording_for(block: str) -> bool:
    """Whether anyone records `block` now (blocks skip their bookkeeping when nobody does)."""
    return _recording_of(block) is not None


def record(block: str, entry: Comm | Span) -> None:
    """Hand `entry` to the innermost recording that asks for `block`, if any."""
    entries = _recording_of(block)
    if entries is not None:
        entries.append(entry)


def comms(entries) -> list[Comm]:
    return [e for e in entries if isinstance(e, Comm)]


def spans(entries) -> list[Span]:
    return [e for e in entries if isinstance(e, Span)]


class Recorder:
    """A block's handle on the log: `add(op, tensor)` next to the torch.distributed call it
    counts records that call's buffer (elements × itemsize), when anyone records the block."""

    def __init__(self, block: str):
        self.block = block

    def add(self, op: str, tensor, phase: str = "") -> None:
        if recording_for(self.block):
            record(self.block, Comm(self.block, op, tensor.numel() * tensor.element_size(), phase))


def bytes_by_op(entries) -> dict[str, int]:
    """{op: bytes} over the `Comm`s among `entries`, in the order each op first appears."""
    totals: dict[str, int] = {}
    for c in comms(entries):
        totals[c.op] = totals.get(c.op, 0) + c.nbytes
    return totals
