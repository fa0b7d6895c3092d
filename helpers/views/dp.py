"""Pictures and widgets of notebook 03: the measured DDP timeline and the ZeRO memory sliders."""
from __future__ import annotations

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from helpers.cost.memory import MIXED_PRECISION_ADAM_BYTES, STAGES, zero_memory_per_rank
from helpers.parallel.trace import Span
from helpers.units import format_decimal_bytes
from helpers.views.kit import FULL_LABEL, previewed

COLOURS = {"forward": "#9ecae1", "backward": "#3182bd", "all_reduce": "#e6550d"}


def plot_timeline(traces: dict[str, list[list[Span]]]) -> Figure:
    """traces: {variant: [events of rank 0, events of rank 1, ...]} (dp.timeline's) -> one row
    per (variant, rank): compute on the upper lane, all-reduces in flight on the lower one,
    ticks where a gradient became ready. Time 0 is the first rank's start of that variant's
    step (they left a barrier)."""
    rows = [(v, r, events) for v, per_rank in traces.items() for r, events in enumerate(per_rank)]
    fig = Figure(figsize=(9, 0.6 * len(rows) + 1.2))
    ax = fig.subplots()
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
    handles = [Rectangle((0, 0), 1, 1, color=c, alpha=0.6 if k == "all_reduce" else 1)
               for k, c in COLOURS.items()] + [Line2D([], [], color="black")]
    ax.legend(handles, ["forward", "backward", "all-reduce in flight", "gradient ready (hook)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    return fig


def zero_memory_text(psi: float, d: int, stage: int,
                     optimizer_bytes: float = MIXED_PRECISION_ADAM_BYTES) -> str:
    """The widget's table: every ZeRO stage's bytes per rank in human units, `stage` marked."""
    ranks = f"{d} rank{'s' * (d != 1)}"
    lines = [f"Ψ = {psi:.3g} parameters on d = {ranks}; bytes per parameter: 2 (bf16 weight) "
             f"+ 2 (bf16 gradient) + K = {optimizer_bytes:g} (optimizer)",
             f"  {'stage':<30}{'weights':>10}{'gradients':>11}{'optimizer':>11}{'total':>10}"]
    for s, name in STAGES.items():
        m = zero_memory_per_rank(psi, d, s, optimizer_bytes=optimizer_bytes)
        cells = [format_decimal_bytes(b).rjust(width) for b, width in
                 ((m.params, 10), (m.grads, 11), (m.optimizer, 11), (m.total, 10))]
        lines.append(f"{'>' if s == stage else ' '} {name:<30}" + "".join(cells))
    return "\n".join(lines)


D_OPTIONS = tuple(2**k for k in range(11))  # d = 1 … 1024 ranks, one notch per doubling


def widget_zero_memory() -> W.Widget:
    """Sliders for Ψ (log scale), d (powers of two), stage and K (optimizer bytes per
    parameter) over zero_memory_text; they act on release."""
    style, layout = FULL_LABEL, W.Layout(width="560px")
    common = dict(continuous_update=False, style=style, layout=layout)
    return previewed(W.interactive(
        lambda psi, d, stage, optimizer_bytes: print(
            zero_memory_text(psi, d, stage, optimizer_bytes)),
        psi=W.FloatLogSlider(value=7.5e9, base=10, min=6, max=12, step=0.125,
                             readout_format=".3g", description="Ψ (parameters)", **common),
        d=W.SelectionSlider(options=D_OPTIONS, value=64, description="d (data-parallel ranks)",
                            **common),
        stage=W.SelectionSlider(options=(0, 1, 2, 3), value=1, description="ZeRO stage", **common),
        optimizer_bytes=W.IntSlider(value=MIXED_PRECISION_ADAM_BYTES, min=0, max=16,
                                    description="K (optimizer bytes per parameter)", **common)))