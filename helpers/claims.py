"""A sentence about a run, checked beside it: `claim(text, holds, kind=..., detail=...)`.

The prose of a notebook says what the output shows; a re-run can show something else. So every
such sentence gets a `claim` in the cell that prints the numbers, of one of two kinds:

* ``kind="exact"``: true on every machine (arithmetic, counts, bytes, schedules in wait mode,
  comparisons with one process). A false one raises `ClaimError`, so the cell fails and so does
  nbval; the committed output shows it passed.
* ``kind="measured"``: depends on this machine's timing. It only says whether *this run* shows
  it and never fails the cell; the prose beside it is written as "in this run ...".

    claim("the bubble follows (p-1)/(m+p-1) within 10 %", abs(err) < 0.10, kind="exact",
          detail=f"{measured:.3f} against {theory:.3f}")
    ✓ the bubble follows (p-1)/(m+p-1) within 10 % (0.231 against 0.222)

`tests/test_notebooks.py` reads the printed marks back from the committed notebooks.
"""
from __future__ import annotations

KINDS = ("exact", "measured")
PASSED = "✓"          # an exact claim that held
SHOWN = "✓ this run"  # a measured claim this run shows
NOT_SHOWN = "✗ this run"


class ClaimError(AssertionError):
    """An exact claim was false: the prose beside it no longer describes the output."""


def claim(text: str, holds: bool, *, kind: str, detail: str = "") -> None:
    """Print one line saying whether `text` holds on the numbers above; raise if an exact one fails.

    text    the claim in words, as the prose makes it (a clause: "the bubble follows ...")
    holds   the check itself, computed from the numbers the cell printed
    kind    "exact" (fails the cell when false) or "measured" (reports this run, never fails)
    detail  the numbers behind the verdict, printed with it
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}; got {kind!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty sentence; got {text!r}")
    holds = _verdict(holds)
    numbers = f" ({detail})" if detail else ""
    if kind == "exact":
        if not holds:
            raise ClaimError(f"✗ {text}{numbers}")
        print(f"{PASSED} {text}{numbers}")
    elif holds:
        print(f"{SHOWN} shows that {text}{numbers}")
    else:
        print(f"{NOT_SHOWN} does not show that {text}{numbers}")


def _verdict(holds) -> bool:
    """A bool, or one boolean value of numpy or torch; a number is refused (a check forgotten)."""
    if isinstance(holds, bool):
        return holds
    if str(getattr(holds, "dtype", "")) in ("bool", "torch.bool"):
        try:
            return bool(holds)
        except (ValueError, RuntimeError):  # several values: which one is the verdict?
            pass
    raise TypeError(f"holds must be a bool (the check's result); got {type(holds).__name__} "
                    f"{holds!r:.60}")
