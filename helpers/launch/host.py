"""This machine, as the ranks see it: how many it can hold, how many threads each gets, which
backend fits, and which network interface their transports bind to.

Everything here is read at call time (cores, memory, GPUs), never cached: a notebook may run
in a container whose limits change, and a test may change the environment. Nothing here
imports torch at module level (the GPU count and the thread setting import it when asked), so
`import helpers.ranks` stays cheap in a notebook that never starts a rank.
"""
from __future__ import annotations

import contextlib
import os
import socket

from helpers.checks import check_choice

BACKENDS = ("auto", "gloo", "nccl")
# A CPU rank costs a Python process with torch imported (~0.4 GB resident); beyond this the
# machine swaps or the kernel OOM-kills ranks, so refuse it up front.
_BYTES_PER_CPU_RANK = 512 * 1024**2
_MAX_CPU_WORLD_SIZE = 64
_RANKS_PER_CORE = 8
# Variables that choose the network interface of gloo, NCCL and TensorPipe.
TRANSPORT_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def memory_bytes() -> int | None:
    """Physical memory, or the container's limit when one is set (cgroup v2)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            total = min(total, int(limit))
    return total


def max_cpu_world_size() -> int:
    """How many CPU ranks this machine can run: each needs memory for a process with torch
    imported, and more than a few ranks per core only queue behind each other."""
    memory = memory_bytes()
    by_memory = _MAX_CPU_WORLD_SIZE if memory is None else memory // _BYTES_PER_CPU_RANK
    by_cores = max(8, _RANKS_PER_CORE * cpu_cores())
    return max(1, min(_MAX_CPU_WORLD_SIZE, by_memory, by_cores))


def threads_per_rank(world_size: int) -> int:
    """Cap intra-op threads so N ranks together use the cores once, not N times over."""
    return max(1, cpu_cores() // world_size)


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """This process's torch intra-op threads set to `threads` inside the block, and the
    previous number restored after it, however the block ends (None or 0: left as they are).

    Why a rank function wants it: a timing should see one rank as one device. A rank alone
    on the machine would otherwise get every core and look faster than a rank of many for
    that reason alone, so timings run with 1 thread; and a rank on live ranks keeps serving
    later calls, which must find the setting its process group was started with
    (`threads_per_rank`), not the last timing's.
    """
    import torch
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' means NCCL when there is one GPU per rank, gloo on the CPU otherwise."""
    check_choice("backend", backend, BACKENDS)
    gpus = cuda_device_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                         f"but this machine has {gpus} CUDA device(s); use backend='gloo' or 'auto'")
    return backend


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name.startswith("lo"):
            return name
    return "lo"


def pin_transports(env: dict, multi_node: bool = False) -> dict:
    """Bind gloo's, NCCL's and TensorPipe's sockets to loopback in `env`.

    An inherited GLOO_SOCKET_IFNAME=eth0 (a cluster's login profile sets such things) must
    not put a notebook's ranks on the network, so the pin overrides it. `multi_node=True`
    is the reader asking for the opposite: what the environment says wins, loopback is
    only the default.
    """
    loopback = loopback_interface()
    for name in TRANSPORT_VARIABLES:
        if multi_node:
            env.setdefault(name, loopback)
        else:
            env[name] = loopback
    return env
