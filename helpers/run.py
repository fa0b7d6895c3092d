"""`python -m helpers.run COMMAND …` under torchrun: the same rank functions as in the notebooks,
one process per rank. The code is helpers.launch.torchrun (its docstring is `--help`'s).

    torchrun --nproc-per-node=2 -m helpers.run allreduce
    scripts/torchrun_local.sh --nproc-per-node=4 -m helpers.run train3d \\
        --data 2 --tensor 2 --pipeline 1 --micro-batches 1

Without torchrun, `--nodes n` starts it on n emulated nodes of this machine, one agent per
node (helpers.launch.nodes; Linux, root, iproute2):

    python -m helpers.run --nodes 2 --nproc-per-node 2 --link-mbit 500 train3d \\
        --data 2 --pipeline 2

A bad command line is one line on stderr and exit status 2, before anything starts.
"""
from __future__ import annotations

import sys

from helpers.launch.torchrun import (DEMOS, cli, init_from_env, main,
                                     pin_transports_to_loopback_if_single_machine, single_machine)

__all__ = ["DEMOS", "cli", "init_from_env", "main",
           "pin_transports_to_loopback_if_single_machine", "single_machine"]

if __name__ == "__main__":
    sys.exit(cli())
