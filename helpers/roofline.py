"""Measure this machine's two roofs, memory bandwidth and matmul FLOP/s, and a matmul's fixed
cost (torch, one process).

The roofline itself is arithmetic (`helpers.cost.roofline`); its figure and widget are in
`helpers.views.hardware`.
"""
from __future__ import annotations

import torch

from helpers.checks import check_int
from helpers.timing import Measurement, measure


def measure_copy_bandwidth(megabytes: int = 256, repeat: int = 5) -> tuple[float, Measurement]:
    """Bytes/s of a large copy (each byte read once and written once, so 2x the size moves).

    The buffer is far larger than any CPU cache, so this is the DRAM bandwidth a single
    process sees with torch's threads.
    """
    check_int("megabytes", megabytes, 1)
    numel = megabytes * 1024**2 // 4
    src, dst = torch.ones(numel), torch.empty(numel)
    m = measure(lambda: dst.copy_(src), f"copy {megabytes} MiB", repeat=repeat, warmup=1)
    return 2 * src.numel() * 4 / m.median, m


def measure_matmul_flops(n: int = 1024, repeat: int = 5,
                         dtype: torch.dtype = torch.float32) -> tuple[float, Measurement]:
    """FLOP/s of an n x n x n matmul (2n^3 FLOPs), median of `repeat`."""
    check_int("n", n, 1)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    m = measure(lambda: a @ b, f"matmul {n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
                repeat=repeat, warmup=1)
    return 2 * n**3 / m.median, m


def measure_matmul_latency(n: int = 8, repeat: int = 200) -> tuple[float, Measurement]:
    """Seconds of an n x n x n matmul so small its arithmetic is nothing: the fixed cost of
    one call (torch's dispatch, the kernel's start), median of `repeat`."""
    check_int("n", n, 1, 64)
    check_int("repeat", repeat, 1)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator) for _ in range(2))
    m = measure(lambda: a @ b, f"matmul {n}x{n}x{n}", repeat=repeat, warmup=10)
    return m.median, m
