"""Notebook 06's app: a thin ipywidgets shell (`SimulatorApp`, laid out by
`widget_simulator`) that only wires controls to the pure functions of configuration.py,
figures.py and summary.py, and their results to outputs. Every callback can be called
without a browser.
"""
from __future__ import annotations

import html
from dataclasses import replace

import ipywidgets as W
from IPython.display import display
from matplotlib.figure import Figure

from helpers.hardware import H100_SXM, PRESETS
from helpers.simulator.config import PRICES_USD
from helpers.simulator.curve import Curve, run_curve
from helpers.simulator.settings import BATCH_LAWS, SCHEDULES, Settings
from helpers.views.kit import FULL_LABEL, aligned, image_output, png, previewed
from helpers.views.simulator.configuration import (GPU_FIELDS, LEVEL_FIELDS, Configuration,
                                                   configuration_from_form,
                                                   default_configurations, form_message,
                                                   form_values, from_form_units,
                                                   same_configuration,
                                                   scaled_gpu, to_form_units)
from helpers.views.simulator.figures import BreakdownView, plot_degrees, plot_mfu
from helpers.views.simulator.summary import download_html, summary_html, summary_rows


def _labelled(widget: W.Widget, label: str, unit: str = "", width: str = "100px") -> W.HBox:
    """A control with its full label in front and its unit behind (labels never cut)."""
    widget.layout = W.Layout(width=width)
    return W.HBox([W.Label(label, layout=W.Layout(width="300px")), widget,
                   W.Label(unit, layout=W.Layout(width="50px"))])


# The four sliders in one column: descriptions 280 px (the longest, τ's, in full), tracks
# 360 px (wider than before for τ's 20 positions and the latency's 13)
SLIDERS, SLIDER_LAYOUT = aligned(280), W.Layout(width="640px")


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
        self.ran = False  # the app shows results (perhaps of no configuration) once it has run
        self._cache: dict[tuple, Curve] = {}
        self.months = W.FloatSlider(value=months, min=0.25, max=24, step=0.25,
                                    description="run duration (months)",
                                    continuous_update=False, style=SLIDERS,
                                    layout=SLIDER_LAYOUT)
        self.threshold = W.FloatSlider(value=threshold, min=0.05, max=1.0, step=0.05,
                                       description="threshold τ (fraction of the MFU ceiling)",
                                       continuous_update=False, style=SLIDERS,
                                       layout=SLIDER_LAYOUT)
        self.latency = W.FloatLogSlider(value=1, base=10, min=-2, max=1, step=0.25,
                                        description="every latency × (matmul and network)",
                                        continuous_update=False, style=SLIDERS, readout_format=".3g",
                                        layout=SLIDER_LAYOUT)
        self.bandwidth = W.FloatLogSlider(value=1, base=10, min=-1, max=2, step=0.25,
                                          description="every network bandwidth ×",
                                          continuous_update=False, style=SLIDERS,
                                          readout_format=".3g", layout=SLIDER_LAYOUT)
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
        if self.ran or not included:  # not `self.curves`: with every box unticked it is empty
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
            raise ValueError(f"price_per_gpu must be a number or empty, got {price!r}") from None
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
                                    f"{html.escape(form_message(e))}</span>")
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
        if self.ran:  # the app is showing results: show the new curve with them
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
        self.ran = True
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
        self.status.value = (f"{len(curves)} configuration{'' if len(curves) == 1 else 's'}, "
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
        """Hand a finished figure (as a PNG encoded here: one draw, no tight bounding box),
        PNG bytes or a widget to an Output (never matplotlib's flush hook). A picture is set
        as the Output's one output: one message, and the kernel knows what it shows."""
        if isinstance(thing, Figure):
            thing = png(thing)
        if isinstance(thing, bytes):
            out.outputs = (image_output(thing),)
            return
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
        self._show(self.out_breakdown, picture)
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
    return previewed(W.VBox([W.VBox([app.months, app.threshold, app.latency, app.bandwidth]),
                             W.HTML("<b>configurations</b> (untick to leave one out)"),
                             app.include, form, W.HBox([app.progress, app.status]), tabs,
                             app.download]))
