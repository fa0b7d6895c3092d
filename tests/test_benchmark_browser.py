"""The browser benchmark's split of a move's time (the page's log in, the parts out)."""
from benchmarks.browser import where_the_time_went


def test_a_drag_then_a_callback_that_outlives_the_visible_change():
    # press at 0, release at 0.1 s; the kernel busy from 0.12 s to 0.5 s; the output changed
    # twice, last at 0.3 s: the page settled 0.2 s before the kernel went idle
    watched = {"last": 0.3, "changes": 2, "inputs": [0.0, 0.02, 0.1, 0.1],
               "status": [[0.12, "busy"], [0.2, "idle"], [0.21, "busy"], [0.5, "idle"]]}
    parts = where_the_time_went(watched, first=0.25, after={"images": ["-12:2048", "7:1024"]})
    assert parts["input_s"] == 0.1
    assert abs(parts["kernel_busy_s"] - 0.38) < 1e-9
    assert abs(parts["after_kernel_s"] - (-0.2)) < 1e-9
    assert parts["output_changes"] == 2 and parts["image_kb"] == 3


def test_inputs_after_the_first_change_are_not_the_move_and_a_missing_kernel_is_none():
    watched = {"last": 0.2, "changes": 1, "inputs": [0.0, 0.4], "status": []}
    parts = where_the_time_went(watched, first=0.15, after={"images": []})
    assert parts["input_s"] == 0.0
    assert parts["kernel_busy_s"] is None and parts["after_kernel_s"] is None
    assert parts["image_kb"] == 0
