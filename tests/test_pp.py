"""Pipeline parallelism: schedules against the plain model, event logs, live activations."""
import dataclasses
import multiprocessing
import threading

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from helpers.configs import LECTURE
from helpers.cost.bubble import bubble_theory, measured_bubble  # noqa: E402
from helpers.cost.schedules import (Action, Event, log_violation, make_plan,  # noqa: E402
                                    peak_live, simulate, verify_event_log)
from helpers.labs import pp as pp_lab
from helpers.parallel import pp  # noqa: E402
from helpers.parallel.groups import split_groups  # noqa: E402
from helpers.ranks import LiveRanks  # noqa: E402
from helpers.views.pp import (MAX_STAGES, WIDGET_T_F, PipelineView,  # noqa: E402
                              _height, pipeline_outputs, plot_bubble_sweep, plot_gantt, plot_runs,
                              schedules_for, valid_ms, widget_pipeline)


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(2, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def ref():
    return pp_lab.reference()


# -- pure: schedules, simulator, theory ---------------------------------------------------

GRID = [(s, p, m, v) for s in ("gpipe", "1f1b") for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8)
        for v in (1,)] + [("interleaved", p, m, v) for p in (1, 2, 4) for m in (p, 2 * p, 4 * p)
                         for v in (2, 3)]


@pytest.mark.parametrize("schedule,p,m,v", GRID)
def test_simulated_bubble_equals_theory(schedule, p, m, v):
    events = simulate(schedule, p, m, t_f=1.0, t_b=2.0, v=v)
    verify_event_log(events, p, m, v)
    assert measured_bubble(events, p) == pytest.approx(bubble_theory(p, m, v), abs=1e-12)


def test_bubble_does_not_depend_on_backward_cost():
    for t_b in (0.5, 1.0, 2.0, 3.0):
        events = simulate("1f1b", 4, 6, t_f=1.0, t_b=t_b)
        assert measured_bubble(events, 4) == pytest.approx(3 / 9)


def test_bubble_arithmetic_checks_its_arguments():
    assert bubble_theory(4, 2.5) == pytest.approx(3 / 5.5)  # fractional m draws the curve
    with pytest.raises(ValueError, match="m must be > 0"):
        bubble_theory(2, 0)
    with pytest.raises(TypeError, match="p must be an int"):
        bubble_theory(2.0, 4)
    with pytest.raises(ValueError, match="events must not be empty"):
        measured_bubble([], 2)
    idle_half = [Event(0, "F", 0, 0, 0.0, 1.0), Event(1, "F", 0, 0, 1.0, 2.0)]
    assert measured_bubble(idle_half, 2) == pytest.approx(0.5)


def test_planned_peak_live_microbatches():
    p, m = 4, 8
    assert [peak_live(make_plan("gpipe", p, m, r)) for r in range(p)] == [m] * p
    assert [peak_live(make_plan("1f1b", p, m, r)) for r in range(p)] == [4, 3, 2, 1]
    assert [peak_live(make_plan("1f1b", p, 2, r)) for r in range(p)] == [2, 2, 2, 1]


def test_1f1b_plan_shape():
    assert make_plan("1f1b", 2, 3, 0) == [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0),
                                          Action("F", 0, 2), Action("B", 0, 1), Action("B", 0, 2)]


def test_event_log_check_catches_causality_violation():
    events = [e.shifted(0.5) if (e.rank, e.action) == (1, Action("F", 0, 0)) else e
              for e in simulate("gpipe", 2, 2)]  # starts before rank 0 finished sending it
    with pytest.raises(AssertionError, match="started before"):
        verify_event_log(events, 2, 2)
    assert "started before" in log_violation(events, 2, 2)
    assert log_violation(simulate("gpipe", 2, 2), 2, 2) == ""
    assert log_violation(simulate("gpipe", 2, 2)[1:], 2, 2) == "expected 8 forwards and backwards, got 7"


def test_stage_ranges_cover_the_model():
    assert [pp.stage_range(s, 2, LECTURE) for s in range(2)] == [range(0, 2), range(2, 4)]
    assert [pp.stage_range(s, 4, LECTURE) for s in range(4)] == [range(s, s + 1) for s in range(4)]


# -- bad inputs: one clear error, before any process starts --------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(p=3), "layers"),                           # 4 layers cannot be cut into 3 stages
    (dict(p=2, config=LECTURE.with_(layers=6), schedule="interleaved", m=4), "layers"),  # 6 % 4
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
        pp_lab.run_pipeline(None, **kwargs)  # the arguments are checked before the ranks
    assert multiprocessing.active_children() == before


def test_bad_types_and_lecture_inputs():
    with pytest.raises(TypeError, match="m must be an int"):
        pp_lab.run_pipeline(None, m=2.0)
    with pytest.raises(ValueError, match="layers must be a multiple of 3"):
        pp_lab.run_lecture_forward(None, p=3)
    with pytest.raises(ValueError, match="m must be >= 1"):
        pp_lab.run_lecture_forward(None, m=0)
    with pytest.raises(ValueError, match="p must be >= 2"):
        pp_lab.run_torch_pipelining(None, p=1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pp_lab.run_torch_pipelining(None, "interleaved")
    with pytest.raises(TypeError, match="ranks must be a LiveRanks"):  # no hidden spawn
        pp_lab.run_pipeline(None)


# -- live ranks ---------------------------------------------------------------------------

def test_lecture_forward_equals_unsharded_mlp(ranks, ref):
    out = pp_lab.run_lecture_forward(ranks, 2, 4)
    torch.testing.assert_close(out, ref.output)


@pytest.mark.parametrize("schedule,p", [("gpipe", 2), ("1f1b", 2), ("interleaved", 2),
                                        ("1f1b", 4), ("gpipe", 4)])
def test_gradients_equal_single_process(ranks, ref, schedule, p):
    m = 4
    run = pp_lab.run_pipeline(ranks, schedule, p, m, mode="compute")
    pp_lab.verify_gradients(run, ref)  # assert_close on every layer and the loss
    assert pp_lab.gradient_error(run, ref) < 1e-5
    off = dataclasses.replace(run, grads={k: g + 1e-3 for k, g in run.grads.items()})
    assert pp_lab.gradient_error(off, ref) == pytest.approx(1e-3, rel=0.05)
    verify_event_log(run.events, p, m, run.v)
    assert run.peak_live == [peak_live(make_plan(schedule, p, m, r, run.v)) for r in range(p)]


def two_pipelines_rank(rank, world_size, schedule, m):
    """Ranks {0, 1} and {2, 3} each run their own 2-stage pipeline (compute mode) and the
    lecture's forward, at the same time, in one world of 4."""
    group = split_groups([[0, 1], [2, 3]])
    log = pp_lab.pipeline_rank(rank, world_size, schedule, m, 1, "compute", pp_lab.T_F, 2 * pp_lab.T_F,
                           group=group)
    return log, pp_lab.lecture_forward(rank, world_size, m, group=group)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_pipelines_side_by_side_in_subgroups(ranks, ref, schedule):
    m = 4
    results = ranks.resize(4).run(two_pipelines_rank, schedule, m)
    for pair in ([0, 1], [2, 3]):
        run = pp_lab.PipelineRun.from_logs(schedule, m, 1, "compute", [results[r][0] for r in pair])
        pp_lab.verify_gradients(run, ref)  # loss and every layer's gradient
        verify_event_log(run.events, 2, m)
        assert {e.rank for e in run.events} == {0, 1}  # stages are group ranks
        assert results[pair[0]][1] is None
        torch.testing.assert_close(results[pair[1]][1], ref.output)


def torch_pipelining_pairs_rank(rank, world_size, schedule, m):
    group = split_groups([[0, 1], [2, 3]])
    return pp_lab.torch_pipelining_rank(rank, world_size, schedule, m, group=group)


def test_torch_pipelining_in_subgroups(ranks, ref):
    logs = ranks.resize(4).run(torch_pipelining_pairs_rank, "1f1b", 4)
    for pair in ([0, 1], [2, 3]):
        run = pp_lab.PipelineRun.from_logs("torch 1f1b", 4, 1, "compute", [logs[r] for r in pair])
        pp_lab.verify_gradients(run, ref)


def test_live_activation_counts_in_wait_mode(ranks):
    p, m = 4, 8
    gpipe = pp_lab.run_pipeline(ranks, "gpipe", p, m, mode="wait", t_f=0.004)
    one_f_one_b = pp_lab.run_pipeline(ranks, "1f1b", p, m, mode="wait", t_f=0.004)
    assert gpipe.peak_live == [m] * p
    assert one_f_one_b.peak_live == [p - r for r in range(p)]
    for run in (gpipe, one_f_one_b):
        verify_event_log(run.events, p, m)
        assert 0 < run.bubble_measured < 1
        assert min(e.duration for e in run.events) >= 0.004  # a wait never ends early


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_matches_single_process(ranks, ref, schedule):
    run = pp_lab.run_torch_pipelining(ranks, schedule, 2, 4)
    pp_lab.verify_gradients(run, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="torch.distributed.pipelining on NCCL needs 2 GPUs")
def test_torch_pipelining_on_nccl(ref):
    with LiveRanks(2, backend="nccl") as gpu_ranks:
        run = pp_lab.run_torch_pipelining(gpu_ranks, "1f1b", 2, 4)
    pp_lab.verify_gradients(run, ref)


def test_bubble_sweep_and_its_plot(ranks):
    runs = pp_lab.bubble_sweep(ranks, ps=(2,), ms=(1, 4), t_f=0.004)
    assert [(r.p, r.m, r.mode) for r in runs] == [(2, 1, "wait"), (2, 4, "wait")]
    fig = plot_bubble_sweep(runs)
    assert len(fig.axes[0].lines) == 2  # one curve and one set of dots per p
    with pytest.raises(TypeError, match="ranks must be a LiveRanks"):
        pp_lab.bubble_sweep(None)


# -- the widget's runs at its slider extremes ---------------------------------------------

EXTREMES = [(2, 1, "gpipe"), (2, 16, "1f1b"), (8, 1, "1f1b"), (8, 16, "gpipe"),
            (2, 16, "interleaved"), (8, 8, "interleaved")]


@pytest.mark.parametrize("p,m,schedule", EXTREMES)
def test_timed_schedule_simulated(p, m, schedule):
    run = pp_lab.timed_schedule(schedule, p, m)
    assert run.mode == "simulated" and run.bubble_measured == pytest.approx(run.bubble_theory)
    fig = plot_gantt(run.events, p)
    assert bars(fig.axes[0]) == len(run.events)


@pytest.mark.parametrize("p,m,schedule", [(2, 1, "gpipe"), (8, 16, "interleaved")])
def test_timed_schedule_live(ranks, p, m, schedule):
    run = pp_lab.timed_schedule(schedule, p, m, ranks=ranks, t_f=0.004)
    verify_event_log(run.events, p, m, run.v)
    assert run.mode == "wait" and 0 < run.bubble_measured < 1
    fig = plot_runs([run])
    assert bars(fig.axes[0]) == len(run.events) and f"p={p} m={m}" in fig.axes[0].get_title()


def test_timed_schedule_rejects_bad_interleaving():
    with pytest.raises(ValueError, match="m must be a multiple of 8"):
        pp_lab.timed_schedule("interleaved", 8, 4)


def bars(ax) -> int:
    """Rectangles drawn on a Gantt axis (the bars are two collections, F and B)."""
    return sum(len(c.get_paths()) for c in ax.collections)


def test_widget_offers_only_valid_settings():
    assert valid_ms("1f1b", 3) == (1, 2, 4, 8, 16) and valid_ms("interleaved", 4) == (4, 8, 16)
    assert schedules_for(3) == ("gpipe", "1f1b") and "interleaved" in schedules_for(8)
    for p in range(2, MAX_STAGES + 1):
        for schedule in schedules_for(p):
            for m in valid_ms(schedule, p):
                pp_lab.timed_schedule(schedule, p, m)  # every offered setting is a valid pipeline


def test_widget_at_its_extremes():
    widget = widget_pipeline(ranks=None)  # simulated: the same callback, no processes
    p, schedule, m = widget.children[0].children
    out = widget.children[1]
    assert p.max == MAX_STAGES and not p.continuous_update and not m.continuous_update
    for p_value, name, m_value in [(2, "gpipe", 1), (8, "1f1b", 16), (8, "interleaved", 8),
                                   (3, "1f1b", 16), (2, "interleaved", 2), (4, "1f1b", 4)]:
        p.value = p_value
        schedule.value = name
        m.value = m_value
        image, text = out.outputs  # always a picture and its line, put there explicitly
        assert "image/png" in image["data"] and f"{name} p={p_value} m={m_value}" in text["text"]
    p.value = 3  # interleaving is not offered at p = 3: the menu falls back to 1F1B
    assert schedule.options == ("gpipe", "1f1b")
    p.value, schedule.value = 4, "interleaved"
    assert m.options == (4, 8, 16) and m.value in m.options  # m moved to a valid value


def test_moving_p_keeps_the_schedule_chosen():
    """p 4→5, 5→8 (through 7→8) and 8→5 add or drop "interleaved" from the menu: the schedule
    stays 1F1B, and the page gets the new options with the kept choice in one message (sent
    apart, it would show the first option, GPipe, and send that back)."""
    widget = widget_pipeline(ranks=None)
    p, schedule, m = widget.children[0].children
    sent = []
    schedule._send = lambda msg, buffers=None: sent.append(msg["state"])
    for p_value in (5, 6, 7, 8, 5):
        p.value = p_value
        assert schedule.value == "1f1b", p_value
        assert f"1f1b p={p_value} " in widget.children[1].outputs[1]["text"]
    assert sent and all("_options_labels" in state and state["index"] == 1 for state in sent)


@pytest.mark.parametrize("p,m,schedule", EXTREMES)
def test_widget_callback_keeps_its_axes_and_labels_do_not_overlap(p, m, schedule):
    view = PipelineView()
    for _ in range(2):
        image, text = pipeline_outputs(schedule, p, m, None, view=view)
    (blit,) = view._axes.values()   # the second run drew over the first one's axes
    ax = blit.figure.axes[0]
    assert len(blit.figure.axes) == 1 and bars(ax) == 2 * p * m * (2 if schedule == "interleaved" else 1)
    renderer = blit.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert pipeline_outputs("interleaved", 8, 4)[0]["text"].startswith("not a valid pipeline")


def _pixels(png_bytes: bytes):
    import io

    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png_bytes)).convert("RGB"), dtype=int)


def test_the_blitted_gantt_chart_is_the_one_drawn_afresh():
    """Each run draws only bars, labels and title over its (p, span)'s saved axes: the picture
    must be the one a full draw of the same axes gives, whatever was drawn before."""
    import base64
    import io

    from helpers.views.pp import gantt_axes, gantt_bars, shared_span_ms
    view = PipelineView()
    runs = [pp_lab.timed_schedule(s, p, m, None, WIDGET_T_F)
            for s, p, m in (("gpipe", 4, 4), ("1f1b", 4, 4), ("interleaved", 8, 16), ("1f1b", 4, 8))]
    for run in runs + runs[:2]:   # back to (4, 4): its saved axes, the last run's bars gone
        span = shared_span_ms(run.p, run.m, WIDGET_T_F)
        fig = Figure(figsize=(10, _height(run.p)), dpi=90)
        fig.subplots_adjust(left=0.07, right=1 - 0.145, bottom=0.5 / _height(run.p),
                            top=1 - 0.35 / _height(run.p))
        ax = fig.add_subplot()
        gantt_axes(ax, run.p, span)
        gantt_bars(ax, run.events, span)
        ax.set_title(run.summary(), fontsize=10)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90)
        fresh = _pixels(buffer.getvalue())
        blitted = _pixels(base64.b64decode(pipeline_outputs(
            run.schedule, run.p, run.m, None, view=view)[0]["data"]["image/png"]))
        assert blitted.shape == fresh.shape
        assert (abs(blitted - fresh).max(axis=2) > 32).mean() < 0.002, run.summary()
    assert len(view._axes) <= PipelineView.KEEP


def test_the_schedules_of_one_p_and_m_share_a_time_axis_a_longer_run_widens_it():
    from helpers.views.pp import _nice_ceiling, shared_span_ms
    assert (_nice_ceiling(150.0), _nice_ceiling(151.0), _nice_ceiling(9.9)) == (150, 175, 10)
    span = shared_span_ms(4, 4, WIDGET_T_F)
    slowest = max(pp_lab.simulated_run(s, 4, 4, t_f=WIDGET_T_F).makespan for s in ("gpipe", "1f1b"))
    assert 1.2e3 * slowest <= span < 1.25 * 1.2e3 * slowest
    view = PipelineView()
    run = pp_lab.timed_schedule("1f1b", 4, 4, None, WIDGET_T_F)
    view.png(run)
    slow = pp_lab.timed_schedule("1f1b", 4, 4, None, 2 * WIDGET_T_F)   # twice as long: no longer fits
    view.png(slow)
    assert [key for key in view._axes] == [(4, span), (4, _nice_ceiling(slow.makespan * 1e3))]


def test_replayed_run_of_a_perfect_run_is_itself():
    for schedule, v in (("gpipe", None), ("1f1b", None), ("interleaved", 2)):
        sim = pp_lab.simulated_run(schedule, p=4, m=8, v=v)
        assert pp_lab.replayed(sim).bubble_measured == pytest.approx(sim.bubble_measured)
    late = pp_lab.simulated_run("1f1b", p=2, m=4)
    late.events = [e.shifted(-1.0) if e.rank == 1 else e for e in late.events]  # rank 1 waits 1 s
    assert pp_lab.replayed(late).bubble_measured < late.bubble_measured


def test_two_quick_changes_lose_no_figure():
    widget = widget_pipeline(ranks=None)
    p, schedule, m = widget.children[0].children
    threads = [threading.Thread(target=setattr, args=(m, "value", 16)),
               threading.Thread(target=setattr, args=(p, "value", 8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    image, text = widget.children[1].outputs
    assert "image/png" in image["data"] and "p=8 m=16" in text["text"]


def test_sixteen_micro_batches_keep_their_colours_and_labels():
    """m = 16 (the widget's largest): 16 colours, none repeated, and labels in 8 pt (9 px at
    the widget's 80 dpi): "B12" where it fits, else the micro-batch alone. Every backward is
    labelled, and every forward of a one-digit micro-batch (a forward is half as long: "12"
    does not fit in it; its colour is its own)."""
    from helpers.views.pp import LABEL_PT, _colour
    assert len({_colour(mb) for mb in range(16)}) == 16
    run = pp_lab.timed_schedule("1f1b", 4, 16)
    ax = plot_gantt(run.events, 4).axes[0]
    labels = {(round(t.get_position()[0], 6), t.get_position()[1]): t.get_text()
              for t in ax.texts if t.get_text()}
    assert {t.get_fontsize() for t in ax.texts if t.get_text()} == {LABEL_PT}
    assert LABEL_PT * 80 / 72 >= 8
    for e in run.events:
        middle = (round(1e3 * ((e.start + e.end) / 2 - run.events[0].start), 6), e.rank)
        if e.kind == "B" or e.mb < 10:
            assert labels.get(middle, "").lstrip("FBW") == str(e.mb), e


def test_within_runs_on_the_first_p_ranks_and_restarts_none(ranks):
    """The widget's way: every p on the first p of the live ranks, each p's group made once;
    no rank starts or stops and the world is not re-formed as p moves."""
    ranks.resize(4)
    pids = ranks.pids
    for p in (2, 3, 4, 2, 3):
        run = pp_lab.timed_schedule("1f1b", p, 4, ranks=ranks, t_f=0.004, within=True)
        verify_event_log(run.events, p, 4, run.v)
        assert run.p == p and run.mode == "wait" and 0 < run.bubble_measured < 1
    assert ranks.pids == pids and ranks.world_size == 4


def test_latency_and_message_gaps_of_a_simulated_run():
    plain = pp_lab.simulated_run("interleaved", p=4, m=8, v=2, t_f=1.0)
    slow = pp_lab.simulated_run("interleaved", p=4, m=8, v=2, t_f=1.0, latency=0.1)
    assert slow.bubble_measured > plain.bubble_measured
    assert pp_lab.simulated_run("1f1b", 2, 4, latency=0.0).bubble_measured == pytest.approx(0.2)
    gaps = pp_lab.message_gaps(slow)  # every wait for another rank's output lasts the latency
    assert gaps and all(g == pytest.approx(0.1) for g in gaps)
    assert all(g == pytest.approx(0.0) for g in pp_lab.message_gaps(plain))
    with pytest.raises(ValueError):
        pp_lab.simulated_run("1f1b", 2, 4, latency=-1.0)
