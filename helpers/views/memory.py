"""Notebook 08's pictures: measured bytes per rank against the ZeRO formulas, the live bytes
over one step, and the memory planner (stacked bars with this machine's measured points)."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from helpers.checks import check_choice
from helpers.configs import SMALL, TRANSFORMER, TransformerConfig
from helpers.hardware import H100_SXM
from helpers.cost.memory import (FP32_RUN, PRECISIONS, STAGES, ModelPreset, PlannedMemory,
                                 plan_memory, preset)
from helpers.labs.memory import StageResult
from helpers.units import format_decimal_bytes
from helpers.views.kit import FULL_LABEL, png_output, previewed

PARTS = ("params", "grads", "optimizer", "activations")
COLOURS = {"params": "#3182bd", "grads": "#e6550d", "optimizer": "#31a354",
           "activations": "#9e9ac8"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations (saved for backward)"}


def _stack(ax, x, values: dict[str, float], width=0.7, highlight=False, scale=1e6):
    bottom = 0.0
    for part in PARTS:
        if part in values:
            ax.bar(x, values[part] / scale, width, bottom=bottom, color=COLOURS[part],
                   edgecolor="black" if highlight else "white",
                   linewidth=2 if highlight else 0.5)
            bottom += values[part] / scale
    return bottom


def plot_measured_vs_formula(results: list[StageResult]) -> Figure:
    """One stacked bar per (stage, d): measured parameters, gradients, optimizer state and
    saved activations of rank 0; a black tick at the fp32 formula's state total."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    labels = []
    for x, res in enumerate(results):
        s = res.run.state
        _stack(ax, x, {"params": s.params, "grads": s.grads, "optimizer": s.optimizer,
                       "activations": res.run.activations})
        ax.plot([x - 0.4, x + 0.4], [res.formula().total / 1e6] * 2, color="black", linewidth=2)
        labels.append(f"stage {res.stage}\nd={res.d}")
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("MB per rank (10⁶ bytes)")
    handles = [Rectangle((0, 0), 1, 1, color=COLOURS[p]) for p in PARTS]
    handles.append(Line2D([], [], color="black", linewidth=2))
    ax.legend(handles, [LABELS[p] for p in PARTS] + ["formula: state (fp32 AdamW)"],
              fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.set_title("What rank 0 holds after a step, measured (bars) and the formula (ticks)")
    return fig


def plot_step_memory(results: list[StageResult], d: int) -> Figure:
    """Bytes live on rank 0 over one step (the profiler's allocator records), one line per
    stage at data degree d; dots at the peak."""
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax = fig.subplots()
    for res in results:
        if res.d != d:
            continue
        times, live = zip(*res.run.peak_curve)
        end = times[-1] or 1.0
        fractions = [t / end for t in times]
        line, = ax.plot(fractions, [b / 1e6 for b in live], label=STAGES[res.stage],
                        linewidth=1.2)
        top = max(range(len(live)), key=live.__getitem__)
        ax.plot(fractions[top], live[top] / 1e6, "o", color=line.get_color())
    ax.set(xlabel="fraction of the step (forward, backward, optimizer step)",
           ylabel="MB live on rank 0", title=f"Memory over one training step, d = {d}")
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------
# The planner.
# ----------------------------------------------------------------------------------------

def config_preset(name: str, config: TransformerConfig) -> ModelPreset:
    """A planner model from a TransformerConfig: its global batch split over d."""
    return preset(name, config.vocab, config.seq, config.hidden, config.heads, config.layers,
                  global_batch=config.batch)


MEASURED_MODEL = "notebook 08's model (measured here)"
MODELS = {m.name: m for m in (
    config_preset(MEASURED_MODEL, SMALL),
    config_preset("notebook 07's model", TRANSFORMER),
    preset("GPT-2 XL shape (1.6B), b = 1, s = 1024", 50257, 1024, 1600, 25, 48, batch=1),
    preset("7B shape (h 4096, 32 layers), b = 1, s = 4096", 32000, 4096, 4096, 32, 32, batch=1),
    preset("70B shape (h 8192, 80 layers), b = 1, s = 4096", 32000, 4096, 8192, 64, 80, batch=1),
)}
D_OPTIONS = tuple(2**k for k in range(11))  # 1 … 1024
# The GPU whose memory the planner's bars are held against (helpers.hardware's record)
DEVICE = H100_SXM


def d_options(model: ModelPreset) -> tuple[int, ...]:
    """The d a model allows: a split global batch needs d to divide it."""
    if model.batch is None:
        return tuple(d for d in D_OPTIONS if model.global_batch % d == 0)
    return D_OPTIONS


@dataclass(frozen=True)
class MeasuredPoint:
    """A bar's measured counterpart: rank 0's state and saved activations in one run."""
    stage: int
    d: int
    checkpointed: bool
    held: PlannedMemory


def measured_points(results: list[StageResult], checkpointed_activations: int | None = None
                    ) -> list[MeasuredPoint]:
    """Points from run_stages; with `checkpointed_activations` (one process on the whole
    batch, d = 1) also the checkpointed points at d = 1."""
    points = [MeasuredPoint(r.stage, r.d, False, PlannedMemory(r.run.state, r.run.activations))
              for r in results]
    if checkpointed_activations is not None:
        points += [MeasuredPoint(r.stage, 1, True,
                                 PlannedMemory(r.run.state, checkpointed_activations))
                   for r in results if r.d == 1]
    return points


def planner_figure(model: str, d: int, stage: int, checkpointed: bool, precision: str,
                   measured: list[MeasuredPoint] = ()) -> Figure:
    """The planner's picture: bytes per rank of every ZeRO stage at d as stacked bars (the
    chosen stage outlined), one GPU's memory (DEVICE) as a dashed line where the bars come
    within a tenth of it (else a line of text says how far off it is), and, for the model
    measured here in fp32, the measured totals as black diamonds on the bars they belong to."""
    check_choice("model", model, MODELS)
    check_choice("d", d, d_options(MODELS[model]))
    check_choice("stage", stage, STAGES)
    check_choice("precision", precision, PRECISIONS)
    preset_ = MODELS[model]
    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    plans = [plan_memory(preset_, d, s, checkpointed, precision) for s in STAGES]
    scale = 1e9 if plans[0].total >= 1e9 else 1e6
    unit = "GB" if scale == 1e9 else "MB"
    for s, plan in zip(STAGES, plans):
        top = _stack(ax, s, {"params": plan.state.params, "grads": plan.state.grads,
                             "optimizer": plan.state.optimizer,
                             "activations": plan.activations}, highlight=s == stage, scale=scale)
        ax.annotate(format_decimal_bytes(plan.total), (s, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    shown = [p for p in measured if model == MEASURED_MODEL and precision == FP32_RUN
             and p.d == d and p.checkpointed == checkpointed]
    if shown:
        ax.plot([p.stage for p in shown], [p.held.total / scale for p in shown], "D", color="black",
                label="measured on this machine (rank 0)")
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xticks(list(STAGES), [f"{s}: {name}" for s, name in STAGES.items()], fontsize=8)
    ax.set_ylabel(f"{unit} per rank ({'10⁹' if unit == 'GB' else '10⁶'} bytes)")
    tallest = max(p.total for p in plans)
    ax.set_ylim(0, 1.15 * tallest / scale)
    # The device the bars must fit: drawn where it is on the bars' scale, else said
    device = DEVICE.hbm_bytes
    if tallest >= device / 10:
        ax.axhline(device / scale, color="black", lw=1.2, ls="--")
        ax.annotate(f"one {DEVICE.name}: {format_decimal_bytes(device)}",
                    (max(STAGES) + 0.45, device / scale), ha="right", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1))  # legible over a bar
        ax.set_ylim(0, 1.15 * max(tallest, device) / scale)
    else:
        ax.text(0.01, 0.98, f"one {DEVICE.name} holds {format_decimal_bytes(device)}: "
                f"{device / tallest:,.0f}× the tallest bar", transform=ax.transAxes,
                ha="left", va="top", fontsize=8)
    pb, gb, kb = PRECISIONS[precision]
    ax.set_title(f"{model}: Ψ = {preset_.parameters:.3g}, d = {d}, "
                 f"{pb:g}+{gb:g}+{kb:g} bytes per parameter"
                 + (", checkpointed" if checkpointed else ""), fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=COLOURS[p]) for p in PARTS]
    fig.legend(handles, [LABELS[p] for p in PARTS], fontsize=8, ncol=4, loc="outside lower center",
               frameon=False)
    return fig


def widget_memory_planner(measured: list[MeasuredPoint] = ()) -> W.Widget:
    """Model, d (only the values the model allows), ZeRO stage, checkpointing and precision
    → planner_figure. Controls act on release; the figure is drawn, then shown."""
    style, layout = FULL_LABEL, W.Layout(width="620px")
    model = W.Dropdown(options=list(MODELS), value=MEASURED_MODEL, description="model",
                       style=style, layout=layout)
    d = W.SelectionSlider(options=d_options(MODELS[MEASURED_MODEL]), value=2,
                          description="d (data-parallel ranks)", continuous_update=False,
                          style=style, layout=layout)
    stage = W.ToggleButtons(options=[(str(s), s) for s in STAGES], value=3,
                            description="ZeRO stage", style=style)
    checkpointed = W.Checkbox(value=False, description="activation checkpointing per block",
                              indent=False, layout=W.Layout(width="auto"))  # label in full
    precision = W.Dropdown(options=list(PRECISIONS), value=FP32_RUN, description="dtypes",
                           style=style, layout=layout)
    out = W.Output()

    def redraw(*_):
        fig = planner_figure(model.value, d.value, stage.value, checkpointed.value,
                             precision.value, measured)
        out.outputs = (png_output(fig),)

    def on_model(_):
        options = d_options(MODELS[model.value])
        keep = d.value if d.value in options else options[-1 if d.value > options[-1] else 0]
        # New options reset the slider to their first value; `keep` is set right after, and
        # both go to the page in one message. (Held trait notifications would validate the
        # value against the old options at the end and keep the reset.)
        with d.hold_sync():
            d.options = options
            d.value = keep
        redraw()

    model.observe(on_model, names="value")
    for control in (d, stage, checkpointed, precision):
        control.observe(redraw, names="value")
    redraw()
    return previewed(W.VBox([model, d, stage, checkpointed, precision, out]))

