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
    assert "t=4, h=1024, b·s=128" in capsys.readouterr().out


def test_decade_labels_are_plain_text_powers_of_ten():
    """Log-axis tick labels without mathtext (cheap to lay out in a widget), still readable."""
    from helpers.views.hardware import decade_label
    assert [decade_label(v) for v in (1e-3, 0.1, 1, 10, 100, 1e3, 1e25)] == \
        ["10⁻³", "0.1", "1", "10", "100", "10³", "10²⁵"]
    assert decade_label(3e4) == "30000" and decade_label(0) == ""
