"""The same rank functions, launched by torchrun instead of a notebook (one process per rank).

    torchrun --nproc-per-node=2 -m helpers.run allreduce
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 \\
             --nproc-per-node=8 -m helpers.run collectives all_reduce 16
    scripts/torchrun_local.sh --nproc-per-node=4 -m helpers.run train3d \\
        --data 2 --tensor 2 --pipeline 1 --micro-batches 1

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the process group comes up
from those (env://). A demo's results are gathered on rank 0 and printed once, in rank order.
train3d is notebook 07's `train_3d`: every rank trains, and rank 0 prints the loss (the last
stage's, one line per step) and the slowest rank's step time.

(train3d's options have long names only: torchrun reads every option on its command line,
its script's too, and takes `--t` for its own `--tee`; `--d`, `--p` and `--m` are ambiguous
prefixes of its options.)
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from helpers.launch.host import pin_transports

# Each demo: the rank function's name in helpers.labs.collectives, and what it shows.
DEMOS = {
    "allreduce": ("lecture_example", "the lecture's [0,1,2,3] + rank example"),
    "collectives": ("run_collective", "one collective: OP [LENGTH]"),
    "probe": ("probe_backend", "what this backend supports"),
}
_TRAIN3D_OPTIONS = (("--data", "d", "d, the data degree"),
                    ("--tensor", "t", "t, the tensor degree"),
                    ("--pipeline", "p", "p, the pipeline stages"),
                    ("--micro-batches", "m", "m, micro-batches per step"),
                    ("--steps", "steps", "training steps"))


def single_machine() -> bool:
    """True when every rank of the job runs on this machine (torchrun's own variables)."""
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def pin_transports_to_loopback_if_single_machine() -> None:
    """One machine: keep gloo's and NCCL's sockets on loopback, even over an inherited
    GLOO_SOCKET_IFNAME=eth0. (torchrun --standalone sets MASTER_ADDR to the host's name, not
    to 127.0.0.1, so the address cannot tell.) Several machines: the environment decides."""
    if single_machine():
        pin_transports(os.environ)


def _parse_arg(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes; NCCL when each local rank has a GPU."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(f"{name} is not set: start this module with torchrun, e.g. "
                             "torchrun --nproc-per-node=2 -m helpers.run allreduce")
    pin_transports_to_loopback_if_single_machine()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_nccl = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    if use_nccl:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method="env://")
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _torchrun_group():
    """(rank, world_size) of the process group torchrun describes, left however the block
    ends: every command's skeleton."""
    rank, world_size = init_from_env()
    try:
        yield rank, world_size
    finally:
        dist.destroy_process_group()


def _gather_on_rank_0(value, rank: int, world_size: int) -> list | None:
    """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def _demo_function(demo: str):
    # Imported when a demo runs, not with this module (benchmarks import it for its helpers).
    from helpers.labs import collectives
    return getattr(collectives, DEMOS[demo][0])


def _run_demo(demo: str, args: list[str]) -> None:
    fn = _demo_function(demo)
    with _torchrun_group() as (rank, world_size):
        result = fn(rank, world_size, *map(_parse_arg, args))
        gathered = _gather_on_rank_0(result, rank, world_size)
        if rank == 0:
            print(f"{demo} on {world_size} ranks ({dist.get_backend()}):")
            for r, value in enumerate(gathered):
                print(f"  rank {r}: {value}")
        dist.barrier()


def _train3d(d: int, t: int, p: int, m: int, steps: int) -> None:
    from helpers.configs import TRANSFORMER
    from helpers.labs.parallel3d import check_3d, train_3d
    check_3d(d, t, p, m, TRANSFORMER)  # a bad layout is refused before any rendezvous
    with _torchrun_group() as (rank, world_size):
        result = train_3d(rank, world_size, d, t, p, m, TRANSFORMER, steps=steps, timeline=True)
        summary = (result.losses, max(span.end for span in result.timeline))
        gathered = _gather_on_rank_0(summary, rank, world_size)
        if rank == 0:
            losses = next(loss for loss, _ in gathered if loss is not None)
            print(f"train_3d d={d} t={t} p={p} m={m} on {world_size} ranks "
                  f"({dist.get_backend()}):")
            for step, loss in enumerate(losses):
                print(f"  step {step}: loss {loss!r}")
            print(f"  last step: {max(s for _, s in gathered):.3f} s (slowest rank)")
        # gather_object was the last collective: every rank is past it, no barrier needed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m helpers.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     title="commands (COMMAND --help lists its arguments)")
    for name, (_, help_) in sorted(DEMOS.items()):
        demo = commands.add_parser(name, help=help_, description=help_)
        demo.add_argument("args", nargs="*",
                          help="arguments passed to the demo after rank, world_size")
    train = commands.add_parser("train3d", help="notebook 07's 3-D training step",
                                description="train_3d on d·t·p ranks (torchrun's world size); "
                                            "rank 0 prints the loss and the slowest step time")
    for flag, dest, help_ in _TRAIN3D_OPTIONS:
        train.add_argument(flag, dest=dest, type=int, default=1, help=help_ + " (default 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "train3d":
        _train3d(options.d, options.t, options.p, options.m, options.steps)
    else:
        _run_demo(options.command, options.args)
    return 0
