"""Notebook 00's picture and table: memory and network levels, small-and-fast to large-and-slow."""
from __future__ import annotations

from helpers.hardware import HIERARCHY, Level


def _bytes(x: float | None) -> str:
    if x is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def _rate(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e9:,.0f} GB/s" if x >= 1e11 else f"{x / 1e9:.3g} GB/s"


def _latency(x: float | None) -> str:
    if x is None:
        return "—"
    return f"~{x * 1e9:.0f} ns" if x < 1e-6 else f"~{x * 1e6:.3g} µs"


def table(gpu: str) -> str:
    """A plain-text table of one GPU's hierarchy (bandwidth per direction, GB = 1e9 B)."""
    rows = [("level", "capacity", "bandwidth / direction", "latency")]
    rows += [(lv.name, _bytes(lv.capacity_bytes), _rate(lv.bandwidth_Bps), _latency(lv.latency_s))
             for lv in HIERARCHY[gpu]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{gpu}\n" + "\n".join(lines)


def sources(gpu: str) -> str:
    return "\n".join(f"- {lv.name}: {lv.source}" for lv in HIERARCHY[gpu])


def ratio(gpu: str, faster: str, slower: str) -> float:
    """How many times more bandwidth level `faster` has than level `slower` (name prefixes)."""
    def find(prefix: str) -> Level:
        return next(lv for lv in HIERARCHY[gpu] if lv.name.startswith(prefix))
    return find(faster).bandwidth_Bps / find(slower).bandwidth_Bps


def draw(gpu: str = "H100 SXM", ax=None):
    """The hierarchy as stacked bars: width ~ log bandwidth, so each step down is visibly slower."""
    import math

    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    levels = [lv for lv in HIERARCHY[gpu] if lv.bandwidth_Bps]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.75 * len(levels) + 0.8))
    top = math.log10(max(lv.bandwidth_Bps for lv in levels))
    bottom = math.log10(min(lv.bandwidth_Bps for lv in levels)) - 1
    cmap = plt.get_cmap("plasma")
    def where(name: str) -> str:
        if name.startswith(("L1", "L2")):
            return "on the chip"
        if name.startswith(("HBM", "GDDR")):
            return "beside the chip"
        if name.startswith(("NVLink", "PCIe")):
            return "inside a node"
        return "between nodes"

    for i, lv in enumerate(levels):
        y = len(levels) - 1 - i
        # Never narrower than the label needs; the ordering still shows the steps down.
        width = 0.45 + 0.55 * (math.log10(lv.bandwidth_Bps) - bottom) / (top - bottom)
        x0 = (1 - width) / 2
        ax.add_patch(FancyBboxPatch((x0, y + 0.1), width, 0.8, boxstyle="round,pad=0.01",
                                    color=cmap(0.15 + 0.7 * i / len(levels)), alpha=0.9))
        ax.text(0.5, y + 0.62, lv.name, ha="center", va="center", fontsize=9, color="white",
                weight="bold")
        ax.text(0.5, y + 0.32, f"{_bytes(lv.capacity_bytes)} · {_rate(lv.bandwidth_Bps)} · "
                f"{_latency(lv.latency_s)}", ha="center", va="center", fontsize=8, color="white")
        ax.text(1.02, y + 0.5, where(lv.name), va="center", fontsize=8, color="0.35")
    ax.set_xlim(0, 1.2)
    ax.set_ylim(0, len(levels))
    ax.set_title(f"{gpu}: capacity · bandwidth per direction · latency (wider = faster)",
                 fontsize=10)
    ax.axis("off")
    return ax
