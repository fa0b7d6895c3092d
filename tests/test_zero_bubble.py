"""The backward split into B and W, and the schedules built on it: ZB-H1, ZB-H2, DualPipeV."""
import math

import pytest
import torch

from helpers.configs import LECTURE
from helpers.cost.bubble import (Durations, closed_form_idle, idle_fraction, mean_durations,
                                 measured_bubble, steady_bubble)
from helpers.cost.schedules import (Action, Event, check_schedule_args, log_violation,
                                    make_plan, peak_live, placement, rank_of_stage, simulate,
                                    split_backwards, stage_of, verify_event_log, verify_plans)
from helpers.labs import pp as pp_lab
from helpers.models import make_batch, make_mlp, mlp_layers, mlp_loss
from helpers.parallel.pp import backward_input, backward_weight, record_forward


SMALL = LECTURE.with_(hidden=128, batch=32)  # the lecture's 4 layers, cheaper matmuls


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(2, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def ref():
    return pp_lab.reference(SMALL)


# -- the split itself ---------------------------------------------------------------------

@pytest.mark.parametrize("last", [False, True])
def test_b_then_w_equals_the_whole_backward_bit_for_bit(last):
    """A stage of two layers, four micro-batches: B gives the input's gradient and touches no
    weight; the Ws afterwards, in the Bs' order as the schedules run them, leave exactly
    backward()'s gradients (another order adds the micro-batches' gradients in another
    order: equal up to float rounding only)."""
    whole, split = (mlp_layers(make_mlp(SMALL), 1, 3) for _ in range(2))
    grad_out = torch.randn(8, SMALL.hidden, generator=torch.Generator().manual_seed(7))
    owed = []
    for x in make_batch(SMALL).chunk(4):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = whole(a)
        (mlp_loss(out).backward() if last else out.backward(grad_out))
        tape = record_forward(split, b, b)
        if last:
            tape = tape._replace(out=mlp_loss(tape.out))
        grad_in, work = backward_input(tape, None if last else grad_out)
        assert torch.equal(grad_in, a.grad)
        assert all(p.grad is None for p in split.parameters())  # B left the weights alone
        owed.append(work)
    for work in owed:
        backward_weight(work)
    for mine, theirs in zip(split.parameters(), whole.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_first_stage_b_has_no_input_gradient():
    layers = mlp_layers(make_mlp(SMALL), 0, 2)
    tape = record_forward(layers, None, make_batch(SMALL)[:8])
    grad_in, work = backward_input(tape, torch.ones(8, SMALL.hidden))
    assert grad_in is None and len(work.grads) == 2  # two Linear outputs, no input
    backward_weight(work)
    assert all(p.grad is not None for p in layers.parameters())


# -- plans --------------------------------------------------------------------------------

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 3 * p, 4 * p)]


@pytest.mark.parametrize("p,m", GRID)
def test_plans_run_everything_once_and_hold_what_their_papers_say(p, m):
    for schedule, held in (("zb-h1", p), ("zb-h2", 2 * p - 1), ("dualpipev", 2 * p + 1)):
        v = check_schedule_args(p, m, schedule)
        plans = [make_plan(schedule, p, m, r) for r in range(p)]
        verify_plans(plans, m, v)
        assert [peak_live(plan) for plan in plans] == [held] * p, schedule
        if schedule != "dualpipev":  # every backward split
            assert all(len(split_backwards(plan)) == m for plan in plans)


@pytest.mark.parametrize("p,m", GRID)
def test_simulated_bubbles_meet_the_closed_forms(p, m):
    """F = B = W = 1 unit: ZB-H1's one step idles (p−1)(T_F+T_B−T_W) per rank; ZB-H2 idles
    nothing inside each rank's window and, in one step, only the ramp (p−1)·T_F no schedule
    avoids; DualPipeV idles (p−1) chunk forwards, below DeepSeek's form."""
    one = Durations(1.0, 1.0, 1.0, math.nan)
    h1 = simulate("zb-h1", p, m, 1.0, 2.0)
    assert measured_bubble(h1, p) == pytest.approx(
        idle_fraction(closed_form_idle("zb-h1", p, one), 3 * m), abs=1e-12)
    h2 = simulate("zb-h2", p, m, 1.0, 2.0)
    assert steady_bubble(h2, p) == pytest.approx(0.0, abs=1e-12)
    assert measured_bubble(h2, p) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    dv = simulate("dualpipev", p, m, 1.0, 2.0)
    verify_event_log(dv, p, m, 2, "v")
    assert measured_bubble(dv, p) == pytest.approx((p - 1) * 0.5 / (3 * m + (p - 1) * 0.5))
    assert mean_durations(dv) == Durations(0.5, 0.5, 0.5, 1.0)
    deepseek = idle_fraction(closed_form_idle("dualpipev", p, mean_durations(dv)), 3 * m)
    assert measured_bubble(dv, p) < deepseek
    one_f_one_b = measured_bubble(simulate("1f1b", p, m, 1.0, 2.0), p)
    assert measured_bubble(h1, p) < one_f_one_b / 2


def test_v_placement_and_arguments():
    p = 4
    assert [stage_of(Action("F", c, 0), r, p, "v") for r in range(p) for c in (0, 1)] == \
        [0, 7, 1, 6, 2, 5, 3, 4]
    assert [rank_of_stage(s, p, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert placement("dualpipev") == "v" and placement("zb-h1") == "loop"
    with pytest.raises(ValueError, match="m >= 2p = 8"):
        check_schedule_args(4, 6, "dualpipev")
    with pytest.raises(ValueError, match="must be 1"):
        check_schedule_args(2, 4, "zb-h1", 2)
    with pytest.raises(ValueError, match="closed form"):
        closed_form_idle("gpipe", 2, Durations(1, 1, 1, 2))


def test_event_log_check_knows_w():
    events = simulate("zb-h1", 2, 4)
    assert log_violation(events, 2, 4) == ""
    w = next(e for e in events if e.kind == "W")
    early = [Event(e.rank, e.kind, e.chunk, e.mb, -1.0, -0.5) if e is w else e for e in events]
    assert "started before" in log_violation(early, 2, 4)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 6), (3, 6), (4, 8), (4, 9)])
def test_dualpipev_order_is_torchs(p, m):
    theirs = pp_lab.torch_schedule_order("dualpipev", p, m)
    if theirs is None:
        pytest.skip("torch.distributed.pipelining._schedule_visualizer.get_schedule_ops is "
                    "missing in this torch (a private module)")
    assert pp_lab.order_differences(pp_lab.our_order("dualpipev", p, m), theirs) == []


def test_order_differences_name_the_first_step_that_differs():
    ours = [[("F", 0, 0), ("B", 0, 0)]]
    assert pp_lab.order_differences(ours, [[("F", 0, 0), ("I", 0, 0)]]) == \
        ["rank 0, step 1: ours B00, torch's I00"]


# -- live ranks ---------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "dualpipev"])
def test_live_gradients_equal_single_process(ranks, ref, schedule):
    run = pp_lab.run_pipeline(ranks, schedule, p=2, m=4, mode="compute", config=SMALL)
    verify_event_log(run.events, 2, 4, run.v, run.layout)
    pp_lab.verify_gradients(run, ref)
    assert run.peak_live == [peak_live(make_plan(schedule, 2, 4, r)) for r in range(2)]
    assert sum(e.kind == "W" for e in run.events) == sum(
        len(split_backwards(make_plan(schedule, 2, 4, r))) for r in range(2))


def test_live_wait_mode_keeps_the_plan(ranks):
    run = pp_lab.run_pipeline(ranks, "zb-h2", p=4, m=8, mode="wait", t_f=0.004,
                              config=SMALL)
    verify_event_log(run.events, 4, 8)
    assert run.peak_live == [7, 7, 7, 7]
    for r in range(4):
        mine = sorted((e for e in run.events if e.rank == r), key=lambda e: e.start)
        assert [e.action for e in mine] == make_plan("zb-h2", 4, 8, r)


def test_torch_dualpipev_matches_single_process(ranks, ref):
    """(ScheduleZBVZeroBubble runs through the same runner; notebook 05 runs both.)"""
    run = pp_lab.run_torch_v_schedule(ranks, "dualpipev", 2, 4, config=SMALL)
    pp_lab.verify_gradients(run, ref)
