"""Notebook 07's pictures: predicted against measured step times of the 3-D layouts, their
breakdown by cause, the per-rank spans of one step, and the widget that runs a layout."""
from __future__ import annotations

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from helpers.cost.parallel3d import Breakdown, Comparison, predict
from helpers.labs.layouts import run_layout
from helpers.layout import Layout, factorizations
from helpers.views.kit import png_output, previewed, text_output

_COLOURS = {"compute": "tab:blue", "tp_comm": "tab:orange", "pp_comm": "tab:green",
            "dp_comm": "tab:red", "optimizer": "tab:brown"}
# the span kinds as the legend names them (the breakdown's words)
_KIND_LABELS = {"compute": "compute", "tp_comm": "TP comm", "pp_comm": "pipeline p2p",
                "dp_comm": "DP comm", "optimizer": "optimizer"}
# Time in no span is white, as the Gantt's gaps are: idle with a pipeline, unattributed
# without one (a layout has one or the other)
_IDLE = _UNATTRIBUTED = dict(facecolor="white", edgecolor="0.45")
# Breakdown.PARTS, in order: the span kinds' colours, then the time in no span
_PART_STYLES = tuple(dict(facecolor=c, edgecolor="white") for c in _COLOURS.values()) + (
    _IDLE, _UNATTRIBUTED)


def _name(layout: Layout) -> str:
    return f"{layout.d}·{layout.t}·{layout.p}" + (f" m={layout.m}" if layout.p > 1 else "")


def plot_parity(comparisons: list[Comparison], band: float = 0.15):
    """Predicted against measured step time, one point per layout, with the ±`band` cone."""
    fig = Figure(figsize=(5.2, 4.6), layout="constrained")
    ax = fig.subplots()
    measured = [1e3 * c.step_s for c in comparisons]
    predicted = [1e3 * c.predicted_s for c in comparisons]
    top = 1.15 * max(measured + predicted)
    ax.plot([0, top], [0, top], color="0.3", linewidth=1, label="prediction = measurement")
    ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], color="0.85",
                    label=f"±{band:.0%}")
    ax.scatter(measured, predicted, zorder=3, color="tab:purple")
    for (c, x, y), offset in zip(zip(comparisons, measured, predicted),
                                 _label_offsets(measured, predicted, top)):
        ax.annotate(_name(c.layout), (x, y), textcoords="offset points", xytext=offset,
                    fontsize=8, ha="left" if offset[0] > 0 else "right")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title="d·t·p layouts: model against measurement")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def _label_offsets(xs, ys, span: float) -> list[tuple[int, int]]:
    """Where each point's label goes (points of offset): right and above, unless an earlier
    label sits close by; then below, then to the left (so that labels do not overprint)."""
    placed, offsets = [], []
    for x, y in zip(xs, ys):
        for offset in ((5, 4), (5, -11), (-5, 4), (-5, -11)):
            near = [(px, py) for (px, py, o) in placed if o == offset
                    and abs(px - x) < 0.12 * span and abs(py - y) < 0.05 * span]
            if not near:
                break
        placed.append((x, y, offset))
        offsets.append(offset)
    return offsets


def plot_breakdown(comparisons: list[Comparison]):
    """Stacked bars per layout: measured (plain) and predicted (hatched), by cause; every
    millisecond of the step is in one part (idle or unattributed: time in no span)."""
    fig = Figure(figsize=(max(5.0, 1.5 * len(comparisons) + 2), 4.6), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    shown = set()  # the parts some bar shows: only those are in the legend
    for i, c in enumerate(comparisons):
        for dx, parts, hatch in ((-width / 2, c.measured, ""), (width / 2, c.predicted.breakdown, "//")):
            bottom = 0.0
            for key, style in zip(Breakdown.PARTS, _PART_STYLES):
                value = 1e3 * max(0.0, getattr(parts, key))
                ax.bar(i + dx, value, width, bottom=bottom, hatch=hatch, **style)
                bottom += value
                shown |= {key} if value > 0 else set()
    handles = [Patch(label=label, **style)
               for key, label, style in zip(Breakdown.PARTS, Breakdown.LABELS, _PART_STYLES)
               if key in shown]
    ax.set_xticks(range(len(comparisons)), [_name(c.layout) for c in comparisons], fontsize=9)
    ax.set(ylabel="ms per step")
    ax.set_title("each layout: measured (plain), predicted (hatched)", fontsize=10)
    ax.legend(handles=handles, fontsize=8, ncol=3, loc="upper center",
              bbox_to_anchor=(0.5, -0.1), frameon=False)  # below the bars, never over them
    return fig


def plot_gantt(timelines, title: str = "one step, rank by rank", pipelined: bool = True):
    """Every rank's spans of one step: compute, TP, pipeline and DP communication, the
    optimizer; the gaps are time in no span (idle with a pipeline, else unattributed)."""
    fig = Figure(figsize=(9, 0.5 * len(timelines) + 1.4), layout="constrained")
    ax = fig.subplots()
    for rank, spans in enumerate(timelines):
        for span in spans:
            ax.barh(rank, 1e3 * (span.end - span.start), left=1e3 * span.start, height=0.7,
                    color=_COLOURS[span.kind], edgecolor="none")
    # Patches, not empty bars: an empty barh has no patch to show, and the legend then drew
    # every entry in the default blue
    handles = [Patch(facecolor=colour, label=_KIND_LABELS[kind])
               for kind, colour in _COLOURS.items()] + [
                   Patch(label="idle" if pipelined else "unattributed", **_IDLE)]
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set(xlabel="ms since the step's start", title=title)
    ax.legend(handles=handles, fontsize=8, ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, -0.25), frameon=False)
    return fig


def _priced(layout: Layout, config, calibration) -> bool:
    """Can `predict` price this layout (every shape it runs was calibrated)?"""
    try:
        predict(layout, config, calibration)
    except ValueError:
        return False
    return True


def run_text(run, comparison: Comparison) -> str:
    """What a run of the widget measured, in two lines: the median step and the spread of
    the steps beside the prediction; the first step's loss every layout shares, and the loss
    now (the layout stays built and trains on from run to run)."""
    ms = sorted(1e3 * s for s in run.steps_s)
    measured = (f"median of {len(ms)} steps {1e3 * run.step_s:.0f} ms (steps "
                f"{ms[0]:.0f}–{ms[-1]:.0f} ms)" if len(ms) > 1 else f"1 step {ms[0]:.0f} ms")
    first = "" if run.first_loss is None else (
        f"its first step's loss {run.first_loss:.4f} (the fresh model's: the same on every "
        f"layout), ")
    return (f"{run.layout}: {measured}, predicted {1e3 * comparison.predicted_s:.0f} ms "
            f"({comparison.rel_error:+.0%})\n"
            f"loss: {first}{run.loss:.4f} at this run's first step (it trains on from run to run)")


def widget_parallel3d(live, calibration, config, steps: int = 3):
    """Choose d, t, p (only factorizations of the live world size) and m (only those that
    split the batch and that the calibration can price), run `steps` steps of the layout on
    the live ranks (built once, kept on them), show the median step and the spread of the
    steps against the prediction, that step's measured and predicted breakdown and the Gantt
    chart of its ranks. The button names the layout it will run."""
    world = live.world_size

    def ms_of(mesh) -> list[int]:   # the m that split the batch and the calibration can price
        return [m for m in range(1, config.batch + 1)
                if Layout(mesh.d, mesh.t, mesh.p, m).problem(config) is None
                and _priced(Layout(mesh.d, mesh.t, mesh.p, m), config, calibration)]

    meshes = [mesh for mesh in factorizations(world)
              if mesh.problem(config) is None and ms_of(mesh)]
    mesh_box = W.Dropdown(options=[(f"d={x.d} · t={x.t} · p={x.p}", x) for x in meshes],
                                description="d·t·p")
    m_box = W.Dropdown(description="m")
    button = W.Button(description="run", button_style="primary")
    out = W.Output()

    def chosen() -> Layout:
        mesh = mesh_box.value
        return Layout(mesh.d, mesh.t, mesh.p, m_box.value)

    def name_the_run(*_):
        # the output below keeps the last result until run is pressed: the button says what
        # it will run, the output's first line what it shows
        button.description = f"run {chosen()}"

    def valid_m(*_):
        mesh = mesh_box.value
        m_box.options = ms_of(mesh)
        m_box.value = 4 if mesh.p > 1 and 4 in m_box.options else m_box.options[0]
        name_the_run()

    def on_run(_):
        layout = chosen()
        with out:  # an error shows here, below the last result
            run = run_layout(live, layout, config, steps)
            comparison = Comparison(layout, run.breakdown, predict(layout, config, calibration))
            text = run_text(run, comparison)
            figures = (plot_breakdown([comparison]),
                       plot_gantt(run.timelines, str(layout), pipelined=layout.p > 1))
            pictures = tuple(png_output(fig) for fig in figures)
            # the text and both pictures replace the last result in one message, after the work
            out.outputs = (text_output(text),) + pictures

    mesh_box.observe(valid_m, "value")
    m_box.observe(name_the_run, "value")
    valid_m()
    button.on_click(on_run)
    return previewed(W.VBox([W.HBox([mesh_box, m_box, button]), out]))
