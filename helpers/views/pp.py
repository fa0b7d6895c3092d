"""The pipeline pictures: Gantt charts of event logs, the bubble against m, and the widget.

`plot_*` return a matplotlib Figure and `widget_*` an ipywidgets widget; neither displays.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from functools import lru_cache

import ipywidgets as W
from matplotlib import colormaps
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from helpers.configs import LECTURE
from helpers.cost.bubble import bubble_theory
from helpers.cost.schedules import PIPELINE_SCHEDULES, Event
from helpers.labs import pp as pp_lab
from helpers.views.kit import FULL_LABEL, Blitted, image_output, previewed, text_output

MAX_STAGES = 8  # the widget's largest p: still timed honestly in wait mode


def _colour(mb: int):
    """Micro-batch mb's colour: tab10's ten hues, then their light twins (tab20 holds both),
    so m = 16 has 16 colours, none repeated."""
    return colormaps["tab20"]((2 * mb + (mb // 10) % 2) % 20)


def _height(p: int) -> float:
    return max(2.6, 0.5 * p + 1.4)  # room for the legend


LABEL_PT = 8  # a bar's label: 8 pt is 8.9 px at 80 dpi, the smallest text the course shows


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
    with a light hatch, so a reader can follow one micro-batch down the ranks and back up;
    where the backward is split, its W (the weights' gradient) is dotted.
    White space is the bubble. A bar is labelled (F3, B3, or F3.1 for micro-batch 3 through
    chunk 1 when ranks hold several chunks) only when the label fits inside it; labels sit
    on a white patch, readable over any colour. Times start at 0; `unit` labels the axis;
    `span` (in that unit) widens the axis beyond this log's own length.
    """
    if ax is None:
        ax = Figure(figsize=(10, _height(p)), layout="constrained").add_subplot()
    scale = 1e3 if unit == "ms" else 1.0
    t0 = min(e.start for e in events)
    span = max(span or 0.0, (max(e.end for e in events) - t0) * scale)
    gantt_axes(ax, p, span, unit)
    gantt_bars(ax, events, span, unit)
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure


def gantt_axes(ax, p: int, span: float, unit: str = "ms") -> None:
    """What a Gantt chart's axes show whatever its events: ranks, the time axis up to `span`
    (in `unit`), and the legend."""
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time (units of t_F)")
    handles = [Patch(facecolor="white", edgecolor="black", alpha=0.4, label="F (pale)"),
               Patch(facecolor="grey", edgecolor="white", hatch="///", label="B (hatched)"),
               Patch(facecolor="grey", edgecolor="black", alpha=0.7, hatch="..",
                     label="W (dotted)"),
               Patch(facecolor="none", edgecolor="none", label="colour = mb")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)


def gantt_bars(ax, events: list[Event], span: float, unit: str = "ms") -> list:
    """The bars of an event log (times from its first start) and the labels that fit in
    them, added to `ax` (whose time axis is `span` long, in `unit`); returns the artists."""
    t0 = min(e.start for e in events)
    scale = 1e3 if unit == "ms" else 1.0
    v = max(e.chunk for e in events) + 1
    inches = ax.get_position().width * ax.figure.get_figwidth()
    bars = {"F": ([], []), "B": ([], []), "W": ([], [])}  # kind -> (rectangles, colours)
    labels = []
    for e in events:
        start, width = (e.start - t0) * scale, e.duration * scale
        rectangles, colours = bars[e.kind]
        rectangles.append([(start, e.rank - 0.4), (start + width, e.rank - 0.4),
                           (start + width, e.rank + 0.4), (start, e.rank + 0.4)])
        colours.append(_colour(e.mb))
        # "F3" where it fits, else the micro-batch alone ("3": the bar's style says F, B or
        # W), at 8 pt (9 px at the widget's 80 dpi), else none
        label = next((text for text in (_label(e, v), _label(e, v)[1:])
                      if _fits(text, width, span, inches, LABEL_PT)), None)
        size = LABEL_PT if label else None
        if size:
            labels.append(ax.text(
                start + width / 2, e.rank, label, ha="center", va="center", fontsize=size,
                clip_on=True, bbox=dict(boxstyle="round,pad=0.15", facecolor="white",
                                        edgecolor="none", alpha=0.85)))
    style = {"F": dict(alpha=0.4, hatch=None, edgecolors="black"),
             "B": dict(alpha=0.9, hatch="///", edgecolors="white"),
             "W": dict(alpha=0.7, hatch="..", edgecolors="black")}  # a split backward's W
    collections = [ax.add_collection(PolyCollection(
        rectangles, facecolors=colours, linewidths=0.4, label=f"{kind} bars", **style[kind]))
        for kind, (rectangles, colours) in bars.items() if rectangles]
    return collections + labels  # in the order the axes draw them: bars under labels


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


def _nice_ceiling(x: float) -> float:
    """`x` rounded up to a multiple of a quarter of its power of ten (150 → 150, 151 → 175)."""
    step = 10 ** math.floor(math.log10(x)) / 4
    return math.ceil(x / step - 1e-9) * step


@lru_cache(maxsize=64)
def shared_span_ms(p: int, m: int, t_f: float) -> float:
    """The time axis of every schedule the widget offers at (p, m): the slowest one's
    simulated length, with a fifth more for what a real run adds (messages, waking up)."""
    return _nice_ceiling(1.2e3 * max(pp_lab.simulated_run(s, p, m, t_f=t_f).makespan
                                     for s in schedules_for(p) if m in valid_ms(s, p)))


class PipelineView:
    """The widget's Gantt chart. The axes (ranks, time axis, legend) are drawn once for each
    (p, time span) and kept (the last KEEP); a run draws only its bars, labels and title over
    the saved pixels. The schedules of one (p, m) share a time axis, so a switch of schedule
    compares their lengths at a glance; a run longer than that axis gets a longer one."""

    KEEP = 6

    def __init__(self, t_f: float = WIDGET_T_F):
        self.t_f = t_f
        self._axes: OrderedDict[tuple, Blitted] = OrderedDict()

    def _blitted(self, p: int, span: float) -> Blitted:
        blit = self._axes.pop((p, span), None)
        if blit is None:
            height = _height(p)
            fig = Figure(figsize=(10, height))
            fig.subplots_adjust(left=0.7 / 10, right=1 - 1.45 / 10, bottom=0.5 / height,
                                top=1 - 0.35 / height)   # fixed margins: no layout engine
            ax = fig.add_subplot()
            gantt_axes(ax, p, span)
            ax.set_title(" ", fontsize=10)
            blit = Blitted(fig, [ax.title], dpi=90)
        self._axes[p, span] = blit
        while len(self._axes) > self.KEEP:
            self._axes.popitem(last=False)
        return blit

    def png(self, run: pp_lab.PipelineRun) -> bytes:
        span = shared_span_ms(run.p, run.m, self.t_f)
        if run.makespan * 1e3 > span:
            span = _nice_ceiling(run.makespan * 1e3)
        blit = self._blitted(run.p, span)
        ax = blit.figure.axes[0]
        for artist in blit.moving[1:]:   # the last run's bars and labels
            artist.remove()
        ax.title.set_text(run.summary())
        blit.set_moving([ax.title, *gantt_bars(ax, run.events, span)])
        return blit.png()


def pipeline_outputs(schedule: str, p: int, m: int, ranks=None, t_f: float = WIDGET_T_F,
                     view: PipelineView | None = None) -> tuple[dict, ...]:
    """The widget's callback as a pure function: run (ranks) or simulate (ranks=None) one
    schedule and return what its Output shows, the Gantt chart (drawn by `view`, a new one
    when None) and a line of text. Invalid settings say why instead of drawing."""
    try:
        if ranks is not None and ranks.world_size < MAX_STAGES:
            ranks.resize(MAX_STAGES)  # once: every p then runs on the first p of these ranks
        run = pp_lab.timed_schedule(schedule, p, m, ranks, t_f, within=True)
    except (ValueError, TypeError) as error:
        return (text_output(f"not a valid pipeline: {error}"),)
    picture = (view or PipelineView(t_f)).png(run)
    return (image_output(picture, run.summary()),
            text_output(f"{run.summary()}\npeak live micro-batches per rank: {run.peak_live}"
                        + ("" if run.mode == "simulated" else
                           f"; makespan {1e3 * run.makespan:.1f} ms (the ranks' run, first start "
                           f"to last end)")))


def widget_pipeline(ranks=None, t_f: float = WIDGET_T_F) -> W.Widget:
    """p, m and schedule controls; each change runs the schedule on live ranks in wait mode
    (`pp_lab.timed_schedule`; ranks=None simulates it) and draws its Gantt chart.

    Only valid settings are offered (m from `valid_ms`, the schedules from `schedules_for`).
    Sliders act on release. Redraws are serialised (a lock) and always draw the controls'
    latest values, so two quick changes give one or two redraws, never a lost one; the
    picture is built after the run and put into the Output by setting its `outputs` (no
    matplotlib display hook involved)."""
    style = FULL_LABEL
    out = W.Output(layout=W.Layout(min_height=f"{int(90 * _height(MAX_STAGES))}px"))
    p = W.IntSlider(value=4, min=2, max=MAX_STAGES, description="p (stages = ranks)",
                    continuous_update=False, style=style)
    schedule = W.Dropdown(options=schedules_for(4), value="1f1b", description="schedule",
                          style=style)
    m = W.SelectionSlider(options=valid_ms("1f1b", 4), value=4, description="m (micro-batches)",
                          continuous_update=False, style=style,
                          layout=W.Layout(margin="2px 0 2px 24px"))  # apart from the menu
    view = PipelineView(t_f)
    lock = threading.Lock()
    state = {"adjusting": False, "shown": None}

    def redraw():
        with lock:  # one redraw at a time, always of the latest values
            key = (schedule.value, p.value, m.value)
            if key == state["shown"]:
                return
            out.outputs = pipeline_outputs(*key, ranks=ranks, t_f=t_f, view=view)
            state["shown"] = key

    def on_p(_=None):
        state["adjusting"] = True  # the option changes below must not redraw on their own
        try:
            previous, offered = schedule.value, schedules_for(p.value)
            if tuple(schedule.options) != offered:  # new options reset the value: restore it
                with schedule.hold_sync():  # one message, so the page never shows the reset
                    schedule.options = offered
                    schedule.value = previous if previous in offered else "1f1b"
            on_schedule_options()
        finally:
            state["adjusting"] = False
        redraw()

    def on_schedule_options():
        ms, current = valid_ms(schedule.value, p.value), m.value
        if tuple(m.options) != ms:
            with m.hold_sync():  # options and value in one message (see on_p)
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
    return previewed(W.VBox([W.HBox([p, schedule, m]), out]))
