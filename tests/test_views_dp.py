"""Notebook 03's ZeRO memory widget: human-sized numbers at every slider extreme, full labels."""
import ipywidgets
import pytest

from helpers.cost.memory import zero_memory_per_rank
from helpers.units import format_decimal_bytes
from helpers.views.dp import D_OPTIONS, widget_zero_memory, zero_memory_text


@pytest.mark.parametrize("psi", [1e6, 1e12])
@pytest.mark.parametrize("d", [D_OPTIONS[0], D_OPTIONS[-1]])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("k", [0, 16])
def test_memory_text_at_slider_extremes(psi, d, stage, k):
    text = zero_memory_text(psi, d, stage, k)
    rows = text.splitlines()[2:]
    assert len(rows) == 4 and rows[stage].startswith(">")
    assert "0.00" not in text  # no number rounds away to zero
    total = zero_memory_per_rank(psi, d, stage, optimizer_bytes=k).total
    assert rows[stage].split()[-2:] == format_decimal_bytes(total).split()


def test_widget_controls_act_on_release_with_full_labels(capsys):
    widget = widget_zero_memory()
    assert isinstance(widget, ipywidgets.Widget)
    controls = [c for c in widget.children if isinstance(c, ipywidgets.ValueWidget)]
    assert len(controls) == 4
    for c in controls:
        assert not c.continuous_update and c.style.description_width == "initial"
    assert "K (optimizer bytes per parameter)" in [c.description for c in controls]
    assert tuple(controls[1].options) == D_OPTIONS  # d on powers of two, 1 … 1024
    assert "d = 64 ranks" in capsys.readouterr().out
