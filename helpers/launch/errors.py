"""What the notebook raises when a rank fails: which rank, inside which collective, and why.

A rank's own traceback is carried over as text (its exception object may not unpickle in
the notebook). A timeout says which peers had already returned, because the usual cause of
a hang in a course is a rank that skipped a collective the others are waiting in.
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
    """A rank did not finish in time (typically: stuck in a collective its peers never joined)."""

    def __init__(self, rank: int, op: str | None, tb: str, timeout: float | None,
                 returned: list[int]):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        hint = (f"; rank(s) {returned} had already returned without joining it" if returned
                else "; a peer never joined it")
        after = "" if timeout is None else f" after {timeout:g} s"
        TimeoutError.__init__(self, f"rank {rank} timed out{after} in "
                              f"{op or 'a collective'}{hint}.\n{tb}")


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: 'exit code -9, killed by SIGKILL'."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
