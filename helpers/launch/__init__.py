"""Launching ranks: live process groups from a notebook, and the same functions under torchrun.

Readers import from `helpers.ranks` and run `python -m helpers.run`; this package is how that
is built, one concern per module:

    host.py      this machine: cores, memory, GPUs, threads per rank, the backend, loopback pinning
    checks.py    what a call may ask for, checked before any process starts
    errors.py    RankError and RankTimeoutError: which rank failed, in which collective, why
    worker.py    the rank side: a process that joins a group and runs what it is sent; the launcher
    process.py   the notebook's handles on rank processes: start, watch, kill, reap; private folders
    cluster.py   emulated nodes: network namespaces joined by a shaped link (Linux, root)
    live.py      LiveRanks, its per-process pool and cap, exit-signal clean-up, spawn
    nodes.py     `python -m helpers.run --nodes N`: torchrun agents on emulated nodes
    torchrun.py  what `python -m helpers.run` runs under torchrun: the demos, notebook 07's train3d

Nothing is imported here, so a rank process imports only worker.py and what it needs.
"""
