"""Tensor-parallel training steps of the lecture's MLP: time, bytes counted, bytes predicted.

    python -m benchmarks.tp [--repeat 12] [--hidden 1024] [--batch 128] [--layers 4]

For each layout (lecture all-gather, Megatron, sequence parallel) and t = 1, 2, 4, on real
ranks (gloo on CPU, NCCL with one GPU per rank): the median step (forward + backward), the
bytes rank 0 handed to torch.distributed in one step under the ring convention next to
`helpers.parallel.tp.formula_bytes`, and the share of the step spent inside collectives (time inside
the collective calls on rank 0, waiting for peers included). One thread per rank by default:
on a machine with fewer cores than ranks the ranks share cores, and times say so. The last line
is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics

from helpers.configs import LECTURE
from helpers.cost import tp as tp_cost
from helpers.labs import tp as tp_lab
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
    mismatched = [r for r in results if r["comm_bytes"] != r["formula_bytes"]]
    if mismatched:
        print(f"MISMATCH between counted and formula bytes: {mismatched}")
    line = {"results": results}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
