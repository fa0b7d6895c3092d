"""Notebook 06's widgets: the pure callbacks, driven at the controls' extremes."""
from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import replace

import ipywidgets as W
import pytest

from helpers.hardware import GTX_580, H100_SXM, PRESETS
from helpers.simulator.config import gpu_to_json
from helpers.simulator.curve import run_curve
from helpers.simulator.report import breakdown
from helpers.simulator.settings import Settings
from helpers.views.simulator import (TABS, Configuration, SimulatorApp, breakdown_parts,
                                     configuration_from_form, describe, form_values,
                                     plot_breakdown, plot_mfu, scaled_gpu, summary_html,
                                     summary_rows, widget_simulator)


def small_app(**kw) -> SimulatorApp:
    return SimulatorApp([Configuration("H100", H100_SXM, Settings())], **kw)


@pytest.mark.parametrize("months, threshold", [(0.25, 1.0), (24, 0.05)])
def test_run_at_slider_extremes(months, threshold):
    app = small_app()
    app.months.value = app.months.min if months < 1 else app.months.max  # runs on release
    app.threshold.value = app.threshold.max if threshold == 1.0 else app.threshold.min
    curves = app.curves
    curve = curves["H100"]
    assert curve.settings.months == app.months.value
    assert curve.settings.threshold == app.threshold.value
    assert app.progress.value == 1.0
    assert app.progress.description == "done"   # not left saying "computing"
    (row,) = summary_rows(curves)
    end = row.linear_scaling_ends
    if threshold == 1.0:  # nothing reaches the ceiling itself: scaling "ends" at once
        assert end.compute_flop == float(curve.points[0].model.C)
    else:
        assert row.max_feasible_at_threshold.compute_flop is not None
    largest = row.largest_feasible
    assert largest.months <= months
    assert largest.cost_usd is None  # no price for an H100 unless one is given
    table = summary_html([row])
    # no configuration with a cited price: no cost column, no note about prices
    assert "<td>H100</td>" in table and table.count("<th>") == 6 and "cost" not in table
    gtx = replace(row, configuration="GTX 580", price_per_gpu=500.0)
    table = summary_html([row, gtx])
    assert table.count("<th>") == 7 and "no price is cited (H100)" in table


def test_longer_runs_push_the_wall_out():
    short, long_ = small_app(months=0.25), small_app(months=24)
    a, b = short.on_run()["H100"], long_.on_run()["H100"]
    assert b.largest_feasible().model.C > a.largest_feasible().model.C


def test_breakdown_slider_extremes_and_the_infeasible_point():
    app = small_app()
    app.on_run()
    app.breakdown_point.value = 0
    assert app.on_breakdown().startswith(b"\x89PNG")
    app.breakdown_point.value = app.breakdown_point.max  # the first infeasible point
    assert app.on_breakdown().startswith(b"\x89PNG")
    curve = app.curves[app.breakdown_choice.value]
    fig = plot_breakdown(curve.points[-1], curve.settings)
    assert "infeasible" in fig.axes[0].texts[0].get_text()


def _pixels(picture: bytes):
    import io
    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(picture)).convert("RGB")).astype(int)


def test_the_blitted_breakdown_is_the_figure_drawn_afresh():
    """A move of the grid point redraws only bars, line, title, axis and legend over the saved
    pixels: at each point the picture must be the one a full draw gives (up to the
    few pixels where a bar meets the spine, drawn in another order). Every third point, walked
    from the far end and back, so each is drawn over a different earlier one."""
    from helpers.views.kit import png
    from helpers.views.simulator import BreakdownView
    app = small_app()
    app.on_run()
    curve = app.curves[app.breakdown_choice.value]
    view = BreakdownView(curve)
    feasible = [i for i, p in enumerate(curve.points) if p.plan is not None]
    sample = feasible[::3] + feasible[-1:]
    for i in sample[::-1] + sample[1:]:
        fresh = _pixels(png(plot_breakdown(curve.points[i], curve.settings)))
        blitted = _pixels(view.png(i))
        assert blitted.shape == fresh.shape
        assert (abs(blitted - fresh).max(axis=2) > 32).mean() < 0.002, i


def test_breakdown_parts_add_up_to_the_step_when_nothing_overlaps():
    settings = Settings(overlap_tp=False, overlap_pp=False, schedules=("1f1b",))
    curve = run_curve(GTX_580, settings)
    point = curve.points[0]
    parts = breakdown_parts(point, settings)
    assert sum(parts.values()) == pytest.approx(point.plan.time.step, rel=1e-9)
    assert plot_breakdown(point, settings) is not None


def test_download_is_the_cli_json():
    app = small_app()
    app.on_run()
    link = app.on_download()
    payload = re.search(r"base64,([A-Za-z0-9+/=]+)", link).group(1)
    out = json.loads(base64.b64decode(payload))
    (conf,) = out["configurations"]
    assert conf["name"] == "H100" and conf["points"][-1]["feasible"] is False


@pytest.mark.parametrize("field, value, said", [
    ("hbm_Bps", 0.0, "memory (HBM) bandwidth must be a finite number > 0, got 0 TB/s"),
    ("l2_Bps", -1.0, "L2 cache bandwidth must be a finite number > 0, got -1 TB/s"),
    ("fpct", 0.0, "FLOP per clock per thread at that precision must be a finite number > 0 "
                  "(FLOP/s must be positive), got 0.0"),
    ("hbm_bytes", -80.0, "memory (HBM) size must be a finite number > 0, got -80 GB"),
    ("num_sms", 0, "streaming multiprocessors (SMs) must be a positive integer, got 0"),
    ("effective_utilization", 1.5,
     "effective utilization (the MFU ceiling) must be in (0, 1], got 1.5"),
])
def test_form_rejects_bad_hardware_in_its_own_words(field, value, said):
    """An error names the field as the form labels it, with the value in the field's unit."""
    app = small_app()
    app.f_gpu[field].value = value
    before = len(app.configs)
    assert app.on_add() is None
    assert html.unescape(app.f_message.value) == f"<span style='color:#b00'>not added: {said}</span>"
    assert len(app.configs) == before


def test_form_rejects_bad_network_and_settings():
    app = small_app()
    app.f_level_widgets[0][0].value = -600.0
    assert app.on_add() is None
    assert ("network level 1: bandwidth per GPU, both directions must be a number > 0 "
            "(infinity allowed), got -600 GB/s") in html.unescape(app.f_message.value)
    app.on_preset({"new": H100_SXM.name})
    for box in app.f_schedules.values():
        box.value = False
    assert app.on_add() is None and "pipeline schedules must be" in app.f_message.value
    app.on_preset({"new": H100_SXM.name})
    app.f_price.value = "cheap"
    assert app.on_add() is None
    assert "price per GPU (USD) must be a number or empty, got 'cheap'" in html.unescape(
        app.f_message.value)
    app.f_price.value = "-3"
    assert app.on_add() is None
    assert "price per GPU (USD) must be a finite number >= 0 or empty, got -3.0" in html.unescape(
        app.f_message.value)
    assert "_" not in html.unescape(app.f_message.value)  # no code name left


@pytest.mark.parametrize("n_levels", [1, SimulatorApp.MAX_LEVELS])
def test_form_with_fewest_and_most_levels(n_levels):
    app = small_app()
    app.f_levels.value = n_levels
    assert len(app.f_level_widgets) == n_levels
    assert app.f_level_widgets[-1][2].disabled  # the outermost level has no size
    for level in app.f_level_widgets[1:-1]:  # size 8 everywhere: 1.5e6 placements, refused
        level[2].value = 2
    cfg = app.on_add()
    assert cfg is not None and len(cfg.gpu.network_levels) == n_levels
    assert cfg.gpu.network_levels[-1].size is None
    assert [c.name for c in app.configs][-1] == cfg.name and len(app.include.children) == 2


def test_added_configuration_runs_and_can_be_excluded():
    app = small_app()
    app.on_preset({"new": GTX_580.name})
    app.f_sparse.value = True
    cfg = app.on_add()
    assert cfg.settings.sparse and cfg.settings.price_per_gpu == 300.0
    app.include.children[0].value = False  # leave the H100 out
    curves = app.on_run()
    assert list(curves) == [cfg.name]
    assert app.degrees_choice.options == (cfg.name,)
    assert app.on_degrees() is not None


def test_ticking_a_box_back_after_unticking_all_shows_its_curve():
    app = SimulatorApp([Configuration("H100", H100_SXM, Settings()),
                        Configuration("GTX 580", GTX_580, Settings(price_per_gpu=300.0))])
    app.on_run()
    for box in app.include.children:  # untick every one: the page shows no configuration
        box.value = False
    assert app.curves == {} and app.status.value.startswith("0 configurations")
    app.include.children[1].value = True  # and tick one back
    assert list(app.curves) == ["GTX 580"] and app.status.value.startswith("1 configuration,")
    app.include.children[0].value = True
    assert list(app.curves) == ["H100", "GTX 580"]


def test_form_round_trips_a_preset():
    values = form_values("x", GTX_580, Settings(price_per_gpu=300.0))
    cfg = configuration_from_form(values)
    assert cfg.gpu.network_levels == GTX_580.network_levels
    assert cfg.gpu.flop_per_clock_per_thread == {32: 0.5}
    assert cfg.settings.price_per_gpu == 300.0


def test_describe_names_the_layout():
    curve = run_curve(H100_SXM, Settings())
    text = describe(curve.linear_scaling_ends(), price=1.0)
    assert "TP (16, 32)" in text and "PP 64" in text and "DP 256" in text and "$" in text
    assert "infeasible" in describe(curve.points[-1])
    # The course's notation: d is the data degree and s the sequence, so the text spells out
    # the model's width, experts and tokens per batch.
    assert "width 12288" in describe(curve.points[0]) and "experts 1" in text
    assert "tokens per batch" in text and "d =" not in text and "s =" not in text


def test_the_layout_holds_the_apps_controls():
    app = small_app()
    box = widget_simulator(app)
    assert box.children[0].children == (app.months, app.threshold, app.latency, app.bandwidth)
    assert all(not w.continuous_update for w in box.children[0].children)  # act on release
    tabs = box.children[5]
    assert [tabs.get_title(i) for i in range(4)] == list(TABS)
    assert all(len(t) <= 18 for t in TABS)  # JupyterLab cuts tab titles near 20 characters
    assert box.children[-1] is app.download


def test_sliders_rerun_on_release_and_threshold_only_rereads(monkeypatch):
    app = small_app()
    app.on_run()
    app.latency.value = 10 ** app.latency.max  # ten times every latency: the wall comes closer
    near = app.curves["H100"]
    app.latency.value = 1.0
    base = app.curves["H100"]
    assert near.points[-1].model.C < base.points[-1].model.C
    app.bandwidth.value = 10 ** app.bandwidth.min  # a tenth of every network bandwidth
    assert app.curves["H100"].linear_scaling_ends().model.C < base.linear_scaling_ends().model.C
    app.bandwidth.value = 1.0  # back to a cached curve
    assert app.curves["H100"].points == base.points

    def no_search(*a, **k):
        raise AssertionError("the threshold must not re-run the search")

    monkeypatch.setattr("helpers.views.simulator.app.run_curve", no_search)
    app.threshold.value = 0.5
    assert app.curves["H100"].mfu_bar == pytest.approx(0.5 * H100_SXM.effective_utilization)
    assert app.curves["H100"].points == base.points


def test_scaled_gpu_scales_every_latency_and_bandwidth():
    g = scaled_gpu(H100_SXM, latency=0.1, bandwidth=10)
    assert g.latency_per_matmul_s == pytest.approx(4.5e-7)
    assert [lv.bandwidth_Bps for lv in g.network_levels] == [9e12, 1e12]
    assert [lv.latency_s for lv in g.network_levels] == pytest.approx([1.125e-7] * 2)
    assert scaled_gpu(H100_SXM) is H100_SXM


def _close(a, b) -> bool:
    """Equal, floats to 12 significant digits, inside dicts and lists."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float):
        return a == pytest.approx(b, rel=1e-12)
    return a == b


def test_form_speaks_units_and_round_trips_every_preset():
    app = small_app()
    labels = " ".join(w.value for row in app.form.children if isinstance(row, W.HBox)
                      for w in row.children if isinstance(w, W.Label))
    for unit in ("TB/s", "GB", "MiB", "KiB", "MHz", "µs", "USD"):
        assert unit in labels
    assert app.f_gpu["hbm_Bps"].value == 3.352 and app.f_gpu["hbm_bytes"].value == 80
    assert app.f_gpu["latency_per_matmul_s"].value == 4.5
    assert app.f_level_widgets[0][0].value == 900 and "GB/s" in app.f_level_widgets[0][0].description
    for name, gpu in PRESETS.items():
        app.f_preset.value = name
        cfg = configuration_from_form(app.get_form())
        # equal to 12 significant digits (the form rounds 1.1250000000000001e-07 to 1.125e-07);
        # the form holds the FLOP per clock at the training precision only
        fpct = {gpu.bitwidth: gpu.flop_per_clock_per_thread[gpu.bitwidth]}
        got = gpu_to_json(replace(cfg.gpu, name=gpu.name))
        want = gpu_to_json(replace(gpu, flop_per_clock_per_thread=fpct))
        assert _close(got, want), name


def test_a_configuration_equal_to_one_shown_is_flagged_not_hidden():
    app = small_app()
    app.on_run()
    app.on_preset({"new": H100_SXM.name})
    cfg = app.on_add()  # results are shown, so adding re-runs
    assert cfg is not None and "(= H100)" in cfg.name and "same hardware" in app.f_message.value
    assert list(app.curves) == ["H100", cfg.name]
    fig = app.on_mfu()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["H100", cfg.name]  # its name already says "(= H100)"
    other = plot_mfu({"a": app.curves["H100"], "b": app.curves[cfg.name]})
    assert other.axes[0].get_legend().get_texts()[1].get_text() == "b (same curve as a)"
    dashed = [ln for ln in fig.axes[0].lines if ln.get_label() == labels[1]]
    assert dashed[0].get_linestyle() == "--"


def test_mfu_plot_draws_the_bar_and_marks_the_largest_efficient_point():
    curve = run_curve(GTX_580, Settings(), max_compute=2e26)
    fig = plot_mfu({"GTX 580": curve})
    ax = fig.axes[0]
    bars = [ln for ln in ax.lines if list(ln.get_ydata()) == [curve.mfu_bar] * 2]
    assert bars, "the τ × ceiling line"
    best = curve.max_feasible_at_threshold()
    stars = [ln for ln in ax.lines if ln.get_marker() == "*"]
    assert list(stars[0].get_xdata()) == [best.model.C]
    rel = plot_mfu({"GTX 580": curve}, relative=True).axes[0]
    assert any(list(ln.get_ydata()) == pytest.approx([0.8, 0.8]) for ln in rel.lines)
    assert "ceiling" in rel.get_ylabel()


def test_breakdown_splits_the_matmul_latency_floor_from_arithmetic():
    curve = run_curve(GTX_580, Settings(), max_compute=1e25)
    point = curve.points[0]
    q, m = point.plan, point.model
    parts = breakdown_parts(point, Settings())
    floor = 6 * (m.L // q.pp) * q.m * GTX_580.latency_per_matmul_s
    assert parts["matmul latency floor"] == pytest.approx(floor)
    assert parts["matmul arithmetic"] + floor == pytest.approx(q.time.matmul)
    cli = breakdown(point, Settings())
    assert cli["matmul_latency"] + cli["matmul_arithmetic"] == pytest.approx(cli["compute"])


def test_download_is_a_button():
    app = small_app()
    app.on_run()
    assert "Download results" in app.download.value and "background" in app.download.value
