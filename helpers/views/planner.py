"""Notebook 10's picture and widget: one layout of a real training run, its memory per GPU
against the GPU's HBM and its step time part by part (helpers.cost.planner's arithmetic).

The pure part (`plan`, `derive_d`, `layout_from`, `summary`, `planner_figure`) takes records
and returns records, text or a Figure, so a test reads it without a browser; `widget_planner`
only wires controls to it.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from helpers.checks import check_choice, check_divisible, check_int
from helpers.cost.activations import RECOMPUTE
from helpers.cost.memory import STAGES
from helpers.cost.model_shapes import MODELS
from helpers.cost.planner import (GB, NODE, Job, Layout, Memory, Step, limits, memory,
                                  memory_limit, step)
from helpers.hardware import RUN_GPUS
from helpers.views.kit import image_output, png, previewed, text_output

# --- the choices the widget offers ------------------------------------------------------

# Powers of two from a node to 16,384 GPUs (Llama 3 405B's run), and three times a power of
# two (1,536, 3,072 …: Megatron-LM's and GPT-3-era clusters), all whole nodes of 8.
GPU_COUNTS = tuple(sorted({2 ** k for k in range(3, 15)} | {3 * 2 ** k for k in range(3, 13)}))
SEQS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = tuple(sorted({2 ** k for k in range(4, 15)} | {1536, 3072}))  # sequences per step
SCHEDULE_CHOICES = ("1f1b", "interleaved", "zb-h2", "dualpipev")
CHOICES = {"t": (1, 2, 4, 8, 16), "p": (1, 2, 4, 8, 16, 32, 64), "c": (1, 2, 4, 8, 16, 32),
           "e": (1, 2, 4, 8, 16, 32, 64, 128, 256), "v": (1, 2, 3, 4, 6, 8),
           "b": (1, 2, 4, 8, 16), "zero": tuple(STAGES), "recompute": RECOMPUTE,
           "schedule": SCHEDULE_CHOICES}
# Llama 3 405B's layout (Dubey et al. 2024, Table 4: TP 8, CP 1, PP 16, DP 128, interleaved),
# with ZeRO-2: with ZeRO-1 the planner counts 82.6 GB, over the H100's 80 GB.
DEFAULT_LAYOUT = dict(t=8, p=16, c=1, e=1, v=2, b=1, zero=2, recompute="selective",
                      schedule="interleaved")
FIXED = ("sp", "grad_bytes", "dropout")   # Layout fields the widget passes through unchanged

# --- colours, words ----------------------------------------------------------------------

MEMORY_COLOURS = {"parameters": "#3182bd", "gradients": "#e6550d", "optimizer state": "#31a354",
                  "activations": "#9e9ac8", "FSDP buffers": "#969696"}
STEP_COLOURS = {"compute": "#3182bd", "hidden communication (overlapped)": "#fdae6b",
                "exposed communication": "#de2d26", "pipeline bubble": "#bdbdbd"}
FONT = 8          # points: 8.9 px at the 80 dpi floor the tests hold every figure to


def percent(x: float) -> str:
    """A share as the widget prints it everywhere: 40.9%."""
    return f"{x:.1%}"


# --- pure: a plan and its words ----------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """A layout of a job, priced: the limits it breaks as a layout (`broken`: no step then),
    its memory per GPU (None where the arithmetic has no answer), its step, and whether it
    fits in the GPU's HBM (`overflow`: the memory limit's words, else "")."""
    job: Job
    layout: Layout
    broken: tuple[str, ...]
    memory: Memory | None
    step: Step | None
    overflow: str = ""


def plan(job: Job, lay: Layout) -> Plan:
    """Price `lay` on `job`: a malformed layout (limits(check_memory=False)) gets no step; one
    that does not fit gets its step and the memory limit it breaks."""
    if not isinstance(job, Job):
        raise TypeError(f"job must be a Job, got {type(job).__name__}")
    if not isinstance(lay, Layout):
        raise TypeError(f"layout must be a Layout, got {type(lay).__name__}")
    broken = tuple(limits(job, lay, check_memory=False))
    mem = memory(job, lay)
    if broken:
        return Plan(job, lay, broken, mem, None)
    over = memory_limit(job, mem)    # well formed: only the memory limit can be left
    return Plan(job, lay, (), mem, step(job, lay), "; ".join(over))


def derive_d(gpus: int, t: int, p: int, c: int) -> tuple[int, str]:
    """d = gpus / (t·p·c) and a line that says so. Where it is not a whole number (or less
    than 1) the line says that, and d is the whole part (at least 1): `limits` then names
    the broken product t·p·d·c."""
    rest = t * p * c
    exact = gpus / rest
    if gpus % rest == 0:
        return gpus // rest, f"d = {gpus:,} / ({t}·{p}·{c}) = {gpus // rest:,}"
    return max(1, gpus // rest), (f"d = {gpus:,} / ({t}·{p}·{c}) = {exact:,.4g}: not a whole "
                                  f"number of data-parallel ranks")


def check_layout_choices(layout: dict) -> dict:
    """The widget's layout keywords, each one of its control's choices (ValueError naming the
    first that is not); d is derived, never given."""
    if "d" in layout:
        raise ValueError("d must not be given: it is derived as gpus / (t·p·c), got "
                         f"{layout['d']!r}")
    known = set(CHOICES) | set(FIXED)
    for name, value in layout.items():
        if name not in known:
            raise ValueError(f"layout keyword must be one of {tuple(sorted(known))}, "
                             f"got {name!r}")
        if name in CHOICES:
            check_choice(name, value, CHOICES[name])
    return {**DEFAULT_LAYOUT, **layout}


def layout_from(gpus: int, **choices) -> tuple[Layout, str]:
    """The Layout the controls describe (d derived from gpus), and the line saying d."""
    d, note = derive_d(gpus, choices["t"], choices["p"], choices["c"])
    return Layout(d=d, **choices), note


def job_from(model: str, gpu: str, gpus: int, seq: int, batch: int) -> Job:
    """The job of the first controls, each argument checked (ValueError naming it)."""
    check_choice("model", model, MODELS)
    check_choice("gpu", gpu, RUN_GPUS)
    check_int("gpus", gpus)
    check_divisible("gpus", gpus, NODE, f"whole nodes of {NODE} GPUs")
    check_int("seq", seq)
    check_int("batch", batch)
    return Job(MODELS[model], RUN_GPUS[gpu], gpus, seq, batch)


def title(pl: Plan) -> str:
    """Two lines: what runs where, then MFU and step (or why there is no step)."""
    job = pl.job
    head = f"{job.model.name} · {job.gpus:,} × {job.gpu.name} · {pl.layout.label()}"
    if pl.step is None:
        n = len(pl.broken)
        return f"{head}\ncannot run: breaks {n} limit{'s' * (n != 1)}"
    priced = f"MFU {percent(pl.step.mfu)} · step {pl.step.seconds:.2f} s"
    return f"{head}\n" + (f"does not fit: {pl.overflow} · {priced}" if pl.overflow else priced)


def summary(pl: Plan) -> str:
    """The line under the figure: memory vs HBM, MFU, step, bubble; then the limits broken."""
    hbm = pl.job.gpu.hbm_bytes
    mem = ("memory per GPU: no count for this layout" if pl.memory is None else
           f"memory {pl.memory.total / GB:.1f} GB of {hbm / GB:.0f} GB HBM "
           f"({percent(pl.memory.total / hbm)})")
    if pl.step is None:
        return f"{mem} · no step\nlimits broken: " + "; ".join(pl.broken)
    s = pl.step
    line = (f"{mem} · MFU {percent(s.mfu)} · step {s.seconds:.2f} s · bubble "
            f"{percent(s.bubble)} ({s.bubble * s.seconds:.2f} s)")
    return line + (f"\nlimits broken: {pl.overflow}" if pl.overflow else "\nlimits broken: none")


# --- the figure -----------------------------------------------------------------------

def step_rows(s: Step) -> list[tuple[str, str, float]]:
    """(category, part, seconds) of each bar of the step panel, top to bottom: compute parts,
    hidden communication, exposed communication, the bubble; parts of 0 s left out."""
    rows = [("compute", k, v) for k, v in s.compute.items()]
    rows += [("hidden communication (overlapped)", k, v) for k, v in s.hidden.items()]
    rows += [("exposed communication", k, v) for k, v in s.exposed.items()]
    rows.append(("pipeline bubble", "pipeline bubble", s.bubble * s.seconds))
    return [r for r in rows if r[2] > 0]


def _memory_panel(ax, pl: Plan) -> None:
    hbm = pl.job.gpu.hbm_bytes / GB
    ax.set_title("memory per GPU (GB)", fontsize=FONT + 1, y=1.0)
    if pl.memory is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no memory count\nfor this layout", ha="center", va="center",
                fontsize=FONT, transform=ax.transAxes)
        return
    bottom = 0.0
    for term, value in pl.memory.terms().items():
        ax.bar(0, value / GB, 0.6, bottom=bottom, color=MEMORY_COLOURS[term], label=term,
               edgecolor="white", linewidth=0.5)
        bottom += value / GB
    ax.axhline(hbm, color="black", lw=1.2, ls="--")
    ax.text(0.98, hbm, f"HBM {hbm:.0f} GB", ha="right", va="bottom", fontsize=FONT,
            transform=ax.get_yaxis_transform())
    ax.set_xlim(-0.5, 2.0)
    ax.set_ylim(0, 1.2 * max(bottom, hbm))
    ax.set_xticks([])
    ax.tick_params(labelsize=FONT)
    ax.legend(fontsize=FONT - 0.5, loc="lower right", frameon=False, handlelength=1,
              borderaxespad=0.2)   # below the HBM line's label, beside the bar


def _step_panel(ax, pl: Plan) -> None:
    if pl.step is None:
        ax.set_axis_off()
        lines = ["No step: this layout breaks"]
        for limit in pl.broken:
            lines += textwrap.wrap(limit, 70, initial_indent="• ", subsequent_indent="  ")
        ax.text(0.0, 0.95, "\n".join(lines), ha="left", va="top", fontsize=FONT + 0.5,
                transform=ax.transAxes, color="#a50f15")
        return
    rows = step_rows(pl.step)
    for category in STEP_COLOURS:
        ys = [i for i, r in enumerate(rows) if r[0] == category]
        if ys:
            ax.barh(ys, [rows[i][2] for i in ys], 0.7, color=STEP_COLOURS[category],
                    label=category)
    ax.set_yticks(range(len(rows)), [r[1] for r in rows], fontsize=FONT)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    widest = max(r[2] for r in rows)
    ax.set_xlim(0, 1.12 * widest)
    for i, r in enumerate(rows):
        ax.text(r[2] + 0.01 * widest, i, f"{r[2]:.2f}", va="center", fontsize=FONT - 0.5)
    ax.tick_params(axis="x", labelsize=FONT)
    ax.xaxis.set_major_formatter("{x:g} s")
    # above the bars, where no bar reaches (the bubble's own row names it)
    handles = [Patch(color=STEP_COLOURS[k], label=k) for k in list(STEP_COLOURS)[:3]]
    ax.legend(handles=handles, fontsize=FONT - 0.5, loc="lower left", ncol=2, frameon=False,
              handlelength=1, borderaxespad=0.1, columnspacing=1.0,
              bbox_to_anchor=(-0.02, 1.0))


def planner_figure(job: Job, layout: Layout) -> Figure:
    """Left: memory per GPU by term (parameters, gradients, optimizer state, activations,
    FSDP buffers) as one stacked bar in GB against the GPU's HBM (dashed). Right: the step's
    parts as horizontal bars in seconds (compute, hidden and exposed communication, the
    bubble's share of the step); for a malformed layout, the limits it breaks instead. The
    title: MFU and step, and "does not fit: <limit>" where the memory is over the HBM."""
    return _figure(plan(job, layout))


def _figure(pl: Plan) -> Figure:
    # fixed margins, not a layout engine: one draw, no measuring of every label first
    fig = Figure(figsize=(9, 3.2))
    left = fig.add_axes((0.07, 0.06, 0.2, 0.66))
    right = fig.add_axes((0.56, 0.06, 0.42, 0.66))
    _memory_panel(left, pl)
    _step_panel(right, pl)
    fig.suptitle(title(pl), fontsize=FONT + 1, y=0.97, va="top",
                 color="#a50f15" if (pl.overflow or pl.step is None) else "black")
    return fig


# --- the widget --------------------------------------------------------------------------

def _dropdown(description: str, options, value, width: str = "150px") -> W.Dropdown:
    if value not in [v for _, v in options]:
        options = sorted(list(options) + [(f"{value:,}", value)], key=lambda o: o[1])
    return W.Dropdown(options=options, value=value, description=description,
                      style={"description_width": "initial"}, layout=W.Layout(width=width))


def _ints(values) -> list[tuple[str, int]]:
    return [(f"{v:,}", v) for v in values]


def widget_planner(model: str = "Llama 3 405B", gpu: str = "H100 SXM", gpus: int = 16384,
                   seq: int = 8192, batch: int = 2048, **layout) -> W.Widget:
    """Model, GPU, number of GPUs, sequence length, global batch and a layout (t, p, c, e, v,
    b, ZeRO stage, recomputation, schedule; d derived as gpus/(t·p·c) and shown) →
    planner_figure and a line of numbers under it. Every change computes the plan, draws the
    figure, then replaces the output once (one change in the browser)."""
    job_from(model, gpu, gpus, seq, batch)           # each argument checked before anything
    chosen = check_layout_choices(layout)
    fixed = {k: chosen.pop(k) for k in FIXED if k in chosen}
    controls = {
        "model": _dropdown("model", [(m, m) for m in MODELS], model, "230px"),
        "gpu": _dropdown("GPU type", [(g, g) for g in RUN_GPUS], gpu, "230px"),
        "gpus": _dropdown("GPUs (N)", _ints(GPU_COUNTS), gpus, "170px"),
        "seq": _dropdown("sequence (tokens)", _ints(SEQS), seq, "210px"),
        "batch": _dropdown("global batch (sequences)", _ints(BATCHES), batch, "250px"),
        "t": _dropdown("t (tensor)", _ints(CHOICES["t"]), chosen["t"], "130px"),
        "p": _dropdown("p (pipeline)", _ints(CHOICES["p"]), chosen["p"], "140px"),
        "c": _dropdown("c (context)", _ints(CHOICES["c"]), chosen["c"], "135px"),
        "e": _dropdown("e (experts)", _ints(CHOICES["e"]), chosen["e"], "145px"),
        "v": _dropdown("v (chunks per rank)", _ints(CHOICES["v"]), chosen["v"], "175px"),
        "b": _dropdown("b (micro-batch)", _ints(CHOICES["b"]), chosen["b"], "160px"),
        "zero": W.ToggleButtons(options=[(str(s), s) for s in STAGES], value=chosen["zero"],
                                description="ZeRO stage", style={"button_width": "36px",
                                                                 "description_width": "initial"}),
        "recompute": W.ToggleButtons(options=list(RECOMPUTE), value=chosen["recompute"],
                                     description="recompute",
                                     style={"button_width": "88px",
                                            "description_width": "initial"}),
        "schedule": _dropdown("schedule", [(s, s) for s in SCHEDULE_CHOICES],
                              chosen["schedule"], "200px"),
    }
    d_line = W.Label()
    out = W.Output()

    def current() -> tuple[Job, Layout, str]:
        v = {name: ctl.value for name, ctl in controls.items()}
        job = job_from(v["model"], v["gpu"], v["gpus"], v["seq"], v["batch"])
        lay, note = layout_from(v["gpus"], **{k: v[k] for k in CHOICES}, **fixed)
        return job, lay, note

    def redraw(*_):
        job, lay, note = current()
        d_line.value = note
        pl = plan(job, lay)
        picture = image_output(png(_figure(pl), dpi=90), title(pl).replace("\n", ": "))
        outputs = (picture, text_output(summary(pl)))
        out.outputs = outputs     # the picture and its line replace the last ones at once

    for ctl in controls.values():
        ctl.observe(redraw, names="value")
    redraw()
    c = controls
    box = W.VBox([W.HBox([c["model"], c["gpu"], c["gpus"]]),
                  W.HBox([c["seq"], c["batch"], c["schedule"]]),
                  W.HBox([c["t"], c["p"], c["c"], c["e"], c["v"], c["b"]]),
                  W.HBox([c["zero"], c["recompute"]]),
                  d_line, out])
    return previewed(box)



# --- the reality check's parity figure ------------------------------------------------------

def plot_parity(checks, moved: dict[str, tuple[float, str]] | None = None) -> Figure:
    """Predicted against published MFU, one numbered point per modelled run
    (helpers.cost.published_runs.reality_check), with the diagonal and the 1.6× line between
    which the model should put every run; a run that does not fit in memory by the planner's
    count is drawn hollow. `moved` maps a run's name to (another prediction, why): an arrow
    from the first to it (DeepSeek-V3 priced with FP8 matmuls)."""
    rows = [c for c in checks if c.predicted is not None]
    moved = moved or {}
    fig = Figure(figsize=(9.6, 4.4))
    ax = fig.add_axes((0.08, 0.12, 0.5, 0.78))
    top = max([max(c.predicted, c.published) for c in rows]
              + [x for x, _ in moved.values()]) * 1.12
    xs = [0, top]
    ax.plot(xs, xs, color="0.3", lw=1, label="predicted = published")
    ax.plot(xs, [1.6 * x for x in xs], color="0.3", lw=1, ls="--", label="1.6 × published")
    ax.fill_between(xs, xs, [1.6 * x for x in xs], color="#c7e9c0", alpha=0.5, lw=0,
                    label="where the model should be")
    names = []
    for k, c in enumerate(rows, 1):
        colour = "#31a354" if c.holds else "#de2d26"
        ax.scatter([c.published], [c.predicted], s=36, zorder=3, edgecolors=colour,
                   facecolors=colour if c.fits else "white", linewidths=1.5)
        ax.annotate(str(k), (c.published, c.predicted), xytext=(-9, 3),
                    textcoords="offset points", fontsize=FONT)
        line = f"{k:>2}  {c.run.name}: {c.predicted:.0%} / {c.published:.0%}"
        if c.run.name in moved:
            other, why = moved[c.run.name]
            ax.annotate("", (c.published, other), (c.published, c.predicted),
                        arrowprops=dict(arrowstyle="->", color="#756bb1", lw=1.2))
            ax.scatter([c.published], [other], s=36, zorder=3, color="#756bb1")
            line += f" ({why}: {other:.0%})"
        names.append(line)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top * 1.3)
    ax.set_xlabel("published MFU, converted to the course's convention", fontsize=FONT + 1)
    ax.set_ylabel("planner's MFU for that layout", fontsize=FONT + 1)
    ax.xaxis.set_major_formatter(lambda x, _pos: f"{x:.0%}")
    ax.yaxis.set_major_formatter(lambda y, _pos: f"{y:.0%}")
    ax.tick_params(labelsize=FONT)
    ax.legend(loc="upper left", fontsize=FONT, frameon=False)
    ax.set_title("Published runs against the planner (hollow: does not fit by its count)",
                 fontsize=FONT + 1)
    fig.text(0.61, 0.9, "run: predicted / published", fontsize=FONT + 1, va="top")
    fig.text(0.61, 0.84, "\n".join(textwrap.fill(x, 58, subsequent_indent="      ")
                                   for x in names), fontsize=FONT, va="top", linespacing=1.5)
    return fig
