"""The ZeRO memory model (helpers.cost.memory) and its widget."""
import ipywidgets
import pytest

from helpers.cost import memory
from helpers.views.dp import widget_zero_memory


def test_zero_formulas_reproduce_the_zero_paper_example():
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12: 120 / 31.4 / 16.6 / 1.9 GB.
    totals = [memory.zero_memory_per_rank(7.5e9, 64, s).total / 1e9 for s in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("psi", [1e6, 1e12])
@pytest.mark.parametrize("d", [1, 1024])
@pytest.mark.parametrize("k", [0, 16])
def test_memory_widget_text_at_slider_extremes(psi, d, k):
    for stage in (0, 3):
        text = memory.zero_memory_table(psi, d, stage, optimizer_bytes=k)
        rows = text.splitlines()[2:]
        assert len(rows) == 4 and rows[stage].startswith(">")
        m = [memory.zero_memory_per_rank(psi, d, s, optimizer_bytes=k) for s in range(4)]
        assert m[0].total == pytest.approx((4 + k) * psi)
        assert m[3].total == pytest.approx((4 + k) * psi / d)
        assert m[0].total >= m[1].total >= m[2].total >= m[3].total


@pytest.mark.parametrize("kwargs,name", [({"psi": 0}, "psi"), ({"d": 0}, "d "),
                                         ({"stage": 4}, "stage"),
                                         ({"optimizer_bytes": -1}, "optimizer_bytes")])
def test_memory_model_rejects_bad_input(kwargs, name):
    args = {"psi": 1e9, "d": 8, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=name):
        memory.zero_memory_per_rank(**args)


def test_widget_is_a_widget_showing_the_table(capsys):
    widget = widget_zero_memory()  # outside a kernel its output widget prints to stdout
    assert isinstance(widget, ipywidgets.Widget)
    assert "d = 64 ranks" in capsys.readouterr().out
