"""The checked exercises of notebooks 03-05: the right answer passes, the usual wrong ones say why."""
from helpers import exercises as ex
from helpers.cost.bubble import bubble_theory
from helpers.cost.schedules import make_plan, peak_live


def test_right_answers_pass():
    assert ex.grade_dp_ring_bytes(25_165_824).right
    assert ex.grade_dp_buckets(2).right
    assert ex.grade_dp_zero1_gb(31.4).right
    assert ex.grade_tp_megatron_bytes(3_670_016).right
    assert ex.grade_tp_comm_ratio(1.25).right
    assert ex.grade_tp_f_backward("All-Reduce").right
    assert ex.grade_pp_bubble(bubble_theory(8, 24)).right
    assert ex.grade_pp_peak_live(peak_live(make_plan("1f1b", 8, 32, 5))).right
    assert "stage 0's count" in ex.grade_pp_peak_live(8).why
    assert ex.grade_pp_interleaved_m(16).right and bubble_theory(4, 16, 2) <= 0.1 < bubble_theory(4, 12, 2)


def test_wrong_answers_say_why():
    for verdict in (ex.grade_dp_ring_bytes(16 * 2**20), ex.grade_dp_buckets(3), ex.grade_dp_zero1_gb(120),
                    ex.grade_tp_megatron_bytes(4_718_592), ex.grade_tp_comm_ratio(0.5),
                    ex.grade_tp_f_backward("identity"), ex.grade_pp_bubble(7 / 24),
                    ex.grade_pp_peak_live(32), ex.grade_pp_interleaved_m(14)):
        assert not verdict.right and str(verdict).startswith("✗ not yet: ") and len(verdict.why) > 20
