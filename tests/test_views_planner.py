"""Notebook 10's planner picture and widget, read without a browser: the bars are the planner's
numbers, a malformed layout shows its limits, an oversized one says it does not fit, and a
change of a control recomputes d and the step."""
import base64
import dataclasses

import ipywidgets as W
import pytest
from matplotlib.container import BarContainer

from helpers.cost.planner import GB, Layout, limits, memory, step
from helpers.views.planner import (DEFAULT_LAYOUT, derive_d, job_from, layout_from, percent,
                                   plan, planner_figure, step_rows, summary, widget_planner)

LLAMA = ("Llama 3 405B", "H100 SXM", 16384, 8192, 2048)


def llama(**changes) -> tuple:
    """Llama 3 405B's job and the widget's default layout (t8 p16·v2 d128, ZeRO-2), changed."""
    job = job_from(*LLAMA)
    lay, _ = layout_from(job.gpus, **{**DEFAULT_LAYOUT, **changes})
    return job, lay


def bars(ax) -> dict[str, list]:
    return {c.get_label(): list(c.patches) for c in ax.containers if isinstance(c, BarContainer)}


def suptitle(fig) -> str:
    return fig._suptitle.get_text()


def test_memory_bar_is_the_planners_terms_stacked_against_the_hbm():
    job, lay = llama(zero=3)                      # FSDP: every term, buffers too, non-zero
    fig = planner_figure(job, lay)
    left = fig.axes[0]
    terms = memory(job, lay).terms()
    shown = bars(left)
    assert list(shown) == list(terms)            # one segment per term, in the planner's order
    bottom = 0.0
    for term, value in terms.items():
        (patch,) = shown[term]
        assert value > 0
        assert patch.get_height() == pytest.approx(value / GB)
        assert patch.get_y() == pytest.approx(bottom)
        bottom += value / GB
    assert bottom == pytest.approx(memory(job, lay).total / GB)
    hbm = [line for line in left.get_lines() if line.get_linestyle() == "--"]
    assert [line.get_ydata()[0] for line in hbm] == [pytest.approx(job.gpu.hbm_bytes / GB)]
    assert any(t.get_text() == "HBM 80 GB" for t in left.texts)


def test_step_bars_are_the_parts_and_the_bubble_and_the_title_gives_mfu_and_step():
    job, lay = llama()
    s = step(job, lay)
    fig = planner_figure(job, lay)
    right = fig.axes[1]
    widths = [p.get_width() for patches in bars(right).values() for p in patches]
    want = [v for v in (*s.compute.values(), *s.hidden.values(), *s.exposed.values()) if v > 0]
    assert widths == pytest.approx(want + [s.bubble * s.seconds])
    assert [t.get_text() for t in right.get_yticklabels()][-1] == "pipeline bubble"
    assert set(bars(right)) == {"compute", "hidden communication (overlapped)",
                                "exposed communication", "pipeline bubble"}
    assert f"MFU {percent(s.mfu)} · step {s.seconds:.2f} s" in suptitle(fig)
    assert "does not fit" not in suptitle(fig) and not limits(job, lay)


def test_malformed_layout_has_no_step_panel_but_says_which_limits_it_breaks():
    job, lay = llama(t=4)                          # d = 256: m = 8 < p = 16 for interleaved
    broken = limits(job, lay, check_memory=False)
    assert broken == ["interleaved needs m ≥ 16 micro-batches, has 8"]
    fig = planner_figure(job, lay)
    right = fig.axes[1]
    assert not right.axison and not bars(right)
    text = "\n".join(t.get_text() for t in right.texts)
    assert "No step" in text and "interleaved needs m ≥ 16 micro-batches, has 8" in text
    assert "cannot run: breaks 1 limit" in suptitle(fig)
    assert bars(fig.axes[0])                       # the memory bar is still drawn


def test_a_layout_too_large_for_the_hbm_is_drawn_whole_and_says_it_does_not_fit():
    job, lay = llama(zero=1)                       # ZeRO-1: 82.6 GB on an 80 GB H100
    (limit,) = limits(job, lay)
    assert limit.startswith("memory 82.6 GB > 80 GB HBM")
    fig = planner_figure(job, lay)
    assert f"does not fit: {limit}" in suptitle(fig)
    s = step(job, lay)
    assert f"MFU {percent(s.mfu)}" in suptitle(fig)
    assert bars(fig.axes[1]) and bars(fig.axes[0])
    assert f"limits broken: {limit}" in summary(plan(job, lay))


def test_d_is_derived_and_a_fraction_is_named_with_the_limit_it_breaks():
    assert derive_d(16384, 8, 16, 1) == (128, "d = 16,384 / (8·16·1) = 128")
    d, note = derive_d(3072, 8, 16, 1)              # 3072 / 128 = 24
    assert d == 24
    d, note = derive_d(16384, 8, 6, 1)             # 16384 / 48 = 341.33
    assert d == 341 and "not a whole number" in note
    job, _ = llama()
    lay, _ = layout_from(job.gpus, **{**DEFAULT_LAYOUT, "p": 6, "v": 1, "schedule": "1f1b"})
    assert "t·p·d·c = 16368 must equal the 16384 GPUs" in summary(plan(job, lay))
    # more model-parallel ranks than GPUs: d is 1, and the product names it
    d, note = derive_d(8, 8, 16, 1)
    assert d == 1 and "not a whole number" in note


def controls(widget) -> dict[str, W.Widget]:
    """Every control of the widget by its description."""
    found, todo = {}, [widget]
    while todo:
        w = todo.pop()
        if isinstance(w, W.ValueWidget) and getattr(w, "description", ""):
            found[w.description] = w
        todo += list(getattr(w, "children", ()))
    return found


def output_of(widget) -> W.Output:
    (out,) = [c for c in widget.children if isinstance(c, W.Output)]
    return out


def shown_text(out: W.Output) -> str:
    return "".join(o.get("text", "") for o in out.outputs)


def test_widget_handler_recomputes_d_and_the_step_in_one_output_change():
    widget = widget_planner(batch=4096)             # m = 16 at t = 4 too: both well formed
    ctl = controls(widget)
    assert ctl["t (tensor)"].value == 8
    out = output_of(widget)
    d_line = [c for c in widget.children if isinstance(c, W.Label)][0]
    assert d_line.value == "d = 16,384 / (8·16·1) = 128"
    changes = []
    out.observe(lambda change: changes.append(change), names="outputs")
    ctl["t (tensor)"].value = 4
    assert len(changes) == 1                        # the picture and its line, at once
    assert d_line.value == "d = 16,384 / (4·16·1) = 256"
    job = job_from("Llama 3 405B", "H100 SXM", 16384, 8192, 4096)
    lay = Layout(**{**DEFAULT_LAYOUT, "t": 4, "d": 256})
    s = step(job, lay)
    text = shown_text(out)
    assert f"MFU {percent(s.mfu)}" in text and f"step {s.seconds:.2f} s" in text
    assert f"memory {memory(job, lay).total / GB:.1f} GB of 80 GB HBM" in text
    kinds = [o["output_type"] for o in out.outputs]
    assert kinds == ["display_data", "stream"]
    assert base64.b64decode(out.outputs[0]["data"]["image/png"])[:4] == b"\x89PNG"


def test_widget_model_change_redraws_and_a_malformed_choice_names_its_limit():
    widget = widget_planner()
    ctl, out = controls(widget), output_of(widget)
    ctl["model"].value = "DeepSeek-V3"
    assert "DeepSeek-V3" in out.outputs[0]["data"]["text/plain"]
    ctl["p (pipeline)"].value = 64                  # 64 · 2 chunks for 61 layers
    assert "limits broken: 128 pipeline chunks for 61 layers" in shown_text(out)
    assert "no step" in shown_text(out)


def test_widget_offers_the_values_it_was_given():
    widget = widget_planner(model="GPT-3 175B", gpu="A100 SXM 80 GB", gpus=1000, seq=2048,
                            batch=1536, t=8, p=8, v=1, schedule="1f1b", zero=1)
    ctl = controls(widget)
    assert ctl["GPUs (N)"].value == 1000 and 1000 in [v for _, v in ctl["GPUs (N)"].options]
    assert ctl["global batch (sequences)"].value == 1536
    assert "not a whole number" in [c for c in widget.children if isinstance(c, W.Label)][0].value


@pytest.mark.parametrize("kwargs,name", [
    (dict(model="GPT-5"), "model"),
    (dict(gpu="TPU v5p"), "gpu"),
    (dict(gpus=12), "gpus"),
    (dict(gpus=0), "gpus"),
    (dict(seq=0), "seq"),
    (dict(batch=-1), "batch"),
    (dict(t=3), "t"),
    (dict(e=3), "e"),
    (dict(zero=4), "zero"),
    (dict(recompute="some"), "recompute"),
    (dict(schedule="gpipe"), "schedule"),
    (dict(d=128), "d"),
    (dict(q=2), "q"),
])
def test_bad_arguments_raise_one_value_error_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError) as error:
        widget_planner(**kwargs)
    message = str(error.value)
    assert message.startswith(name + " ") or repr(name) in message, message


def test_figure_takes_records_only():
    job, lay = llama()
    with pytest.raises(TypeError, match="layout"):
        planner_figure(job, dataclasses.asdict(lay))
    with pytest.raises(TypeError, match="job"):
        planner_figure(LLAMA, lay)


def test_step_rows_leave_out_zero_parts():
    job, lay = llama()
    rows = step_rows(step(job, lay))
    assert all(seconds > 0 for _, _, seconds in rows)
    assert "FSDP gathers" not in [part for _, part, _ in rows]   # ZeRO-2: no gathers
