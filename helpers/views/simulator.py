"""Notebook 06's interactive simulator: pure functions for figures and tables, and a thin
ipywidgets shell (`SimulatorApp`, laid out by `widget_simulator`) that only wires them to
controls.

Everything a reader sees is computed by the functions here from `Curve`s, so the tests call
the same functions (and the app's callbacks) without a browser. Printed text says width,
experts and tokens per batch, never d, s or B: in this course d is the data-parallel degree,
s the sequence length and b the micro-batch (see `helpers.simulator`).
"""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, replace
import ipywidgets as W
from IPython.display import Image, display
from matplotlib.figure import Figure

from helpers.hardware import GPU, GTX_580, H100_SXM, KIB, MIB, NetworkLevel, PRESETS

from helpers.simulator.config import PRICES_USD, gpu_to_json, validate_gpu
from helpers.simulator.curve import Curve, Point, run_curve
from helpers.simulator.report import SECONDS_PER_MONTH, bubble_seconds, dumps, price_of
from helpers.simulator.settings import BATCH_LAWS, SCHEDULES, Settings, validate_settings
from helpers.views.kit import FULL_LABEL, Blitted, decade_label, fixed_layout, png


@dataclass
class Configuration:
    """What Epoch's tool calls a configuration: scaling laws + GPU + parallelism assumptions."""

    name: str
    gpu: GPU
    settings: Settings
    included: bool = True


def default_configurations() -> list[Configuration]:
    return [
        Configuration("H100 SXM dense", H100_SXM, Settings()),
        Configuration("H100 SXM sparse (MoE)", H100_SXM, Settings(sparse=True)),
        Configuration("GTX 580 dense", GTX_580, Settings(price_per_gpu=PRICES_USD["GTX 580"])),
    ]


# --- figures and tables: pure functions of curves --------------------------------------

def same_curve(a: Curve, b: Curve) -> bool:
    """Two curves with the same points (compute and MFU): one would hide the other."""
    return [(p.model.C, p.mfu) for p in a.points] == [(p.model.C, p.mfu) for p in b.points]


def plot_mfu(curves: dict[str, Curve], relative: bool = False) -> Figure:
    """MFU against training compute, one line per configuration.

    Each curve gets its bar, τ × its ceiling, as a dashed line of its colour, a star on its
    largest compute at or above the bar and a circle where linear scaling ends. With
    `relative`, MFU is divided by each GPU's ceiling (its effective utilization), so GPUs
    with different ceilings share one bar, τ. A curve identical to an earlier one is drawn
    dashed and hollow and says so in the legend instead of hiding under it.
    """
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    seen: list[tuple[str, Curve]] = []
    for name, curve in curves.items():
        scale = 1 / curve.gpu.effective_utilization if relative else 1.0
        pts = curve.feasible
        twin = next((other for other, c in seen if same_curve(c, curve)), None)
        label = (name if twin is None or f"(= {twin})" in name
                 else f"{name} (same curve as {twin})")
        style = dict(marker=".") if twin is None else dict(ls="--", marker="o", mfc="none",
                                                           ms=7)
        line, = ax.plot([p.model.C for p in pts], [p.mfu * scale for p in pts], label=label,
                        **style)
        color = line.get_color()
        ax.axhline(curve.mfu_bar * scale, color=color, ls="--", lw=0.8, alpha=0.7)
        end = curve.linear_scaling_ends()
        if end is not None and end.feasible:
            ax.plot([end.model.C], [end.mfu * scale], "o", mfc="none", ms=10, color=color)
        best = curve.max_feasible_at_threshold()
        if best is not None:
            ax.plot([best.model.C], [best.mfu * scale], "*", ms=13, color=color, mec="black",
                    mew=0.6)
        if len(curve.points) > len(pts):  # the latency wall: first infeasible grid point
            ax.axvline(curve.points[-1].model.C, color=color, ls=":", lw=1)
        seen.append((name, curve))
    ax.set_xscale("log")
    ax.minorticks_off()   # decades only: minor ticks cost most of a redraw
    # plain-text tick labels and pinned title and labels: redrawn on every slider release,
    # so nothing is laid out by mathtext or placed by measuring ticks (as plot_degrees)
    ax.xaxis.set_major_formatter(decade_label)
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("MFU ÷ the GPU's ceiling" if relative else "MFU (against peak FLOP/s)")
    fixed_layout(ax, xlabel_y=-0.08, ylabel_x=-0.08)
    ax.set_ylim(0, 1.05 if relative else 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("dashed: τ × ceiling · ★ largest compute at or above it · ○ linear scaling "
                 "ends · dotted: first infeasible point", fontsize=9, y=1.0)
    return fig


DEGREES = (("dp", "DP"), ("tp_model", "TP_model"), ("tp_ff", "TP_ff"), ("pp", "PP"),
           ("ep", "EP"), ("m", "micro-batches m"))


def plot_degrees(curve: Curve, name: str = "") -> Figure:
    """How each parallel degree of the best layout grows with compute."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    pts = curve.feasible
    for attr, label in DEGREES:
        ax.plot([p.model.C for p in pts], [getattr(p.plan, attr) for p in pts],
                marker=".", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.minorticks_off()
    # plain-text tick labels and pinned title and labels: redrawn on every choice of the
    # configuration menu, so nothing is laid out by mathtext or placed by measuring ticks
    ax.xaxis.set_major_formatter(decade_label)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("degree")
    fixed_layout(ax, xlabel_y=-0.08, ylabel_x=-0.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(name, y=1.0)
    return fig


@dataclass(frozen=True)
class SummaryCell:
    """One summary point of a configuration; every field None where no point qualifies."""

    compute_flop: float | None = None
    mfu: float | None = None
    n_gpus: float | None = None
    months: float | None = None
    cost_usd: float | None = None

    @classmethod
    def of(cls, point: Point | None, price: float | None) -> "SummaryCell":
        if point is None or not point.feasible:
            return cls()
        return cls(float(point.model.C), point.mfu, point.plan.n_gpus,
                   point.run_time_s / SECONDS_PER_MONTH,
                   None if price is None else price * point.plan.n_gpus)


@dataclass(frozen=True)
class SummaryRow:
    """A configuration's three summary points (the `Curve` methods' names)."""

    configuration: str
    price_per_gpu: float | None
    linear_scaling_ends: SummaryCell
    max_feasible_at_threshold: SummaryCell
    largest_feasible: SummaryCell


SUMMARIES = (("linear_scaling_ends", "linear scaling ends"),
             ("max_feasible_at_threshold", "largest compute at MFU ≥ τ × ceiling"),
             ("largest_feasible", "largest feasible run"))


def summary_rows(curves: dict[str, Curve]) -> list[SummaryRow]:
    """Per configuration, the three summary points with GPUs, duration and cost."""
    rows = []
    for name, curve in curves.items():
        price = price_of(curve)
        rows.append(SummaryRow(name, price, **{
            attr: SummaryCell.of(getattr(curve, attr)(), price) for attr, _ in SUMMARIES}))
    return rows


def describe(point: Point, price: float | None = None) -> str:
    """One line that says what a grid point is and how the search parallelised it."""
    m = point.model
    head = (f"C = {m.C:.3g} FLOP (width {m.d}, L = {m.L}, experts {m.s}, "
            f"{m.B:.3g} tokens per batch)")
    q = point.plan
    if q is None:
        return head + ": infeasible — no cluster of up to experts × 2^59 GPUs finishes in time"
    sched = "zero-bubble" if q.zero_bubble else f"1F1B, v = {q.v}"
    cost = "" if price is None else f", ${price * q.n_gpus:.3g} of GPUs"
    return (f"{head}: {q.n_gpus:.3g} GPUs, MFU {point.mfu:.3f}, "
            f"{point.run_time_s / SECONDS_PER_MONTH:.2f} months{cost}\n"
            f"    TP ({q.tp_model}, {q.tp_ff}), PP {q.pp} ({sched}, m = {q.m}), DP {q.dp}, "
            f"EP {q.ep}; per level {q.degrees_on_levels()}")


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


_CELLS = (("compute_flop", ".3g"), ("mfu", ".3f"), ("n_gpus", ".3g"), ("months", ".2f"),
          ("cost_usd", ".3g"))


def summary_html(rows: list[SummaryRow]) -> str:
    """The largest-runs table: one line per configuration and summary point, seven narrow
    columns, so it fits the tab."""
    head = ("<tr><th>configuration</th><th>summary point</th><th>C (FLOP)</th><th>MFU</th>"
            "<th>GPUs</th><th>months</th><th>cost (USD)</th></tr>")
    body = []
    for r in rows:
        for k, (attr, label) in enumerate(SUMMARIES):
            c = getattr(r, attr)
            name = html.escape(r.configuration) if k == 0 else ""
            top = " style='border-top:1px solid #999'" if k == 0 else ""
            body.append(f"<tr{top}><td>{name}</td><td>{html.escape(label)}</td>" + "".join(
                f"<td>{_fmt(getattr(c, key), spec)}</td>" for key, spec in _CELLS) + "</tr>")
    return ("<table cellpadding='3' style='font-size:12px;border-collapse:collapse;max-width:100%'>"
            + head + "".join(body) + "</table><p style='font-size:12px'>cost = GPUs × price "
            "per GPU (hardware only); — where no price is set or no point qualifies.</p>")


def breakdown_parts(point: Point, settings: Settings) -> dict[str, float]:
    """Seconds of one step by cause, as the model charges them (exposed latency only).

    The matmul time is split: its fixed latency per matmul (a floor no number of GPUs
    lowers) and the rest, arithmetic or memory traffic."""
    t = point.plan.time
    lat = t.dp_lat + (0.0 if point.plan.zero_bubble else t.tp_lat + t.ppep_lat)
    floor = point.matmul_latency_s
    return {"matmul arithmetic": t.matmul - floor, "matmul latency floor": floor,
            "TP bandwidth": t.tp_bw, "PP/EP bandwidth": t.ppep_bw,
            "DP bandwidth": t.dp_bw, "network latency": lat,
            "bubble": bubble_seconds(t, settings)}


def plot_breakdown(point: Point, settings: Settings, title: str = "") -> Figure:
    """Why utilization falls: each cause of one step's time next to the step itself."""
    fig = Figure(figsize=(8, 3.4))
    # fixed margins, wide enough for the longest cause's name: tight_layout would measure every
    # label, and cost about as much as the draw itself
    fig.subplots_adjust(left=0.22, right=0.98, top=0.9, bottom=0.2)
    ax = fig.subplots()
    if point.plan is None:
        ax.text(0.5, 0.5, "infeasible: no cluster finishes in time", ha="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    parts = breakdown_parts(point, settings)
    hidden = {"TP bandwidth": settings.overlap_tp, "PP/EP bandwidth": settings.overlap_pp,
              "DP bandwidth": settings.overlap_dp}
    names = list(parts)[::-1]
    colors = ["#bbb" if hidden.get(n) else "C1" if n == "matmul latency floor" else "C0"
              for n in names]
    ax.barh(names, [parts[n] for n in names], color=colors)
    ax.axvline(point.plan.time.step, color="C3", lw=1.5, label="step time")
    ax.set_xlabel("seconds per training step")
    fixed_layout(ax, xlabel_y=-0.14, ylabel_x=-0.25)
    ax.set_title(title or breakdown_title(point), fontsize=10, y=1.0)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, "grey: overlaps the matmuls (only its excess over them costs time); "
             "orange: the fixed latency of every matmul", fontsize=7)
    return fig


class BreakdownView:
    """The step breakdown of one curve's grid points as the widget shows it: the figure is drawn
    once; a move to another feasible point redraws only what changes (the bars, the step line,
    the title, the seconds axis and the legend above them) over the saved pixels. An infeasible
    point is drawn on its own."""

    def __init__(self, curve: Curve):
        self.curve = curve
        self._blit = None

    def png(self, index: int) -> bytes:
        point = self.curve.points[index]
        if point.plan is None:
            return png(plot_breakdown(point, self.curve.settings))
        if self._blit is None:
            fig = plot_breakdown(point, self.curve.settings)
            ax = fig.axes[0]
            self._ax, self._bars, self._line = ax, list(ax.patches), ax.lines[0]
            self._blit = Blitted(fig, [*self._bars, self._line, ax.xaxis, ax.title,
                                       ax.get_legend()])
        parts = breakdown_parts(point, self.curve.settings)
        step = point.plan.time.step
        names = list(parts)[::-1]   # as plot_breakdown draws them, bottom to top
        for bar, name in zip(self._bars, names):
            bar.set_width(parts[name])
        self._line.set_xdata([step, step])
        # The limits a fresh draw gets: the bars with matplotlib's 5% margin, widened to the
        # step line only where it falls beyond them (axvline rescales only then).
        right = 1.05 * max(parts.values())
        self._ax.set_xlim(0, right if step <= right else 1.05 * step)
        self._ax.title.set_text(breakdown_title(point))
        return self._blit.png()


def breakdown_title(point: Point) -> str:
    q = point.plan
    return f"C = {point.model.C:.3g} FLOP on {q.n_gpus:.3g} GPUs, MFU {point.mfu:.3f}"


_BUTTON = ("display:inline-block;padding:5px 14px;background:#1976d2;color:#fff;"
           "border-radius:4px;text-decoration:none;font-weight:600;cursor:pointer")


def download_html(curves: dict[str, Curve], filename: str = "simulator_output.json") -> str:
    """A download button (an anchor styled as one) for the complete output, the CLI's JSON."""
    payload = base64.b64encode(dumps(curves).encode()).decode()
    n = len(curves)
    return (f'<a download="{filename}" href="data:application/json;base64,{payload}" '
            f'style="{_BUTTON}" title="the format of python -m helpers.simulator --json">'
            f"⬇ Download results ({n} configuration{'s' if n != 1 else ''}, JSON)</a>")


def scaled_gpu(gpu: GPU, latency: float = 1.0, bandwidth: float = 1.0) -> GPU:
    """The GPU with every latency (matmul and network) × `latency` and every network
    bandwidth × `bandwidth`: the app's two what-if sliders."""
    if latency == 1 and bandwidth == 1:
        return gpu
    return replace(gpu, latency_per_matmul_s=gpu.latency_per_matmul_s * latency,
                   network_levels=tuple(replace(lv, bandwidth_Bps=lv.bandwidth_Bps * bandwidth,
                                                latency_s=lv.latency_s * latency)
                                        for lv in gpu.network_levels))


# --- the add-configuration form: values → Configuration ---------------------------------

# (field, label, unit, scale, kind): the GPU record's fields, as the form shows them. A value
# in the form times `scale` is the record's value in SI units (bytes, B/s, Hz, s).
GPU_FIELDS = (
    ("bitwidth", "bits per number (training precision)", "bits", 1, int),
    ("fpct", "FLOP per clock per thread at that precision", "", 1, float),
    ("register_bytes_per_processing_block", "register file per processing block", "KiB",
     KIB, float),
    ("num_sms", "streaming multiprocessors (SMs)", "", 1, int),
    ("l2_Bps", "L2 cache bandwidth", "TB/s", 1e12, float),
    ("l2_bytes", "L2 cache size", "MiB", MIB, float),
    ("hbm_Bps", "memory (HBM) bandwidth", "TB/s", 1e12, float),
    ("hbm_bytes", "memory (HBM) size", "GB", 1e9, float),
    ("max_clock_Hz", "max clock", "MHz", 1e6, float),
    ("effective_utilization", "effective utilization (the MFU ceiling)", "", 1, float),
    ("latency_per_matmul_s", "fixed latency per matmul", "µs", 1e-6, float),
)
LEVEL_FIELDS = (("bandwidth_Bps", "bandwidth per GPU, both directions", "GB/s", 1e9),
                ("latency_s", "latency", "µs", 1e-6), ("size", "GPUs in the level", "", 1))


def to_form_units(value: float, scale: float) -> float:
    """A record value in the form's unit, rounded to 12 significant digits (no 0.30000004)."""
    return float(f"{value / scale:.12g}")


def from_form_units(value: float, scale: float) -> float:
    return float(f"{value * scale:.12g}")


def form_values(name: str, gpu: GPU, settings: Settings) -> dict:
    """A configuration as plain values in SI units (to prefill the form from a preset)."""
    values = {f: getattr(gpu, f) for f, *_ in GPU_FIELDS if f != "fpct"}
    values.update(name=name, fpct=gpu.flop_per_clock_per_thread[gpu.bitwidth],
                  distributed_shared_memory=gpu.distributed_shared_memory,
                  levels=[{"bandwidth_Bps": lv.bandwidth_Bps, "latency_s": lv.latency_s,
                           "size": lv.size} for lv in gpu.network_levels],
                  price_per_gpu=settings.price_per_gpu, **{
                      k: getattr(settings, k) for k in (
                          "tokens_per_param", "batch_law", "depth_coef", "depth_exp", "sparse",
                          "overlap_tp", "overlap_pp", "overlap_dp")},
                  schedules=list(settings.schedules))
    return values


def configuration_from_form(values: dict) -> Configuration:
    """Build and validate a configuration; ValueError names the first field that cannot work."""
    levels = values["levels"]
    gpu = GPU(
        name=values["name"] or "custom GPU", bitwidth=values["bitwidth"],
        flop_per_clock_per_thread={values["bitwidth"]: values["fpct"]},
        register_bytes_per_processing_block=values["register_bytes_per_processing_block"],
        num_sms=values["num_sms"], l2_Bps=values["l2_Bps"], l2_bytes=values["l2_bytes"],
        hbm_Bps=values["hbm_Bps"], hbm_bytes=values["hbm_bytes"],
        max_clock_Hz=values["max_clock_Hz"],
        effective_utilization=values["effective_utilization"],
        distributed_shared_memory=values["distributed_shared_memory"],
        latency_per_matmul_s=values["latency_per_matmul_s"],
        network_levels=tuple(NetworkLevel(lv["bandwidth_Bps"], lv["latency_s"],
                                          lv["size"] if k < len(levels) - 1 else None)
                             for k, lv in enumerate(levels)))
    validate_gpu(gpu)
    settings = validate_settings(Settings(
        tokens_per_param=values["tokens_per_param"], batch_law=values["batch_law"],
        depth_coef=values["depth_coef"], depth_exp=values["depth_exp"],
        sparse=values["sparse"], schedules=tuple(values["schedules"]),
        overlap_tp=values["overlap_tp"], overlap_pp=values["overlap_pp"],
        overlap_dp=values["overlap_dp"], price_per_gpu=values["price_per_gpu"]))
    return Configuration(values["name"] or gpu.name, gpu, settings)


def same_configuration(a: Configuration, b: Configuration) -> bool:
    """Same hardware record (all but the name) and same settings: the same curve."""
    return (gpu_to_json(replace(a.gpu, name="")) == gpu_to_json(replace(b.gpu, name=""))
            and a.settings == b.settings)


# --- the app ------------------------------------------------------------------------------

def _labelled(widget: W.Widget, label: str, unit: str = "", width: str = "100px") -> W.HBox:
    """A control with its full label in front and its unit behind (labels never cut)."""
    widget.layout = W.Layout(width=width)
    return W.HBox([W.Label(label, layout=W.Layout(width="300px")), widget,
                   W.Label(unit, layout=W.Layout(width="50px"))])


class SimulatorApp:
    """Controls → pure functions → outputs. Every callback can be called directly.

    Sliders act on release (`continuous_update=False`): months, latency and bandwidth re-run
    the curves (each configuration's curve is cached, so going back is instant); the
    threshold only re-reads the curves it already has (it changes no layout)."""

    MAX_LEVELS = 5

    def __init__(self, configs: list[Configuration] | None = None, months: float = 3,
                 threshold: float = 0.8):
        self.configs = list(configs if configs is not None else default_configurations())
        self.curves: dict[str, Curve] = {}
        self._cache: dict[tuple, Curve] = {}
        self.months = W.FloatSlider(value=months, min=0.25, max=24, step=0.25,
                                    description="run duration (months)",
                                    continuous_update=False, style=FULL_LABEL,
                                    layout=W.Layout(width="420px"))
        self.threshold = W.FloatSlider(value=threshold, min=0.05, max=1.0, step=0.05,
                                       description="threshold τ (fraction of the MFU ceiling)",
                                       continuous_update=False, style=FULL_LABEL,
                                       layout=W.Layout(width="420px"))
        self.latency = W.FloatLogSlider(value=1, base=10, min=-2, max=1, step=0.25,
                                        description="every latency × (matmul and network)",
                                        continuous_update=False, style=FULL_LABEL, readout_format=".3g",
                                        layout=W.Layout(width="420px"))
        self.bandwidth = W.FloatLogSlider(value=1, base=10, min=-1, max=2, step=0.25,
                                          description="every network bandwidth ×",
                                          continuous_update=False, style=FULL_LABEL,
                                          readout_format=".3g", layout=W.Layout(width="420px"))
        self.include = W.VBox()
        self.progress = W.FloatProgress(value=0, min=0, max=1, description="computing",
                                        style=FULL_LABEL)
        self.status = W.HTML()
        self.out_mfu, self.out_degrees, self.out_summary = W.Output(), W.Output(), W.Output()
        self.out_breakdown, self.download = W.Output(), W.HTML()
        self.mfu_scale = W.ToggleButtons(options=["MFU", "MFU ÷ ceiling"], value="MFU",
                                         description="y axis", style=FULL_LABEL,
                                         tooltips=["against peak FLOP/s",
                                                   "divided by each GPU's effective "
                                                   "utilization: one bar τ for all GPUs"])
        self.degrees_choice = W.Dropdown(description="configuration", style=FULL_LABEL)
        self.breakdown_choice = W.Dropdown(description="configuration", style=FULL_LABEL)
        self._breakdown_views: dict[str, BreakdownView] = {}
        self.breakdown_point = W.IntSlider(description="grid point", min=0, max=0,
                                           continuous_update=False, style=FULL_LABEL)
        self._build_form()
        self._rebuild_include()
        for slider in (self.months, self.latency, self.bandwidth):
            slider.observe(self.on_run, names="value")
        self.threshold.observe(self.on_threshold, names="value")
        self.mfu_scale.observe(self.on_mfu, names="value")
        self.degrees_choice.observe(self.on_degrees, names="value")
        self.breakdown_choice.observe(self.on_breakdown_config, names="value")
        self.breakdown_point.observe(self.on_breakdown, names="value")

    def _rebuild_include(self) -> None:
        boxes = []
        for cfg in self.configs:
            box = W.Checkbox(value=cfg.included, description=cfg.name, indent=False,
                             layout=W.Layout(width="auto"))
            box.observe(lambda ch, cfg=cfg: self.on_include(cfg, ch["new"]), names="value")
            boxes.append(box)
        self.include.children = boxes

    def on_include(self, cfg: Configuration, included: bool) -> None:
        cfg.included = included
        if self.curves or not included:
            self.on_run()

    # -- the form
    def _build_form(self) -> None:
        self.f_preset = W.Dropdown(options=list(PRESETS), value=H100_SXM.name,
                                   description="start from the preset", style=FULL_LABEL,
                                   layout=W.Layout(width="380px"))  # the longest name in full
        self.f_name = W.Text(description="name", style=FULL_LABEL)
        self.f_gpu = {f: (W.IntText if kind is int else W.FloatText)()
                      for f, _, _, _, kind in GPU_FIELDS}
        gpu_rows = [_labelled(self.f_gpu[f], label, unit) for f, label, unit, _, _ in GPU_FIELDS]
        self.f_dsmem = W.Checkbox(description="distributed shared memory (Hopper's DSMEM)",
                                  indent=False, layout=W.Layout(width="auto"))
        self.f_levels = W.IntSlider(description="network levels", min=1, max=self.MAX_LEVELS,
                                    style=FULL_LABEL)
        self.f_level_rows = W.VBox()
        self.f_level_widgets: list[tuple] = []
        self.f_tpp = W.FloatText()
        self.f_batch = W.Dropdown(options=BATCH_LAWS)
        self.f_depth_coef = W.FloatText()
        self.f_depth_exp = W.FloatText()
        self.f_sparse = W.Checkbox(description="sparse (mixture of experts, the sparsity law)",
                                   indent=False, layout=W.Layout(width="auto"))
        self.f_schedules = {s: W.Checkbox(description=s, indent=False,
                                          layout=W.Layout(width="130px")) for s in SCHEDULES}
        self.f_overlap = {k: W.Checkbox(description=f"{k.upper()} traffic overlaps the matmuls",
                                        indent=False, layout=W.Layout(width="260px"))
                          for k in ("tp", "pp", "dp")}
        self.f_price = W.Text(placeholder="unknown")
        self.f_add = W.Button(description="Add configuration", button_style="primary",
                              layout=W.Layout(width="auto", flex="0 0 auto"))  # never cut
        self.f_message = W.HTML()
        self.f_preset.observe(self.on_preset, names="value")
        self.f_levels.observe(self.on_levels, names="value")
        self.f_add.on_click(self.on_add)
        self.form = W.VBox([
            W.HBox([self.f_preset, self.f_name]),
            W.HTML("<b>scaling laws</b>"),
            _labelled(self.f_tpp, "training tokens per parameter"),
            _labelled(self.f_batch, "batch-size law", width="140px"),
            W.HTML("depth law: layers = coefficient × (h_model·h_ff)<sup>exponent</sup>"),
            _labelled(self.f_depth_coef, "depth law: coefficient"),
            _labelled(self.f_depth_exp, "depth law: exponent"), self.f_sparse,
            W.HTML("<b>GPU</b>: the fields of the hardware record"),
            *gpu_rows, self.f_dsmem,
            W.HTML("<b>network</b>: innermost level first; the last level is unbounded"),
            self.f_levels, self.f_level_rows,
            W.HTML("<b>parallelism</b>: allowed pipeline schedules and overlap"),
            W.HBox(list(self.f_schedules.values())), W.HBox(list(self.f_overlap.values())),
            _labelled(self.f_price, "price per GPU", "USD"),
            W.HBox([self.f_add, self.f_message])])
        self.on_preset({"new": H100_SXM.name})

    def _level_row(self, bw=1e11, lat=1e-6, size=8):
        (_, l_bw, u_bw, s_bw), (_, l_lat, u_lat, s_lat), (_, l_size, _, _) = LEVEL_FIELDS
        return (W.FloatText(value=to_form_units(bw, s_bw), description=f"{l_bw} ({u_bw})",
                            style=FULL_LABEL, layout=W.Layout(width="440px")),  # ~140 px left for the input
                W.FloatText(value=to_form_units(lat, s_lat), description=f"{l_lat} ({u_lat})",
                            style=FULL_LABEL, layout=W.Layout(width="170px")),
                W.IntText(value=size or 8, description=l_size, style=FULL_LABEL,
                          layout=W.Layout(width="190px")))

    def on_levels(self, change=None) -> None:
        n = self.f_levels.value
        while len(self.f_level_widgets) < n:
            self.f_level_widgets.append(self._level_row())
        del self.f_level_widgets[n:]
        for k, (_, _, size) in enumerate(self.f_level_widgets):
            size.disabled = k == n - 1  # the outermost level is unbounded
        self.f_level_rows.children = [
            W.HBox([W.Label(f"level {k}", layout=W.Layout(width="50px")), *row])
            for k, row in enumerate(self.f_level_widgets)]

    def set_form(self, values: dict) -> None:
        """Fill the form from SI values (see `form_values`)."""
        self.f_name.value = values["name"]
        for f, _, _, scale, _ in GPU_FIELDS:
            self.f_gpu[f].value = values[f] if scale == 1 else to_form_units(values[f], scale)
        self.f_dsmem.value = values["distributed_shared_memory"]
        self.f_level_widgets = [self._level_row(lv["bandwidth_Bps"], lv["latency_s"],
                                                lv["size"]) for lv in values["levels"]]
        if self.f_levels.value == len(values["levels"]):
            self.on_levels()
        else:
            self.f_levels.value = len(values["levels"])
        self.f_tpp.value = values["tokens_per_param"]
        self.f_batch.value = values["batch_law"]
        self.f_depth_coef.value = values["depth_coef"]
        self.f_depth_exp.value = values["depth_exp"]
        self.f_sparse.value = values["sparse"]
        for s, box in self.f_schedules.items():
            box.value = s in values["schedules"]
        for k, box in self.f_overlap.items():
            box.value = values[f"overlap_{k}"]
        p = values["price_per_gpu"]
        self.f_price.value = "" if p is None else f"{p:g}"

    def get_form(self) -> dict:
        """The form's values back in SI units."""
        values = {f: (self.f_gpu[f].value if scale == 1
                      else from_form_units(self.f_gpu[f].value, scale))
                  for f, _, _, scale, _ in GPU_FIELDS}
        price = self.f_price.value.strip()
        try:
            price = None if price == "" else float(price)
        except ValueError:
            raise ValueError(f"price_per_gpu must be a number or empty (got {price!r})") from None
        s_bw, s_lat = LEVEL_FIELDS[0][3], LEVEL_FIELDS[1][3]
        values.update(
            name=self.f_name.value.strip(), distributed_shared_memory=self.f_dsmem.value,
            levels=[{"bandwidth_Bps": from_form_units(bw.value, s_bw),
                     "latency_s": from_form_units(lat.value, s_lat), "size": size.value}
                    for bw, lat, size in self.f_level_widgets],
            tokens_per_param=self.f_tpp.value, batch_law=self.f_batch.value,
            depth_coef=self.f_depth_coef.value, depth_exp=self.f_depth_exp.value,
            sparse=self.f_sparse.value,
            schedules=[s for s, box in self.f_schedules.items() if box.value],
            overlap_tp=self.f_overlap["tp"].value, overlap_pp=self.f_overlap["pp"].value,
            overlap_dp=self.f_overlap["dp"].value, price_per_gpu=price)
        return values

    def on_preset(self, change) -> None:
        gpu = PRESETS[change["new"]]
        price = PRICES_USD.get(gpu.name)
        self.set_form(form_values(f"custom {gpu.name}", gpu, Settings(price_per_gpu=price)))

    def on_add(self, _=None) -> Configuration | None:
        """Add the form's configuration (and re-run if results are shown). One equal to an existing configuration
        is added flagged (named "(= …)", drawn dashed), not drawn silently over it."""
        try:
            cfg = configuration_from_form(self.get_form())
        except ValueError as e:
            self.f_message.value = ("<span style='color:#b00'>not added: "
                                    f"{html.escape(str(e))}</span>")
            return None
        twin = next((c for c in self.configs if same_configuration(c, cfg)), None)
        if twin is not None:
            cfg.name = f"{cfg.name} (= {twin.name})"
        names = {c.name for c in self.configs}
        base, k = cfg.name, 2
        while cfg.name in names:  # names key the outputs, so keep them distinct
            cfg.name = f"{base} ({k})"
            k += 1
        self.configs.append(cfg)
        self._rebuild_include()
        note = ("" if twin is None else f" — <b>same hardware and settings as "
                f"{html.escape(twin.name)}</b>: its curve is drawn dashed over that one")
        self.f_message.value = f"added {html.escape(cfg.name)}{note}"
        if self.curves:  # the app is showing results: show the new curve with them
            self.on_run()
        return cfg

    # -- running and drawing
    def _curve(self, cfg: Configuration, months: float, threshold: float) -> Curve:
        settings = replace(cfg.settings, months=months)
        gpu = scaled_gpu(cfg.gpu, self.latency.value, self.bandwidth.value)
        key = (repr(gpu), settings)
        if key not in self._cache:
            self._cache[key] = run_curve(gpu, settings)
        curve = self._cache[key]
        return replace(curve, settings=replace(curve.settings, threshold=threshold))

    def on_run(self, _=None) -> dict[str, Curve]:
        """Compute (or take from the cache) every included configuration's curve; redraw."""
        chosen = [c for c in self.configs if c.included]
        self.status.value = "computing…"
        self.progress.description = "computing"   # the bar's label says what it shows now
        curves = {}
        try:
            for i, cfg in enumerate(chosen):
                curves[cfg.name] = self._curve(cfg, self.months.value, self.threshold.value)
                self.progress.value = (i + 1) / len(chosen)
        except ValueError as e:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            self.progress.description = "stopped"
            return {}
        self.progress.value = 1.0
        self.progress.description = "done"
        self.curves = curves
        self.status.value = (f"{len(curves)} configurations, "
                             f"{sum(len(c.points) for c in curves.values())} grid points")
        self.refresh()
        return curves

    def on_threshold(self, _=None) -> dict[str, Curve]:
        """A new τ changes no layout: re-read the curves already computed."""
        t = self.threshold.value
        self.curves = {n: replace(c, settings=replace(c.settings, threshold=t))
                       for n, c in self.curves.items()}
        self.refresh()
        return self.curves

    def refresh(self) -> None:
        names = list(self.curves)
        self.on_mfu()
        self._show(self.out_summary, W.HTML(summary_html(summary_rows(self.curves))))
        for dd in (self.degrees_choice, self.breakdown_choice):
            keep = dd.value if dd.value in names else (names[0] if names else None)
            dd.options = names
            dd.value = keep
        self.on_degrees()
        self.on_breakdown_config()
        self.on_download()

    @staticmethod
    def _show(out: W.Output, thing) -> None:
        """Hand a finished figure (as a PNG encoded here: one draw, no tight bounding box) or
        widget to an Output (never matplotlib's flush hook)."""
        if isinstance(thing, Figure):
            thing = Image(png(thing))
        out.clear_output(wait=True)
        with out:
            display(thing)

    def on_mfu(self, _=None) -> Figure:
        fig = plot_mfu(self.curves, relative=self.mfu_scale.value != "MFU")
        self._show(self.out_mfu, fig)
        return fig

    def on_degrees(self, _=None) -> Figure | None:
        name = self.degrees_choice.value
        if name is None:
            return None
        fig = plot_degrees(self.curves[name], name)
        self._show(self.out_degrees, fig)
        return fig

    def on_breakdown_config(self, _=None) -> None:
        name = self.breakdown_choice.value
        if name is None:
            return
        n = len(self.curves[name].points)
        self.breakdown_point.max = n - 1
        end = self.curves[name].linear_scaling_ends()
        self.breakdown_point.value = (self.curves[name].points.index(end)
                                      if end is not None else 0)
        self.on_breakdown()

    def on_breakdown(self, _=None) -> bytes | None:
        name = self.breakdown_choice.value
        if name is None:
            return None
        curve = self.curves[name]
        view = self._breakdown_views.get(name)
        if view is None or view.curve is not curve:   # a new run, or a new threshold
            view = self._breakdown_views[name] = BreakdownView(curve)
        picture = view.png(min(self.breakdown_point.value, len(curve.points) - 1))
        self._show(self.out_breakdown, Image(picture))
        return picture

    def on_download(self, _=None) -> str:
        self.download.value = download_html(self.curves) if self.curves else ""
        return self.download.value


TABS = ("MFU vs compute", "layout vs compute", "largest runs", "step breakdown")


def widget_simulator(app: SimulatorApp | None = None) -> W.Widget:
    """The app's controls and outputs in one box: the four sliders, the configurations, the
    add form, four tabs of results and the JSON download. A fresh `SimulatorApp` by default;
    nothing is computed until a slider moves or `app.on_run()` is called."""
    app = app if app is not None else SimulatorApp()
    tabs = W.Tab([W.VBox([app.mfu_scale, app.out_mfu]),
                  W.VBox([app.degrees_choice, app.out_degrees]),
                  W.Box([app.out_summary], layout=W.Layout(overflow="auto")),
                  W.VBox([W.HBox([app.breakdown_choice, app.breakdown_point]),
                          app.out_breakdown])])
    for i, title in enumerate(TABS):
        tabs.set_title(i, title)
    form = W.Accordion([app.form])
    form.set_title(0, "Add a configuration")
    return W.VBox([W.VBox([app.months, app.threshold, app.latency, app.bandwidth]),
                   W.HTML("<b>configurations</b> (untick to leave one out)"), app.include,
                   form, W.HBox([app.progress, app.status]), tabs, app.download])
