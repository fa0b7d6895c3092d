"""Notebook 06's interactive simulator: pure functions for figures and tables, and a thin
ipywidgets shell (`SimulatorApp`, laid out by `widget_simulator`) that only wires them to
controls.

Everything a reader sees is computed by the functions here from `Curve`s, so the tests call
the same functions (and the app's callbacks) without a browser. Printed text says width,
experts and tokens per batch where the spec writes d, s and B (see `helpers.simulator`).
"""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, replace
from typing import Callable

import ipywidgets as W
from IPython.display import display
from matplotlib.figure import Figure

from helpers.hardware import GPU, GTX_580, H100_SXM, NetworkLevel, PRESETS

from helpers.simulator.config import PRICES_USD, validate_gpu
from helpers.simulator.curve import Curve, Point, run_curve
from helpers.simulator.report import SECONDS_PER_MONTH, bubble_seconds, dumps, price_of
from helpers.simulator.settings import BATCH_LAWS, SCHEDULES, Settings, validate_settings


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


def compute(configs: list[Configuration], months: float, threshold: float,
            progress: Callable[[float], None] | None = None) -> dict[str, Curve]:
    """Curves of the included configurations, with the shared duration and threshold."""
    chosen = [c for c in configs if c.included]
    out = {}
    for i, cfg in enumerate(chosen):
        settings = replace(cfg.settings, months=months, threshold=threshold)
        step = (lambda done, total, i=i: progress((i + done / total) / len(chosen))) \
            if progress else None
        out[cfg.name] = run_curve(cfg.gpu, settings, progress=step)
    if progress:
        progress(1.0)
    return out


# --- figures and tables: pure functions of curves --------------------------------------

def plot_mfu(curves: dict[str, Curve]) -> Figure:
    """Tab 1: MFU against training compute, one line per configuration."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for name, curve in curves.items():
        pts = curve.feasible
        line, = ax.plot([p.model.C for p in pts], [p.mfu for p in pts], marker=".", label=name)
        end = curve.linear_scaling_ends()
        if end is not None and end.feasible:
            ax.plot([end.model.C], [end.mfu], "o", mfc="none", ms=10, color=line.get_color())
        if len(curve.points) > len(pts):  # the latency wall: first infeasible grid point
            ax.axvline(curve.points[-1].model.C, color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("MFU (against peak FLOP/s)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("circles: linear scaling ends; dotted: first infeasible grid point")
    return fig


DEGREES = (("dp", "DP"), ("tp_model", "TP_model"), ("tp_ff", "TP_ff"), ("pp", "PP"),
           ("ep", "EP"), ("m", "microbatches m"))


def plot_degrees(curve: Curve, name: str = "") -> Figure:
    """Tab 2: how each parallel degree of the best layout grows with compute."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    pts = curve.feasible
    for attr, label in DEGREES:
        ax.plot([p.model.C for p in pts], [getattr(p.plan, attr) for p in pts],
                marker=".", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("degree")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(name)
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
    """Tab 3's row: a configuration's three summary points (the `Curve` methods' names)."""

    configuration: str
    price_per_gpu: float | None
    linear_scaling_ends: SummaryCell
    max_feasible_at_threshold: SummaryCell
    largest_feasible: SummaryCell


SUMMARIES = (("linear_scaling_ends", "linear scaling ends"),
             ("max_feasible_at_threshold", "max feasible compute at τ"),
             ("largest_feasible", "largest feasible run"))


def summary_rows(curves: dict[str, Curve]) -> list[SummaryRow]:
    """Tab 3: per configuration, the three summary points with GPUs, duration and cost."""
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


def summary_html(rows: list[SummaryRow]) -> str:
    head = "".join(f"<th colspan=5>{html.escape(label)}</th>" for _, label in SUMMARIES)
    sub = "<th>C (FLOP)</th><th>MFU</th><th>GPUs</th><th>months</th><th>cost (USD)</th>" * 3
    body = []
    for r in rows:
        cells = [f"<td>{html.escape(r.configuration)}</td>"]
        for attr, _ in SUMMARIES:
            c = getattr(r, attr)
            cells += [f"<td>{_fmt(getattr(c, key), spec)}</td>" for key, spec in (
                ("compute_flop", ".3g"), ("mfu", ".3f"), ("n_gpus", ".3g"), ("months", ".2f"),
                ("cost_usd", ".3g"))]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<table><tr><th rowspan=2>configuration</th>{head}</tr><tr>{sub}</tr>"
            + "".join(body) + "</table><p>cost = GPUs × price per GPU (hardware only); "
            "— where no price is set or no point qualifies.</p>")


def breakdown_parts(point: Point, settings: Settings) -> dict[str, float]:
    """Seconds of one step by cause, as the model charges them (exposed latency only)."""
    t = point.plan.time
    lat = t.dp_lat + (0.0 if point.plan.zero_bubble else t.tp_lat + t.ppep_lat)
    return {"compute": t.matmul, "TP bandwidth": t.tp_bw, "PP/EP bandwidth": t.ppep_bw,
            "DP bandwidth": t.dp_bw, "latency": lat, "bubble": bubble_seconds(t, settings)}


def plot_breakdown(point: Point, settings: Settings, title: str = "") -> Figure:
    """Why utilization falls: each cause of one step's time next to the step itself."""
    fig = Figure(figsize=(8, 3.2))
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
    ax.barh(names, [parts[n] for n in names],
            hatch=None, color=["#bbb" if hidden.get(n) else "C0" for n in names])
    ax.axvline(point.plan.time.step, color="C3", lw=1.5, label="step time")
    ax.set_xlabel("seconds per training step")
    q = point.plan
    ax.set_title(title or f"C = {point.model.C:.3g} FLOP on {q.n_gpus:.3g} GPUs, "
                 f"MFU {point.mfu:.3f}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, "grey: overlaps compute (only the excess over compute costs time)",
             fontsize=7)
    fig.tight_layout()
    return fig


def download_html(curves: dict[str, Curve], filename: str = "simulator_output.json") -> str:
    """An anchor that downloads the complete output (the CLI's JSON) from the page itself."""
    payload = base64.b64encode(dumps(curves).encode()).decode()
    return (f'<a download="{filename}" href="data:application/json;base64,{payload}">'
            f"download {filename} ({len(curves)} configurations)</a>")


# --- the add-configuration form: values → Configuration ---------------------------------

GPU_FIELDS = (  # (field, label, kind)
    ("bitwidth", "bitwidth", int), ("fpct", "FLOP per clock per thread at that bitwidth", float),
    ("register_bytes_per_processing_block", "register bytes per processing block", float),
    ("num_sms", "SMs", int), ("l2_Bps", "L2 bandwidth (B/s)", float),
    ("l2_bytes", "L2 size (B)", float), ("hbm_Bps", "HBM bandwidth (B/s)", float),
    ("hbm_bytes", "HBM size (B)", float), ("max_clock_Hz", "max clock (Hz)", float),
    ("effective_utilization", "effective utilization", float),
    ("latency_per_matmul_s", "latency per matmul (s)", float),
)


def form_values(name: str, gpu: GPU, settings: Settings) -> dict:
    """A configuration as the form's plain values (to prefill it from a preset)."""
    values = {f: getattr(gpu, f) for f, _, _ in GPU_FIELDS if f != "fpct"}
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


# --- the app ------------------------------------------------------------------------------

class SimulatorApp:
    """Controls → pure functions → outputs. Every callback can be called directly."""

    MAX_LEVELS = 5

    def __init__(self, configs: list[Configuration] | None = None, months: float = 3,
                 threshold: float = 0.8):
        self.configs = list(configs if configs is not None else default_configurations())
        self.curves: dict[str, Curve] = {}
        self.months = W.FloatSlider(value=months, min=0.25, max=24, step=0.25,
                                    description="months")
        self.threshold = W.FloatSlider(value=threshold, min=0.05, max=1.0, step=0.05,
                                       description="threshold τ")
        self.include = W.VBox()
        self.run_button = W.Button(description="Run", button_style="primary")
        self.progress = W.FloatProgress(value=0, min=0, max=1, description="progress")
        self.status = W.HTML()
        self.out_mfu, self.out_degrees, self.out_summary = W.Output(), W.Output(), W.Output()
        self.out_breakdown, self.download = W.Output(), W.HTML()
        self.degrees_choice = W.Dropdown(description="configuration")
        self.breakdown_choice = W.Dropdown(description="configuration")
        self.breakdown_point = W.IntSlider(description="grid point", min=0, max=0)
        self.download_button = W.Button(description="Prepare JSON download")
        self._build_form()
        self._rebuild_include()
        self.run_button.on_click(self.on_run)
        self.degrees_choice.observe(self.on_degrees, names="value")
        self.breakdown_choice.observe(self.on_breakdown_config, names="value")
        self.breakdown_point.observe(self.on_breakdown, names="value")
        self.download_button.on_click(self.on_download)

    def _rebuild_include(self) -> None:
        boxes = []
        for cfg in self.configs:
            box = W.Checkbox(value=cfg.included, description=cfg.name, indent=False)
            box.observe(lambda ch, cfg=cfg: setattr(cfg, "included", ch["new"]), names="value")
            boxes.append(box)
        self.include.children = boxes

    # -- the form
    def _build_form(self) -> None:
        self.f_preset = W.Dropdown(options=list(PRESETS), value=H100_SXM.name,
                                   description="start from")
        self.f_name = W.Text(description="name")
        self.f_gpu = {f: (W.IntText if kind is int else W.FloatText)(description=f)
                      for f, _, kind in GPU_FIELDS}
        for f, label, _ in GPU_FIELDS:
            self.f_gpu[f].tooltip = label
        self.f_dsmem = W.Checkbox(description="distributed_shared_memory")
        self.f_levels = W.IntSlider(description="network levels", min=1, max=self.MAX_LEVELS)
        self.f_level_rows = W.VBox()
        self.f_level_widgets: list[tuple] = []
        self.f_tpp = W.FloatText(description="tokens/param")
        self.f_batch = W.Dropdown(options=BATCH_LAWS, description="batch law")
        self.f_depth_coef = W.FloatText(description="depth coef")
        self.f_depth_exp = W.FloatText(description="depth exp")
        self.f_sparse = W.Checkbox(description="sparse (MoE sparsity law)")
        self.f_schedules = {s: W.Checkbox(description=s) for s in SCHEDULES}
        self.f_overlap = {k: W.Checkbox(description=f"{k.upper()} overlaps compute")
                          for k in ("tp", "pp", "dp")}
        self.f_price = W.Text(description="USD per GPU", placeholder="unknown")
        self.f_add = W.Button(description="Add configuration")
        self.f_message = W.HTML()
        self.f_preset.observe(self.on_preset, names="value")
        self.f_levels.observe(self.on_levels, names="value")
        self.f_add.on_click(self.on_add)
        self.form = W.VBox([
            W.HBox([self.f_preset, self.f_name]),
            W.HTML("<b>scaling laws</b>"),
            W.HBox([self.f_tpp, self.f_batch, self.f_sparse]),
            W.HBox([self.f_depth_coef, self.f_depth_exp]),
            W.HTML("<b>GPU</b> (hover a field for its meaning)"),
            W.GridBox(list(self.f_gpu.values()) + [self.f_dsmem],
                      layout=W.Layout(grid_template_columns="repeat(2, 50%)")),
            W.HTML("<b>network</b>: innermost level first; bandwidth per GPU counts both "
                   "directions; the last level is unbounded"),
            self.f_levels, self.f_level_rows,
            W.HTML("<b>parallelism</b>: allowed pipeline schedules and overlap"),
            W.HBox(list(self.f_schedules.values())), W.HBox(list(self.f_overlap.values())),
            self.f_price, W.HBox([self.f_add, self.f_message])])
        self.on_preset({"new": H100_SXM.name})

    def _level_row(self, bw=1e11, lat=1e-6, size=8):
        return (W.FloatText(value=bw, description="B/s"),
                W.FloatText(value=lat, description="latency s"),
                W.IntText(value=size or 8, description="size"))

    def on_levels(self, change=None) -> None:
        n = self.f_levels.value
        while len(self.f_level_widgets) < n:
            self.f_level_widgets.append(self._level_row())
        del self.f_level_widgets[n:]
        for k, (_, _, size) in enumerate(self.f_level_widgets):
            size.disabled = k == n - 1  # the outermost level is unbounded
        self.f_level_rows.children = [W.HBox(list(row)) for row in self.f_level_widgets]

    def set_form(self, values: dict) -> None:
        self.f_name.value = values["name"]
        for f, _, _ in GPU_FIELDS:
            self.f_gpu[f].value = values[f]
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
        values = {f: w.value for f, w in self.f_gpu.items()}
        price = self.f_price.value.strip()
        try:
            price = None if price == "" else float(price)
        except ValueError:
            raise ValueError(f"price_per_gpu must be a number or empty (got {price!r})") from None
        values.update(
            name=self.f_name.value.strip(), distributed_shared_memory=self.f_dsmem.value,
            levels=[{"bandwidth_Bps": bw.value, "latency_s": lat.value, "size": size.value}
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
        try:
            cfg = configuration_from_form(self.get_form())
        except ValueError as e:
            self.f_message.value = ("<span style='color:#b00'>not added: "
                                    f"{html.escape(str(e))}</span>")
            return None
        names = {c.name for c in self.configs}
        base, k = cfg.name, 2
        while cfg.name in names:  # names key the outputs, so keep them distinct
            cfg.name = f"{base} ({k})"
            k += 1
        self.configs.append(cfg)
        self._rebuild_include()
        self.f_message.value = f"added {html.escape(cfg.name)}; press Run"
        return cfg

    # -- running and drawing
    def on_run(self, _=None) -> dict[str, Curve]:
        self.run_button.disabled = True
        self.status.value = "running…"
        try:
            self.curves = compute(self.configs, self.months.value, self.threshold.value,
                                  progress=lambda x: setattr(self.progress, "value", x))
        except ValueError as e:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            return {}
        finally:
            self.run_button.disabled = False
        self.status.value = (f"{len(self.curves)} configurations, "
                             f"{sum(len(c.points) for c in self.curves.values())} grid points")
        self.download.value = ""
        self.refresh()
        return self.curves

    def refresh(self) -> None:
        names = list(self.curves)
        self._show(self.out_mfu, plot_mfu(self.curves))
        self._show(self.out_summary, W.HTML(summary_html(summary_rows(self.curves))))
        for dd in (self.degrees_choice, self.breakdown_choice):
            dd.options = names
            dd.value = names[0] if names else None
        self.on_degrees()
        self.on_breakdown_config()

    @staticmethod
    def _show(out: W.Output, thing) -> None:
        out.clear_output(wait=True)
        with out:
            display(thing)

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

    def on_breakdown(self, _=None) -> Figure | None:
        name = self.breakdown_choice.value
        if name is None:
            return None
        curve = self.curves[name]
        point = curve.points[min(self.breakdown_point.value, len(curve.points) - 1)]
        fig = plot_breakdown(point, curve.settings)
        self._show(self.out_breakdown, fig)
        return fig

    def on_download(self, _=None) -> str:
        self.download.value = download_html(self.curves) if self.curves else "run first"
        return self.download.value


def widget_simulator(app: SimulatorApp | None = None) -> W.Widget:
    """The app's controls and outputs in one box: settings, configurations, the add form,
    Run, four tabs of results and the JSON download. A fresh `SimulatorApp` by default."""
    app = app if app is not None else SimulatorApp()
    tabs = W.Tab([app.out_mfu, W.VBox([app.degrees_choice, app.out_degrees]), app.out_summary,
                  W.VBox([W.HBox([app.breakdown_choice, app.breakdown_point]),
                          app.out_breakdown])])
    for i, title in enumerate(("MFU vs compute", "parallelism vs compute",
                               "largest runs", "step-time breakdown")):
        tabs.set_title(i, title)
    form = W.Accordion([app.form])
    form.set_title(0, "Add configuration")
    return W.VBox([W.HBox([app.months, app.threshold]),
                   W.HTML("<b>configurations</b> (untick to leave one out)"), app.include,
                   form, W.HBox([app.run_button, app.progress]), app.status, tabs,
                   W.HBox([app.download_button, app.download])])
