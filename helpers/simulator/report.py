"""A curve as the JSON of the CLI and the notebook's download (schema in issue 7).

Infinite bandwidth (the "Infinite network" preset) is written as the string "Infinity" so
that the file stays strict JSON that any reader can parse.
"""
from __future__ import annotations

import json
import math

from .config import PRICES_USD, gpu_to_json
from .curve import Curve, Point
from .settings import SECONDS_PER_YEAR

SECONDS_PER_MONTH = SECONDS_PER_YEAR / 12


def _finite(x):
    if isinstance(x, float) and math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def breakdown(point: Point, settings) -> dict[str, float] | None:
    """Seconds of one step by cause; `bubble` is the pipeline time lost to idle stages.

    `compute` is all matmul time; it splits into `matmul_latency` (the fixed cost of each
    matmul, however small its shard) and `matmul_arithmetic` (the rest: FLOP or memory
    traffic, whichever bounds each matmul).
    """
    if point.plan is None:
        return None
    t = point.plan.time
    lat = point.matmul_latency_s
    return {
        "compute": t.matmul,
        "matmul_arithmetic": t.matmul - lat,
        "matmul_latency": lat,
        "tp_bandwidth": t.tp_bw,
        "pp_ep_bandwidth": t.ppep_bw,
        "dp_bandwidth": t.dp_bw,
        "tp_latency": t.tp_lat,
        "pp_ep_latency": t.ppep_lat,
        "dp_latency": t.dp_lat,
        "bubble": bubble_seconds(t, settings),
        "bubble_fraction": t.bubble,
        "step": t.step,
    }


def bubble_seconds(t, settings) -> float:
    """Idle pipeline time: what dividing by (1 − bubble) added to the pipeline's busy time."""
    if t.bubble == 0:
        return 0.0
    tp, pp = settings.overlap_tp, settings.overlap_pp
    hidden = (t.tp_bw if tp else 0.0) + (t.ppep_bw if pp else 0.0)
    exposed = (0.0 if tp else t.tp_bw) + (0.0 if pp else t.ppep_bw)
    return t.bubble / (1 - t.bubble) * (max(t.matmul, hidden) + exposed)


def price_of(curve: Curve) -> float | None:
    """USD per GPU: the configuration's own price, else the GPU's known one, else None."""
    p = curve.settings.price_per_gpu
    return p if p is not None else PRICES_USD.get(curve.gpu.name)


def point_json(point: Point, price: float | None, settings) -> dict:
    m = point.model
    out = {"compute_flop": float(m.C), "d_model": m.d, "d_ff": m.f, "layers": m.L,
           "sparsity": m.s, "batch_tokens": m.B, "feasible": point.feasible}
    q = point.plan
    if q is None:
        out.update({k: None for k in (
            "n_gpus", "mfu", "months", "dp", "tp_model", "tp_ff", "pp", "ep", "interleave",
            "microbatches", "zero_bubble", "placement", "cost_usd", "time_breakdown_s")})
        return out
    out.update({
        "n_gpus": q.n_gpus, "mfu": point.mfu, "months": point.run_time_s / SECONDS_PER_MONTH,
        "dp": q.dp, "tp_model": q.tp_model, "tp_ff": q.tp_ff, "pp": q.pp, "ep": q.ep,
        "interleave": q.v, "microbatches": q.m, "zero_bubble": q.zero_bubble,
        "placement": q.degrees_on_levels(),
        "cost_usd": None if price is None else q.n_gpus * price,
        "time_breakdown_s": breakdown(point, settings),
    })
    return out


def configuration_json(curve: Curve, name: str | None = None) -> dict:
    price = price_of(curve)
    summary = {
        "linear_scaling_ends_flop": curve.linear_scaling_ends(),
        "max_feasible_flop": curve.max_feasible_at_threshold(),
        "largest_feasible_flop": curve.largest_feasible(),
    }
    settings = curve.settings.to_json()
    settings["price_per_gpu"] = price
    return _finite({
        "name": name or curve.gpu.name,
        "hardware": gpu_to_json(curve.gpu),
        "settings": settings,
        **{k: None if p is None else float(p.model.C) for k, p in summary.items()},
        "points": [point_json(p, price, curve.settings) for p in curve.points],
    })


def to_json(curves: dict[str, Curve]) -> dict:
    """`{"configurations": [...]}` for named curves, in order."""
    return {"configurations": [configuration_json(c, name) for name, c in curves.items()]}


def dumps(curves: dict[str, Curve]) -> str:
    return json.dumps(to_json(curves), indent=1, allow_nan=False)
