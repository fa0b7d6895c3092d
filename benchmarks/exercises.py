"""Time the coding exercises' checks: `python -m benchmarks.exercises [--runs N]`.

What a reader waits for after running an exercise cell: `check(fn)` on the course's solution
over its whole sweep of cases, cold (the first check of a kernel starts the ranks) and warm
(the ranks already run; each case is a re-rendezvous over the same processes), and each named
wrong answer on its first case (a deadlock among them waits out `CHECK_TIMEOUT_S`, then the
ranks restart). Medians over `--runs` runs; the cold time is the median of fresh starts, the
ranks closed before each.

The last line is one JSON object: {"runs", "check_timeout_s", "exercises": [{"id",
"notebook", "cases", "solution_cold_s", "solution_warm_s", "slowest_mistake_s"}...],
"slowest_cold_s", "slowest_warm_s"} (seconds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from helpers.checks import check_int
from helpers.exercises import EXERCISES, check
from helpers.exercises import coding


def _seconds(fn, name: str, first_case_only: bool = False) -> float:
    start = time.perf_counter()
    verdict = check(fn, name, first_case_only=first_case_only)
    seconds = time.perf_counter() - start
    if verdict.right == first_case_only:  # the solution must pass and a mistake must not
        raise RuntimeError(f"{name}: unexpected verdict {verdict}")
    return seconds


def _close_ranks() -> None:
    for ranks in coding._RANKS:
        ranks.close()
    coding._RANKS.clear()


def measure(name: str, runs: int) -> dict:
    ex = EXERCISES[name]
    cold, warm = [], []
    for _ in range(runs):
        _close_ranks()
        cold.append(_seconds(ex.solution, name))
        warm.append(_seconds(ex.solution, name))
    mistakes = [statistics.median(_seconds(m.fn, name, True) for _ in range(runs))
                for m in ex.mistakes]
    return {"id": name, "notebook": ex.notebook, "cases": len(ex.cases),
            "solution_cold_s": round(statistics.median(cold), 3),
            "solution_warm_s": round(statistics.median(warm), 3),
            "slowest_mistake_s": round(max(mistakes), 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exercises",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args(argv)
    runs = check_int("runs", args.runs, 1, 20)
    rows = []
    try:
        for name in sorted(EXERCISES, key=lambda n: (EXERCISES[n].notebook, n)):
            row = measure(name, runs)
            rows.append(row)
            print(f"{row['notebook']} {name:<24} solution cold {row['solution_cold_s']:5.2f} s, "
                  f"warm {row['solution_warm_s']:5.2f} s ({row['cases']} cases); slowest wrong "
                  f"answer {row['slowest_mistake_s']:5.2f} s")
    finally:
        _close_ranks()
    record = {"runs": runs, "check_timeout_s": coding.CHECK_TIMEOUT_S, "exercises": rows,
              "slowest_cold_s": max(r["solution_cold_s"] for r in rows),
              "slowest_warm_s": max(r["solution_warm_s"] for r in rows)}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
