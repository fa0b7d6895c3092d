"""Checked exercises: each `check_*` says right or wrong and why, so a reader can test an answer alone."""
from __future__ import annotations
from dataclasses import dataclass

@dataclass(frozen=True)
class Verdict:
    right: bool
    why: str
    def __str__(self) -> str:
        return ("✓ right: " if self.right else "✗ not yet: ") + self.why
    def _repr_markdown_(self) -> str:
        return str(self)

def close_to(answer: float, expected: float, rel: float = 0.02) -> bool:
    return abs(answer - expected) <= rel * abs(expected)
