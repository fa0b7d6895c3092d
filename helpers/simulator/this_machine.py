"""This machine as one "GPU" of the simulator: a rank of the course's emulated cluster (nodes of
a few ranks joined by a shaped link, `helpers.launch.cluster`), in the fields of the cost model's
hardware record (`helpers.hardware.GPU`), from what was measured here.

What is measured: the matmul FLOP/s and the DRAM copy bandwidth (notebook 00's measurements,
shared by the ranks that share the cores), the memory (`helpers.launch.host.memory_bytes`: the
machine's, or its container's limit; shared likewise) and the two network levels' all-reduce
α–β fits that notebook 02 saves (inside a node: loopback; across: the shaped link). What is
not: the model's memory boundaries are a GPU's (registers, L2, HBM); a CPU core's caches stand
in for the first two, their sizes read from /sys where Linux gives them, and the cache rate is a
stated guess (`CACHE_OVER_DRAM` × the copy bandwidth).
"""
from __future__ import annotations

import math
from pathlib import Path

from helpers.checks import check_int, check_number
from helpers.hardware import GPU, NetworkLevel

CLOCK_HZ = 1e9           # a notional clock: only FLOP per clock × clock is measured
CACHE_OVER_DRAM = 4      # the cache's rate as a multiple of DRAM's: a guess, not measured
TYPICAL_CACHE = {1: 32 * 1024, 2: 1024 * 1024}  # bytes, where /sys says nothing


def cache_bytes(level: int) -> tuple[int, bool]:
    """(bytes of this CPU's level-`level` data cache, whether /sys gave it) for core 0."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if int((index / "level").read_text()) == level and kind in ("Data", "Unified"):
                size = (index / "size").read_text().strip()  # "48K", "2048K", "32M"
                return int(size[:-1]) * {"K": 1024, "M": 1024**2}[size[-1]], True
        except (OSError, ValueError, KeyError):
            break
    return TYPICAL_CACHE[level], False


def level_of(fit: dict, ranks_sharing: int = 1, size: int | None = None) -> NetworkLevel:
    """A network level from an all-reduce fit {"alpha_s", "beta_s_per_byte"}: 1/β is the bus
    bandwidth one rank sends at (and receives at, at the same time), which the hardware record
    counts in both directions (×2); `ranks_sharing` ranks share it (a node's ranks, its link)."""
    check_int("ranks_sharing", ranks_sharing, 1)
    beta = check_number("beta_s_per_byte", fit["beta_s_per_byte"], 0, low_inclusive=False)
    alpha = check_number("alpha_s", fit["alpha_s"], 0)
    return NetworkLevel(2 / beta / ranks_sharing, alpha, size)


def this_machine_gpu(matmul_flops: float, copy_Bps: float, memory_bytes: float,
                     inside: dict, across: dict, ranks_per_node: int, ranks: int,
                     latency_per_matmul_s: float) -> GPU:
    """One rank of `ranks` (of `ranks_per_node` per node) as the simulator's GPU record.

    matmul_flops, copy_Bps, memory_bytes  this whole machine's, shared by the `ranks` ranks
    inside, across   the all-reduce fits of the two levels (the link's with one rank per node)
    latency_per_matmul_s   the time of a tiny matmul: the fixed cost of one call
    """
    check_int("ranks", ranks, 1)
    check_int("ranks_per_node", ranks_per_node, 1, ranks)
    for name, value in (("matmul_flops", matmul_flops), ("copy_Bps", copy_Bps),
                        ("memory_bytes", memory_bytes), ("latency_per_matmul_s",
                                                         latency_per_matmul_s)):
        check_number(name, value, 0, math.inf, low_inclusive=False)
    flops = matmul_flops / ranks
    l1, _ = cache_bytes(1)
    l2, _ = cache_bytes(2)
    return GPU(
        name=f"this machine ({ranks_per_node} ranks a node)", bitwidth=32,
        flop_per_clock_per_thread={32: flops / (128 * CLOCK_HZ)},  # one "SM" of 128 threads
        register_bytes_per_processing_block=l1 / 4,  # an SM's four blocks: the L1 in four
        num_sms=1, l2_Bps=CACHE_OVER_DRAM * copy_Bps / ranks, l2_bytes=l2,
        hbm_Bps=copy_Bps / ranks, hbm_bytes=memory_bytes / ranks, max_clock_Hz=CLOCK_HZ,
        effective_utilization=1.0, distributed_shared_memory=False,
        latency_per_matmul_s=latency_per_matmul_s,
        network_levels=(level_of(inside, size=ranks_per_node),
                        level_of(across, ranks_sharing=ranks_per_node)))


def across_costs(gpu: GPU) -> tuple[float, float]:
    """What the outermost level costs in the GPU's own currency, FLOP it could have done
    meanwhile: per byte sent one way (peak FLOP/s ÷ half the both-directions bandwidth), and
    per message (peak FLOP/s × latency)."""
    outer = gpu.network_levels[-1]
    return gpu.peak_flops / (outer.bandwidth_Bps / 2), gpu.peak_flops * outer.latency_s
