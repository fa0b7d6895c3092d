"""Time the cost simulator's full H100 curves: `python -m benchmarks.simulator [--runs N]`.

Each run starts cold (every cache cleared), computes the whole curve until the first
infeasible grid point, and is timed with a wall clock; CPU time is shown too because on a
shared machine the wall clock also measures the neighbours. Then the dense curve is
computed once more with the direct transcription (`reference.size_cluster`, about 20 s)
and compared plan for plan, layout and placement included.

A cold run is what the first curve of a fresh kernel costs. Notebook 06 then re-runs the
curves on the release of its months, latency and bandwidth sliders, with whatever the
search has cached by then (integer tables, and for a months move the network's bounds
too). `*_move_s` time that: the dense curve at each of the slider's next positions in turn
after one cold curve, nothing cleared: months up by 0.25, latency down and bandwidth up by a
quarter decade a move (at most 8 moves: the log sliders end two decades out).

The last line is one JSON object: {"dense_s", "sparse_s", "dense_points", "sparse_points",
"target_dense_s", "identical_to_reference", "reference_dense_s", "months_move_s",
"latency_move_s", "bandwidth_move_s"} (medians, seconds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from helpers.hardware import H100_SXM
from helpers.simulator import reference, search
from helpers.simulator.curve import run_curve
from helpers.simulator.settings import Settings
from helpers.views.simulator import scaled_gpu


TARGET_DENSE_S = 0.1  # issue 11: notebook 06 re-runs a dense curve on release of a slider


def measure(settings: Settings, runs: int):
    walls, cpus, curve = [], [], None
    for _ in range(runs):
        search.clear_caches()
        w0, c0 = time.perf_counter(), time.process_time()
        curve = run_curve(H100_SXM, settings)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return walls, cpus, curve


def slider_moves(moves: int) -> dict[str, tuple[list[float], list[int]]]:
    """Seconds and grid points per dense curve as notebook 06's sliders step away from their
    defaults (a lower latency moves the latency wall out: more points, larger clusters)."""
    out = {}
    for slider in ("months", "latency", "bandwidth"):
        search.clear_caches()
        run_curve(H100_SXM, Settings())  # the kernel's first curve, as after Run All
        walls, points = [], []
        for k in range(1, min(moves, 8) + 1):
            gpu, settings = H100_SXM, Settings()
            if slider == "months":
                settings = replace(settings, months=settings.months + 0.25 * k)
            else:
                sign = -1 if slider == "latency" else 1
                gpu = scaled_gpu(H100_SXM, **{slider: 10 ** (sign * 0.25 * k)})
            w0 = time.perf_counter()
            curve = run_curve(gpu, settings)
            walls.append(time.perf_counter() - w0)
            points.append(len(curve.points))
        out[slider] = walls, points
    return out


def line(what: str, walls: list[float], cpus: list[float], points: int) -> str:
    spread = max(walls) - min(walls)
    return (f"{what}: median {statistics.median(walls):.3f} s wall "
            f"(spread {spread:.3f} s over {len(walls)} cold runs; "
            f"median CPU {statistics.median(cpus):.3f} s), {points} grid points")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--skip-reference", action="store_true",
                   help="leave out the 20 s reference run (identical_to_reference: null)")
    args = p.parse_args()
    result = {}
    curves = {}
    for key, settings in (("dense", Settings()), ("sparse", Settings(sparse=True))):
        walls, cpus, curve = measure(settings, args.runs)
        curves[key] = curve
        print(line(f"H100 SXM {key} curve", walls, cpus, len(curve.points)))
        result[f"{key}_s"] = round(statistics.median(walls), 3)
        result[f"{key}_points"] = len(curve.points)
    result["target_dense_s"] = TARGET_DENSE_S
    for slider, (walls, points) in slider_moves(args.runs).items():
        print(f"H100 SXM dense curve after a {slider} slider move: median "
              f"{statistics.median(walls):.3f} s wall over {len(walls)} moves "
              f"({min(points)}-{max(points)} grid points)")
        result[f"{slider}_move_s"] = round(statistics.median(walls), 3)
    if args.skip_reference:
        result["reference_dense_s"] = result["identical_to_reference"] = None
    else:
        compare_with_reference(curves["dense"], result)
    print(json.dumps({k: result[k] for k in ("dense_s", "sparse_s", "dense_points",
                                              "sparse_points", "target_dense_s",
                                              "identical_to_reference",
                                              "reference_dense_s", "months_move_s",
                                              "latency_move_s", "bandwidth_move_s")}))


def compare_with_reference(dense, result: dict) -> None:
    """The dense curve once more with the direct transcription, compared plan for plan."""
    w0 = time.perf_counter()
    slow = run_curve(H100_SXM, Settings(), sizer=reference.size_cluster)
    result["reference_dense_s"] = round(time.perf_counter() - w0, 3)
    same = [a.plan == b.plan for a, b in zip(dense.points, slow.points)]
    result["identical_to_reference"] = len(slow.points) == len(same) and all(same)
    print(f"reference.py dense curve: {result['reference_dense_s']:.1f} s wall; plans "
          f"{'identical' if result['identical_to_reference'] else 'DIFFERENT'} at "
          f"{sum(same)} of {len(slow.points)} points")


if __name__ == "__main__":
    main()
