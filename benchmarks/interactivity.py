"""How long one all-reduce round trip takes from a notebook cell: fresh processes vs warm ranks.

    python -m benchmarks.interactivity [--world-size 4] [--spawn-runs 5] [--warm-runs 30]

The lecture starts new processes (mp.spawn) for every call; LiveRanks keeps them. Fresh
processes are timed two ways: forked from a launcher that imported torch once (the default on
Linux) and each one a `python -c` that imports torch itself (as on macOS). All are measured in
the same run; the last line is one JSON object.
"""
import argparse
import json

from helpers import ranks
from helpers.labs.collectives import all_reduce_once
from helpers.ranks import LiveRanks, cpu_cores, spawn, threads_per_rank
from helpers.timing import measure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--spawn-runs", type=int, default=5)
    parser.add_argument("--warm-runs", type=int, default=30)
    args = parser.parse_args(argv)
    n = args.world_size
    expected = float(sum(range(n)))

    def through_spawn():
        assert spawn(all_reduce_once, n) == [expected] * n

    cold = measure(through_spawn, f"spawn({n} ranks) + all-reduce, forked", repeat=args.spawn_runs,
                   warmup=0)
    fork, ranks.FORK_RANKS = ranks.FORK_RANKS, False
    try:
        own = measure(through_spawn, f"spawn({n} ranks) + all-reduce, each its own python -c",
                      repeat=args.spawn_runs, warmup=0)
    finally:
        ranks.FORK_RANKS = fork
    with LiveRanks(n) as live:
        live.run(all_reduce_once)  # the first start is paid once, outside the timing

        def through_live():
            assert live.run(all_reduce_once) == [expected] * n

        warm = measure(through_live, f"LiveRanks({n}).run all-reduce", repeat=args.warm_runs,
                       warmup=2)
        smaller = max(1, n // 2)

        def slider_move():  # what a world-size slider does: re-form the group, run
            live.resize(smaller).run(all_reduce_once)
            live.resize(n).run(all_reduce_once)

        moves = measure(slider_move, f"resize {n}->{smaller}->{n} with an all-reduce at each",
                        repeat=5, warmup=1)
    print(f"{cpu_cores()} cores, {threads_per_rank(n)} thread(s) per rank")
    print(cold)
    print(own)
    print(warm)
    print(moves)
    print(json.dumps({"world_size": n, "forked_ranks": fork, "spawn_s": round(cold.median, 4),
                      "spawn_python_c_s": round(own.median, 4),
                      "python_c_over_spawn": round(own.median / cold.median, 2),
                      "warm_s": round(warm.median, 5),
                      "speedup": round(cold.median / warm.median, 1)}))


if __name__ == "__main__":
    main()
