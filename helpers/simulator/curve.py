"""The curve: every grid model, its cluster and best layout, until the latency wall.

`run_curve` is the one entry point the CLI, the notebook and the benchmark share. A point is
a grid model plus the plan the search found for it; an infeasible point (no cluster finishes
in time) ends the curve.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from helpers.hardware import GPU

from .config import validate
from .plan import Plan
from .scaling import Model, grid
from .settings import Settings


@dataclass(frozen=True)
class Point:
    model: Model
    plan: Plan | None  # None: infeasible (past the latency wall)
    peak_flops: float
    duration_s: float
    latency_per_matmul_s: float = 0.0  # the GPU's fixed cost per matmul, for the breakdown

    @property
    def matmul_latency_s(self) -> float:
        """The part of the step's matmul time that is the fixed latency of each matmul:
        six matmuls per layer and micro-batch, on the `L/PP` layers and `E/EP` experts of
        one stage, `m` micro-batches. The rest of the matmul time is arithmetic and memory."""
        if self.plan is None:
            return 0.0
        m, q = self.model, self.plan
        return 6 * (m.L // q.pp) * (m.s // q.ep) * q.m * self.latency_per_matmul_s

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def mfu(self) -> float:
        if self.plan is None:
            return 0.0
        m = self.model
        q = self.plan
        return 6 * m.active_params * m.B / (self.peak_flops * q.n_gpus) / q.time.step

    @property
    def run_time_s(self) -> float | None:
        return None if self.plan is None else self.model.D / self.model.B * self.plan.time.step


@dataclass(frozen=True)
class Curve:
    gpu: GPU
    settings: Settings
    points: tuple[Point, ...]

    @property
    def mfu_bar(self) -> float:
        """The threshold as an MFU: τ times the GPU's ceiling."""
        return self.settings.threshold * self.gpu.effective_utilization

    @property
    def feasible(self) -> tuple[Point, ...]:
        return tuple(p for p in self.points if p.feasible)

    def linear_scaling_ends(self) -> Point | None:
        """The first grid point whose MFU has fallen to τ of the ceiling (infeasible counts)."""
        return next((p for p in self.points if p.mfu <= self.mfu_bar), None)

    def max_feasible_at_threshold(self) -> Point | None:
        """The largest compute still at or above τ of the ceiling (the curve is not monotonic)."""
        ok = [p for p in self.feasible if p.mfu >= self.mfu_bar]
        return max(ok, key=lambda p: p.model.C) if ok else None

    def largest_feasible(self) -> Point | None:
        f = self.feasible
        return f[-1] if f else None


Sizer = Callable[[GPU, Model, Settings], Plan | None]


def run_curve(gpu: GPU, settings: Settings, sizer: Sizer | None = None,
              progress: Callable[[int, int], None] | None = None,
              max_compute: float | None = None) -> Curve:
    """Size a cluster for each grid model in order; stop after the first infeasible one.

    `sizer` defaults to the fast search; `max_compute` stops early (for quick previews).
    """
    validate(gpu, settings)
    if sizer is None:
        from .search import size_cluster as sizer
    models = grid(settings)
    if max_compute is not None:
        models = [m for m in models if m.C <= max_compute]
    points = []
    for i, model in enumerate(models):
        plan = sizer(gpu, model, settings)
        points.append(Point(model, plan, gpu.peak_flops, settings.duration_s,
                            gpu.latency_per_matmul_s))
        if progress is not None:
            progress(i + 1, len(models))
        if plan is None:
            break
    return Curve(gpu, settings, tuple(points))
