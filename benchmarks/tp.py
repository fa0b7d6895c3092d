"""Tensor-parallel training steps of the lecture's MLP: time, bytes counted, bytes predicted.

    python -m benchmarks.tp [--repeat 12] [--hidden 1024] [--batch 128] [--layers 4]

For each layout (lecture all-gather, Megatron, sequence parallel) and t = 1, 2, 4, on real
ranks (gloo on CPU, NCCL with one GPU per rank): the median step (forward + backward), the
bytes rank 0 handed to torch.distributed in one step under the ring convention next to
`helpers.parallel.tp.formula_bytes`, and the share of the step spent inside collectives (time inside
the collective calls on rank 0, waiting for peers included). One thread per rank by default:
on a machine with fewer cores than ranks the ranks share cores, and times say so. The last line
is one JSON object.

Then notebook 06's model's 2-D layout (TP_model × TP_ff, feed-forward layers h → 4h → h) on
every grid of the largest t: the bytes rank 0 handed to torch.distributed in one step (ring
convention) next to the model's (`helpers.cost.tp.formula_bytes_2d`, from the simulator's
`tp_comm`), which must be equal. Where emulated nodes exist (root, iproute2: otherwise one line
says what is missing), each 2 × 2 placement with one kind of group across the link adds the
bytes the link's shapers counted against the model's bytes on its outer level.
"""
from __future__ import annotations

import argparse
import json
import statistics

from helpers.configs import LECTURE
from helpers.cost import tp as tp_cost
from helpers.labs import tp as tp_lab
from helpers.launch import cluster
from helpers.ranks import LiveRanks, cpu_cores, threads_per_rank
from helpers.timing import Measurement

ROUNDS = 3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=12, help="timed steps per layout and t")
    parser.add_argument("--hidden", type=int, default=LECTURE.hidden)
    parser.add_argument("--batch", type=int, default=LECTURE.batch)
    parser.add_argument("--layers", type=int, default=LECTURE.layers)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--threads-per-rank", type=int, default=1,
                        help="intra-op threads of each rank while timing (default 1: one rank is "
                             "one device with one core; 0 keeps helpers.ranks' cores/t)")
    args = parser.parse_args(argv)
    config = LECTURE.with_(batch=args.batch, hidden=args.hidden, layers=args.layers)
    for t in args.degrees:
        for layout in tp_cost.LAYOUTS:
            tp_cost.check_config(t, config, layout)

    results = []
    with LiveRanks(max(args.degrees)) as ranks:
        for t in args.degrees:
            ranks.resize(t)
            threads = args.threads_per_rank or threads_per_rank(t)
            print(f"t={t}: backend {ranks.backend}, {cpu_cores()} core(s) on this machine, "
                  f"{threads} thread(s) per rank" +
                  (" (more threads than cores: ranks take turns)" if threads * t > cpu_cores() else ""))
            # Layouts take turns, a few steps at a time, so a burst of load on a shared machine
            # lands on all of them rather than on one.
            times, shares, comms = {}, {}, {}
            for _ in range(ROUNDS):
                for layout in tp_cost.LAYOUTS:
                    out = ranks.run(tp_lab.timed_steps, layout, config,
                                    repeat=max(1, args.repeat // ROUNDS),
                                    threads=args.threads_per_rank or None)[0]
                    times.setdefault(layout, []).extend(out.measurement.times_s)
                    shares.setdefault(layout, []).extend(out.comm_shares)
                    comms[layout] = out.comm
            for layout in tp_cost.LAYOUTS:
                m = Measurement(f"{layout} t={t} step", tuple(times[layout]))
                comm, share = comms[layout], statistics.median(shares[layout])
                formula = tp_cost.formula_bytes(layout, t, config)
                results.append({"layout": layout, "t": t, "step_s": m.median,
                                "comm_bytes": comm.ring_bytes, "formula_bytes": formula,
                                "comm_share": round(share, 4)})
                base = next(r for r in results if r["layout"] == layout and r["t"] == args.degrees[0])
                print(f"  {m}  (speedup over t={args.degrees[0]}: {base['step_s'] / m.median:.2f}×); "
                      f"{comm.calls} collectives, {comm.ring_bytes:,} B counted vs "
                      f"{formula:,} B formula; {share:.0%} of the step in collectives")
            lecture, megatron = (next(r for r in results if r["t"] == t and r["layout"] == name)
                                 for name in ("lecture", "megatron"))
            print(f"  same run, t={t}: Megatron step / lecture step = "
                  f"{megatron['step_s'] / lecture['step_s']:.2f}")
        results += two_dimensional(ranks, max(args.degrees), config)
    results += on_the_wire(config)
    mismatched = [r for r in results if r["comm_bytes"] != r["formula_bytes"]]
    if mismatched:
        print(f"MISMATCH between counted and formula bytes: {mismatched}")
    line = {"results": results}
    print(json.dumps(line))
    return line


def two_dimensional(ranks, t: int, config) -> list[dict]:
    """One step on every TP_model × TP_ff grid of t ranks: bytes counted and the model's."""
    rows = []
    print(f"2-D tensor parallelism, t={t} (feed-forward layers h={config.hidden} → "
          f"{tp_cost.FF_FACTOR * config.hidden} → h, b={config.batch}, L={config.layers}):")
    for tp_model in (d for d in range(1, t + 1) if t % d == 0):
        grid = tp_cost.Grid2D(tp_model, t // tp_model)
        result = tp_lab.run_step_2d(ranks, grid, config)[0]
        formula = tp_cost.formula_bytes_2d(grid, config)
        rows.append({"layout": "2d", "t": t, "tp_model": grid.tp_model, "tp_ff": grid.tp_ff,
                     "comm_bytes": result.ring_bytes, "formula_bytes": formula})
        print(f"  TP_model {grid.tp_model} × TP_ff {grid.tp_ff}: {result.ring_bytes:,} B counted "
              f"vs {formula:,} B the model's ("
              + ", ".join(f"{c.group} {c.ring_bytes:,} B" for c in result.groups) + ")")
    return rows


def on_the_wire(config, link_bps: float = 1e9) -> list[dict]:
    """2 × 2 on two emulated nodes, TP_ff then TP_model across the link."""
    missing = cluster.missing()
    if missing:
        print(f"2-D tensor parallelism on emulated nodes: skipped ({missing})")
        return []
    rows, grid = [], tp_cost.Grid2D(2, 2)
    with LiveRanks(grid.world_size, nodes=2, link_bps=link_bps) as ranks:
        for placement in ((0, 0, 1, 1), (0, 1, 0, 1)):
            run = tp_lab.run_on_nodes_2d(ranks, grid, placement, config)
            across = "TP_ff" if run.tp_ff[1] > 1 else "TP_model"
            result = run.results[0]
            rows.append({"layout": "2d", "t": grid.world_size, "tp_model": 2, "tp_ff": 2,
                         "placement": list(placement), "across_nodes": across,
                         "comm_bytes": result.ring_bytes,
                         "formula_bytes": tp_cost.formula_bytes_2d(grid, config),
                         "wire_bytes": run.wire_bytes, "wire_formula_bytes": run.formula_bytes,
                         "wire_overhead": round(run.overhead, 4)})
            print(f"  2 × 2, nodes {placement} ({across} across the link): {run.wire_bytes:,} B "
                  f"crossed vs {run.formula_bytes:,} B the model's ({run.overhead:+.1%}: headers)")
    return rows


if __name__ == "__main__":
    main()
