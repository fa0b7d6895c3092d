"""Notebook 00's pictures: the memory and network hierarchy, and rooflines with their widget."""
from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
from IPython.display import display
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from helpers.cost.roofline import Roofline, matmul_verdicts
from helpers.hardware import HIERARCHY
from helpers.hierarchy import capacity_text, latency_text, rate_text


def _where(name: str) -> str:
    if name.startswith(("L1", "L2")):
        return "on the chip"
    if name.startswith(("HBM", "GDDR")):
        return "beside the chip"
    if name.startswith(("NVLink", "PCIe")):
        return "inside a node"
    return "between nodes"


def _draw_hierarchy(ax, gpu: str) -> None:
    levels = [lv for lv in HIERARCHY[gpu] if lv.bandwidth_Bps]
    top = math.log10(max(lv.bandwidth_Bps for lv in levels))
    bottom = math.log10(min(lv.bandwidth_Bps for lv in levels)) - 1
    cmap = colormaps["plasma"]
    for i, lv in enumerate(levels):
        y = len(levels) - 1 - i
        # Never narrower than the label needs; the ordering still shows the steps down.
        width = 0.45 + 0.55 * (math.log10(lv.bandwidth_Bps) - bottom) / (top - bottom)
        x0 = (1 - width) / 2
        ax.add_patch(FancyBboxPatch((x0, y + 0.1), width, 0.8, boxstyle="round,pad=0.01",
                                    color=cmap(0.15 + 0.7 * i / len(levels)), alpha=0.9))
        ax.text(0.5, y + 0.62, lv.name, ha="center", va="center", fontsize=9, color="white",
                weight="bold")
        ax.text(0.5, y + 0.32, f"{capacity_text(lv.capacity_bytes)} · {rate_text(lv.bandwidth_Bps)}"
                f" · {latency_text(lv.latency_s)}", ha="center", va="center", fontsize=8,
                color="white")
        ax.text(1.02, y + 0.5, _where(lv.name), va="center", fontsize=8, color="0.35")
    ax.set_xlim(0, 1.2)
    ax.set_ylim(0, len(levels))
    ax.set_title(f"{gpu}: capacity · bandwidth per direction · latency (wider = faster)",
                 fontsize=10)
    ax.axis("off")


def plot_hierarchy(gpus=("H100 SXM",)) -> Figure:
    """One panel per GPU: its levels as stacked bars, width ~ log bandwidth, so each step
    down is visibly slower."""
    gpus = (gpus,) if isinstance(gpus, str) else tuple(gpus)
    rows = max(sum(1 for lv in HIERARCHY[g] if lv.bandwidth_Bps) for g in gpus)
    fig = Figure(figsize=(8 * len(gpus), 0.75 * rows + 0.8))
    for ax, gpu in zip(fig.subplots(1, len(gpus), squeeze=False).flat, gpus):
        _draw_hierarchy(ax, gpu)
    fig.tight_layout()
    return fig


def plot_roofline(roofs: list[Roofline], points: dict[str, float] | None = None,
                  title: str = "") -> Figure:
    """Log-log rooflines of `roofs`; `points` marks named intensities on every roof."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    lo = min(r.ridge for r in roofs) / 100
    hi = max(r.ridge for r in roofs) * 100
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    for roof in roofs:
        y = np.minimum(roof.peak_flops, x * roof.memory_Bps)
        line, = ax.loglog(x, y, label=f"{roof.name} (ridge {roof.ridge:.3g} FLOP/B)")
        ax.scatter([roof.ridge], [roof.peak_flops], color=line.get_color(), s=18)
    for label, intensity in (points or {}).items():
        ax.axvline(intensity, color="0.4", ls=":", lw=1)
        ax.text(intensity, ax.get_ylim()[0] * 1.5, f" {label}", rotation=90, fontsize=8,
                va="bottom", color="0.3")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title)
    return fig


def widget_roofline(roofs: list[Roofline]) -> W.Widget:
    """Matrix size and dtype -> intensity, and which machines are compute- or memory-bound."""
    size = W.IntSlider(value=1024, min=1, max=16384, step=1, description="n")
    dtype = W.Dropdown(options=["float32", "bfloat16"], value="float32", description="dtype")
    out = W.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            verdicts = matmul_verdicts(size.value, dtype.value, roofs)
            display(plot_roofline(roofs, {f"n={size.value}": verdicts[0].intensity}))
            for v in verdicts:
                print(f"{v.machine:>14}: {v.bound:<13} reaches "
                      f"{100 * v.attainable_fraction:5.1f}% of peak "
                      f"(intensity {v.intensity:.3g} vs ridge {v.ridge:.3g} FLOP/B)")

    size.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox([size, dtype]), out])
