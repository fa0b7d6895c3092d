"""The 3-D cost model (helpers.cost.parallel3d) on hand-computed cases, and the views' smoke test."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.cost.alpha_beta import Fit
from helpers.cost.parallel3d import (LAYOUTS_4, Breakdown, Calibration, Comparison,
                                     Shape, busy_ranks, forward_flops,
                                     measured_breakdown, predict, shape_flops, shapes_used,
                                     stage_parameters, stages_used, summary, table)
from helpers.layout import Layout

TINY = SimpleNamespace(vocab=8, hidden=4, heads=2, layers=4, seq=3, batch=8)


def test_forward_flops_by_hand():
    f = forward_flops(tokens=10, hidden=2, seq=5, vocab=3, layers=2)
    assert (f.block_linears, f.block_attention, f.head) == (24 * 10 * 4, 4 * 10 * 5 * 2, 2 * 10 * 2 * 3)
    assert f.total == 2 * (960 + 400) + 120 == 2840


def test_stage_parameters_by_hand_and_they_add_up_to_the_model():
    from helpers.configs import TransformerConfig
    lay = Layout(1, 2, 2, 4)
    # stage 0: 2 blocks × (12·16/2 + 4·4) + embeddings 8·4 + 3·4; stage 1: 2 blocks + 2·4 + 4·8
    assert stage_parameters(lay, TINY, 0) == 2 * (96 + 16) + 32 + 12 == 268
    assert stage_parameters(lay, TINY, 1) == 2 * (96 + 16) + 8 + 32 == 264
    config = TransformerConfig(**vars(TINY))
    assert stage_parameters(Layout(1, 1, 1), config, 0) == config.parameters == 916


def _calibration(cores: float, layouts=(Layout(1, 2, 2, 4),), **changes) -> Calibration:
    """4 ranks; every block piece takes 1 s with all of them busy, the head 0.5 s; a TP
    all-reduce costs α = 10 ms only, a p2p hop α = 100 ms only; the optimizer and DP nothing."""
    seconds = {"block": 1.0, "head": 0.5}
    fields = dict(world=4, compute_s={s: seconds[s.part] for s in shapes_used(layouts, TINY)},
                  cores=cores, tp_all_reduce={2: Fit("all_reduce", 0.01, 0.0)}, all_reduce={},
                  send_recv=Fit("send_recv", 0.1, 0.0),
                  optimizer_s=dict.fromkeys(stages_used(layouts, TINY), 0.0), lateness={})
    return Calibration(**{**fields, **changes})


def test_pipeline_with_tensor_parallel_stages_by_hand():
    got = predict(Layout(1, 2, 2, 4), TINY, _calibration(cores=4.0))
    # T0 = 2 blocks + 4·2 all-reduces of 2(t−1)α = 2 + 0.16; T1 = T0 + head 0.5
    assert got.stage_s == pytest.approx((2.16, 2.66))
    # 4·T1 + fill/drain bubble (p−1)·T0 = 2.16 + 2·(p−1 + m−1) hops of 0.1 s
    assert got.bubble_s == pytest.approx(2.16)
    assert got.p2p_s == pytest.approx(0.8)
    assert got.step_s == pytest.approx(4 * 2.66 + 2.16 + 0.8)
    assert got.breakdown.compute_s == pytest.approx((4 * 2 + 4 * 2.5) / 2)
    assert got.breakdown.tp_comm_s == pytest.approx(0.64)
    assert got.breakdown.dp_comm_s == 0


def test_fewer_busy_ranks_than_calibrated_share_the_cores_less():
    # 1F1B, p = 2, m = 4 (F = 1, B = 2): stage 0 works 12 units, 3 of them alone (its first
    # forward and its last backward: 1 + 2), 9 with stage 1; stage 1 the same, mirrored:
    # a busy stage shares with 1 + 9/12 = 1.75 stages, so 2 · 1.75 = 3.5 ranks of 1·2·2
    assert busy_ranks(Layout(1, 2, 2, 4)) == pytest.approx(3.5)
    assert busy_ranks(Layout(2, 2, 1)) == 4
    # calibrated with 4 busy on 1.75 cores (each at 1.75/4), now each at 1.75/3.5: × 0.875
    got = predict(Layout(1, 2, 2, 4), TINY, _calibration(cores=1.75))
    assert got.stage_s == pytest.approx((2 * 0.875 + 0.16, 2.5 * 0.875 + 0.16))


def test_equal_stages_give_notebook_05s_bubble():
    """With the head free, every stage is equal and the step is (m + p − 1)·T."""
    lay = Layout(1, 1, 4, 8)
    cal = _calibration(4.0, (lay,))
    cal.compute_s[Shape("head", 1 * 3, 1)] = 0.0
    got = predict(lay, TINY, cal)
    assert got.step_s - got.p2p_s == pytest.approx((8 + 4 - 1) * 1.0)


def test_data_parallel_all_reduce_lateness_and_optimizer_by_hand():
    lay = Layout(2, 1, 1)
    cal = _calibration(4.0, (lay,), all_reduce={2: Fit("all_reduce", 0.0, 1e-9)},
                       lateness={2: 0.1}, optimizer_s={(1, 1, 0): 0.25})
    got = predict(lay, TINY, cal)
    # 4 blocks of 1 s and the head's 0.5 s; the slowest replica 10 % later; ring all-reduce
    # on 2 ranks: 2(p−1)/p · n·β = n·β with n = 4 bytes × 916 parameters; AdamW 0.25 s
    assert got.breakdown.compute_s == pytest.approx(4.5)
    assert got.breakdown.dp_comm_s == pytest.approx(0.45 + 4 * 916 * 1e-9)
    assert got.breakdown.optimizer_s == 0.25
    assert got.step_s == pytest.approx(4.5 + 0.45 + 4 * 916 * 1e-9 + 0.25)
    assert cal.flops_per_s(Shape("head", 12, 1), TINY) == shape_flops(Shape("head", 12, 1), TINY) / 0.5


def test_measured_breakdown_adds_up_to_the_step():
    span = lambda kind, a, b: SimpleNamespace(kind=kind, start=a, end=b)  # noqa: E731
    got = measured_breakdown([[span("compute", 0, 1), span("tp_comm", 1, 1.5), span("pp_comm", 1.5, 2)],
                              [span("compute", 0, 2), span("dp_comm", 2, 2.5),
                               span("optimizer", 2.5, 3)]], step_s=3.0)
    # rank 0: 1 + 0.5 + 0.5 in spans, 1 s in none; rank 1: 3 s in spans
    assert got == Breakdown(compute_s=1.5, tp_comm_s=0.25, p2p_s=0.25, dp_comm_s=0.25,
                            optimizer_s=0.25, idle_s=0.5)
    assert got.step_s == 3.0
    # without a pipeline, the time in no span is unattributed, not idle
    flat = measured_breakdown([[span("compute", 0, 1)]], step_s=1.5, pipelined=False)
    assert (flat.idle_s, flat.unattributed_s, flat.step_s) == (0.0, 0.5, 1.5)
    with pytest.raises(ValueError, match="span kind must be one of"):
        measured_breakdown([[span("idle", 0, 1)]], 1.0)


def test_layouts_that_do_not_divide_the_model_are_named():
    assert Layout(1, 4, 1).problem(TINY) == (
        "heads must be a multiple of 4 (each of the t=4 TP ranks keeps whole heads), got 2")
    assert "batch must be a multiple of 16" in Layout(2, 1, 2, 8).problem(TINY)
    assert "layers must be a multiple of 3" in Layout(1, 1, 3).problem(TINY)
    assert all(lay.world == 4 for lay in LAYOUTS_4) and len(set(LAYOUTS_4)) == 6


def _comparison(layout, measured, predicted):
    parts = Breakdown(measured, 0.0, 0.0, 0.0, 0.0)
    from helpers.cost.parallel3d import Prediction
    return Comparison(layout, parts, Prediction(layout, Breakdown(predicted, 0, 0, 0, 0), 0, 0, ()))


def test_summary_has_the_benchmarks_fields():
    rows = [_comparison(Layout(4, 1, 1), 1.0, 1.1), _comparison(Layout(1, 4, 1), 2.0, 1.0),
            _comparison(Layout(2, 2, 1), 0.5, 0.6)]
    got = summary(rows)
    assert got.median_rel_error == pytest.approx(0.2)
    assert got.max_rel_error == pytest.approx(0.5)
    assert got.results[1].rel_error == pytest.approx(-0.5)
    assert (got.best_measured, got.best_predicted) == ("2·2·1", "2·2·1")
    record = got.as_json()  # the benchmark's JSON line
    assert record["results"][1]["rel_error"] == pytest.approx(-0.5) and record["world_size"] == 4
    assert "+10%" in table(rows)


def test_views_draw(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from helpers.views.parallel3d import plot_breakdown, plot_gantt, plot_parity, widget_parallel3d
    rows = [_comparison(Layout(4, 1, 1), 1.0, 1.1), _comparison(Layout(1, 1, 4, 4), 2.0, 1.0)]
    rows.append(Comparison(Layout(1, 1, 4, 4), Breakdown(1.0, 0.0, 0.25, 0.0, 0.0, idle_s=0.5),
                           rows[1].predicted))
    span = lambda kind, a, b: SimpleNamespace(kind=kind, start=a, end=b)  # noqa: E731
    figs = [plot_parity(rows), plot_breakdown(rows),
            plot_gantt([[span("compute", 0, 1), span("pp_comm", 1, 2)], [span("dp_comm", 0, 1)]])]
    assert all(isinstance(f, Figure) for f in figs)
    def legend_of(fig):
        legend = fig.axes[0].get_legend()
        return {t.get_text(): tuple(h.get_facecolor()) for t, h in zip(legend.get_texts(),
                                                                      legend.legend_handles)}
    # the Gantt chart's legend: one entry per kind of span, each in that kind's colour, and
    # the gaps (time in no span) named
    entries = legend_of(figs[2])
    assert list(entries) == ["compute", "TP comm", "pipeline p2p", "DP comm", "optimizer", "idle"]
    assert len(set(entries.values())) == 6
    bars = {tuple(b.get_facecolor()) for b in figs[2].axes[0].patches}
    assert {entries[k] for k in ("compute", "pipeline p2p", "DP comm")} == bars
    unpiped = plot_gantt([[span("compute", 0, 1)]], pipelined=False)
    assert list(legend_of(unpiped))[-1] == "unattributed"
    # the breakdown names every part a bar shows (idle too), in the Gantt's colours
    parts = legend_of(figs[1])
    assert list(parts) == ["compute", "pipeline p2p", "idle"]
    assert all(parts[name] == entries[name] for name in parts)
    # its legend sits below the bars, not over them, and its title fits in the figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # views make plain Figures
    renderer = FigureCanvasAgg(figs[1]).get_renderer()
    box = figs[1].axes[0].get_legend().get_window_extent(renderer)
    assert box.y1 <= figs[1].axes[0].get_window_extent().y0
    title = figs[1].axes[0].title.get_window_extent(renderer)
    assert 0 <= title.x0 and title.x1 <= figs[1].bbox.width
    plt.close("all")
    from helpers.configs import TRANSFORMER
    from helpers.views import parallel3d as views
    # This calibration prices TINY's shapes only: the widget offers none of the decoder's.
    assert not views._priced(Layout(4, 1, 1, 2), TRANSFORMER, _calibration(4.0))
    monkeypatch.setattr(views, "_priced", lambda *_: True)   # as if every shape was calibrated
    widget = widget_parallel3d(SimpleNamespace(world_size=4), _calibration(4.0), TRANSFORMER)
    mesh_box, m_box, _ = widget.children[0].children
    assert len(mesh_box.options) == 6          # every d·t·p = 4 divides the default decoder
    mesh_box.value = next(v for _, v in mesh_box.options if v.p == 4)
    assert m_box.value == 4 and m_box.options == (1, 2, 4, 8)


def test_parity_labels_do_not_overprint():
    """Layouts whose points nearly coincide (as 2·1·2 and 1·1·4 often do) get labels apart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Annotation

    from helpers.views.parallel3d import plot_parity
    rows = [_comparison(Layout(4, 1, 1), 0.100, 0.101), _comparison(Layout(2, 1, 2, 4), 0.102, 0.100),
            _comparison(Layout(1, 1, 4, 4), 0.101, 0.103), _comparison(Layout(1, 4, 1), 0.5, 0.45)]
    fig = plot_parity(rows)
    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [a.get_window_extent(renderer) for a in fig.axes[0].texts if isinstance(a, Annotation)]
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_a_group_of_one_sends_nothing():
    """At d = 1 the gradient hook's span is not communication: it goes to unattributed."""
    from types import SimpleNamespace as NS
    spans = [[NS(kind="compute", start=0, end=1), NS(kind="dp_comm", start=1, end=1.25)]]
    alone = measured_breakdown(spans, step_s=1.5, pipelined=True, data_parallel=False)
    assert alone.dp_comm_s == 0 and alone.unattributed_s == 0.25 and alone.idle_s == 0.25
    flat = measured_breakdown(spans, step_s=1.5, pipelined=False, data_parallel=False)
    assert flat.unattributed_s == 0.5
