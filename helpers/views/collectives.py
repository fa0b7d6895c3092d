"""Notebook 01's pictures: one row per rank, the tensor before and after, cells coloured by
value; and the widget that re-runs every collective on live ranks."""
from __future__ import annotations

import ipywidgets as W
from IPython.display import display
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from helpers.parallel.collectives import run_all

MAX_WIDGET_WORLD_SIZE = 8   # the world-size slider's end


def _draw(ax, op: str, results: list[dict]) -> None:
    """One collective on one Axes: what each rank held before and after `op`."""
    world_size = len(results)
    held = [r[k] for r in results for k in ("before", "after") if r[k] is not None]
    width = max([len(t) for t in held] + [1])
    values = [float(v) for t in held for v in t.tolist()]
    hi = max(values + [1.0])
    cmap = colormaps["viridis"]
    gap = 1.5
    for rank, res in enumerate(results):
        y = world_size - 1 - rank
        ax.text(-0.3, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
        for column, key in enumerate(("before", "after")):
            x0 = column * (width + gap)
            tensor = res[key]
            if tensor is None:
                ax.text(x0 + 0.1, y + 0.5, "—", va="center", color="0.5", fontsize=9)
                continue
            for i, v in enumerate(tensor.tolist()):
                ax.add_patch(Rectangle((x0 + i, y + 0.05), 0.95, 0.9,
                                       color=cmap(0.15 + 0.75 * v / hi)))
                ax.text(x0 + i + 0.47, y + 0.5, f"{v:g}", ha="center", va="center",
                        fontsize=8, color="white" if v / hi < 0.6 else "black")
    for column, key in enumerate(("before", "after")):
        ax.text(column * (width + gap) + width / 2, world_size + 0.15, key, ha="center",
                fontsize=10, weight="bold")
    ax.annotate("", xy=(width + gap - 0.15, world_size / 2), xytext=(width + 0.15, world_size / 2),
                arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.set_xlim(-1.6, 2 * width + gap + 0.2)
    ax.set_ylim(-0.2, world_size + 0.6)
    ax.set_title(op, fontsize=11)
    ax.axis("off")


def plot_collectives(results_by_op: dict[str, list[dict]], columns: int = 2) -> Figure:
    """Every op of `results_by_op` ({op: per-rank before/after}), `columns` to a row."""
    ops = list(results_by_op)
    rows = max(1, -(-len(ops) // columns))
    world_size = len(next(iter(results_by_op.values()))) if ops else 1
    fig = Figure(figsize=(6.5 * columns, (0.9 + 0.45 * world_size) * rows))
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax, op in zip(axes, ops):
        _draw(ax, op, results_by_op[op])
    for ax in axes[len(ops):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def widget_collectives(live) -> W.Widget:
    """Sliders for world size (1–8) and length; reruns and redraws every collective on change."""
    size = W.IntSlider(value=min(live.world_size, MAX_WIDGET_WORLD_SIZE), min=1,
                       max=MAX_WIDGET_WORLD_SIZE, description="world size")
    length = W.IntSlider(value=4, min=1, max=16, description="length")
    out = W.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            done = run_all(live, size.value, length.value)
            if done.results:
                display(plot_collectives(done.results))
            if done.skipped:
                print(f"skipped {', '.join(done.skipped)}: length {length.value} does not "
                      f"split into {size.value} equal chunks")

    size.observe(redraw, names="value")
    length.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox([size, length]), out])
