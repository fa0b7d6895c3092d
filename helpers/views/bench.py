"""Notebook 02's figure (time and bus bandwidth against message size, with the fitted α–β
lines) and its widget (a small live sweep per click)."""
from __future__ import annotations

import ipywidgets as W
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure

from helpers.cost import alpha_beta as ab
from helpers.cost.bench import Timing, fit_for, fit_lines, median_time, op_labels, uncontended_time
from helpers.labs.bench import SIZE_EXPONENTS, cores_line, run_small_sweep
from helpers.views.kit import previewed

# The world-size slider stops here by default: each extra CPU rank is a process that imports
# torch (seconds on a small machine). Pass max_world_size=8 for the full range.
MAX_SWEEP_WORLD_SIZE = 4


def plot_sweep(records: list[Timing], fits: dict | None = None) -> Figure:
    """Left: time vs message size, measured points (10th percentile, the bar up to the median:
    the calls that waited for a core) and fitted α–β lines.
    Right: nccl-tests bus bandwidth vs size. `fits` is {op: Fit} or {N: {op: Fit}}."""
    fig = Figure(figsize=(11, 4))
    ax_t, ax_bw = fig.subplots(1, 2)
    labels = op_labels(records)
    groups: dict[tuple[str, int], list[Timing]] = {}
    for r in records:
        groups.setdefault((r.op, r.world_size), []).append(r)
    # One colour per operation, one line style and marker per world size.
    colors = {op: f"C{i % 10}" for i, op in enumerate(sorted({op for op, _ in groups}))}
    world_sizes = sorted({world for _, world in groups})
    styles = {world: ("-", "--", ":", "-.")[i % 4] for i, world in enumerate(world_sizes)}
    markers = {world: "osD^v<>p"[i % 8] for i, world in enumerate(world_sizes)}
    for (op, world), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r.bytes)
        n = np.array([r.bytes for r in rs], dtype=float)
        low = np.array([uncontended_time(r) for r in rs])
        med = np.array([median_time(r) for r in rs])
        color, name = colors[op], f"{labels[op]}, N={world}"
        ax_t.errorbar(n, low, yerr=[np.zeros_like(low), np.maximum(med - low, 0)], fmt=markers[world],
                      ms=4, color=color, label=name, capsize=2)
        if fits and (op in fits or op in fits.get(world, {})):
            grid = np.geomspace(n.min(), n.max(), 50)
            fit = fit_for(fits, op, world)
            ax_t.plot(grid, [fit.predict(world, x) for x in grid], styles[world], color=color, lw=1)
        ax_bw.plot(n, [ab.busbw_GBps(op, world, x, t) for x, t in zip(n, low)], styles[world],
                   marker=markers[world], ms=4, color=color, label=name)
    ax_t.set(xscale="log", yscale="log", xlabel="message size n (bytes)",
             ylabel="time per call (s): 10th percentile, bar to median",
             title="measured (points) and fitted α–β model (lines)")
    ax_bw.set(xscale="log", xlabel="message size n (bytes)",
              ylabel="bus bandwidth (GB/s, 1 GB = 10⁹ B)",
              title="nccl-tests busbw (of the 10th percentile)")
    ax_t.legend(fontsize=8)
    ax_bw.legend(fontsize=8)
    fig.tight_layout()
    return fig


def widget_sweep(ranks, max_world_size: int = MAX_SWEEP_WORLD_SIZE) -> W.Widget:
    """Operation, world size and size range -> re-run a small sweep and redraw."""
    wide = {"description_width": "initial"}
    op = W.Dropdown(options=sorted(ab.COST_MODELS), value="all_reduce", description="operation", style=wide)
    world = W.IntSlider(value=2, min=2, max=max_world_size, description="world size N (ranks)",
                        continuous_update=False, style=wide)
    sizes = W.IntRangeSlider(value=(10, 20), min=SIZE_EXPONENTS[0], max=SIZE_EXPONENTS[1],
                             description="message sizes, log₂ bytes (10 = 1 KiB, 28 = 256 MiB)",
                             continuous_update=False, style=wide,
                             layout=W.Layout(width="36em"))
    button = W.Button(description="run sweep")
    out = W.Output()

    def on_click(_):
        with out:
            out.clear_output(wait=True)
            sweep = run_small_sweep(ranks, op.value, world.value, tuple(sizes.value))
            print(cores_line(sweep.records[0].backend, world.value))
            for line in fit_lines(sweep.fits or {}, op_labels(sweep.records)):
                print(line)
            display(plot_sweep(sweep.records, sweep.fits))

    button.on_click(on_click)
    return previewed(W.VBox([W.HBox([op, world]), W.HBox([sizes, button]), out]))
