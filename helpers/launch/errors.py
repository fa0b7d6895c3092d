"""What the notebook raises when a rank fails: which rank, inside which collective, and why.

A rank's own traceback is carried over as text (its exception object may not unpickle in
the notebook). Whether it was a timeout is the rank's own flag in its reply, never words
searched for in the traceback. A timeout says what each other rank was doing: which had
already returned (the usual cause of a hang in a course is a rank that skipped a collective
the others are waiting in), which timed out too, which were inside another collective or
still running their own Python code; no rank that joined is blamed. A rank that died says
how, with the last lines it wrote to stderr (gloo's own message when it aborted it).
"""
from __future__ import annotations

import contextlib
import signal


class RankError(RuntimeError):
    """A rank raised; carries the rank and its traceback."""

    def __init__(self, rank: int, op: str | None, tb: str):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        where = f" during {op}" if op else ""
        super().__init__(f"rank {rank} failed{where}:\n{tb}")


class RankTimeoutError(RankError, TimeoutError):
    """A rank did not finish in time (typically: stuck in a collective its peers never joined).

    `others` says what each other rank of the call was doing when the notebook gave up:
    "returned" (it had finished the call), "timed out" (its own collective timed out too),
    the name of the collective it was inside, or None (running Python code, in no
    collective). `waited` is None when the rank's own collective timed out; otherwise the
    rank never replied, and it is how long the notebook waited for it."""

    def __init__(self, rank: int, op: str | None, tb: str, timeout: float | None,
                 others: dict[int, str | None], waited: float | None = None):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        self.others, self.waited = dict(others), waited
        self.returned = sorted(r for r, doing in others.items() if doing == "returned")
        after = "" if timeout is None else f" after {timeout:g} s"
        if waited is None:
            head = f"rank {rank} timed out{after} in {op or 'a collective'}"
        else:
            where = (f"still inside {op}" if op
                     else "in no collective: its own Python code was still running")
            head = f"rank {rank} gave no reply in {waited:g} s, {where}"
        TimeoutError.__init__(self, f"{head}{_what_others_did(op, others)}.\n{tb}")


def _what_others_did(op: str | None, others: dict[int, str | None]) -> str:
    """'; rank(s) [3] had already returned without joining it; rank(s) [2] were running
    Python code, in no collective': only what happened, so no rank that joined is blamed."""
    by_kind: dict[str | None, list[int]] = {}
    for rank, doing in sorted(others.items()):
        by_kind.setdefault(doing, []).append(rank)
    parts = []
    for doing, ranks in by_kind.items():
        if doing == "returned":
            parts.append(f"rank(s) {ranks} had already returned"
                         + (" without joining it" if op else ""))
        elif doing in ("timed out", "failed"):
            parts.append(f"rank(s) {ranks} {doing} too")
        elif doing is None:
            parts.append(f"rank(s) {ranks} were running Python code, in no collective")
        else:
            parts.append(f"rank(s) {ranks} were inside {doing}")
    if not parts and op:
        parts.append("a peer never joined it")
    return "".join(f"; {part}" for part in parts)


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: 'exit code -9, killed by SIGKILL'."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
