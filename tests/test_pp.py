"""Pipeline parallelism: schedules against the plain model, event logs, live activations."""
import multiprocessing

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from helpers.parallel import pp  # noqa: E402
from helpers.parallel.schedules import (Action, bubble_theory, check_event_log, make_plan,  # noqa: E402
                                  measured_bubble, peak_live, simulate)
from helpers.ranks import LiveRanks  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    with LiveRanks(2, backend="gloo", timeout=60) as live:
        yield live


@pytest.fixture(scope="module")
def ref():
    return pp.reference()


# -- pure: schedules, simulator, theory ---------------------------------------------------

GRID = [(s, p, m, v) for s in ("gpipe", "1f1b") for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8)
        for v in (1,)] + [("interleaved", p, m, v) for p in (1, 2, 4) for m in (p, 2 * p, 4 * p)
                         for v in (2, 3)]


@pytest.mark.parametrize("schedule,p,m,v", GRID)
def test_simulated_bubble_equals_theory(schedule, p, m, v):
    events = simulate(schedule, p, m, t_f=1.0, t_b=2.0, v=v)
    check_event_log(events, p, m, v)
    assert measured_bubble(events, p) == pytest.approx(bubble_theory(p, m, v), abs=1e-12)


def test_bubble_does_not_depend_on_backward_cost():
    for t_b in (0.5, 1.0, 2.0, 3.0):
        events = simulate("1f1b", 4, 6, t_f=1.0, t_b=t_b)
        assert measured_bubble(events, 4) == pytest.approx(3 / 9)


def test_planned_peak_live_microbatches():
    p, m = 4, 8
    assert [peak_live(make_plan("gpipe", p, m, r)) for r in range(p)] == [m] * p
    assert [peak_live(make_plan("1f1b", p, m, r)) for r in range(p)] == [4, 3, 2, 1]
    assert [peak_live(make_plan("1f1b", p, 2, r)) for r in range(p)] == [2, 2, 2, 1]


def test_1f1b_plan_shape():
    assert make_plan("1f1b", 2, 3, 0) == [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0),
                                          Action("F", 0, 2), Action("B", 0, 1), Action("B", 0, 2)]


def test_event_log_check_catches_causality_violation():
    events = simulate("gpipe", 2, 2)
    for e in events:
        if e["rank"] == 1 and e["kind"] == "F" and e["mb"] == 0:
            e["start"] -= 0.5  # starts before rank 0 finished sending it
    with pytest.raises(AssertionError, match="started before"):
        check_event_log(events, 2, 2)


# -- bad inputs: one clear error, before any process starts --------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(p=3), "num_layers"),                       # 4 layers cannot be cut into 3 stages
    (dict(p=2, num_layers=6, schedule="interleaved", m=4), "num_layers"),  # 6 % (2·2)
    (dict(m=0), "m"),
    (dict(m=-1), "m"),
    (dict(m=3), "batch"),                            # 128 % 3
    (dict(p=0), "p"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(schedule="interleaved", p=2, m=3), "m"),   # m must be a multiple of p
    (dict(mode="fast"), "mode"),
    (dict(t_f=0, mode="wait"), "t_f"),
])
def test_bad_inputs_raise_before_any_process(kwargs, name):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=name):
        pp.run_pipeline(**kwargs)
    assert multiprocessing.active_children() == before


def test_bad_types_and_lecture_inputs():
    with pytest.raises(TypeError, match="m must be an int"):
        pp.run_pipeline(m=2.0)
    with pytest.raises(ValueError, match="num_layers"):
        pp.run_lecture_forward(p=3)
    with pytest.raises(ValueError, match="m must be >= 1"):
        pp.run_lecture_forward(m=0)


# -- live ranks ---------------------------------------------------------------------------

def test_lecture_forward_equals_unsharded_mlp(ranks, ref):
    out = pp.run_lecture_forward(2, 4, ranks=ranks)
    torch.testing.assert_close(out, ref["output"])


@pytest.mark.parametrize("schedule,p", [("gpipe", 2), ("1f1b", 2), ("interleaved", 2),
                                        ("1f1b", 4), ("gpipe", 4)])
def test_gradients_equal_single_process(ranks, ref, schedule, p):
    m = 4
    run = pp.run_pipeline(schedule, p, m, ranks=ranks, mode="compute")
    pp.check_gradients(run, ref)  # assert_close on every layer and the loss
    check_event_log(run.events, p, m, run.v)
    assert run.peak_live == [peak_live(make_plan(schedule, p, m, r, run.v)) for r in range(p)]


def test_live_activation_counts_in_wait_mode(ranks):
    p, m = 4, 8
    gpipe = pp.run_pipeline("gpipe", p, m, ranks=ranks, mode="wait", t_f=0.004)
    one_f_one_b = pp.run_pipeline("1f1b", p, m, ranks=ranks, mode="wait", t_f=0.004)
    assert gpipe.peak_live == [m] * p
    assert one_f_one_b.peak_live == [p - r for r in range(p)]
    for run in (gpipe, one_f_one_b):
        check_event_log(run.events, p, m)
        assert 0 < run.bubble_measured < 1
        waits = [e["end"] - e["start"] for e in run.events]
        assert min(waits) >= 0.004  # a wait never ends early


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_matches_single_process(ranks, ref, schedule):
    run = pp.run_torch_pipelining(schedule, 2, 4, ranks=ranks)
    pp.check_gradients(run, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="torch.distributed.pipelining on NCCL needs 2 GPUs")
def test_torch_pipelining_on_nccl(ref):
    run = pp.run_torch_pipelining("1f1b", 2, 4)
    pp.check_gradients(run, ref)


# -- the widget's callback at its slider extremes -------------------------------------------

EXTREMES = [(2, 1, "gpipe"), (2, 16, "1f1b"), (8, 1, "1f1b"), (8, 16, "gpipe"),
            (2, 16, "interleaved"), (8, 8, "interleaved")]


@pytest.mark.parametrize("p,m,schedule", EXTREMES)
def test_explore_pipeline_simulated(p, m, schedule):
    fig, ax = plt.subplots()
    run, text = pp.explore_pipeline(p, m, schedule, ranks=None, ax=ax)
    plt.close(fig)
    assert run.bubble_measured == pytest.approx(run.bubble_theory)
    assert f"p={p} m={m}" in text and len(ax.patches) == len(run.events)


@pytest.mark.parametrize("p,m,schedule", [(2, 1, "gpipe"), (8, 16, "interleaved")])
def test_explore_pipeline_live(ranks, p, m, schedule):
    fig, ax = plt.subplots()
    run, text = pp.explore_pipeline(p, m, schedule, ranks=ranks, t_f=0.004, ax=ax)
    plt.close(fig)
    check_event_log(run.events, p, m, run.v)
    assert run.mode == "wait" and 0 < run.bubble_measured < 1
    assert len(ax.patches) == len(run.events)


def test_explore_pipeline_rejects_bad_interleaving():
    with pytest.raises(ValueError, match="multiple of p"):
        pp.explore_pipeline(8, 4, "interleaved")
