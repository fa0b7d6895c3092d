"""helpers.exercises: each grader says right for the right answer and names common mistakes."""
import pytest

from helpers.exercises import arithmetic as E


@pytest.mark.parametrize("grade, right, wrong, words", [
    (E.grade_hardware_ridge, 153, 1 / 153, "bytes per FLOP"),
    (E.grade_hardware_ridge, 153, 201, "40 GB A100 of the table"),
    (E.grade_hardware_compute_bound_n, 886, 885, "round up"),
    (E.grade_hardware_compute_bound_n, 886, 1771, "fp32"),
    (E.grade_hardware_send_time, 0.32, 0.16, "two directions"),
    (E.grade_collectives_reduce_scatter, [52], [28, 36, 44, 52, 60, 68, 76, 84], "all-reduce"),
    (E.grade_collectives_reduce_scatter, 52, 7, "not it"),
    (E.grade_collectives_all_to_all, [4, 14, 24, 34, 44, 54], [54, 44, 34, 24, 14, 4], "order"),
    (E.grade_collectives_all_to_all, [4, 14, 24, 34, 44, 54], [40, 41, 42, 43, 44, 45], "before"),
    (E.grade_collectives_ring_bytes, 1.75, 0.875, "one half"),
    (E.grade_planner_state_gb, 10.78, 36.33, "nothing sharded"),
    (E.grade_planner_activation_gb, 10.27, 1.28, "p = 8 of them"),
])
def test_right_and_wrong(grade, right, wrong, words):
    yes, no = grade(right), grade(wrong)
    assert yes.right and str(yes).startswith("✓ right")
    assert not no.right and words in no.why and str(no).startswith("✗ not yet")
    assert repr(yes) == str(yes) and repr(no) == str(no)  # one text, printed or shown


def test_judge_exact_and_close():
    assert E.judge(2, 2, "yes", ((3, "three"),), "no", exact=True).right
    assert E.judge(3, 2, "yes", ((3, "three"),), "no", exact=True).why == "three"
    assert E.judge(2.01, 2, "yes", (), "no").right            # within 2 %
    assert E.judge(2.01, 2, "yes", (), "no", exact=True).why == "no"


def test_close_to():
    assert E.close_to(1.01, 1.0) and not E.close_to(1.1, 1.0)


def test_simulator_graders():
    """Notebook 06's blog numbers: 'about 16 million' GTX 580s, and the MFU that fits 3 months."""
    assert E.grade_simulator_min_gpus(2**23).right and "16 million" in E.grade_simulator_min_gpus(2**23).why
    assert "section 7's cluster" in E.grade_simulator_min_gpus(2**24).why
    model, gpu, months3 = E._gtx580_blog_point()
    mfu = model.C / (2**24 * gpu.peak_flops * months3)
    assert 0 < mfu < 1 and E.grade_simulator_mfu_needed(mfu).right
    assert not E.grade_simulator_mfu_needed(0.0).right


# A wrong answer's generic hint points to where the tool is; it never spells out the formula
# with the question's numbers, nor the equation to solve (the placeholder's verdict is on the page,
# right under the question). Each entry: a grader's fallback verdict, words it must not contain.
def _sparse_largest_run():
    """Notebook 06's exercise 1 point: the largest feasible sparse run (section 6), whose
    latency floor the page does not print (section 3 prints the dense run's)."""
    from helpers.hardware import H100_SXM
    from helpers.simulator.curve import run_curve
    from helpers.simulator.settings import Settings
    return run_curve(H100_SXM, Settings(sparse=True)).largest_feasible()


@pytest.mark.parametrize("verdict, recipe", [
    (lambda: E.grade_collectives_reduce_scatter([3]), ("3 + r", "sum element", "8·3")),
    (lambda: E.grade_collectives_all_to_all([1, 2]), ("10j", "element 4", "chunk 4")),
    (lambda: E.grade_bench_busbw(100), ("n / t", "busbw_factor('all_reduce', 4)", "2(p−1)/p")),
    (lambda: E.grade_bench_busbw(198.3), ("2(p−1)/p", "1.5")),          # algbw, named
    (lambda: E.grade_bench_predict(10), ("a·α + b·n·β", "2(p−1)", "1.5")),
    (lambda: E.grade_bench_predict(67.5), ("2(p−1)", "1.5")),           # α + n·β, named
    (lambda: E.grade_bench_predict(2.4 + 67.1), ("2(p−1)/p", "1.5")),   # byte factor, named
    (lambda: E.grade_bench_crossover(1e5), ("a(p)·α = b(p)·n·β", "solve", "6", "1.5")),
    (lambda: E.grade_bench_crossover(4e5), ("6 α", "1.5 n·β", "1.5")),  # α/β, named
    (lambda: E.grade_simulator_latency_floor(0.0, _sparse_largest_run()),
     ("6 per layer", "L/PP", "16 layers", "m = 64", "4.5 µs")),
    (lambda: E.grade_simulator_min_gpus(0), ("divide", "1.12e+26", "7.885e+06", "round up")),
    (lambda: E.grade_simulator_mfu_needed(0.0), ("C / (GPUs", "solve", "× time", "3 months")),
])
def test_fallback_hints_do_not_give_the_recipe(verdict, recipe):
    no = verdict()
    assert not no.right and str(no).startswith("✗ not yet")
    assert "=" not in no.why and not [words for words in recipe if words in no.why], no.why


def test_hints_point_to_the_tool():
    assert "run_collective" in E.grade_collectives_reduce_scatter([3]).why
    assert "run_collective" in E.grade_collectives_all_to_all([1, 2]).why
    assert "section 2" in E.grade_bench_busbw(100).why
    assert "section 4's table" in E.grade_bench_predict(67.5).why
    assert "section 4's table" in E.grade_bench_predict(10).why
    assert "coefficients" in E.grade_bench_crossover(4e5).why
    # below the crossover the latency term is the larger, above it the smaller
    assert "is larger" in E.grade_bench_crossover(1e5).why
    assert "is smaller" in E.grade_bench_crossover(1e7).why
    assert "section 3" in E.grade_simulator_latency_floor(0.0, _sparse_largest_run()).why
    assert "section 7" in E.grade_simulator_min_gpus(0).why
    assert "section 7" in E.grade_simulator_mfu_needed(0.0).why


def test_ring_bytes_names_the_ranks_n():
    """The course keeps p for pipeline stages: a collective's ranks are n."""
    why = E.grade_collectives_ring_bytes(1.75).why
    assert "2·(n−1)/n" in why and "(p−1)" not in why


def test_simulator_latency_floor_on_the_sparse_run():
    """Notebook 06's exercise 1: 6 matmuls × L/PP layers × E/EP experts × m micro-batches ×
    4.5 µs on the largest sparse run (L = 1024, PP = 64, E = EP = 72, m = 64)."""
    point = _sparse_largest_run()
    assert (point.model.L, point.plan.pp, point.model.s, point.plan.ep, point.plan.m) == \
        (1024, 64, 72, 72, 64)
    assert E.grade_simulator_latency_floor(6 * 16 * 1 * 64 * 4.5e-6, point).right
    assert not E.grade_simulator_latency_floor(6 * 16 * 72 * 64 * 4.5e-6, point).right


def test_simulator_named_mistakes():
    model, gpu, months3 = E._gtx580_blog_point()
    need = model.C / (2 * months3 * gpu.sustained_flops)  # the question's 6 months
    assert "round up, not down" in E.grade_simulator_min_gpus(2**22).why
    assert "before rounding" in E.grade_simulator_min_gpus(round(need)).why
    assert "the bar" in E.grade_simulator_mfu_needed(0.68).why
    mfu = model.C / (2**24 * gpu.peak_flops * months3)
    assert "sustained" in E.grade_simulator_mfu_needed(mfu * gpu.peak_flops / gpu.sustained_flops).why


def test_memory_graders():
    """Notebook 08: exercise 1 asks d = 8, which the page never prints (its table stops at
    d = 4, and that row's value is named as such); 3 asks bytes, not the ratio the page prints;
    2 and 3 name their usual mistakes."""
    psi = 464_128
    assert E.grade_memory_zero2_bytes(4 * psi + 12 * psi / 8).right
    assert "the table's row" in E.grade_memory_zero2_bytes(4 * psi + 12 * psi / 4).why
    assert "plain data parallelism" in E.grade_memory_zero2_bytes(16 * psi).why
    assert E.grade_memory_fsdp_wire_bytes(5.25e9).right
    assert "(d−1)/d" in E.grade_memory_fsdp_wire_bytes(6e9).why
    block_mb = (16 * 4096 + 4 + 32) * 4096 * 2 / 1e6  # the page prints only its small model's
    assert E.grade_memory_block_activation_mb(block_mb).right
    assert "fp32" in E.grade_memory_block_activation_mb(2 * block_mb).why
    assert "with checkpointing" in E.grade_memory_block_activation_mb(4096 * 4096 * 2 / 1e6).why
    assert "Korthikanti" in E.grade_memory_block_activation_mb(34 * 4096 * 4096 / 1e6).why


# --- notebook 07: 3-D parallelism ---

@pytest.mark.parametrize("grade, right, wrong, words", [
    (E.grade_3d_rank, 8, 7, "DP varying fastest"),
    (E.grade_3d_rank, 8, 5, "PP varying fastest"),
    (E.grade_3d_crossing, {"dp", "pp"}, {"pp"}, "nodes of 8 GPUs"),
    (E.grade_3d_crossing, "DP and PP", "tp, dp", "TP varies fastest"),
    (E.grade_3d_bubble, 3 / 11, 3 / 7, "m = 4"),
    (E.grade_3d_bubble, 3 / 11, 3 / 8, "(p−1)/m"),
])
def test_3d_graders(grade, right, wrong, words):
    yes, no = grade(right), grade(wrong)
    assert yes.right and not no.right and words in no.why, (yes, no)


def test_3d_quiet_tp_reads_the_readers_calibration():
    """Priced with the quiet fits, the TP all-reduces of 1·4·1 cost what `all_reduce` says:
    a calibration whose in-step fit is 10× the quiet one predicts a slower step with it."""
    from types import SimpleNamespace

    from helpers.cost.alpha_beta import Fit
    from helpers.cost.parallel3d import Calibration, predict, shapes_used, stages_used
    from helpers.layout import Layout
    config = SimpleNamespace(vocab=8, hidden=8, heads=4, layers=4, seq=3, batch=8)
    layouts = (Layout(1, 4, 1),)
    cal = Calibration(world=4, compute_s=dict.fromkeys(shapes_used(layouts, config), 1e-3),
                      cores=4.0, tp_all_reduce={4: Fit("all_reduce", 1e-3, 0.0)},
                      all_reduce={4: Fit("all_reduce", 1e-4, 0.0)},
                      send_recv=Fit("send_recv", 1e-5, 0.0),
                      optimizer_s=dict.fromkeys(stages_used(layouts, config), 0.0), lateness={})
    in_step = predict(layouts[0], config, cal).step_s * 1e3
    # 4 blocks × (1 ms + 4 all-reduces of 6α) + the head, with α = 0.1 ms instead of 1 ms
    quiet = 4 * (1 + 4 * 6 * 0.1) + 1
    assert E.grade_3d_quiet_tp(quiet, cal, config).right
    no = E.grade_3d_quiet_tp(in_step, cal, config)
    assert not no.right and "in-step fits" in no.why
    forward_only = in_step - 8 * 6 * (1 - 0.1)  # 8 of the 16 all-reduces, 6α each
    assert "the backward has 2 more" in E.grade_3d_quiet_tp(forward_only, cal, config).why
    assert "in seconds" in E.grade_3d_quiet_tp(quiet / 1e3, cal, config).why


def test_planner_fits_grader():
    """Notebook 10's layout exercise: one that fits passes, the obvious ones name their limit."""
    from helpers.cost.planner import Layout
    assert E.grade_planner_fits(Layout(t=8, p=2, d=1, b=1, zero=1, recompute="full")).right
    no = E.grade_planner_fits(Layout(t=8, p=2, d=1, b=1, zero=1))
    assert not no.right and "HBM" in no.why
    assert "t·p·d·c" in E.grade_planner_fits(Layout(t=8, p=4, d=1)).why
    assert not E.grade_planner_fits("t8 p2").right
