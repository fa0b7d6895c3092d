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


# --- notebook 08: this run's dtypes, communication, activations, the planner ---------------

from helpers.views import memory as views_memory  # noqa: E402


@pytest.mark.parametrize("d", [1, 4, 1024])
def test_fp32_and_mixed_precision_formulas(d):
    psi = 1e9
    fp32 = [memory.zero_memory_for(psi, d, s).total for s in range(4)]
    assert fp32 == pytest.approx([16 * psi, 8 * psi + 8 * psi / d, 4 * psi + 12 * psi / d,
                                  16 * psi / d])
    mixed = [memory.zero_memory_for(psi, d, s, memory.MIXED_RUN).total for s in range(4)]
    assert mixed == pytest.approx([16 * psi, 4 * psi + 12 * psi / d, 2 * psi + 14 * psi / d,
                                   16 * psi / d])


def test_comm_volume_is_2_and_3_psi_in_the_limit():
    assert memory.comm_volume(0, 1, 1e9) == 0
    assert memory.comm_volume(2, 4, 1e9, 2) == pytest.approx(2 * 1e9 * 2 * 3 / 4)
    assert memory.comm_volume(3, 10**6, 1e9, 1) == pytest.approx(3e9, rel=1e-5)
    assert memory.comm_volume(3, 8, 1e9) / memory.comm_volume(0, 8, 1e9) == pytest.approx(1.5)


def test_checkpointing_keeps_one_tensor_per_block():
    shape = memory.ActivationShape(2, 64, 32, 4, 3, 50)
    per_block = memory.block_activation_bytes(shape)
    assert per_block == 2 * 64 * (16 * 32 + 4 + 4) * 4
    assert memory.block_activation_bytes(shape, checkpointed=True) == 2 * 64 * 32 * 4
    assert memory.activation_bytes(shape) - memory.activation_bytes(shape, checkpointed=True) \
        == pytest.approx(3 * (per_block - 2 * 64 * 32 * 4))


@pytest.mark.parametrize("kwargs,name", [({"batch": 0}, "batch"), ({"hidden": 0}, "hidden"),
                                         ({"heads": 1.5}, "heads")])
def test_activation_shape_rejects_bad_input(kwargs, name):
    args = {"batch": 1, "seq": 8, "hidden": 8, "heads": 2, "layers": 1, "vocab": 10, **kwargs}
    with pytest.raises((ValueError, TypeError), match=name):
        memory.ActivationShape(**args)


def test_planner_bars_add_up_and_shrink_with_the_stage():
    model = views_memory.MODELS["notebook 07's model"]
    plans = [memory.plan_memory(model, 8, s, False) for s in range(4)]
    assert plans[0].total > plans[1].total > plans[2].total > plans[3].total
    assert len({p.activations for p in plans}) == 1  # ZeRO does not shard activations
    assert memory.plan_memory(model, 8, 3, True).activations < plans[3].activations


POINT = views_memory.MeasuredPoint(3, 2, False, memory.PlannedMemory(
    memory.ZeroMemory(928_256, 928_256, 1_856_528), 2_371_908))


@pytest.mark.parametrize("model", list(views_memory.MODELS))
def test_planner_figure_at_every_control_extreme(model):
    options = views_memory.d_options(views_memory.MODELS[model])
    for d, stage, checkpointed, precision in ((options[0], 0, False, memory.FP32_RUN),
                                              (options[-1], 3, True, memory.MIXED_RUN)):
        fig = views_memory.planner_figure(model, d, stage, checkpointed, precision, [POINT])
        assert len(fig.axes[0].patches) == 16  # 4 stages × 4 parts


def test_planner_draws_measured_points_only_where_they_belong():
    fig = views_memory.planner_figure(views_memory.MEASURED_MODEL, 2, 3, False,
                                      memory.FP32_RUN, [POINT])
    assert any(line.get_marker() == "D" for line in fig.axes[0].lines)
    fig = views_memory.planner_figure(views_memory.MEASURED_MODEL, 2, 3, False,
                                      memory.MIXED_RUN, [POINT])
    assert not any(line.get_marker() == "D" for line in fig.axes[0].lines)


def test_planner_holds_the_bars_against_one_gpus_memory():
    """70B at d = 1024 with ZeRO-3 plans 174 GB a rank: the H100's 80 GB is drawn across the
    bars; the small model's megabytes are far below it, and a line of text says by how much."""
    big = list(views_memory.MODELS)[-1]
    fig = views_memory.planner_figure(big, 1024, 3, False, memory.FP32_RUN)
    ax = fig.axes[0]
    device_gb = views_memory.DEVICE.hbm_bytes / 1e9
    assert [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--"] == [device_gb]
    assert any(f"{views_memory.DEVICE.name}: 80 GB" in t.get_text() for t in ax.texts)
    small = views_memory.planner_figure(views_memory.MEASURED_MODEL, 2, 3, False, memory.FP32_RUN)
    assert not [line for line in small.axes[0].lines if line.get_linestyle() == "--"]
    assert any("holds 80 GB" in t.get_text() and "× the tallest bar" in t.get_text()
               for t in small.axes[0].texts)


def test_planner_offers_only_valid_d_and_rejects_others():
    assert views_memory.d_options(views_memory.MODELS[views_memory.MEASURED_MODEL]) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="d must be one of"):
        views_memory.planner_figure(views_memory.MEASURED_MODEL, 16, 0, False, memory.FP32_RUN)


def test_planner_widget_is_a_widget():
    widget = views_memory.widget_memory_planner([POINT])
    assert isinstance(widget, ipywidgets.Widget)
    model, d = widget.children[0], widget.children[1]
    model.value = "70B shape (h 8192, 80 layers), b = 1, s = 4096"
    assert d.options[-1] == 1024
    model.value = views_memory.MEASURED_MODEL
    assert d.value in (1, 2, 4, 8)


def test_a_new_model_keeps_a_d_it_allows():
    """d = 2 (the default) is valid for every model: switching models keeps it, and the page
    gets the new options with the kept d in one message (sent apart, the page shows the first
    option, d = 1, and sends it back)."""
    widget = views_memory.widget_memory_planner([POINT])
    model, d = widget.children[0], widget.children[1]
    sent = []
    d._send = lambda msg, buffers=None: sent.append(msg["state"])
    for name in reversed(views_memory.MODELS):
        model.value = name
        assert d.value == 2, name
    assert sent and all(state.get("index") == 1 for state in sent)
