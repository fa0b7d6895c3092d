"""The 3-D mesh drawn: every rank, and which ranks talk to each other in its TP, DP and PP
groups."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from helpers.layout import Layout

_BOX = 0.62         # a rank's square, in grid units
_ROW = 1.35         # distance between DP rows: the gap above a row holds its PP arcs
_GAP = 0.9          # extra space between two pipeline stages
_COLOURS = {"tp": "tab:blue", "dp": "tab:orange", "pp": "tab:green"}


def plot_mesh(mesh: Layout, title: str | None = None):
    """One panel per pipeline stage, left to right; inside a stage, one row per DP index and
    one column per TP index. TP groups are the shaded bands (a row of one stage), DP groups
    the dashed lines (a column of one stage), PP groups the arrows that carry activations
    from a rank to the rank in the same place of the next stage."""
    d, t, p = mesh.d, mesh.t, mesh.p
    width = p * t + (p - 1) * _GAP
    size = (min(16, max(7.5, 1.15 * width + 1.6)), min(12, 0.95 * d * _ROW + 2.4))
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.subplots()

    def centre(rank):
        dp, tp, pp = mesh.coords(rank)
        return pp * (t + _GAP) + tp, dp * _ROW

    half = _BOX / 2
    for block in mesh.groups().tp if t > 1 else ():
        (x0, y), (x1, _) = centre(block[0]), centre(block[-1])
        pad = 0.12
        ax.add_patch(FancyBboxPatch((x0 - half - pad, y - half - pad), x1 - x0 + _BOX + 2 * pad,
                                    _BOX + 2 * pad, boxstyle="round,pad=0,rounding_size=0.15",
                                    facecolor=_COLOURS["tp"], alpha=0.18,
                                    edgecolor=_COLOURS["tp"], linewidth=1.5, zorder=1))
    for block in mesh.groups().dp if d > 1 else ():
        for a, b in zip(block, block[1:]):
            (x, y0), (_, y1) = centre(a), centre(b)
            ax.plot([x, x], [y0 + half, y1 - half], color=_COLOURS["dp"], linestyle="--",
                    linewidth=2, zorder=2)
    for block in mesh.groups().pp if p > 1 else ():
        tp = mesh.coords(block[0]).tp
        for a, b in zip(block, block[1:]):
            (x0, y), (x1, _) = centre(a), centre(b)
            # from the top of one square to the top of the next stage's, bulging into the gap
            # above the row so it passes over the squares between them; staggered by TP index
            lift = 0.15 + 0.4 * (_ROW - _BOX) * tp / max(1, t - 1)
            ax.add_patch(FancyArrowPatch((x0 + 0.12, y - half), (x1 - 0.12, y - half),
                                         connectionstyle=f"arc3,rad={-2 * lift / (x1 - x0):.3f}",
                                         arrowstyle="-|>", mutation_scale=12,
                                         color=_COLOURS["pp"], linewidth=1.6, zorder=3))
    for rank in range(mesh.world):
        x, y = centre(rank)
        dp, tp, pp = mesh.coords(rank)
        ax.add_patch(FancyBboxPatch((x - half, y - half), _BOX, _BOX,
                                    boxstyle="round,pad=0,rounding_size=0.06",
                                    facecolor="white", edgecolor="black", linewidth=1, zorder=4))
        ax.text(x, y - 0.06, str(rank), ha="center", va="center", fontsize=13,
                fontweight="bold", zorder=5)
        ax.text(x, y + 0.19, f"dp{dp} tp{tp} pp{pp}", ha="center", va="center", fontsize=7.5,
                color="0.3", zorder=5)

    top, bottom = -half - 0.75, (d - 1) * _ROW + half + 0.45
    for pp in range(p):
        x0 = pp * (t + _GAP)
        ax.text(x0 + (t - 1) / 2, top + 0.2, f"stage pp={pp}", ha="center", va="center",
                fontsize=10, fontweight="bold")
        for tp in range(t):
            ax.text(x0 + tp, bottom - 0.15, f"tp={tp}", ha="center", va="center", fontsize=8,
                    color="0.35")
    for dp in range(d):
        ax.text(-half - 0.25, dp * _ROW, f"dp={dp}", ha="right", va="center", fontsize=8,
                color="0.35")

    handles = [
        Patch(facecolor=_COLOURS["tp"], alpha=0.35, edgecolor=_COLOURS["tp"],
              label=f"TP group (t={t}): all-reduce in every block; consecutive ranks, one node"),
        Line2D([], [], color=_COLOURS["dp"], linestyle="--", linewidth=2,
               label=f"DP group (d={d}): all-reduce of the gradients, once a step"),
        Line2D([], [], color=_COLOURS["pp"], marker=">", linewidth=1.6,
               label=f"PP group (p={p}): send activations to the next stage (gradients back)"),
    ]
    for handle, degree in zip(handles, (t, d, p)):
        if degree == 1:
            handle.set_label(handle.get_label().split(":")[0] + ": a single rank, no traffic")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
              frameon=False, ncol=1)
    ax.set_xlim(-half - 1.0, width - 1 + half + 0.3)
    ax.set_ylim(bottom, top)  # dp = 0 on top
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"mesh {mesh}: rank = (pp·d + dp)·t + tp", fontsize=10)
    return fig
