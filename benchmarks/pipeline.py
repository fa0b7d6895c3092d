"""Measured bubble of GPipe and 1F1B on live ranks, in wait mode, against (p−1)/(m+p−1).

    python -m benchmarks.pipeline

Each forward waits T_F seconds and each backward 2·T_F without using the CPU, so the timing
of the schedule itself is measured, not how the machine's cores are shared among ranks.
Each configuration runs REPEAT times; the bubble quoted is the median. The last line is
one JSON object: {"results": [{"schedule", "p", "m", "bubble_measured", "bubble_theory",
"peak_live_microbatches"}, ...]} with peak_live_microbatches the maximum over ranks.
"""
from __future__ import annotations

import json
import statistics
import sys

from helpers.labs.pp import run_pipeline
from helpers.ranks import LiveRanks, cpu_cores
from helpers.timing import Measurement

T_F = 0.05          # 50 ms per forward, 100 ms per backward: per-step overheads stay ~1%
REPEAT = 3
PS, MS, COMPARED = (2, 4), (1, 2, 4, 8), ("gpipe", "1f1b")  # schedules compared
TOLERANCE = 0.10    # relative, where the theory is above 0.05


def main() -> int:
    print(f"wait mode: t_F = {T_F * 1e3:g} ms, t_B = {2 * T_F * 1e3:g} ms, {REPEAT} runs each, "
          f"{cpu_cores()} CPU cores, gloo")
    results, misses = [], []
    with LiveRanks(max(PS), backend="gloo") as ranks:
        for schedule in COMPARED:
            for p in PS:
                for m in MS:
                    runs = [run_pipeline(ranks, schedule, p, m, mode="wait", t_f=T_F)
                            for _ in range(REPEAT)]
                    measured = statistics.median(r.bubble_measured for r in runs)
                    theory = runs[0].bubble_theory
                    peak = max(runs[0].peak_live)
                    span = Measurement(f"{schedule} p={p} m={m} makespan",
                                       tuple(r.makespan for r in runs))
                    error = (measured - theory) / theory if theory else float("nan")
                    print(f"{span}; bubble measured {measured:.3f} vs theory {theory:.3f} "
                          f"({error:+.1%}); peak live micro-batches {runs[0].peak_live}")
                    if theory > 0.05 and abs(error) > TOLERANCE:
                        misses.append(f"{schedule} p={p} m={m}")
                    results.append({"schedule": schedule, "p": p, "m": m,
                                    "bubble_measured": round(measured, 4),
                                    "bubble_theory": round(theory, 4),
                                    "peak_live_microbatches": peak})
    print(f"within {TOLERANCE:.0%} of theory: {len(results) - len(misses)}/{len(results)}"
          + (f"; outside: {', '.join(misses)}" if misses else ""))
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
