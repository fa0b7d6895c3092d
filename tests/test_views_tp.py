"""Notebook 04's widget: sliders act on release, labels are whole."""
import ipywidgets

from helpers.cost import tp as tp_cost
from helpers.views.tp import widget_when_tp_pays


def test_tp_widget_acts_on_release_with_full_labels(capsys):
    widget = widget_when_tp_pays(tp_cost.hardware_choices(), t=4, hidden=1024, tokens=128)
    sliders = [c for c in widget.children if isinstance(c, ipywidgets.SelectionSlider)]
    assert [s.description for s in sliders] == ["t (tensor degree)", "h (hidden size)",
                                                "b·s (tokens per step)"]
    assert all(not s.continuous_update and s.style.description_width == "initial" for s in sliders)
    [text] = [c for c in widget.children if isinstance(c, ipywidgets.HTML)]
    [image] = [c for c in widget.children if isinstance(c, ipywidgets.Image)]
    assert "t=4, h=1024, b·s=128" in text.value and bytes(image.value).startswith(b"\x89PNG")
    sliders[0].value = 64
    assert "t=64, h=1024, b·s=128" in text.value


def test_a_move_of_t_only_moves_the_marker():
    """Blitted: t moves redraw the marker over the saved pixels, so going back to a t gives the
    very same picture, and another t a different one."""
    from helpers.views.tp import TPCurveView
    view = TPCurveView(tp_cost.hardware_choices())
    name = next(iter(view.choices))
    first, _ = view.update(4, 1024, 128, name)
    assert view.update(64, 1024, 128, name)[0] != first
    assert view.update(4, 1024, 128, name)[0] == first
    assert view.update(4, 2048, 128, name)[0] != first     # another h: another curve
    for hidden in (256, 512, 2048, 4096, 8192, 16384, 32768):
        view.update(4, hidden, 128, name)
    assert len(view._drawn) == TPCurveView.KEEP            # the oldest figures are let go


def test_decade_labels_are_plain_text_powers_of_ten():
    """Log-axis tick labels without mathtext (cheap to lay out in a widget), still readable."""
    from helpers.views.kit import decade_label
    assert [decade_label(v) for v in (1e-3, 0.1, 1, 10, 100, 1e3, 1e25)] == \
        ["10⁻³", "0.1", "1", "10", "100", "10³", "10²⁵"]
    assert decade_label(3e4) == "30000" and decade_label(0) == ""


def test_the_t_label_stays_inside_the_axes_at_both_ends_of_the_slider():
    """At t = 64 the label went right of the line and was cut at the edge ("t = 6")."""
    from helpers.views.tp import T_OPTIONS, TPCurveView
    view = TPCurveView(tp_cost.hardware_choices())
    name = next(iter(view.choices))
    for t in (min(T_OPTIONS), max(T_OPTIONS)):
        view.update(t, 1024, 128, name)
        _, _, label = view._drawn[(1024, 128, name)]
        fig = label.figure
        renderer = fig.canvas.get_renderer()
        box, axes = label.get_window_extent(renderer), label.axes.get_window_extent(renderer)
        assert label.get_text().strip() == f"t = {t}"
        assert axes.x0 <= box.x0 and box.x1 <= axes.x1, (t, box, axes)


def test_a_tiny_speedup_is_not_printed_as_zero():
    from helpers.cost.tp import _times
    assert _times(3.517) == "3.52" and _times(0.1) == "0.10" and _times(0.00125) == "0.0013"
