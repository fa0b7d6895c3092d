"""helpers.exercises: each check says right for the right answer and names common mistakes."""
import pytest

from helpers import exercises as E


@pytest.mark.parametrize("check, right, wrong, words", [
    (E.check_hardware_ridge, 201, 1 / 201, "bytes per FLOP"),
    (E.check_hardware_compute_bound_n, 886, 885, "round up"),
    (E.check_hardware_compute_bound_n, 886, 1771, "fp32"),
    (E.check_hardware_send_time, 0.32, 0.16, "two directions"),
    (E.check_collectives_reduce_scatter, [52], [28, 36, 44, 52, 60, 68, 76, 84], "all-reduce"),
    (E.check_collectives_reduce_scatter, 52, 7, "not it"),
    (E.check_collectives_all_to_all, [2, 12, 22, 32], [32, 22, 12, 2], "order"),
    (E.check_collectives_ring_bytes, 1.75, 0.875, "one half"),
])
def test_right_and_wrong(check, right, wrong, words):
    yes, no = check(right), check(wrong)
    assert yes.right and str(yes).startswith("✓ right")
    assert not no.right and words in no.why and str(no).startswith("✗ not yet")
    assert yes._repr_markdown_() == str(yes)


def test_close_to():
    assert E.close_to(1.01, 1.0) and not E.close_to(1.1, 1.0)
