"""Time the cost simulator's full H100 curves: `python -m benchmarks.simulator [--runs N]`.

Each run starts cold (every cache cleared), computes the whole curve until the first
infeasible grid point, and is timed with a wall clock; CPU time is shown too because on a
shared machine the wall clock also measures the neighbours. The last line is one JSON
object: {"dense_s", "sparse_s", "dense_points", "sparse_points"} (medians, seconds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from helpers.hardware import H100_SXM
from helpers.simulator import search
from helpers.simulator.curve import run_curve
from helpers.simulator.settings import Settings


def measure(settings: Settings, runs: int) -> tuple[list[float], list[float], int]:
    walls, cpus, points = [], [], 0
    for _ in range(runs):
        search.clear_caches()
        w0, c0 = time.perf_counter(), time.process_time()
        curve = run_curve(H100_SXM, settings)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        points = len(curve.points)
    return walls, cpus, points


def line(what: str, walls: list[float], cpus: list[float], points: int) -> str:
    spread = max(walls) - min(walls)
    return (f"{what}: median {statistics.median(walls):.3f} s wall "
            f"(spread {spread:.3f} s over {len(walls)} cold runs; "
            f"median CPU {statistics.median(cpus):.3f} s), {points} grid points")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    result = {}
    for key, settings in (("dense", Settings()), ("sparse", Settings(sparse=True))):
        walls, cpus, points = measure(settings, args.runs)
        print(line(f"H100 SXM {key} curve", walls, cpus, points))
        result[f"{key}_s"] = round(statistics.median(walls), 3)
        result[f"{key}_points"] = points
    print(json.dumps({k: result[k] for k in ("dense_s", "sparse_s", "dense_points",
                                              "sparse_points")}))


if __name__ == "__main__":
    main()
