"""`python -m helpers.run COMMAND …` under torchrun: the same rank functions as in the notebooks,
one process per rank. The code is helpers.launch.torchrun (its docstring is `--help`'s).

    torchrun --nproc-per-node=2 -m helpers.run allreduce
    scripts/torchrun_local.sh --nproc-per-node=4 -m helpers.run train3d \\
        --data 2 --tensor 2 --pipeline 1 --micro-batches 1
"""
from __future__ import annotations

import sys

from helpers.launch.torchrun import (DEMOS, init_from_env, main,
                                     pin_transports_to_loopback_if_single_machine, single_machine)

__all__ = ["DEMOS", "init_from_env", "main", "pin_transports_to_loopback_if_single_machine",
           "single_machine"]

if __name__ == "__main__":
    sys.exit(main())
