"""Tensor-parallel training steps of the lecture's MLP: time, bytes counted, bytes predicted.

    python -m benchmarks.tp [--repeat 10] [--hidden 1024] [--batch 128] [--layers 4]

For each layout (lecture all-gather, Megatron, sequence parallel) and t = 1, 2, 4, on real
ranks (gloo on CPU, NCCL with one GPU per rank): the median step (forward + backward), the
bytes rank 0 handed to torch.distributed in one step under the ring convention next to
`helpers.tp.formula_bytes`, and the share of the step spent inside collectives. The last
line is one JSON object.
"""
from __future__ import annotations

import argparse
import json

from helpers import tp
from helpers.ranks import LiveRanks, cpu_cores, threads_per_rank


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    for t in args.degrees:
        for layout in tp.LAYOUTS:
            tp.check_config(t, args.hidden, args.batch, args.layers, layout)

    results = []
    with LiveRanks(max(args.degrees)) as ranks:
        for t in args.degrees:
            ranks.resize(t)
            print(f"t={t}: backend {ranks.backend}, {cpu_cores()} core(s), "
                  f"{threads_per_rank(t)} thread(s) per rank")
            for layout in tp.LAYOUTS:
                out = ranks.run(tp.timed_steps, layout, args.batch, args.hidden, args.layers,
                                repeat=args.repeat)[0]
                m, comm = out["measurement"], out["comm"]
                formula = tp.formula_bytes(layout, t, args.batch, args.hidden, args.layers)
                results.append({"layout": layout, "t": t, "step_s": m.median,
                                "comm_bytes": comm["ring_bytes"], "formula_bytes": formula,
                                "comm_share": round(out["comm_share"], 4)})
                base = next(r for r in results if r["layout"] == layout and r["t"] == args.degrees[0])
                print(f"  {m}  ({base['step_s'] / m.median:.2f}× t={args.degrees[0]}); "
                      f"{comm['calls']} collectives, {comm['ring_bytes']:,} B counted vs "
                      f"{formula:,} B formula; {out['comm_share']:.0%} of the step in collectives")
    mismatched = [r for r in results if r["comm_bytes"] != r["formula_bytes"]]
    if mismatched:
        print(f"MISMATCH between counted and formula bytes: {mismatched}")
    line = {"results": results}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
