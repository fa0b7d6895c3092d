"""Time notebook 10's planner: every layout of a real run enumerated, priced and sorted.

    python -m benchmarks.planner [--runs N]

Per job (Llama 3 405B on 16,384 H100s at 8K, Llama 3 70B on 16 H100s, DeepSeek-V3 on 2,048
H800s): `enumerate_layouts` over the whole space (t, p, c, e, b, ZeRO stage, recomputation,
schedule), cold (the matmul caches cleared) and warm (the caches of the run before kept, as
in the widget), `runs` times each, wall clock; the median is reported with the number of
candidates and of those that fit, the best layout and its MFU. The target: under a second cold
(`all_under_target`); the dense jobs take about a tenth of that, DeepSeek-V3's tens of thousands
of layouts (every expert degree that divides d and its 256 experts) most of it.

Last line: one JSON object {"jobs": [{"job", "candidates", "feasible", "cold_s", "warm_s",
"best", "best_mfu"}], "target_s", "all_under_target"}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from helpers.cost import planner
from helpers.cost.activations import activation_bytes
from helpers.cost.model_shapes import DEEPSEEK_V3, LLAMA3_405B, LLAMA3_70B
from helpers.hardware import H100_SXM, H800_SXM

TARGET_S = 1.0
JOBS = {"Llama 3 405B, 16,384 H100, 8K": planner.Job(LLAMA3_405B, H100_SXM, 16384, 8192, 2048),
        "Llama 3 70B, 16 H100, 8K": planner.Job(LLAMA3_70B, H100_SXM, 16, 8192, 64),
        "DeepSeek-V3, 2,048 H800, 4K": planner.Job(DEEPSEEK_V3, H800_SXM, 2048, 4096, 15360)}


def clear() -> None:
    """Every memo the planner keeps between calls (matmul times, notebook 06's comm formulas,
    activations, weights per GPU): a cold enumeration is a fresh kernel's first."""
    for memo in (planner._matrix, planner._forward, planner.tp_comm, planner.ppep_comm,
                 planner.dp_comm, planner._weights, activation_bytes):
        memo.cache_clear()


def timed(job: planner.Job, cold: bool) -> tuple[float, list]:
    if cold:
        clear()
    t0 = time.perf_counter()
    verdicts = planner.enumerate_layouts(job)
    planner.best(verdicts)
    return time.perf_counter() - t0, verdicts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs per job and mode (≥ 1)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    rows = []
    for name, job in JOBS.items():
        cold = [timed(job, True)[0] for _ in range(args.runs)]
        warm = [timed(job, False)[0] for _ in range(args.runs)]
        _, verdicts = timed(job, False)
        top = planner.best(verdicts)
        rows.append({"job": name, "candidates": len(verdicts),
                     "feasible": sum(v.step is not None for v in verdicts),
                     "cold_s": round(statistics.median(cold), 4),
                     "warm_s": round(statistics.median(warm), 4),
                     "best": top.layout.label() if top else None,
                     "best_mfu": round(top.step.mfu, 4) if top else None})
        print(f"{name:<32} {rows[-1]['candidates']:>6} layouts, {rows[-1]['feasible']:>5} fit; "
              f"cold {rows[-1]['cold_s']:.3f} s, warm {rows[-1]['warm_s']:.3f} s; best "
              f"{rows[-1]['best']} at {rows[-1]['best_mfu']:.1%} MFU")
    out = {"jobs": rows, "target_s": TARGET_S,
           "all_under_target": all(r["cold_s"] < TARGET_S for r in rows)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
