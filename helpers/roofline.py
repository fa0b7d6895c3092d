"""Measure this machine's memory bandwidth and matmul FLOP/s, and place it on a roofline.

The roofline: a kernel that does I FLOPs per byte moved runs at most at
min(peak FLOP/s, I x memory bandwidth). Below the ridge point I* = peak / bandwidth it waits
on memory; above it, on arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.hardware import ROOFLINE_PEAKS
from helpers.timing import Measurement, measure

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: float
    memory_Bps: float

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roof turns from sloped to flat."""
        return self.peak_flops / self.memory_Bps


def published(name: str) -> Machine:
    peak, bandwidth, _ = ROOFLINE_PEAKS[name]
    return Machine(name, peak, bandwidth)


def attainable_flops(intensity: float, machine: Machine) -> float:
    if intensity <= 0:
        raise ValueError(f"intensity must be > 0 FLOP/byte, got {intensity}")
    return min(machine.peak_flops, intensity * machine.memory_Bps)


def bound(intensity: float, machine: Machine) -> str:
    return "compute-bound" if intensity >= machine.ridge else "memory-bound"


def matmul_intensity(n: int, dtype: str = "float32") -> float:
    """FLOPs per byte of an n x n x n matmul that reads A and B and writes C once: 2n/(3 bytes)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * n**3 / (3 * n * n * DTYPE_BYTES[dtype])


def measure_copy_bandwidth(megabytes: int = 256, repeat: int = 5) -> tuple[float, Measurement]:
    """Bytes/s of a large copy (each byte read once and written once, so 2x the size moves).

    The buffer is far larger than any CPU cache, so this is the DRAM bandwidth a single
    process sees with torch's threads.
    """
    numel = megabytes * 1024**2 // 4
    src, dst = torch.ones(numel), torch.empty(numel)
    m = measure(lambda: dst.copy_(src), f"copy {megabytes} MiB", repeat=repeat, warmup=1)
    return 2 * src.numel() * 4 / m.median, m


def measure_matmul_flops(n: int = 1024, repeat: int = 5,
                         dtype: torch.dtype = torch.float32) -> tuple[float, Measurement]:
    """FLOP/s of an n x n x n matmul (2n^3 FLOPs), median of `repeat`."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    m = measure(lambda: a @ b, f"matmul {n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
                repeat=repeat, warmup=1)
    return 2 * n**3 / m.median, m


def plot(machines: list[Machine], points: dict[str, float] | None = None, ax=None):
    """Log-log rooflines of `machines`; `points` marks named intensities on every roof."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    lo = min(m.ridge for m in machines) / 100
    hi = max(m.ridge for m in machines) * 100
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    for machine in machines:
        y = np.minimum(machine.peak_flops, x * machine.memory_Bps)
        line, = ax.loglog(x, y, label=f"{machine.name} (ridge {machine.ridge:.3g} FLOP/B)")
        ax.scatter([machine.ridge], [machine.peak_flops], color=line.get_color(), s=18)
    for label, intensity in (points or {}).items():
        ax.axvline(intensity, color="0.4", ls=":", lw=1)
        ax.text(intensity, ax.get_ylim()[0] * 1.5, f" {label}", rotation=90, fontsize=8,
                va="bottom", color="0.3")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def intensity_report(n: int, dtype: str, machines: list[Machine]) -> list[dict]:
    """What the widget shows: for an n x n x n matmul, where each machine lands."""
    intensity = matmul_intensity(n, dtype)
    return [{"machine": m.name, "intensity": intensity, "ridge": m.ridge,
             "bound": bound(intensity, m),
             "attainable_fraction": attainable_flops(intensity, m) / m.peak_flops}
            for m in machines]


def widget(machines: list[Machine]):
    """Matrix size and dtype -> intensity, and which machines are compute- or memory-bound."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    size = w.IntSlider(value=1024, min=1, max=16384, step=1, description="n")
    dtype = w.Dropdown(options=["float32", "bfloat16"], value="float32", description="dtype")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            rows = intensity_report(size.value, dtype.value, machines)
            plot(machines, {f"n={size.value}": rows[0]["intensity"]})
            plt.show()
            for r in rows:
                print(f"{r['machine']:>14}: {r['bound']:<13} reaches "
                      f"{100 * r['attainable_fraction']:5.1f}% of peak "
                      f"(intensity {r['intensity']:.3g} vs ridge {r['ridge']:.3g} FLOP/B)")

    size.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    redraw()
    display(w.VBox([w.HBox([size, dtype]), out]))
