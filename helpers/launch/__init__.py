"""Launching ranks: live process groups from a notebook, one concern per module.

Readers import from `helpers.ranks`; this package is how that is built:

    host.py      this machine: cores, memory, GPUs, threads per rank, the backend, loopback pinning
    checks.py    what a call may ask for, checked before any process starts
    errors.py    RankError and RankTimeoutError: which rank failed, in which collective, why
    worker.py    the rank side: a process that joins a group and runs what it is sent; the launcher
    process.py   the notebook's handles on rank processes: start, watch, kill, reap; private folders
    live.py      LiveRanks, its per-process pool and cap, exit-signal clean-up, spawn

Nothing is imported here, so a rank process imports only worker.py and what it needs.
"""
