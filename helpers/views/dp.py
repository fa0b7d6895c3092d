"""Pictures and widgets of notebook 03: the measured DDP timeline and the ZeRO memory sliders."""
from __future__ import annotations

import ipywidgets as w
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from helpers.cost.memory import MIXED_PRECISION_ADAM_BYTES, zero_memory_table
from helpers.parallel.dp import TraceEvent

COLOURS = {"forward": "#9ecae1", "backward": "#3182bd", "all_reduce": "#e6550d"}


def plot_timeline(traces: dict[str, list[list[TraceEvent]]]) -> Figure:
    """traces: {variant: [events of rank 0, events of rank 1, ...]} (dp.timeline's) -> one row
    per (variant, rank): compute on the upper lane, all-reduces in flight on the lower one,
    ticks where a gradient became ready. Time 0 is the first rank's start of that variant's
    step (they left a barrier)."""
    rows = [(v, r, events) for v, per_rank in traces.items() for r, events in enumerate(per_rank)]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2))
    plt.close(fig)  # the caller displays it
    starts = {v: min(e.start for events in per_rank for e in events)
              for v, per_rank in traces.items()}
    for y, (v, _, events) in enumerate(rows):
        t0, n_reduce = starts[v], 0
        for e in sorted(events, key=lambda e: e.start):
            x, width = 1e3 * (e.start - t0), 1e3 * (e.end - e.start)
            if e.kind in ("forward", "backward"):
                ax.broken_barh([(x, width)], (y - 0.4, 0.4), color=COLOURS[e.kind])
            elif e.kind == "all_reduce":  # alternate two sub-lanes: several can be in flight
                ax.broken_barh([(x, width)], (y + 0.02 + 0.19 * (n_reduce % 2), 0.17),
                               facecolor=COLOURS[e.kind], alpha=0.6, edgecolor="black",
                               linewidth=0.5)
                n_reduce += 1
            elif e.kind == "grad":
                ax.plot([x, x], [y - 0.42, y + 0.02], color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{v} rank {r}" for v, r, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started (first rank)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.6 if k == "all_reduce" else 1)
               for k, c in COLOURS.items()] + [plt.Line2D([], [], color="black")]
    ax.legend(handles, ["forward", "backward", "all-reduce in flight", "gradient ready (hook)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    return fig


def widget_zero_memory() -> w.Widget:
    """Sliders for Ψ, d, stage and K (optimizer bytes per parameter) over zero_memory_table."""
    return w.interactive(
        lambda log10_psi, d, stage, optimizer_bytes: print(
            zero_memory_table(10 ** log10_psi, d, stage, optimizer_bytes=optimizer_bytes)),
        log10_psi=w.FloatSlider(value=9.875, min=6, max=12, step=0.125, description="log10 Ψ"),
        d=w.IntSlider(value=64, min=1, max=1024, description="d"),
        stage=w.IntSlider(value=1, min=0, max=3, description="stage"),
        optimizer_bytes=w.IntSlider(value=MIXED_PRECISION_ADAM_BYTES, min=0, max=16,
                                    description="K (opt. B/param)"))
