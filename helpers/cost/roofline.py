"""The roofline, as arithmetic: a kernel that does I FLOPs per byte moved runs at most at
min(peak FLOP/s, I × memory bandwidth). Below the ridge point I* = peak / bandwidth it waits
on memory; above it, on arithmetic.

Measuring a machine's two roofs is `helpers.roofline` (torch); drawing them is
`helpers.views.hardware`.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.checks import check_choice, check_int, check_number
from helpers.hardware import ROOFLINE_PEAKS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Roofline:
    """One machine's roofline: its peak FLOP/s and its memory bandwidth (bytes/s)."""

    name: str
    peak_flops: float
    memory_Bps: float

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roof turns from sloped to flat."""
        return self.peak_flops / self.memory_Bps


def published(name: str) -> Roofline:
    """The roofline of a GPU in `helpers.hardware.ROOFLINE_PEAKS` (datasheet numbers)."""
    check_choice("name", name, ROOFLINE_PEAKS)
    peaks = ROOFLINE_PEAKS[name]
    return Roofline(name, peaks.peak_flops, peaks.memory_Bps)


def attainable_flops(intensity: float, roof: Roofline) -> float:
    check_number("intensity", intensity, 0, low_inclusive=False, unit="FLOP/byte")
    return min(roof.peak_flops, intensity * roof.memory_Bps)


def bound(intensity: float, roof: Roofline) -> str:
    return "compute-bound" if intensity >= roof.ridge else "memory-bound"


def matmul_intensity(n: int, dtype: str = "float32") -> float:
    """FLOPs per byte of an n x n x n matmul that reads A and B and writes C once: 2n/(3 bytes)."""
    check_int("n", n, 1)
    check_choice("dtype", dtype, sorted(DTYPE_BYTES))
    return 2 * n**3 / (3 * n * n * DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class RooflinePoint:
    """Where one kernel lands on one machine's roofline."""

    machine: str
    intensity: float
    ridge: float
    bound: str
    attainable_fraction: float   # of the machine's peak FLOP/s


def matmul_points(n: int, dtype: str, roofs: list[Roofline]) -> list[RooflinePoint]:
    """For an n x n x n matmul: where each machine lands (what notebook 00's widget prints)."""
    intensity = matmul_intensity(n, dtype)
    return [RooflinePoint(r.name, intensity, r.ridge, bound(intensity, r),
                        attainable_flops(intensity, r) / r.peak_flops) for r in roofs]
