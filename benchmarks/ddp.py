"""Time one data-parallel training step for every wrapper and for torch's DDP, on gloo.

    python -m benchmarks.ddp [--world-sizes 2 4] [--repeat 25] [--hidden 512] [--layers 16]

The model is the lecture's MLP made deeper and narrower (16 layers of 512: 4.2M parameters,
16 MiB of fp32 gradients in 16 tensors), so that each step moves as many bytes as the
lecture's 4 x 1024 model but in many tensors: per-collective latency (naive, overlap) and
bucketing then matter, and the loopback all-reduce costs as much as the compute.

Definitions (all measured in this run, on the same ranks):
* step_s: median over `repeat` steps of one step (forward, backward, gradient sync, SGD step),
  a barrier ending every step so that it lasts as long as the slowest rank. All variants' models
  live side by side and take one step each in turn (rotating order), so the load of a shared
  machine, which changes from second to second, hits all of them alike.
* comm_share = (step_s - compute_step_s) / step_s, where compute_step_s is the same step with
  no gradient synchronisation at all ("compute" row), run at the same world size: the share
  of the step that synchronisation costs and overlap did not hide (clamped at 0).
* bucketed_vs_torch: the best BucketedDDP step divided by torch DDP's step (default 25 MiB
  buckets) at the same world size; the worse of the world sizes is reported (target <= 1.10).
  bucketed_vs_best_torch: the same against torch DDP's best bucket size (the stricter test:
  the best of several noisy medians favours whoever gets more tries).
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics

from helpers.configs import MLPConfig
from helpers.labs import dp as dp_lab
from helpers.ranks import LiveRanks, cpu_cores, threads_per_rank
from helpers.timing import Measurement

BUCKET_SIZES_MB = (1.0, 4.0, 16.0)
TORCH_BUCKET_MB = 25.0  # torch DDP's default bucket_cap_mb


def configurations() -> list[tuple[str, float | None]]:
    rows = [("compute", None), ("naive", None), ("flat", None), ("overlap", None)]
    rows += [("bucketed", mb) for mb in BUCKET_SIZES_MB]
    # torch DDP at its default and at our bucket sizes: a like-for-like comparison too
    return rows + [("torch", mb) for mb in BUCKET_SIZES_MB + (TORCH_BUCKET_MB,)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    config = MLPConfig(batch=args.batch, hidden=args.hidden, layers=args.layers)
    grad_mib = args.hidden * args.hidden * args.layers * 4 / 2**20
    print(f"MLP {args.layers} x {args.hidden} (batch {args.batch}): {grad_mib:.0f} MiB of fp32 "
          f"gradients in {args.layers} tensors; gloo on loopback; {cpu_cores()} CPU cores")

    results, ratios, strict = [], {}, {}
    with LiveRanks(max(args.world_sizes), backend="gloo", timeout=300) as ranks:
        for world_size in args.world_sizes:
            ranks.resize(world_size)
            print(f"\nworld size {world_size} ({threads_per_rank(world_size)} thread(s) per rank)")
            configs = configurations()
            # One step of each variant in turn, all models alive at once: a shared machine's
            # load, which changes from second to second, then slows every variant alike.
            per_rank = ranks.run(dp_lab.time_interleaved, [(v, mb or 25.0) for v, mb in configs],
                                 config, repeat=args.repeat, warmup=2)
            times = dict(zip(configs, per_rank[0]))  # the barrier makes ranks agree
            compute = statistics.median(times[("compute", None)])
            for (variant, mb), ts in times.items():
                step = statistics.median(ts)
                share = max(0.0, (step - compute) / step)
                what = variant + (f" ({mb:g} MiB)" if mb else "")
                print(f"  {Measurement(f'{what:<18} step', tuple(ts))}  comm_share {share:.2f}")
                results.append({"variant": variant, "world_size": world_size,
                                "bucket_size_mb": mb, "step_s": round(step, 6),
                                "comm_share": round(share, 3)})
            here = [r for r in results if r["world_size"] == world_size]
            best = min(r["step_s"] for r in here if r["variant"] == "bucketed")
            torch_default = next(r["step_s"] for r in here if r["variant"] == "torch"
                                 and r["bucket_size_mb"] == TORCH_BUCKET_MB)
            torch_best = min(r["step_s"] for r in here if r["variant"] == "torch")
            ratios[world_size] = round(best / torch_default, 3)
            strict[world_size] = round(best / torch_best, 3)
            print(f"  best bucketed / torch DDP (25 MiB) = {ratios[world_size]:.3f}, "
                  f"/ best torch DDP = {strict[world_size]:.3f}")
    summary = {"results": results, "bucketed_vs_torch": max(ratios.values()),
               "bucketed_vs_best_torch": max(strict.values()),
               "bucketed_vs_torch_by_world_size": ratios}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
