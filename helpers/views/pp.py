"""The pipeline pictures: Gantt charts of event logs, the bubble against m, and the widget.

`plot_*` return a matplotlib Figure and `widget_*` an ipywidgets widget; neither displays.
"""
from __future__ import annotations

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from helpers.cost.bubble import bubble_theory
from helpers.parallel import pp
from helpers.parallel.schedules import PIPELINE_SCHEDULES, Event

MAX_WIDGET_WORLD_SIZE = 8  # the widget's largest p: still timed honestly in wait mode


def _colour(mb: int):
    return plt.get_cmap("tab10")(mb % 10)


def _height(p: int) -> float:
    return max(2.6, 0.5 * p + 1.4)  # room for the legend


def plot_gantt(events: list[Event], p: int, title: str = "", ax=None, unit: str = "ms") -> Figure:
    """Draw an event log (as returned by `run_pipeline` or `simulate`) on `ax` (a new figure
    when None) and return the figure.

    Each micro-batch has its own colour: its forwards are pale, its backwards solid and
    hatched, so a reader can follow one micro-batch down the ranks and back up. White space
    is the bubble. Times are shifted so the schedule starts at 0; `unit` labels the axis.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(10, _height(p)), layout="constrained")
    t0 = min(e.start for e in events)
    scale = 1e3 if unit == "ms" else 1.0
    span = (max(e.end for e in events) - t0) * scale
    for e in events:
        start, width = (e.start - t0) * scale, e.duration * scale
        forward = e.kind == "F"
        ax.barh(e.rank, width, left=start, height=0.8, color=_colour(e.mb),
                alpha=0.45 if forward else 0.95, hatch=None if forward else "//",
                edgecolor="black", linewidth=0.4)
        if width > span / 60:  # label the bar only when there is room
            label = f"{e.kind}{e.mb}" + (f".{e.chunk}" if e.chunk else "")
            ax.text(start + width / 2, e.rank, label, ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time (units of t_F)")
    mbs = sorted({e.mb for e in events})
    handles = [Patch(facecolor=_colour(i), edgecolor="black", label=f"mb {i}") for i in mbs[:10]]
    handles += [Patch(facecolor="white", edgecolor="black", alpha=0.45, label="F: pale"),
                Patch(facecolor="grey", edgecolor="black", hatch="//", label="B: hatched")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure


def plot_runs(runs, unit: str = "ms") -> Figure:
    """Several `PipelineRun`s stacked on one time axis, each titled with its summary."""
    runs = list(runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, sum(_height(r.p) for r in runs)),
                             sharex=True, squeeze=False, layout="constrained")
    for ax, run in zip(axes[:, 0], runs):
        plot_gantt(run.events, run.p, title=run.summary(), ax=ax, unit=unit)
    widest = max(r.makespan for r in runs)
    axes[0, 0].set_xlim(0, widest * (1e3 if unit == "ms" else 1.0) * 1.01)  # shared by all
    return fig


def plot_bubble_sweep(runs, ax=None) -> Figure:
    """Measured bubble of each run (dots) over the curve (p−1)/(m+p−1) for each p."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, p in enumerate(sorted({r.p for r in runs})):
        mine = [r for r in runs if r.p == p]
        ms = [r.m for r in mine]
        fine = [m / 4 for m in range(4, 4 * max(ms) + 1)]
        colour = plt.get_cmap("tab10")(i)
        ax.plot(fine, [bubble_theory(p, m) for m in fine], color=colour,
                label=f"(p−1)/(m+p−1), p={p}")
        ax.plot(ms, [r.bubble_measured for r in mine], "o", color=colour,
                label=f"measured, p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (micro-batches)")
    ax.set_ylabel("bubble (idle fraction)")
    ax.legend(fontsize=8, frameon=False)
    return ax.figure


def widget_pipeline(ranks=None, t_f: float = 0.02) -> W.Widget:
    """Sliders for p and m and a schedule menu; each change runs the schedule on live ranks
    in wait mode (`pp.timed_schedule`; ranks=None simulates it) and draws its Gantt chart."""
    out = W.Output()
    p = W.IntSlider(value=4, min=2, max=MAX_WIDGET_WORLD_SIZE, description="p (ranks)")
    m = W.IntSlider(value=4, min=1, max=16, description="m (micro)")
    schedule = W.Dropdown(options=PIPELINE_SCHEDULES, value="1f1b", description="schedule")

    def update(_=None):
        with out:
            out.clear_output(wait=True)
            try:
                run = pp.timed_schedule(schedule.value, p.value, m.value, ranks, t_f)
            except (ValueError, TypeError) as error:
                print(f"not a valid pipeline: {error}")
                return
            fig = plot_runs([run])
            display(fig)
            plt.close(fig)
            print(f"{run.summary()}; peak live micro-batches per rank {run.peak_live}")

    for control in (p, m, schedule):
        control.observe(update, names="value")
    update()
    return W.VBox([W.HBox([p, m, schedule]), out])
