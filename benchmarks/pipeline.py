"""Measured bubble of GPipe, 1F1B and the zero-bubble schedules (ZB-H1, ZB-H2, DualPipeV) on live
ranks, in wait mode, against each schedule's formula.

    python -m benchmarks.pipeline

Each forward waits T_F seconds and each backward 2·T_F without using the CPU, so the timing
of the schedule itself is measured, not how the machine's cores are shared among ranks. A
split backward waits T_F for B (the input's gradient) and T_F for W (the weights'): the
durations Qi et al. assume (T_F = T_B = T_W); DualPipeV's two chunks per rank each take half.
The zero-bubble rows, and the 1F1B rows they are compared with, wait ZB_T_F per forward: their
bubbles are a few per cent, so the per-action overhead (a message, a wake-up) must be small
against each wait.
Each configuration runs REPEAT times; the bubble quoted is the median.

bubble_theory is (p−1)/(m+p−1) for GPipe and 1F1B; for the zero-bubble schedules it is the
paper's closed form (`helpers.cost.bubble.CLOSED_FORMS`) evaluated with the F, B and W
durations measured in the same run. bubble_measured is the idle fraction of the step, except for
ZB-H2, whose paper's zero is the bubble of steps that follow each other without a synchronising
optimizer step: there it is each rank's idle inside its own window (`steady_bubble`), and
bubble_one_step gives the whole step's (rows with B and W apart carry both).

The last line is one JSON object: {"results": [{"schedule", "p", "m", "t_f_ms", "bubble_measured",
"bubble_theory", "peak_live_microbatches", ...}, ...]} with peak_live_microbatches the maximum
over ranks (a (chunk, micro-batch) pair for DualPipeV, whose chunks are half a rank's layers).
"""
from __future__ import annotations

import json
import statistics
import sys

from helpers.configs import LECTURE
from helpers.cost.schedules import ZERO_BUBBLE_SCHEDULES
from helpers.labs.pp import run_pipeline
from helpers.ranks import LiveRanks, cpu_cores
from helpers.timing import Measurement

T_F = 0.05          # 50 ms per forward, 100 ms per backward: per-step overheads stay ~1%
ZB_T_F = 0.1        # the zero-bubble rows: three actions per micro-batch, bubbles of a few %
REPEAT = 3
PS, MS, COMPARED = (2, 4), (1, 2, 4, 8), ("gpipe", "1f1b")  # schedules compared
ZERO_BUBBLE_GRID = ((2, 4), (2, 8), (4, 8), (4, 16))       # (p, m) of the zero-bubble rows
TOLERANCE = 0.10    # relative, where the theory is above 0.05
FLAT = 0.03         # ZB-H2's and DualPipeV's target: their closed forms are about 0


def measure(ranks, schedule: str, p: int, m: int, t_f: float = T_F) -> dict:
    """REPEAT wait-mode runs of one configuration: one row, printed as it is measured."""
    v = 2 if schedule == "dualpipev" else 1
    config = LECTURE.with_(layers=p * v)  # one notional layer per stage: the schedule is timed
    runs = [run_pipeline(ranks, schedule, p, m, mode="wait", t_f=t_f, config=config)
            for _ in range(REPEAT)]
    measured = statistics.median(r.bubble_measured for r in runs)
    theory = statistics.median(r.bubble_theory for r in runs)
    span = Measurement(f"{schedule} p={p} m={m} t_F={t_f * 1e3:g} ms makespan",
                       tuple(r.makespan for r in runs))
    error = (measured - theory) / theory if theory else float("nan")
    print(f"{span}; bubble measured {measured:.3f} vs theory {theory:.3f} ({error:+.1%}); "
          f"peak live micro-batches {runs[0].peak_live}")
    row = {"schedule": schedule, "p": p, "m": m, "t_f_ms": t_f * 1e3,
           "bubble_measured": round(measured, 4),
           "bubble_theory": round(theory, 4), "peak_live_microbatches": max(runs[0].peak_live)}
    if schedule in ZERO_BUBBLE_SCHEDULES:
        row["bubble_one_step"] = round(statistics.median(r.bubble_one_step for r in runs), 4)
    return row


def zero_bubble_targets(rows: list[dict]) -> list[str]:
    """The targets, one line each: ZB-H1 within TOLERANCE of its closed form and at most a
    third of 1F1B's bubble + 0.01 at the same (p, m); ZB-H2 and DualPipeV at most FLAT."""
    by = {(r["schedule"], r["p"], r["m"]): r for r in rows if r["t_f_ms"] == ZB_T_F * 1e3}
    lines = []
    for p, m in ZERO_BUBBLE_GRID:
        h1, one = by[("zb-h1", p, m)], by[("1f1b", p, m)]
        gap = (h1["bubble_measured"] - h1["bubble_theory"]) / h1["bubble_theory"]
        lines.append(f"zb-h1 p={p} m={m}: {gap:+.1%} from its closed form "
                     f"({'within' if abs(gap) <= TOLERANCE else 'outside'} {TOLERANCE:.0%}); "
                     f"{h1['bubble_measured']:.3f} against 1F1B's {one['bubble_measured']:.3f}/3"
                     f" + 0.01 = {one['bubble_measured'] / 3 + 0.01:.3f} "
                     f"({'met' if h1['bubble_measured'] <= one['bubble_measured'] / 3 + 0.01 else 'missed'})")
        for schedule in ("zb-h2", "dualpipev"):
            b = by[(schedule, p, m)]["bubble_measured"]
            lines.append(f"{schedule} p={p} m={m}: {b:.3f} "
                         f"({'met' if b <= FLAT else 'missed'}: at most {FLAT})")
    return lines


def main() -> int:
    print(f"wait mode: t_F = {T_F * 1e3:g} ms, t_B = {2 * T_F * 1e3:g} ms ({ZB_T_F * 1e3:g} and "
          f"{2 * ZB_T_F * 1e3:g} ms in the zero-bubble rows, where B and W take half of t_B "
          f"each), {REPEAT} runs each, {cpu_cores()} CPU cores, gloo")
    results, misses = [], []
    with LiveRanks(max(PS), backend="gloo") as ranks:
        for schedule in COMPARED:
            for p in PS:
                for m in MS:
                    row = measure(ranks, schedule, p, m)
                    theory, measured = row["bubble_theory"], row["bubble_measured"]
                    if theory > 0.05 and abs(measured - theory) / theory > TOLERANCE:
                        misses.append(f"{schedule} p={p} m={m}")
                    results.append(row)
        print(f"within {TOLERANCE:.0%} of theory: {len(results) - len(misses)}/{len(results)}"
              + (f"; outside: {', '.join(misses)}" if misses else ""))
        for p, m in ZERO_BUBBLE_GRID:
            for schedule in ("1f1b", *ZERO_BUBBLE_SCHEDULES):  # 1F1B: what ZB-H1 is held to
                results.append(measure(ranks, schedule, p, m, ZB_T_F))
    for line in zero_bubble_targets(results):
        print(line)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
