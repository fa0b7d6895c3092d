"""Measure this machine's two roofs, memory bandwidth and matmul FLOP/s, and a matmul's fixed
cost (torch, one process).

The roofline itself is arithmetic (`helpers.cost.roofline`); its figure and widget are in
`helpers.views.hardware`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.checks import check_int, check_number
from helpers.timing import Measurement, measure
from helpers.units import format_binary_bytes


def measure_copy_bandwidth(megabytes: float = 256, repeat: int = 5) -> tuple[float, Measurement]:
    """Bytes/s of copying `megabytes` MiB (each byte read once and written once: 2x the size moves).

    Which memory this measures depends on the size: when source and destination together are
    larger than the last-level cache (`cache_sizes`), DRAM; when they fit in a cache, that cache.
    """
    nbytes = int(check_number("megabytes", megabytes, 0, low_inclusive=False, unit="MiB") * 1024**2)
    numel = max(1, nbytes // 4)
    src, dst = torch.ones(numel), torch.empty(numel)
    m = measure(lambda: dst.copy_(src), f"copy {format_binary_bytes(numel * 4)}", repeat=repeat, warmup=1)
    return 2 * src.numel() * 4 / m.median, m


def cache_sizes(cpu: int = 0) -> dict[int, int]:
    """{level: bytes} of the data (or unified) caches `cpu` sees, read from Linux's sysfs;
    {} where it cannot be read (not Linux, or a kernel that does not export it)."""
    sizes: dict[int, int] = {}
    for index in sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1].upper(), 1)
        sizes[level] = int(text.rstrip("KkMmGg")) * scale
    return dict(sorted(sizes.items()))


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
