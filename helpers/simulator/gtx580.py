"""The GTX 580 question of notebook 06, checked against the answer Epoch AI published.

Epoch AI introduced its Distributed Training Interactive Simulator (2024) with a 2012
counterfactual: on the GTX 580 3GB that trained AlexNet, the largest run doable in 3 months at
≥ 80 % of the maximum utilization is about 1e26 FLOP, on about 16 million (2^24) GPUs, about
$5 billion at ~$300 each, parallelised as data 1024 × pipeline 32 × tensor 512.

This module holds that answer (`BLOG`), the readings of "80 % of the maximum utilization"
(`READINGS`), and a small sensitivity study (`sensitivity`) over the GTX 580 inputs that the
record marks as guesses and over the one overlap setting that moves the answer. Everything is
computed with the simulator itself, and only on the grid points the question needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from helpers.hardware import GPU, GTX_580, NetworkLevel

from .curve import Curve, Point, run_curve
from .settings import Settings


@dataclass(frozen=True)
class BlogAnswer:
    """The figures Epoch AI's announcement gives for the GTX 580 question."""

    compute_flop: float = 1e26
    months: float = 3
    n_gpus: int = 2**24
    price_per_gpu: float = 300.0
    cost_usd: float = 5e9
    dp: int = 1024
    pp: int = 32
    tp: int = 512
    source: str = ("Epoch AI (2024), announcement of the Distributed Training Interactive "
                   "Simulator (epoch.ai)")


BLOG = BlogAnswer()


def nearest_grid_point(curve: Curve, compute_flop: float = BLOG.compute_flop) -> Point:
    """The grid point whose compute is closest to `compute_flop` on a log scale."""
    return min(curve.points, key=lambda p: abs(math.log(p.model.C / compute_flop)))


def blog_layout_matches(point: Point, blog: BlogAnswer = BLOG) -> bool:
    """True if the point is the blog's cluster: same GPUs, DP, PP and total TP."""
    q = point.plan
    return (q is not None and q.n_gpus == blog.n_gpus and q.dp == blog.dp and q.pp == blog.pp
            and q.tp_model * q.tp_ff == blog.tp)


# --- readings of "≥ 80 % of the maximum utilization" --------------------------------------

@dataclass(frozen=True)
class Reading:
    name: str
    bar: Callable[[Curve], float]  # the MFU a point must reach


def _curve_best(curve: Curve) -> float:
    return max((p.mfu for p in curve.feasible), default=0.0)


READINGS: tuple[Reading, ...] = (
    Reading("MFU ≥ τ × the GPU's ceiling (effective utilization)", lambda c: c.mfu_bar),
    Reading("MFU / ceiling ≥ τ", lambda c: c.settings.threshold * c.gpu.effective_utilization),
    Reading("MFU ≥ τ × the curve's best MFU", lambda c: c.settings.threshold * _curve_best(c)),
)


def answer(curve: Curve, bar: float) -> Point | None:
    """The largest-compute feasible point with MFU ≥ `bar` (the curve is not monotonic)."""
    ok = [p for p in curve.feasible if p.mfu >= bar]
    return max(ok, key=lambda p: p.model.C) if ok else None


# --- the inputs the blog's conclusion could hinge on --------------------------------------

@dataclass(frozen=True)
class Variant:
    label: str      # what changes, with the record's value → the variant's
    guess: bool     # True where the record marks the input as the authors' guess
    gpu: GPU
    settings: Settings


def _levels(gpu: GPU, bandwidths=None, latency=None, node=None) -> tuple[NetworkLevel, ...]:
    inner, outer = gpu.network_levels
    bw = bandwidths or (inner.bandwidth_Bps, outer.bandwidth_Bps)
    lat = inner.latency_s if latency is None else latency
    return (NetworkLevel(bw[0], lat, node or inner.size), NetworkLevel(bw[1], lat))


def variants(gpu: GPU = GTX_580, settings: Settings | None = None) -> list[Variant]:
    """The record as given, then one input changed at a time."""
    s = settings or Settings(price_per_gpu=BLOG.price_per_gpu)
    bw_in, bw_out = (lv.bandwidth_Bps for lv in gpu.network_levels)
    v = [Variant("the record as given", False, gpu, s)]
    for eff in (0.95, 1.0):
        v.append(Variant(f"effective utilization 0.85 → {eff:g}", True,
                         replace(gpu, effective_utilization=eff), s))
    for lat in (4.5e-6, 0.0):
        v.append(Variant(f"matmul latency 22.5 µs → {lat * 1e6:g} µs", True,
                         replace(gpu, latency_per_matmul_s=lat), s))
    v.append(Variant("network latencies 5 µs → 1.125 µs", True,
                     replace(gpu, network_levels=_levels(gpu, latency=1.125e-6)), s))
    v.append(Variant("node of 8 → 16 GPUs", False,
                     replace(gpu, network_levels=_levels(gpu, node=16)), s))
    v.append(Variant("in-node bandwidth 8 → 16 GB/s", False,
                     replace(gpu, network_levels=_levels(gpu, bandwidths=(2 * bw_in, bw_out))), s))
    for k in (2, 4):
        v.append(Variant(f"beyond-node bandwidth 1 → {k:g} GB/s", False,
                         replace(gpu, network_levels=_levels(gpu, bandwidths=(bw_in, k * bw_out))),
                         s))
    v.append(Variant("setting: DP all-reduce overlaps compute", False, gpu,
                     replace(s, overlap_dp=True)))
    return v


@dataclass(frozen=True)
class Row:
    """One line of the sensitivity table."""

    label: str
    guess: bool
    answer_flop: float | None     # largest compute at MFU ≥ τ × ceiling
    n_gpus: int | None
    layout: str                   # of the answer
    mfu_at_blog: float            # MFU of the grid point nearest 1e26 FLOP
    ceiling: float
    blog_holds: bool              # answer ≈ 1e26 on the blog's cluster and layout


def layout(point: Point | None) -> str:
    q = None if point is None else point.plan
    if q is None:
        return "—"
    return f"DP {q.dp} × PP {q.pp} × TP {q.tp_model * q.tp_ff} ({q.tp_model}×{q.tp_ff})"


def row(v: Variant, max_compute: float) -> tuple[Row, Curve]:
    curve = run_curve(v.gpu, v.settings, max_compute=max_compute)
    best = answer(curve, curve.mfu_bar)
    near = nearest_grid_point(curve)
    holds = (best is not None and best is near and blog_layout_matches(best))
    return Row(v.label, v.guess, None if best is None else float(best.model.C),
               None if best is None else best.plan.n_gpus, layout(best), near.mfu,
               v.gpu.effective_utilization, holds), curve


def sensitivity(max_compute: float = 3e26, items: list[Variant] | None = None) -> list[Row]:
    """The table: each variant's answer on the grid points up to `max_compute` FLOP.

    The points past 1e26 are computed only as far as needed to see whether a variant's answer
    moves beyond the blog's point (3e26 covers the next two grid points).
    """
    return [row(v, max_compute)[0] for v in (items or variants())]
