"""The pipeline pictures: Gantt charts of event logs, the bubble against m, and the widget.

`plot_*` return a matplotlib Figure and `widget_*` an ipywidgets widget; neither displays.
"""
from __future__ import annotations

import base64
import io
import threading

import ipywidgets as W
from matplotlib import colormaps
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from helpers.cost.bubble import bubble_theory
from helpers.models import LECTURE
from helpers.parallel import pp
from helpers.parallel.schedules import PIPELINE_SCHEDULES, Event

MAX_WIDGET_WORLD_SIZE = 8  # the widget's largest p: still timed honestly in wait mode


def _colour(mb: int):
    return colormaps["tab10"](mb % 10)


def _height(p: int) -> float:
    return max(2.6, 0.5 * p + 1.4)  # room for the legend


def _label(e: Event, v: int) -> str:
    return f"{e.kind}{e.mb}" + (f".{e.chunk}" if v > 1 else "")


def _fits(label: str, width: float, span: float, axes_inches: float = 8.3,
          fontsize: float = 7) -> bool:
    """Does `label` fit inside a bar `width` long on an axis `span` long, `axes_inches` wide?"""
    text_inches = (0.6 * len(label) + 0.5) * fontsize / 72  # glyph ≈ 0.6 em, + the white patch
    return width / span * axes_inches >= text_inches


def plot_gantt(events: list[Event], p: int, title: str = "", ax=None, unit: str = "ms",
               span: float | None = None) -> Figure:
    """Draw an event log (as returned by `run_pipeline` or `simulate`) on `ax` (a new figure
    when None) and return the figure.

    Each micro-batch has its own colour: its forwards are pale, its backwards full colour
    with a light hatch, so a reader can follow one micro-batch down the ranks and back up.
    White space is the bubble. A bar is labelled (F3, B3, or F3.1 for micro-batch 3 through
    chunk 1 when ranks hold several chunks) only when the label fits inside it; labels sit
    on a white patch, readable over any colour. Times start at 0; `unit` labels the axis;
    `span` (in that unit) widens the axis beyond this log's own length.
    """
    if ax is None:
        ax = Figure(figsize=(10, _height(p)), layout="constrained").add_subplot()
    t0 = min(e.start for e in events)
    scale = 1e3 if unit == "ms" else 1.0
    span = max(span or 0.0, (max(e.end for e in events) - t0) * scale)
    v = max(e.chunk for e in events) + 1
    inches = ax.get_position().width * ax.figure.get_figwidth()
    bars = {"F": ([], []), "B": ([], [])}  # kind -> (rectangles, colours): one collection each
    for e in events:
        start, width = (e.start - t0) * scale, e.duration * scale
        rectangles, colours = bars[e.kind]
        rectangles.append([(start, e.rank - 0.4), (start + width, e.rank - 0.4),
                           (start + width, e.rank + 0.4), (start, e.rank + 0.4)])
        colours.append(_colour(e.mb))
        label = _label(e, v)
        size = next((s for s in (7, 6) if _fits(label, width, span, inches, s)), None)
        if size:  # the largest font that fits, or no label
            ax.text(start + width / 2, e.rank, label, ha="center", va="center", fontsize=size,
                    clip_on=True, bbox=dict(boxstyle="round,pad=0.15", facecolor="white",
                                            edgecolor="none", alpha=0.85))
    for kind, (rectangles, colours) in bars.items():
        forward = kind == "F"
        ax.add_collection(PolyCollection(
            rectangles, facecolors=colours, alpha=0.4 if forward else 0.9,
            hatch=None if forward else "///", edgecolors="black" if forward else "white",
            linewidths=0.4, label=f"{kind} bars"))
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time (units of t_F)")
    handles = [Patch(facecolor="white", edgecolor="black", alpha=0.4, label="F (pale)"),
               Patch(facecolor="grey", edgecolor="white", hatch="///", label="B (hatched)"),
               Patch(facecolor="none", edgecolor="none", label="colour = mb")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure


def plot_runs(runs, unit: str = "ms") -> Figure:
    """Several `PipelineRun`s stacked on one time axis, each titled with its summary."""
    runs = list(runs)
    fig = Figure(figsize=(10, sum(_height(r.p) for r in runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    widest = max(r.makespan for r in runs) * (1e3 if unit == "ms" else 1.0)  # shared by all
    for ax, run in zip(axes[:, 0], runs):
        plot_gantt(run.events, run.p, title=run.summary(), ax=ax, unit=unit, span=widest)
    return fig


def plot_bubble_sweep(runs, ax=None) -> Figure:
    """Measured bubble of each run (dots) over the curve (p−1)/(m+p−1) for each p."""
    if ax is None:
        ax = Figure(figsize=(6, 3.5), layout="constrained").add_subplot()
    for i, p in enumerate(sorted({r.p for r in runs})):
        mine = [r for r in runs if r.p == p]
        ms = [r.m for r in mine]
        fine = [m / 4 for m in range(4, 4 * max(ms) + 1)]
        colour = colormaps["tab10"](i)
        ax.plot(fine, [bubble_theory(p, m) for m in fine], color=colour,
                label=f"(p−1)/(m+p−1), p={p}")
        ax.plot(ms, [r.bubble_measured for r in mine], "o", color=colour,
                label=f"measured, p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (micro-batches)")
    ax.set_ylabel("bubble (idle fraction)")
    ax.legend(fontsize=8, frameon=False)
    return ax.figure


WIDGET_T_F = 0.006  # seconds per forward in the widget's wait mode (a backward waits 2×)
M_CHOICES = (1, 2, 4, 8, 16)  # micro-batches the widget offers, where they fit (valid_ms)


def valid_ms(schedule: str, p: int, batch: int = LECTURE.batch) -> tuple[int, ...]:
    """The m of M_CHOICES that make a valid pipeline: m divides the batch, and the interleaved
    schedule also needs m to be a multiple of p."""
    return tuple(m for m in M_CHOICES
                 if batch % m == 0 and (schedule != "interleaved" or m % p == 0))


def schedules_for(p: int) -> tuple[str, ...]:
    """The schedules the widget offers at p stages: interleaving only where some m fits."""
    return tuple(s for s in PIPELINE_SCHEDULES if valid_ms(s, p))


def draw_pipeline(run: pp.PipelineRun, fig: Figure | None = None) -> Figure:
    """The widget's picture of one run, drawn into `fig` (a new figure when None). A figure
    drawn before keeps its axes: only the bars, labels, title and limits change, and the
    margins are fixed (no layout engine), which is most of what a redraw would cost."""
    height = _height(run.p)
    if fig is None:
        fig = Figure()
    fig.set_size_inches(10, height)
    if fig.axes:
        ax = fig.axes[0]
        for artist in [*ax.collections, *ax.texts]:
            artist.remove()
    else:
        ax = fig.add_subplot()
    fig.subplots_adjust(left=0.7 / 10, right=1 - 1.45 / 10, bottom=0.5 / height,
                        top=1 - 0.35 / height)
    plot_gantt(run.events, run.p, title=run.summary(), ax=ax, unit="ms")
    return fig


def png_output(fig: Figure) -> dict:
    """A figure as one display_data output (PNG bytes encoded here, not by a display hook)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                     "text/plain": f"<Figure: {fig.axes[0].get_title() if fig.axes else ''}>"}}


def text_output(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text + "\n"}


def pipeline_outputs(schedule: str, p: int, m: int, ranks=None, t_f: float = WIDGET_T_F,
                     fig: Figure | None = None) -> tuple[dict, ...]:
    """The widget's callback as a pure function: run (ranks) or simulate (ranks=None) one
    schedule and return what its Output shows, the Gantt chart (drawn into `fig`) and a line
    of text. Invalid settings say why instead of drawing."""
    try:
        run = pp.timed_schedule(schedule, p, m, ranks, t_f)
    except (ValueError, TypeError) as error:
        return (text_output(f"not a valid pipeline: {error}"),)
    fig = draw_pipeline(run, fig)
    return (png_output(fig),
            text_output(f"{run.summary()}; peak live micro-batches per rank {run.peak_live}"))


def widget_pipeline(ranks=None, t_f: float = WIDGET_T_F) -> W.Widget:
    """p, m and schedule controls; each change runs the schedule on live ranks in wait mode
    (`pp.timed_schedule`; ranks=None simulates it) and draws its Gantt chart.

    Only valid settings are offered (m from `valid_ms`, the schedules from `schedules_for`).
    Sliders act on release. Redraws are serialised (a lock) and always draw the controls'
    latest values, so two quick changes give one or two redraws, never a lost one; the
    picture is built after the run and put into the Output by setting its `outputs` (no
    matplotlib display hook involved)."""
    style = {"description_width": "initial"}
    out = W.Output(layout=W.Layout(min_height=f"{int(90 * _height(MAX_WIDGET_WORLD_SIZE))}px"))
    p = W.IntSlider(value=4, min=2, max=MAX_WIDGET_WORLD_SIZE, description="p (stages = ranks)",
                    continuous_update=False, style=style)
    schedule = W.Dropdown(options=schedules_for(4), value="1f1b", description="schedule",
                          style=style)
    m = W.SelectionSlider(options=valid_ms("1f1b", 4), value=4, description="m (micro-batches)",
                          continuous_update=False, style=style)
    fig = Figure()
    lock = threading.Lock()
    state = {"adjusting": False, "shown": None}

    def redraw():
        with lock:  # one redraw at a time, always of the latest values
            key = (schedule.value, p.value, m.value)
            if key == state["shown"]:
                return
            out.outputs = pipeline_outputs(*key, ranks=ranks, t_f=t_f, fig=fig)
            state["shown"] = key

    def on_p(_=None):
        state["adjusting"] = True  # the option changes below must not redraw on their own
        try:
            schedule.options = schedules_for(p.value)
            if schedule.value is None:
                schedule.value = "1f1b"
            on_schedule_options()
        finally:
            state["adjusting"] = False
        redraw()

    def on_schedule_options():
        ms, current = valid_ms(schedule.value, p.value), m.value
        if tuple(m.options) != ms:
            m.options = ms
            m.value = current if current in ms else min(ms, key=lambda x: abs(x - current))

    def on_schedule(_=None):
        if state["adjusting"]:
            return
        state["adjusting"] = True
        try:
            on_schedule_options()
        finally:
            state["adjusting"] = False
        redraw()

    def on_m(_=None):
        if not state["adjusting"]:
            redraw()

    p.observe(on_p, names="value")
    schedule.observe(on_schedule, names="value")
    m.observe(on_m, names="value")
    redraw()
    return W.VBox([W.HBox([p, schedule, m]), out])
