"""Sweep collectives over message sizes, fit the α–β model, and print how well it predicts.

    python -m benchmarks.collectives [--world-size N] [--ops all_reduce ...] [--sizes 4KiB 1MiB ...]
    torchrun --nproc-per-node=N -m benchmarks.collectives [same options]

Alone, it starts N live ranks on this machine (helpers.ranks.LiveRanks). Under torchrun
(RANK and WORLD_SIZE set) every process joins the group torchrun describes and runs the same
rank code, so the one command also measures across nodes; only rank 0 prints.
The last line of output is one JSON object: results, fit and median relative error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from helpers.checks import check_int
from helpers.cost import bench as cost
from helpers.cost.alpha_beta import COST_MODELS
from helpers.labs import bench as lab
from helpers.run import pin_transports_to_loopback_if_single_machine
from helpers.units import format_seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks (default 2; under torchrun, its WORLD_SIZE)")
    parser.add_argument("--ops", nargs="+", default=["all_reduce"], metavar="OP",
                        help=f"operations, from {', '.join(sorted(COST_MODELS))} (default all_reduce)")
    parser.add_argument("--sizes", nargs="+", default=None, metavar="SIZE",
                        help="message sizes in bytes, e.g. 4096 4KiB 1MiB "
                             "(default 1 KiB to 16 MiB by 4x; --full: 1 KiB to 256 MiB by 2x)")
    parser.add_argument("--full", action="store_true", help="the full size range, 1 KiB to 256 MiB")
    parser.add_argument("--iters", type=int, default=100,
                        help="timed iterations per size up to 1 MiB, fewer above (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size first (default 5)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="the sizes are visited in this many interleaved rounds (default 5)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--save", action="store_true",
                        help="also write the fit to results/collective_fit.json for later "
                             "notebooks (or where $PLAB_RESULTS_DIR says)")
    return parser.parse_args(argv)


def _sizes(args) -> tuple[int, ...]:
    if args.sizes:
        return tuple(cost.parse_size(s) for s in args.sizes)
    return cost.FULL_SIZES if args.full else cost.DEFAULT_SIZES


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _json_result(row: cost.PointResult) -> dict:
    """A row's fields but its world size, which the JSON object states once."""
    return {k: v for k, v in asdict(row).items() if k != "world_size"}


def report(records: list[cost.Timing], world_size: int, cores_per_rank, backend: str,
           save: bool) -> dict:
    """Print the human-readable lines, then return the JSON object."""
    fits = cost.fit_sweep(records)
    rows = cost.result_rows(records, fits)
    labels = cost.op_labels(records)
    for record in records:
        print(cost.measurement(record),
              f"; 10th percentile {format_seconds(cost.uncontended_time(record))} (the fit's)")
    print(cost.format_table(rows, labels))
    for line in cost.fit_lines(fits, labels):
        print("fit", line)
    if cost.reduce_scatter_is_emulated(records):
        print(f"note: reduce_scatter on {backend} costs an all-reduce here (see notebook 02)")
    median = cost.median_rel_error(rows)
    print(f"median |predicted - measured| / measured = {median:.1%}")
    if save:
        from helpers.cost.alpha_beta import save_fit
        print("fit saved to", save_fit(fits, backend, world_size, cores_per_rank))
    return {"world_size": world_size, "backend": backend, "cores_per_rank": cores_per_rank,
            "results": [_json_result(row) for row in rows],
            "fit": {op: f.as_dict() for op, f in fits.items()},
            "median_rel_error": median}


def run_local(args) -> dict:
    from helpers.ranks import LiveRanks, cpu_cores, resolve_backend
    world_size = 2 if args.world_size is None else args.world_size
    sizes = _sizes(args)
    lab.plan_sweep(args.ops, sizes, (world_size,))  # bad input stops here, before any process
    backend = resolve_backend(args.backend, world_size)
    print(lab.cores_line(backend, world_size))
    with LiveRanks(world_size, backend=backend) as ranks:
        records = lab.run_sweep(ranks, args.ops, sizes, (world_size,), iters=args.iters,
                                warmup=args.warmup, rounds=args.rounds,
                                progress=sys.stderr.isatty())
    cores = None if backend == "nccl" else round(cpu_cores() / world_size, 3)
    return report(records, world_size, cores, backend, args.save)


def run_torchrun(args) -> dict | None:
    import torch
    import torch.distributed as dist
    from helpers.ranks import cpu_cores

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if args.world_size is not None and args.world_size != world_size:
        raise ValueError(f"--world-size {args.world_size} disagrees with torchrun's "
                         f"WORLD_SIZE={world_size}; drop it or make them equal")
    sizes = _sizes(args)
    plan = lab.plan_sweep(args.ops, sizes, (world_size,))
    check_int("--iters", args.iters, 1)
    check_int("--warmup", args.warmup, 0)
    check_int("--rounds", args.rounds, 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend if args.backend != "auto" else ("nccl" if gpus >= local_ranks else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    pin_transports_to_loopback_if_single_machine()
    dist.init_process_group(backend, init_method="env://")
    try:
        if rank == 0:
            print(lab.cores_line(backend, local_ranks) + f" (x{world_size // local_ranks} nodes)"
                  if world_size != local_ranks else lab.cores_line(backend, world_size))
        records = []
        for op in dict.fromkeys(op for _, op, _ in plan):
            points = [n for _, o, n in plan if o == op]
            records += lab.time_collective(rank, world_size, op, points, args.iters,
                                           args.warmup, args.rounds)
        if rank != 0:
            return None
        cores = None if backend == "nccl" else round(cpu_cores() / local_ranks, 3)
        return report(records, world_size, cores, backend, args.save)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run_torchrun(args) if _under_torchrun() else run_local(args)
    if result is not None:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
