"""A parallel layout of one training step and what it costs (the result of docs/cost_model.md §5–§6).

Degrees are named as in docs/cost_model.md: DP, TP = TP_model · TP_ff, PP (with interleaving `v`),
EP, `m` microbatches. `placement[k]` holds each type's degree on network level `k`.
"""
from __future__ import annotations

from dataclasses import dataclass

TYPES = ("dp", "tp_model", "tp_ff", "pp", "ep")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by cause."""

    matmul: float
    tp_bw: float
    tp_lat: float
    ppep_bw: float
    ppep_lat: float
    dp_bw: float
    dp_lat: float
    bubble: float  # fraction of the pipeline lost to the bubble
    step: float

    @property
    def comm(self) -> float:
        """All communication time, overlapped or not, latencies included."""
        return self.tp_bw + self.tp_lat + self.ppep_bw + self.ppep_lat + self.dp_bw + self.dp_lat


@dataclass(frozen=True)
class Plan:
    n_gpus: int
    dp: int
    tp_model: int
    tp_ff: int
    pp: int
    ep: int
    m: int
    v: int
    zero_bubble: bool
    placement: tuple[tuple[int, int, int, int, int], ...]
    time: StepTime

    def degrees_on_levels(self) -> dict[str, list[int]]:
        return {t: [lv[i] for lv in self.placement] for i, t in enumerate(TYPES)}
