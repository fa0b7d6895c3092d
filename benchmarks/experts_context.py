"""Expert parallelism and ring attention on live ranks: step time, bytes sent, drops, idle time.

    python -m benchmarks.experts_context [--steps 5] [--tokens 1024] [--hidden 128] [--seqs 256 512 1024]

MoE: one forward + backward of the expert-parallel layer (`helpers.parallel.experts`, run by
`helpers.labs.experts`) for e = 2, 4 and top-1, top-2 (E = 4 experts, capacity factor 1.25): the median step of the slowest
rank, the bytes rank 0 sent (dispatch and combine, forward and backward) next to the balanced
router's formula (`helpers.cost.experts.moe_step_bytes`), and the slots dropped over all ranks.

Ring: forward + backward of ring attention (`helpers.parallel.ring_attention`, run by
`helpers.labs.ring_attention`) for c = 1, 2, 4 and each sequence length: the zig-zag split's median step, rank 0's bytes next to
`helpers.cost.context.ring_bytes`, and the measured idle share (time ranks spend waiting for a
neighbour) of the naive and the zig-zag split, measured in the same run, turn about; and the
same in wait mode (blocks replaced by sleeps, so the ring's own schedule is timed whatever the
load) next to `helpers.cost.context.ring_schedule_idle`. Also one
ring step's parts at c = 2: a K/V hop alone, a block's attention alone, and both overlapped.
On a machine with fewer cores than ranks the ranks take turns on the cores, and times say so.
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics

from helpers.configs import MOE, RingConfig
from helpers.cost import context as cost_context
from helpers.cost import experts as cost_experts
from helpers.labs import experts as ep_lab
from helpers.labs import ring_attention as ra_lab
from helpers.ranks import LiveRanks, cpu_cores

ROUNDS = 3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting and round")
    parser.add_argument("--tokens", type=int, default=1024, help="MoE tokens in the whole batch")
    parser.add_argument("--hidden", type=int, default=128, help="MoE token width h")
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args(argv)
    moe = MOE.with_(tokens=args.tokens, hidden=args.hidden)
    for e in (2, 4):
        ep_lab.check_ep(e, moe)
    rings = [RingConfig(seq=s) for s in args.seqs]
    for config in rings:
        for c in (1, 2, 4):
            for layout in ("naive", "zigzag"):
                ra_lab.check_ring(c, config, layout)
    print(f"{cpu_cores()} core(s) on this machine; up to 4 ranks")

    out = {"moe": [], "ring": []}
    with LiveRanks(4) as ranks:
        for e in (2, 4):
            for top_k in (1, 2):
                config = ep_lab.check_ep(e, moe.with_(top_k=top_k))
                runs = [ranks.resize(e).run(ep_lab.timed_ep_steps, config, args.steps) for _ in range(ROUNDS)]
                row = {"e": e, "top_k": top_k,
                       "step_s": statistics.median(r[0].step_s for r in runs),
                       "comm_bytes": runs[0][0].sent_bytes,
                       "formula_bytes": round(cost_experts.formula_bytes(e, config)),
                       "dropped": sum(r.dropped for r in runs[0])}
                comm = statistics.median(r[0].comm_s for r in runs)
                print(f"MoE e={e} top-{top_k}: step {row['step_s'] * 1e3:.1f} ms, of it "
                      f"{comm * 1e3:.1f} ms in the all-to-alls (rank 0); rank 0 sent "
                      f"{row['comm_bytes']:,} B (balanced formula {row['formula_bytes']:,} B); "
                      f"{row['dropped']} slots dropped")
                out["moe"].append(row)
        for config in rings:
            for c in (1, 2, 4):
                ranks.resize(c)
                timings = {"naive": [], "zigzag": []}
                for _ in range(ROUNDS):
                    for layout in timings:
                        timings[layout].append(ra_lab.summarize(ranks.run(ra_lab.timed_ring_steps, config,
                                                                      layout, args.steps)))
                balanced = timings["zigzag"]
                row = {"c": c, "seq": config.seq,
                       "step_s": statistics.median(t.step_s for t in balanced),
                       "comm_bytes": balanced[0].sent_bytes,
                       "formula_bytes": cost_context.formula_bytes(c, config),
                       "idle_share_naive": statistics.median(t.idle_share for t in timings["naive"]),
                       "idle_share_balanced": statistics.median(t.idle_share for t in balanced)}
                naive_s = statistics.median(t.step_s for t in timings["naive"])
                print(f"ring c={c} s={config.seq}: zig-zag step {row['step_s'] * 1e3:.1f} ms "
                      f"(naive {naive_s * 1e3:.1f} ms); rank 0 sent {row['comm_bytes']:,} B "
                      f"(formula {row['formula_bytes']:,} B); idle share naive "
                      f"{row['idle_share_naive']:.2f}, zig-zag {row['idle_share_balanced']:.2f}")
                out["ring"].append(row)
        for c in (2, 4):   # the schedule alone: wait mode (sleeps for blocks) against its model
            for layout in ("naive", "zigzag"):
                steps = ranks.resize(c).run(ra_lab.timed_ring_steps, RingConfig(seq=64), layout, 2, 1, 0.02)
                print(f"wait mode c={c} {layout}: idle share {ra_lab.summarize(steps).idle_share:.2f}, "
                      f"schedule model {cost_context.ring_schedule_idle(c, layout):.2f}")
        parts = ranks.resize(2).run(ra_lab.ring_step_parts, rings[-1])[0]
        print(f"one ring step at c=2, s={rings[-1].seq}: K/V hop {parts.comm_s * 1e3:.2f} ms, "
              f"block attention {parts.compute_s * 1e3:.2f} ms, both overlapped "
              f"{parts.both_s * 1e3:.2f} ms: {parts.hidden_share:.0%} of the hop hidden")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
