"""The same rank functions, launched by torchrun instead of a notebook (one process per rank).

    torchrun --nproc-per-node=2 -m helpers.run allreduce
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=29500 \\
             --nproc-per-node=8 -m helpers.run collectives all_reduce 16
    scripts/torchrun_local.sh --nproc-per-node=4 -m helpers.run train3d \\
        --data 2 --tensor 2 --pipeline 1 --micro-batches 1
    python -m helpers.run --nodes 2 --nproc-per-node 2 --link-mbit 500 train3d \\
        --data 2 --pipeline 2

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the process group comes up
from those (env://). A demo's results are gathered on rank 0 and printed once, in rank order.
train3d is notebook 07's `train_3d`: every rank trains, and rank 0 prints the loss (the last
stage's, one line per step) and the slowest rank's step time. Every command also prints where
the ranks ran: which network namespace each is in, and the address its transports use.

With `--nodes n` (and no torchrun around it) the command starts torchrun itself, once per
emulated node of this machine: helpers.launch.nodes, which needs Linux, root and iproute2.

(train3d's options have long names only: torchrun reads every option on its command line,
its script's too, and takes `--t` for its own `--tee`; `--d`, `--p` and `--m` are ambiguous
prefixes of its options.)
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys

from helpers.checks import check_int, check_number
from helpers.launch import cluster as emulated
from helpers.launch.host import max_cpu_world_size, pin_transports

# torch is imported where a rank needs it, not here: `--nodes` runs this module in a launcher
# that only checks its arguments and starts torchrun, and should answer a bad one at once.

PROG = "python -m helpers.run"
# Each demo: the rank function's name in helpers.labs.collectives, and what it shows.
DEMOS = {
    "allreduce": ("lecture_example", "the lecture's [0,1,2,3] + rank example"),
    "collectives": ("run_collective", "one collective: OP [LENGTH]"),
    "probe": ("probe_backend", "what this backend supports"),
}
# What each demo takes from the command line: (fewest, most) arguments, and in words.
_DEMO_ARGS = {"allreduce": (0, 0, "none"), "collectives": (1, 2, "OP [LENGTH]"),
              "probe": (0, 0, "none")}
_TRAIN3D_OPTIONS = (("--data", "d", "d, the data degree"),
                    ("--tensor", "t", "t, the tensor degree"),
                    ("--pipeline", "p", "p, the pipeline stages"),
                    ("--micro-batches", "m", "m, micro-batches per step"),
                    ("--steps", "steps", "training steps"))
# Where torchrun says how many ranks there are (a launcher's check needs it before any start).
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The link speeds helpers.launch.cluster shapes, in the option's unit.
LINK_MBIT = (emulated.MIN_LINK_BPS / 1e6, emulated.MAX_LINK_BPS / 1e6)


class UsageError(ValueError):
    """A command line this module cannot run: one line on stderr, exit status 2."""


def single_machine() -> bool:
    """True when every rank of the job runs on this machine (torchrun's own variables).

    Emulated nodes (`--nodes`, helpers.launch.nodes) count as several machines, as they
    should: each node's agent has its own ranks (LOCAL_WORLD_SIZE) of the whole WORLD_SIZE,
    so the transports stay on the uplink the launcher names instead of loopback, which
    would not reach the other nodes."""
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
    for name in _TORCHRUN_VARIABLES:
        if name not in os.environ:
            raise SystemExit(f"{name} is not set: start this module with torchrun, e.g. "
                             "torchrun --nproc-per-node=2 -m helpers.run allreduce")
    import torch
    import torch.distributed as dist
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
    import torch.distributed as dist
    rank, world_size = init_from_env()
    try:
        yield rank, world_size
    finally:
        dist.destroy_process_group()


def _gather_on_rank_0(value, rank: int, world_size: int) -> list | None:
    """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def _where_ranks_ran(rank: int, world_size: int) -> str | None:
    """On rank 0, one line: which ranks share a network namespace (a node: one machine, or
    one emulated node) and the address their transports use; None on the other ranks."""
    gathered = _gather_on_rank_0(emulated.whereabouts(rank, world_size), rank, world_size)
    if gathered is None:
        return None
    nodes: dict[tuple[int, str], list[int]] = {}
    for where in gathered:
        nodes.setdefault((where.netns_inode, where.address), []).append(where.rank)
    return "  network: " + " · ".join(
        f"rank{'s' * (len(ranks) > 1)} {' '.join(map(str, ranks))} in namespace {inode} "
        f"at {address}" for (inode, address), ranks in nodes.items())


def _demo_function(demo: str):
    # Imported when a demo is checked or runs (it imports torch), not with this module.
    from helpers.labs import collectives
    return getattr(collectives, DEMOS[demo][0])


def check_demo(demo: str, args: list, world_size: int) -> None:
    """The demo's arguments, checked before its rank function runs (a launcher checks them
    before it starts anything)."""
    fewest, most, words = _DEMO_ARGS[demo]
    if not fewest <= len(args) <= most:
        raise ValueError(f"{demo}'s arguments must be {words}, got "
                         f"{' '.join(map(str, args)) or 'none'}")
    if demo == "collectives":
        from helpers.labs.collectives import check_op, run_collective  # torch: this demo only
        length = inspect.signature(run_collective).parameters["length"].default
        check_op(args[0], world_size, *(args[1:] or [length]))


def _run_demo(demo: str, args: list) -> None:
    import torch.distributed as dist
    fn = _demo_function(demo)
    with _torchrun_group() as (rank, world_size):
        check_demo(demo, args, world_size)
        where = _where_ranks_ran(rank, world_size)
        result = fn(rank, world_size, *args)
        gathered = _gather_on_rank_0(result, rank, world_size)
        if rank == 0:
            print(f"{demo} on {world_size} ranks ({dist.get_backend()}):")
            for r, value in enumerate(gathered):
                print(f"  rank {r}: {value}")
            if demo == "collectives":  # a long tensor prints cut short: say what was checked
                from helpers.labs.collectives import expected, mismatch
                problem = mismatch(gathered, expected(args[0], world_size, *args[1:]))
                print(f"  against expected(): {problem or 'equal on every rank'}")
            print(where)
        dist.barrier()


def check_train3d(d: int, t: int, p: int, m: int, steps: int):
    """The layout, checked before any rendezvous (torch-free: a launcher runs it too)."""
    from helpers.configs import TRANSFORMER
    from helpers.layout import Layout
    check_int("--steps", steps)
    return Layout(d, t, p, m).check(TRANSFORMER)


def _train3d(d: int, t: int, p: int, m: int, steps: int) -> None:
    import torch.distributed as dist
    from helpers.configs import TRANSFORMER
    from helpers.labs.parallel3d import check_3d, train_3d
    check_3d(d, t, p, m, TRANSFORMER)  # a bad layout is refused before any rendezvous
    with _torchrun_group() as (rank, world_size):
        where = _where_ranks_ran(rank, world_size)
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
            print(where)
        # gather_object was the last collective: every rank is past it, no barrier needed


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage first, then exit
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    nodes = parser.add_argument_group(
        "emulated nodes (without torchrun: start it on each node of this machine)")
    nodes.add_argument("--nodes", type=int, metavar="N",
                       help="N network namespaces joined by a shaped link, one torchrun agent "
                            f"each (2 … {emulated.MAX_NODES}; Linux, root, iproute2)")
    nodes.add_argument("--nproc-per-node", type=int, metavar="K",
                       help=f"ranks per node (1 … {emulated.MAX_RANKS_PER_NODE}; default 1)")
    nodes.add_argument("--link-mbit", type=float, metavar="MBIT",
                       help=f"the link's speed in Mbit/s ({LINK_MBIT[0]:g} … {LINK_MBIT[1]:g}; "
                            "default: this machine's loopback all-reduce bandwidth / "
                            f"{emulated.DEFAULT_LINK_RATIO}, measured)")
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


def _check_nodes_options(options) -> int:
    """The ranks per node; UsageError or ValueError naming the option."""
    if options.nodes is None:
        asked = "--nproc-per-node" if options.nproc_per_node is not None else "--link-mbit"
        raise UsageError(f"{asked} needs --nodes N (emulated nodes, 2 … {emulated.MAX_NODES})")
    if any(name in os.environ for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")):
        raise UsageError("--nodes starts torchrun itself: leave it out of a command torchrun runs")
    check_int("--nodes", options.nodes, 2, emulated.MAX_NODES)
    k = check_int("--nproc-per-node", 1 if options.nproc_per_node is None
                  else options.nproc_per_node, 1, emulated.MAX_RANKS_PER_NODE)
    # each rank is a process with torch imported: as many as LiveRanks allows on this machine
    check_int("--nodes · --nproc-per-node", options.nodes * k, 2, max_cpu_world_size())
    if options.link_mbit is not None:
        check_number("--link-mbit", options.link_mbit, *LINK_MBIT, unit="Mbit/s")
    return k


def _check_command(options, world_size: int) -> None:
    if options.command == "train3d":
        layout = check_train3d(options.d, options.t, options.p, options.m, options.steps)
        if layout.world != world_size:
            raise ValueError(f"--data · --tensor · --pipeline must be --nodes · "
                             f"--nproc-per-node = {world_size} ranks, got "
                             f"{layout.d}·{layout.t}·{layout.p} = {layout.world}")
    else:
        check_demo(options.command, [_parse_arg(a) for a in options.args], world_size)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    if any(value is not None for value in (options.nodes, options.nproc_per_node,
                                           options.link_mbit)):
        return _start_on_nodes(options, argv)
    if options.command == "train3d":
        _train3d(options.d, options.t, options.p, options.m, options.steps)
    else:
        _run_demo(options.command, [_parse_arg(a) for a in options.args])
    return 0


def _start_on_nodes(options, argv: list[str]) -> int:
    """Not under torchrun: check everything, then start torchrun on each emulated node."""
    try:
        nproc_per_node = _check_nodes_options(options)
        _check_command(options, options.nodes * nproc_per_node)
    except (TypeError, ValueError) as error:  # the checks' one line, before anything starts
        raise UsageError(str(error)) from None
    from helpers.launch.nodes import run_on_nodes
    link_bps = None if options.link_mbit is None else options.link_mbit * 1e6
    # COMMAND is the first word that is not an option's or its value: the rest is what each
    # rank runs under torchrun.
    return run_on_nodes(options.nodes, nproc_per_node, link_bps,
                        argv[argv.index(options.command):])


def cli(argv: list[str] | None = None) -> int:
    """`python -m helpers.run`: main, with a bad command line (with --nodes, any bad
    argument) said in one line, exit status 2, and a Ctrl-C outside a rank in one line, 130."""
    try:
        return main(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the launcher's own handlers (a check imports torch)
        if "RANK" in os.environ:
            raise  # a rank under torchrun: torchrun reports how it ended
        print(f"{PROG}: interrupted before anything started", file=sys.stderr)
        return 130
