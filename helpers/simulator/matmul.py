"""Time of one matmul on one GPU (docs/cost_model.md §2): IO at three memory boundaries against FLOP/s.

The kernel tiles the *weight* matrix so each tile fits the memory below a boundary; the
activations stream past each tile once per tile row/column, which is where the IO comes from.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from helpers.hardware import GPU


@lru_cache(maxsize=None)  # tiles depend on the weight shape only, not on the batch
def tile(m: int, n: int, cap: float, bytes_per_word: float) -> tuple[float, float]:
    """How many tile rows and columns an `m × n` matrix needs so each tile fits `cap` bytes."""
    words = m * n
    count = math.ceil(words * bytes_per_word / cap)
    w = words / count
    tm = max(min(m, math.sqrt(w)), w / n)
    tn = w / tm
    return m / tm, n / tn


def boundary_io(d1: int, d2: int, b: int, weight_grad: bool, cap: float, units: int,
                dsmem: bool, bytes_per_word: float) -> tuple[float, float]:
    """(bytes across the boundary, bytes over distributed shared memory) for one matmul."""
    W = d1 * d2 * bytes_per_word
    Lh = d1 * b * bytes_per_word
    Rh = d2 * b * bytes_per_word
    if dsmem:
        rows, cols = tile(d1, d2, cap * units, bytes_per_word)
        sr, sc = tile(d1, d2, cap, bytes_per_word)
    else:
        rows, cols = tile(d1, d2, cap, bytes_per_word)
        sr = sc = 1
    io = 0.0
    ds = 0.0
    if 2 * W > cap * units:  # weights and their gradients do not stay below the boundary
        io += 2 * W if weight_grad else W
    io += rows * Rh
    if sr > 1:
        ds += sr * Rh
    if weight_grad:
        io += cols * Lh
        if sc > 1:
            ds += sc * Lh
    else:
        io += (2 * cols - 1) * Lh
        ds += 2 * (sc - 1) * Lh
    return io, ds


def matmul_flop(d1: int, d2: int, b: int) -> int:
    """FLOP of the kernel: every dimension is padded to a multiple of 8 (tensor-core tiles)."""
    return 2 * math.ceil(d1 / 8) * math.ceil(d2 / 8) * math.ceil(b / 8) * 8**3


class Chip(NamedTuple):
    """What `matmul_time` reads of a GPU, computed once: hashable, so the fast search's
    matmul caches key on it (a GPU that differs only in its network has the same chip)."""

    bytes_per_word: float
    registers: float          # bytes below the SM-register boundary: 0.75 of a block's
    l2_cap: float             # bytes below the HBM-L2 boundary: 0.75 of L2, ≥ 4·registers
    num_sms: int
    distributed_shared_memory: bool
    hbm_Bps: float
    l2_Bps: float
    shared_Bps: float
    sustained_flops: float
    latency_per_matmul_s: float

    @classmethod
    def of(cls, gpu: GPU) -> Chip:
        R = 0.75 * gpu.register_bytes_per_processing_block
        return cls(gpu.bytes_per_word, R, max(0.75 * gpu.l2_bytes, 4 * R), gpu.num_sms,
                   gpu.distributed_shared_memory, gpu.hbm_Bps, gpu.l2_Bps, gpu.shared_Bps,
                   gpu.sustained_flops, gpu.latency_per_matmul_s)


def matmul_seconds(chip: Chip, d1: int, d2: int, b: int, weight_grad: bool = False) -> float:
    """`matmul_time` from a `Chip`: the same operations in the same order."""
    by, R, l2_cap, sms, dsmem, hbm_Bps, l2_Bps, shared_Bps, flops, latency = chip
    hbm_l2, _ = boundary_io(d1, d2, b, weight_grad, l2_cap, 1, False, by)
    l2_sm, l2_sm_ds = boundary_io(d1, d2, b, weight_grad, 4 * R, sms, dsmem, by)
    sm_reg, _ = boundary_io(d1, d2, b, weight_grad, R, 4 * sms, False, by)
    hbm_io = hbm_l2
    l2_io = hbm_l2 + l2_sm
    sm_io = l2_sm + l2_sm_ds + sm_reg
    return max(hbm_io / hbm_Bps, l2_io / l2_Bps, sm_io / shared_Bps,
               matmul_flop(d1, d2, b) / flops) + latency


def matmul_time(gpu: GPU, d1: int, d2: int, b: int, weight_grad: bool = False) -> float:
    """Seconds for a `d1×d2` weight times `d2×b` activations (or the weight-gradient product)."""
    by = gpu.bytes_per_word
    R = 0.75 * gpu.register_bytes_per_processing_block
    l2_cap = max(0.75 * gpu.l2_bytes, 4 * R)
    hbm_l2, _ = boundary_io(d1, d2, b, weight_grad, l2_cap, 1, False, by)
    l2_sm, l2_sm_ds = boundary_io(d1, d2, b, weight_grad, 4 * R, gpu.num_sms,
                                  gpu.distributed_shared_memory, by)
    sm_reg, _ = boundary_io(d1, d2, b, weight_grad, R, 4 * gpu.num_sms, False, by)
    hbm_io = hbm_l2
    l2_io = hbm_l2 + l2_sm
    sm_io = l2_sm + l2_sm_ds + sm_reg
    return max(hbm_io / gpu.hbm_Bps, l2_io / gpu.l2_Bps, sm_io / gpu.shared_Bps,
               matmul_flop(d1, d2, b) / gpu.sustained_flops) + gpu.latency_per_matmul_s
