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
    assert E.grade_simulator_min_gpus(2**24).right and "16 million" in E.grade_simulator_min_gpus(2**24).why
    assert not E.grade_simulator_min_gpus(2**23).right
    model, gpu, months3 = E._gtx580_blog_point()
    mfu = model.C / (2**24 * gpu.peak_flops * months3)
    assert 0 < mfu < 1 and E.grade_simulator_mfu_needed(mfu).right
    assert not E.grade_simulator_mfu_needed(0.0).right


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
