"""`train_3d` under torchrun: the same rank function as on live ranks, one process per rank.

    scripts/torchrun_local.sh --nproc-per-node=4 -m helpers.parallel3d_run \
        --data 2 --tensor 2 --pipeline 1 --micro-batches 1

(Long option names: torchrun reads every option on its command line, its script's too, and
takes `--t` for its own `--tee`; `--d`, `--p` and `--m` are ambiguous prefixes of its options.)

The process group comes up from torchrun's environment (`helpers.run.init_from_env`); every
rank trains, and rank 0 prints the loss (the last stage's, one line per step) and the
slowest rank's step time.
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from helpers.models import TRANSFORMER
from helpers.parallel.parallel3d import check_3d, train_3d
from helpers.run import init_from_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.parallel3d_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, name, help_ in (("--data", "d", "d, the data degree"),
                              ("--tensor", "t", "t, the tensor degree"),
                              ("--pipeline", "p", "p, the pipeline stages"),
                              ("--micro-batches", "m", "m, micro-batches per step"),
                              ("--steps", "steps", "training steps")):
        parser.add_argument(flag, dest=name, type=int, default=1, help=help_ + " (default 1)")
    options = parser.parse_args(argv)
    check_3d(options.d, options.t, options.p, options.m, TRANSFORMER)
    rank, world_size = init_from_env()
    try:
        result = train_3d(rank, world_size, options.d, options.t, options.p, options.m,
                          TRANSFORMER, steps=options.steps, timeline=True)
        gathered = [None] * world_size if rank == 0 else None
        summary = (result.losses, max(span.end_s for span in result.timeline))
        dist.gather_object(summary, gathered, dst=0)
        if rank == 0:
            losses = next(loss for loss, _ in gathered if loss is not None)
            print(f"train_3d d={options.d} t={options.t} p={options.p} m={options.m} on "
                  f"{world_size} ranks ({dist.get_backend()}):")
            for step, loss in enumerate(losses):
                print(f"  step {step}: loss {loss!r}")
            print(f"  last step: {max(s for _, s in gathered):.3f} s (slowest rank)")
    finally:  # gather_object was the last collective: every rank is past it
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
