"""When does tensor parallelism pay (helpers.cost.tp) and its widget (helpers.views.tp)."""
import json

import pytest

from helpers.cost import alpha_beta
from helpers.cost import tp as tp_cost

THIS_MACHINE = "this machine: gloo fit from notebook 02"


def _fit_file(tmp_path):
    path = tmp_path / "collective_fit.json"
    path.write_text(json.dumps({"backend": "gloo", "world_size": 2, "cores_per_rank": 1,
                                "fit": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}}}))
    return path


def test_fit_is_optional(tmp_path):
    assert tp_cost.load_fit(tmp_path / "missing.json") is None
    assert THIS_MACHINE not in tp_cost.hardware_choices(None)
    fit = tp_cost.load_fit(_fit_file(tmp_path))
    assert fit.all_reduce.alpha_s == 1e-4 and fit.all_reduce.beta_s_per_byte == 1e-9
    hardware = tp_cost.hardware_choices(fit, cpu_flops=1e10)[THIS_MACHINE]
    assert tp_cost.link_for(hardware, 2).bandwidth_Bps == pytest.approx(1e9)


def test_fit_saved_by_notebook_02_is_read_even_with_fractional_cores(tmp_path):
    path = alpha_beta.save_fit({"all_reduce": alpha_beta.Fit("all_reduce", 2e-4, 1.5e-9)},
                               "gloo", 4, 0.5, path=tmp_path / "collective_fit.json")
    fit = tp_cost.load_fit(path)
    assert (fit.world_size, fit.cores_per_rank) == (4, 0.5)
    assert fit.all_reduce.beta_s_per_byte == 1.5e-9


def test_links_come_from_hardware_hierarchy():
    nvlink, ib = tp_cost.h100_links()
    assert (nvlink.bandwidth_Bps, ib.bandwidth_Bps) == (450e9, 50e9)


@pytest.mark.parametrize("layout", tp_cost.LAYOUTS)
def test_comm_time_is_alpha_beta_of_the_layout_collectives(layout):
    hardware = next(iter(tp_cost.hardware_choices().values()))
    t, hidden, tokens = 4, 1024, 128
    link, n = tp_cost.link_for(hardware, t), tokens * hidden * hardware.bytes_per_element
    per_step = sum(sum(calls) * alpha_beta.predict(op, t, n, link.latency_s, 1 / link.bandwidth_Bps)
                   for op, calls in tp_cost.formula_collectives(layout, 4).items())
    row = tp_cost.layer_times(t, hidden, hardware, tokens, layout)
    assert row.comm_s == pytest.approx(per_step / 4)
    # Megatron, by hand: one all-reduce per layer, 2(t−1)α + 2(t−1)/t·n/W
    if layout == "megatron":
        assert row.comm_s == pytest.approx(6 * link.latency_s + 1.5 * n / link.bandwidth_Bps)


@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("hidden", [256, 32768])
@pytest.mark.parametrize("tokens", [128, 65536])
def test_widget_model_at_slider_extremes(tmp_path, t, hidden, tokens, capsys):
    from helpers.views import tp as views
    choices = tp_cost.hardware_choices(tp_cost.load_fit(_fit_file(tmp_path)), cpu_flops=5e10)
    view = views.TPCurveView(choices)
    for name, hardware in choices.items():
        row = tp_cost.layer_times(t, hidden, hardware, tokens)
        assert row.compute_s == pytest.approx(6 * tokens * hidden**2 / t / hardware.flops)
        assert (row.comm_s == 0) == (t == 1) and row.comm_s >= 0
        text = tp_cost.describe(t, hidden, hardware, tokens)
        assert f"t={t}, h={hidden}" in text
        picture, sentence = view.update(t, hidden, tokens, name)
        assert sentence == text and picture.startswith(b"\x89PNG\r\n\x1a\n")
        fig = views.plot_curve(hidden, hardware, tokens, t)
        assert len(fig.axes[0].lines) >= 4  # compute, communication, step, best t
    assert t in views.T_OPTIONS and hidden in views.HIDDEN_OPTIONS and tokens in views.TOKEN_OPTIONS
    assert views.widget_when_tp_pays(choices, t, hidden, tokens).children  # sliders build here


def test_tp_stays_inside_a_node():
    cluster, ib_only, _ = tp_cost.hardware_choices().values()
    hidden, tokens = 8192, 16384
    # On NVLink the step keeps shrinking up to the node (8); crossing into InfiniBand it grows.
    rows = {r.t: r for r in tp_cost.tp_curve(hidden, cluster, tokens)}
    assert rows[8].step_s < rows[4].step_s < rows[1].step_s
    assert rows[16].step_s > rows[8].step_s and rows[16].link == "InfiniBand NDR"
    assert tp_cost.best_t(tp_cost.tp_curve(hidden, cluster, tokens)) == 8
    # With InfiniBand only, TP does not pay at all; at the lecture's size it never pays.
    assert tp_cost.best_t(tp_cost.tp_curve(hidden, ib_only, tokens)) == 1
    assert tp_cost.best_t(tp_cost.tp_curve(1024, cluster, 128)) == 1


def test_layer_times_rejects_bad_input():
    hardware = next(iter(tp_cost.hardware_choices().values()))
    with pytest.raises(ValueError, match="^hidden must be a multiple of 3"):
        tp_cost.layer_times(3, 1024, hardware, 128)
    with pytest.raises(ValueError, match="^tokens must"):
        tp_cost.layer_times(2, 1024, hardware, tokens=0)
    with pytest.raises(ValueError, match="^layout must"):
        tp_cost.layer_times(2, 1024, hardware, 128, layout="diagonal")


def test_this_machine_prices_its_fit_and_flops():
    fit = tp_cost.SavedFit("gloo", 2, 1.0, alpha_beta.Fit("all_reduce", 1e-4, 1e-9), source="here")
    hardware = tp_cost.this_machine(fit, cpu_flops=1e11)
    assert tp_cost.hardware_choices(fit, 1e11)["this machine: gloo fit from here"] == hardware
    row = tp_cost.layer_times(2, 1024, hardware, tokens=128)
    n = 128 * 1024 * 4                     # one fp32 activation
    # t = 2, by hand: half the compute, and one ring all-reduce 2(t−1)α + 2(t−1)/t · n·β
    assert row.compute_s == pytest.approx(6 * 128 * 1024**2 / 2 / 1e11)
    assert row.comm_s == pytest.approx(2 * 1e-4 + n * 1e-9)
