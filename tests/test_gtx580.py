"""The GTX 580 question: Epoch's published answer against the simulator (helpers.simulator.gtx580)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.hardware import GTX_580
from helpers.simulator import gtx580
from helpers.simulator.curve import run_curve
from helpers.simulator.settings import Settings


@pytest.fixture(scope="module")
def curve():
    return run_curve(GTX_580, Settings(price_per_gpu=300.0), max_compute=3e26)


def test_the_point_nearest_1e26_is_the_blogs_cluster(curve):
    near = gtx580.nearest_grid_point(curve)
    q = near.plan
    assert near.model.C == pytest.approx(1.12e26, rel=0.01)
    assert gtx580.blog_layout_matches(near)
    assert (q.n_gpus, q.dp, q.pp, q.tp_model, q.tp_ff) == (2**24, 1024, 32, 16, 32)
    assert q.n_gpus * gtx580.BLOG.price_per_gpu == pytest.approx(5.03e9, rel=0.01)
    assert near.run_time_s <= curve.settings.duration_s
    assert near.mfu == pytest.approx(0.554, abs=1e-3) and near.mfu < curve.mfu_bar


def test_no_reading_admits_the_blogs_point(curve):
    near = gtx580.nearest_grid_point(curve)
    bars = [r.bar(curve) for r in gtx580.READINGS]
    assert bars[0] == bars[1] == pytest.approx(0.68)  # τ × ceiling is MFU/ceiling ≥ τ
    assert bars[2] == pytest.approx(0.8 * 0.801, abs=1e-3)
    for bar in bars:
        best = gtx580.answer(curve, bar)
        assert near.mfu < bar and best.model.C == pytest.approx(5.81e25, rel=0.01)


def test_compute_side_guesses_leave_the_blogs_point_unchanged():
    v = gtx580.Variant("eff 1", True, replace(GTX_580, effective_utilization=1.0),
                       Settings(price_per_gpu=300.0))
    row, _ = gtx580.row(v, 1.2e26)
    assert row.mfu_at_blog == pytest.approx(0.554, abs=1e-3) and not row.blog_holds


def test_bandwidth_beyond_the_node_moves_the_answer_past_the_blog():
    (row,) = gtx580.sensitivity(3e26, [v for v in gtx580.variants()
                                       if v.label == "beyond-node bandwidth 1 → 2 GB/s"])
    assert row.mfu_at_blog > 0.68 and row.answer_flop > 2e26 and not row.blog_holds


def test_variants_change_one_input_each():
    base, *rest = gtx580.variants()
    assert base.gpu == GTX_580
    for v in rest:
        changed = sum(getattr(v.gpu, f) != getattr(GTX_580, f)
                      for f in ("effective_utilization", "latency_per_matmul_s", "network_levels"))
        assert changed + (v.settings != base.settings) == 1, v.label
    assert {v.guess for v in rest if "latency" in v.label or "utilization" in v.label} == {True}
