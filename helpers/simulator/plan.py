"""A parallel layout of one training step and what it costs (the result of spec §5–§6).

Degrees are named as in the spec: DP, TP = TP_model · TP_ff, PP (with interleaving `v`),
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
        """All communication time, overlapped or not: the spec's tie-breaker."""
        return self.tp_bw + self.tp_lat + self.ppep_bw + self.ppep_lat + self.dp_bw + self.dp_lat

    @property
    def exposed(self) -> float:
        """The part of the step not spent in matmuls: the last tie-breaker.

        Mirror-image 2-D TP layouts (TP_model·4 ↔ TP_ff) give the same step and the same
        communication; their matmul sums differ only in the last bit. Preferring the one
        with less time outside the matmuls reproduces the spec's §8 choice of (8, 64) at
        2.05e28 while keeping (4, 8) at the first grid point.
        """
        return self.step - self.matmul


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
