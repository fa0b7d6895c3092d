"""A cluster on this machine: 2 emulated nodes × 2 ranks, its two levels and its layouts.

    python -m benchmarks.cluster [--rounds 3] [--steps 3] [--link-mbit M]

On `LiveRanks(4, nodes=2)` (helpers.launch.cluster; the link defaults to this machine's
loopback all-reduce bandwidth / 12):
* the link: its speed, its ratio to loopback as set, and as the two levels' all-reduce fits
  measure it;
* the bytes one flat all-reduce put on the link, counted by the kernel's shapers, against
  the ring's formula (helpers.cost.alpha_beta.flat_uplink_bytes);
* each level's α–β fit (inside a node over loopback, across nodes over the link) with its
  median relative error (helpers.labs.bench.level_fit_records);
* the hierarchical all-reduce's time over the flat ring's, measured;
* notebook 07's 4-rank layouts in each placement that differs, measured and predicted by
  the two-level cost model (helpers.labs.layouts.cluster_layouts; no coefficient fitted to
  step times), in wait mode (every piece of compute waits its time alone on one core, as
  with a processor per rank: helpers.parallel.wait_mode), the targets' regime; then the same
  with the real model computing on the shared cores ("compute_mode", the plain CPU result).
Prints the pieces, then one JSON line. Needs root and iproute2 (see docs/emulated_nodes.md);
elsewhere it says what is missing and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from helpers.checks import check_int
from helpers.cost.alpha_beta import flat_uplink_bytes
from helpers.labs.bench import (FLAT_VS_HIERARCHICAL_BYTES, hierarchical_vs_flat_all_reduce,
                                level_fit_records, placement_of, wire_bytes_per_all_reduce)
from helpers.labs.layouts import cluster_layouts
from helpers.launch import cluster
from helpers.launch.live import loopback_bandwidth
from helpers.ranks import LiveRanks

LAYOUT_FIELDS = ("d", "t", "p", "m", "placement", "step_s", "predicted_s", "rel_error")
SUMMARY_FIELDS = ("median_rel_error", "best_measured", "best_predicted", "best_predicted_slower",
                  "orders", "tp_across_over_inside")


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the layouts (median)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and round")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="the link in Mbit/s (default: loopback / 12, measured)")
    args = parser.parse_args(argv)
    check_int("rounds", args.rounds)
    check_int("steps", args.steps)
    link_bps = None if args.link_mbit is None else cluster.check_link_bps(args.link_mbit * 1e6)
    reason = cluster.missing()
    if reason:
        print(f"benchmarks.cluster: {reason}", file=sys.stderr)
        raise SystemExit(2)
    load_before = os.getloadavg()
    with LiveRanks(4, nodes=2, link_bps=link_bps) as ranks:
        levels = level_fit_records(ranks)
        nbytes = FLAT_VS_HIERARCHICAL_BYTES
        wire = wire_bytes_per_all_reduce(ranks, nbytes, hierarchical=False)
        formula = sum(flat_uplink_bytes(nbytes, placement_of(ranks)))
        ratio = hierarchical_vs_flat_all_reduce(ranks)
        layouts = cluster_layouts(ranks, rounds=args.rounds, steps=args.steps, mode="wait")
        plain = cluster_layouts(ranks, rounds=args.rounds, steps=args.steps, mode="compute")
        link = ranks.link_bps
    by_level = {r["level"]: r for r in levels}
    measured_ratio = by_level["loopback"]["beta_s_per_byte"] and (
        by_level["link"]["beta_s_per_byte"] / by_level["loopback"]["beta_s_per_byte"])
    print(f"link {cluster.format_link(link)}; loopback all-reduce {loopback_bandwidth() / 1e9:.2f} "
          f"GB/s; the levels' β differ {measured_ratio:.1f}×")
    for r in levels:
        print(f"  {r['level']:>8}: α {1e6 * r['alpha_s']:.0f} µs, 1/β "
              f"{1e-9 / r['beta_s_per_byte']:.3f} GB/s, median error {r['median_rel_error']:.0%}")
    print(f"one flat all-reduce of {nbytes / 2**20:g} MiB per rank on 2×2: {wire:,.0f} bytes on "
          f"the link, the ring's formula {formula:,.0f} ({wire / formula - 1:+.1%})")
    print(f"hierarchical / flat all-reduce time: {ratio:.2f}")
    for mode, record in (("wait mode", layouts), ("compute mode", plain)):
        print(f"{mode}: median |error| {record['median_rel_error']:.0%}, TP across / inside "
              f"{record['tp_across_over_inside']:.2f}, orders {record['orders']}")
        for row in record["layouts"]:
            print(f"  {row['d']}·{row['t']}·{row['p']} {row['placement']:<24} measured "
                  f"{1e3 * row['step_s']:7.1f} ms, predicted {1e3 * row['predicted_s']:7.1f} ms "
                  f"({row['rel_error']:+.0%})")
    print(f"load average (1, 5, 15 min): before {load_before}, after {os.getloadavg()}")
    record = {
        "link_bps": link,
        "link_ratio_to_loopback": round(8 * loopback_bandwidth() / link, 3),
        "levels_beta_ratio": round(measured_ratio, 3),
        "wire_bytes_cross_node": round(wire),
        "formula_bytes_cross_node": round(formula),
        "levels": levels,
        "hierarchical_vs_flat_all_reduce": round(ratio, 4),
        "layouts": [{k: row[k] for k in LAYOUT_FIELDS} for row in layouts["layouts"]],
        **{k: layouts[k] for k in SUMMARY_FIELDS},
        "mode": "wait",
        "compute_mode": {k: plain[k] for k in SUMMARY_FIELDS},
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
