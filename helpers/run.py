"""The same rank functions, launched by torchrun instead of a notebook (one process per rank).

    torchrun --nproc-per-node=2 -m helpers.run allreduce
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 \
             --nproc-per-node=8 -m helpers.run collectives all_reduce 16

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the process group comes up
from those (env://). Results are gathered on rank 0 and printed once, in rank order.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from helpers.labs import collectives
from helpers.ranks import pin_transports

DEMOS = {
    "allreduce": (collectives.lecture_example, "the lecture's [0,1,2,3] + rank example"),
    "collectives": (collectives.run_collective, "one collective: OP [LENGTH]"),
    "probe": (collectives.probe_backend, "what this backend supports"),
}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo", choices=sorted(DEMOS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(DEMOS.items())))
    parser.add_argument("args", nargs="*", help="arguments passed to the demo after rank, world_size")
    options = parser.parse_args(argv)
    fn = DEMOS[options.demo][0]
    rank, world_size = init_from_env()
    try:
        result = fn(rank, world_size, *map(_parse_arg, options.args))
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            print(f"{options.demo} on {world_size} ranks ({dist.get_backend()}):")
            for r, value in enumerate(gathered):
                print(f"  rank {r}: {value}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
