"""Every 4-rank layout d·t·p of notebook 07's decoder: measured step against the cost model.

    python -m benchmarks.parallel3d [--rounds 5] [--steps 3]

On 4 live gloo ranks (one thread each), `helpers.labs.layouts.measure` runs the six
layouts taking turns (round r: calibrate, then `steps` timed steps of each layout, built once
and kept on the ranks; the median step of a round, then the median round), and
`helpers.cost.parallel3d.predict` predicts each from that calibration.
Prints the table and the machine's load average, then one JSON line: world_size, results
(d, t, p, m, step_s, predicted_s, rel_error), median and max |relative error|, and the
fastest layout measured and predicted.
"""
from __future__ import annotations

import argparse
import json
import os

from helpers.checks import check_int
from helpers.configs import TRANSFORMER
from helpers.cost.parallel3d import LAYOUTS_4, summary, table
from helpers.labs.layouts import measure
from helpers.ranks import LiveRanks


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (median over them)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and round")
    args = parser.parse_args(argv)
    check_int("rounds", args.rounds)
    check_int("steps", args.steps)
    load_before = os.getloadavg()
    with LiveRanks(4, backend="gloo") as ranks:
        measure(ranks, LAYOUTS_4, TRANSFORMER, rounds=1, steps=1)  # warm-up: connections, kernels
        measured = measure(ranks, LAYOUTS_4, TRANSFORMER, rounds=args.rounds, steps=args.steps)
    comparisons = measured.comparisons(TRANSFORMER)
    print(table(comparisons))
    cal = measured.calibration
    print(f"calibration: {cal.cores:.2f} cores shared by 4 ranks; TP all_reduce in the step α = "
          + ", ".join(f"{1e3 * f.alpha_s:.2f} ms (p={g})" for g, f in cal.tp_all_reduce.items())
          + "; quiet all_reduce α = "
          + ", ".join(f"{1e3 * f.alpha_s:.2f} ms (p={g})" for g, f in cal.all_reduce.items())
          + f"; p2p α = {1e3 * cal.send_recv.alpha_s:.2f} ms; slowest replica late by "
          + ", ".join(f"{x:.0%} (d={d})" for d, x in cal.lateness.items()))
    print(f"load average (1, 5, 15 min): before {load_before}, after {os.getloadavg()}")
    record = summary(comparisons).as_json()
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
