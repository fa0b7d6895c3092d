"""Notebook 00's pictures: the memory and network hierarchy on a log bandwidth axis, the
lecture's picture of GPU nodes, and rooflines with their widget."""
from __future__ import annotations

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from helpers.cost.roofline import Roofline, matmul_points
from helpers.hardware import HIERARCHY
from helpers.hierarchy import capacity_text, latency_text, level, rate_text
from helpers.views.kit import FULL_LABEL, Blitted, previewed

WHERE_COLOURS = {"on the chip": "#6a3d9a", "beside the chip": "#1f78b4",
                 "inside a node": "#33a02c", "between nodes": "#e6550d"}


def where(name: str) -> str:
    """Which of the four places a level of HIERARCHY lives in."""
    if name.startswith(("L1", "L2")):
        return "on the chip"
    if name.startswith(("HBM", "GDDR")):
        return "beside the chip"
    if name.startswith(("NVLink", "PCIe")):
        return "inside a node"
    return "between nodes"


def _draw_hierarchy(ax, gpu: str) -> None:
    levels = [lv for lv in HIERARCHY[gpu] if lv.bandwidth_Bps]
    ys = np.arange(len(levels))[::-1]
    gbps = [lv.bandwidth_Bps / 1e9 for lv in levels]
    floor = 0.05   # GB/s: where the bars start (the axis is log, so there is no zero)
    ax.barh(ys, [g - floor for g in gbps], height=0.7, left=floor,
            color=[WHERE_COLOURS[where(lv.name)] for lv in levels])
    for y, lv, g in zip(ys, levels, gbps):
        parts = [rate_text(lv.bandwidth_Bps)]
        if lv.capacity_bytes:
            parts.append(capacity_text(lv.capacity_bytes))
        parts.append(latency_text(lv.latency_s))
        ax.text(g * 1.25, y, " · ".join(parts), va="center", fontsize=8)
    ax.set_yticks(ys, [lv.name for lv in levels], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(floor, 2e6)
    decades = [10.0**k for k in range(-1, 6)]
    ax.set_xticks(decades, ["0.1", "1", "10", "100", "1,000", "10,000", "100,000"], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("bandwidth per direction, GB/s (log scale: each gridline is 10× the last)",
                  fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"{gpu}: bandwidth · capacity · latency", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def plot_hierarchy(gpus=("H100 SXM",)) -> Figure:
    """One panel per GPU: each level a bar whose length is its bandwidth on a log axis, so
    the 2,600× from L1 to Ethernet reads as 3.4 decades, coloured by where the level lives."""
    gpus = (gpus,) if isinstance(gpus, str) else tuple(gpus)
    rows = max(sum(1 for lv in HIERARCHY[g] if lv.bandwidth_Bps) for g in gpus)
    fig = Figure(figsize=(7.5 * len(gpus), 0.42 * rows + 1.6), layout="constrained")
    for ax, gpu in zip(fig.subplots(1, len(gpus), squeeze=False).flat, gpus):
        _draw_hierarchy(ax, gpu)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in WHERE_COLOURS.values()]
    fig.legend(handles, list(WHERE_COLOURS), loc="outside lower center", ncols=4, fontsize=8,
               frameon=False)
    return fig


# ---------------------------------------------------------------------------------------
# The lecture's one picture: nodes of 8 GPUs (SMs, HBM), NVSwitch, NICs, InfiniBand.
# ---------------------------------------------------------------------------------------

def _box(ax, x, y, w, h, colour, text="", fontsize=7.5, text_colour="white", **kw):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=colour, edgecolor="none", **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=text_colour)


def _draw_gpu(ax, x, y, label: str) -> None:
    """One GPU package: the die (a grid of SMs) with HBM stacks on both sides."""
    w, h = 1.5, 1.1
    _box(ax, x, y, w, h, "#d9d9d9")
    die_x, die_w = x + 0.3, w - 0.6
    _box(ax, die_x, y + 0.12, die_w, h - 0.24, WHERE_COLOURS["on the chip"])
    cols, rows = 6, 5
    sm_w, sm_h = die_w / (cols + 1), (h - 0.45) / (rows + 1)
    for i in range(cols):
        for j in range(rows):
            ax.add_patch(Rectangle((die_x + sm_w * (i + 0.5), y + 0.3 + sm_h * (j + 0.3)),
                                   sm_w * 0.75, sm_h * 0.7, facecolor="#cab2d6",
                                   edgecolor="none"))
    ax.text(die_x + die_w / 2, y + 0.2, "SMs", ha="center", va="center", fontsize=7.5,
            color="white")
    for side in (x + 0.05, x + w - 0.25):
        for k in range(3):
            ax.add_patch(Rectangle((side, y + 0.15 + 0.28 * k), 0.2, 0.22,
                                   facecolor=WHERE_COLOURS["beside the chip"], edgecolor="none"))
    ax.text(x + w / 2, y + h + 0.05, label, ha="center", va="bottom", fontsize=7.5)


def plot_node(gpu: str = "H100 SXM", nodes: int = 2) -> Figure:
    """`nodes` nodes of 8 GPUs: each GPU an SM grid with HBM beside it, wired by NVLink to
    every one of the node's 4 NVSwitches, one NIC per GPU (over PCIe), and the NICs of all
    nodes joined by an InfiniBand switch. Link speeds come from helpers.hardware.HIERARCHY
    (per direction, per GPU)."""
    nvlink, ib, hbm = level(gpu, "NVLink"), level(gpu, "InfiniBand"), level(gpu, "HBM")
    pitch, node_w, gap = 1.75, 8 * 1.75 + 0.25, 1.2
    total_w = nodes * (node_w + gap) - gap
    fig = Figure(figsize=(13, 3.9))
    ax = fig.subplots()
    ib_x, ib_y = total_w / 2, 8.3
    nvlink_colour, ib_colour = WHERE_COLOURS["inside a node"], WHERE_COLOURS["between nodes"]
    for n in range(nodes):
        x0 = n * (node_w + gap)
        _box(ax, x0, 1.0, node_w, 6.3, "#f0f0f0", zorder=0)
        ax.text(x0 + 0.15, 1.15, f"node {n}: 8 × {gpu}", fontsize=9, weight="bold",
                va="bottom")
        switches = [x0 + 0.6 + 3.4 * s for s in range(4)]
        for sx in switches:
            _box(ax, sx, 1.9, 2.4, 0.55, nvlink_colour, "NVSwitch", fontsize=8)
        for g in range(8):
            gx = x0 + 0.25 + pitch * g
            for sx in switches:     # every GPU has NVLinks to every NVSwitch
                ax.plot([gx + 0.75, sx + 1.2], [3.75, 2.45], color=nvlink_colour, lw=0.9,
                        alpha=0.8)
            _draw_gpu(ax, gx, 3.75, f"GPU {g + 8 * n}")
            _box(ax, gx + 0.35, 6.3, 0.8, 0.45, ib_colour, "NIC", fontsize=7.5)
            ax.plot([gx + 0.75, gx + 0.75], [5.1, 6.3], color="0.45", lw=1)   # PCIe
            ax.plot([gx + 0.75, ib_x], [6.75, ib_y], color=ib_colour, lw=0.7, alpha=0.6)
    _box(ax, ib_x - 2, ib_y, 4, 0.6, ib_colour, "InfiniBand switch", fontsize=9)
    ax.text(total_w, ib_y + 0.3,
            f"HBM (blue, beside each die): {rate_text(hbm.bandwidth_Bps)} per GPU\n"
            f"NVLink via NVSwitch (green): {rate_text(nvlink.bandwidth_Bps)} per GPU per direction\n"
            f"NIC ↔ InfiniBand (orange): {rate_text(ib.bandwidth_Bps)} per GPU per direction "
            f"({nvlink.bandwidth_Bps / ib.bandwidth_Bps:.0f}× less)\n"
            "GPU ↔ its NIC: PCIe (grey)", fontsize=8, ha="right", va="center")
    ax.set_xlim(-0.2, total_w + 0.2)
    ax.set_ylim(0.8, 9.2)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.subplots_adjust(left=0.01, right=0.99, top=0.99, bottom=0.01)
    return fig


# ---------------------------------------------------------------------------------------
# Rooflines.
# ---------------------------------------------------------------------------------------

def plot_roofline(roofs: list[Roofline], points: dict[str, float] | None = None,
                  title: str = "") -> Figure:
    """Log-log rooflines of `roofs`; `points` marks named intensities on every roof.
    The legend sits below the axes, so it never covers a marker's label."""
    fig = Figure(figsize=(7, 5.4), layout="constrained")
    ax = fig.subplots()
    lo = min(r.ridge for r in roofs) / 100
    hi = max(r.ridge for r in roofs) * 100
    x = np.logspace(np.log10(lo), np.log10(hi), 64)
    for roof in roofs:
        y = np.minimum(roof.peak_flops, x * roof.memory_Bps)
        line, = ax.loglog(x, y, label=f"{roof.name} (ridge {roof.ridge:.3g} FLOP/B)")
        ax.scatter([roof.ridge], [roof.peak_flops], color=line.get_color(), s=18)
    ax.set_xlim(lo, hi)
    bottom = ax.get_ylim()[0]
    for label, intensity in (points or {}).items():
        ax.axvline(intensity, color="0.4", ls=":", lw=1)
        ax.text(intensity, bottom * 1.5, f" {label}", rotation=90, fontsize=8, va="bottom",
                ha="center", color="0.2",
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none",
                          alpha=0.85))
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(fontsize=8, loc="outside lower center", ncols=2, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


MATRIX_SIZES = tuple(2**k for k in range(15))   # n = 1 … 16384, one stop per power of two


def roofline_text(roofs: list[Roofline], n: int, dtype: str) -> str:
    """What the widget prints under the figure: the matmul, then per machine, compute- or
    memory-bound."""
    return "\n".join(
        [f"n×n×n matmul, n = {n:,}, {dtype}:"]
        + [f"{v.machine:>24}: {v.bound:<13} reaches {100 * v.attainable_fraction:5.1f}% of peak "
           f"(intensity {v.intensity:.3g} vs ridge {v.ridge:.3g} FLOP/B)"
           for v in matmul_points(n, dtype, roofs)])


class RooflineView:
    """The roofline figure, built once; `update(n, dtype)` moves the marker and returns the
    PNG and the text under it. (The widget's callback, callable without a browser.)"""

    def __init__(self, roofs: list[Roofline], n: int = 1024, dtype: str = "float32"):
        self.roofs = roofs
        points = matmul_points(n, dtype, roofs)
        fig = plot_roofline(roofs, {f"n={n} ({dtype})": points[0].intensity})
        ax = fig.axes[0]
        self.line, self.label = ax.lines[-1], ax.texts[-1]
        self.blit = Blitted(fig, [self.line, self.label])

    @property
    def figure(self) -> Figure:
        return self.blit.figure

    def update(self, n: int, dtype: str) -> tuple[bytes, str]:
        intensity = matmul_points(n, dtype, self.roofs)[0].intensity
        self.line.set_xdata([intensity, intensity])
        self.label.set_x(intensity)
        self.label.set_text(f" n={n} ({dtype})")
        return self.blit.png(), roofline_text(self.roofs, n, dtype)


def widget_roofline(roofs: list[Roofline]) -> W.Widget:
    """Matrix size (powers of two, acting on release) and dtype -> where an n×n×n matmul
    lands on each roofline, and which machines are compute- or memory-bound."""
    style = FULL_LABEL
    size = W.SelectionSlider(options=[(f"{n:,}", n) for n in MATRIX_SIZES], value=1024,
                             description="matrix size n (n×n×n matmul)", style=style,
                             continuous_update=False, layout=W.Layout(width="480px"))
    dtype = W.Dropdown(options=["float32", "bfloat16"], value="float32",
                       description="dtype", style=style)
    view = RooflineView(roofs, size.value, dtype.value)
    image = W.Image(format="png", layout=W.Layout(width="560px"))
    text = W.HTML()

    def redraw(*_):
        picture, lines = view.update(size.value, dtype.value)
        image.value = picture
        text.value = f"<pre style='font-size: 12px; line-height: 1.3'>{lines}</pre>"

    size.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    redraw()
    return previewed(W.VBox([W.HBox([size, dtype]), image, text]))
