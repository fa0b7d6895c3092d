"""The checked exercises of notebooks 03-05: the right answer passes, the usual wrong ones say why."""
from helpers import exercises as ex
from helpers.cost.bubble import bubble_theory
from helpers.cost.schedules import make_plan, peak_live


def test_right_answers_pass():
    assert ex.grade_dp_ring_bytes(25_165_824).right
    assert ex.grade_dp_buckets(2).right
    assert ex.grade_dp_zero1_gb(31.4).right
    assert ex.grade_tp_megatron_bytes(3_670_016).right
    assert ex.grade_tp_comm_ratio(0.54).right
    assert "t = 8" in ex.grade_tp_comm_ratio(1.25).why
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


def test_fallback_hints_point_to_the_tool_not_the_recipe():
    """The placeholder's verdict sits under the question: its hint names the section that holds
    the tool, never the formula with the question's numbers nor the equation to solve."""
    cases = (
        (ex.grade_tp_megatron_bytes(1000), "section 4", ("L/2", "2L(t−1)/t", "7/8")),
        (ex.grade_tp_comm_ratio(0.5), "section 6", ("(t−1)·bytes·F", "3·h·W", "/")),
        (ex.grade_pp_bubble(0.25), "bubble_theory", ("(p−1)/(m+p−1)", "p = 8", "m = 24", "7/31")),
        (ex.grade_pp_interleaved_m(8), "interleaved_1f1b",
         ("(p−1)/(v·m+p−1)", "≤ 0.1", "round up", "multiple of p")),
    )
    for verdict, tool, recipe in cases:
        assert not verdict.right and tool in verdict.why, verdict
        assert "=" not in verdict.why and not [w for w in recipe if w in verdict.why], verdict


def test_megatron_bytes_names_section_4s_table():
    """Section 4's table prints t = 4 only: a value read off it is named, not taken for a guess."""
    assert "lecture layout at t = 4" in ex.grade_tp_megatron_bytes(4_718_592).why
    assert "that is t = 4" in ex.grade_tp_megatron_bytes(3_145_728).why
    assert "lecture layout (3L" in ex.grade_tp_megatron_bytes(5_505_024).why
