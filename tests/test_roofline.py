"""Notebook 00: the roofline's arithmetic, this machine's measurements, the hierarchy and the
figures and widget of helpers.views.hardware."""
import pytest

from helpers import hierarchy, roofline
from helpers.cost.roofline import (Roofline, attainable_flops, bound, matmul_intensity,
                                   matmul_points, published)
from helpers.hardware import HIERARCHY, ROOFLINE_PEAKS
from helpers.views.hardware import plot_hierarchy, plot_roofline, widget_roofline


def test_h100_ridge_is_the_syllabus_number():
    assert round(published("H100 SXM").ridge) == 295
    assert ROOFLINE_PEAKS["H100 SXM"].peak_flops == ROOFLINE_PEAKS["H100 SXM"][0] == 989e12


def test_attainable_is_the_lower_of_the_two_roofs():
    m = Roofline("toy", peak_flops=100.0, memory_Bps=10.0)  # ridge 10
    assert attainable_flops(1, m) == 10
    assert attainable_flops(10, m) == 100
    assert attainable_flops(1000, m) == 100
    assert bound(9.9, m) == "memory-bound" and bound(10, m) == "compute-bound"


def test_matmul_intensity():
    # 2 n^3 FLOPs over 3 n^2 elements: n/6 for fp32, n/3 for bf16
    assert matmul_intensity(1200, "float32") == pytest.approx(200)
    assert matmul_intensity(1200, "bfloat16") == pytest.approx(400)


@pytest.mark.parametrize("call, words", [
    (lambda: matmul_intensity(0), "n must be >= 1, got 0"),
    (lambda: matmul_intensity(8, "int4"), "dtype must be one of"),
    (lambda: attainable_flops(0, published("GTX 580")), "intensity must be > 0 FLOP/byte"),
    (lambda: published("B200"), "name must be one of"),
    (lambda: hierarchy.ratio("H100 SXM", "NVLink", "Carrier pigeon"), "prefix must start one of"),
])
def test_bad_input(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("n", [1, 16384])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_widget_numbers_at_slider_extremes(n, dtype):
    roofs = [published(name) for name in ROOFLINE_PEAKS]
    points = matmul_points(n, dtype, roofs)
    assert [v.machine for v in points] == list(ROOFLINE_PEAKS)
    for v in points:
        assert 0 < v.attainable_fraction <= 1
        assert v.bound == ("compute-bound" if v.intensity >= v.ridge else "memory-bound")
    if n == 1:  # a 1x1x1 matmul is memory-bound on every machine
        assert {v.bound for v in points} == {"memory-bound"}
    fig = plot_roofline(roofs, {"n": points[0].intensity}, title="t")
    assert len(fig.axes[0].get_lines()) >= len(roofs) and fig.axes[0].get_title() == "t"


def test_widget_acts_on_release_over_powers_of_two_and_redraws_at_its_extremes():
    from helpers.views.hardware import MATRIX_SIZES, RooflineView
    roofs = [published("H100 SXM"), published("GTX 580")]
    box = widget_roofline(roofs)
    size, dtype = box.children[0].children
    image, text = box.children[1], box.children[2]
    assert not size.continuous_update and [v for _, v in size.options] == list(MATRIX_SIZES)
    assert "matrix size n" in size.description
    first = image.value
    size.value, dtype.value = MATRIX_SIZES[0], "bfloat16"
    assert image.value != first and "H100 SXM: memory-bound" in text.value
    size.value = MATRIX_SIZES[-1]
    assert "H100 SXM: compute-bound" in text.value
    # The callback itself: marker moved, figure reused, PNG returned.
    view = RooflineView(roofs)
    for n in (MATRIX_SIZES[0], MATRIX_SIZES[-1]):
        picture, lines = view.update(n, "bfloat16")
        assert picture[:4] == b"\x89PNG" and view.label.get_text() == f" n={n} (bfloat16)"
        assert view.line.get_xdata()[0] == pytest.approx(matmul_intensity(n, "bfloat16"))


def test_roofline_legend_is_outside_the_axes():
    fig = plot_roofline([published("H100 SXM")], {"x": 1.0})
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    axes = fig.axes[0].get_window_extent(renderer)
    assert legend.y1 <= axes.y0   # below the axes: it cannot cover a marker's label


def test_measurements_are_positive_and_plausible():
    bandwidth, copy = roofline.measure_copy_bandwidth(megabytes=16, repeat=2)
    flops, matmul = roofline.measure_matmul_flops(n=128, repeat=2)
    assert 1e8 < bandwidth < 1e13 and 1e6 < flops < 1e15
    assert "median" in str(copy) and "n=2" in str(matmul)
    latency, tiny = roofline.measure_matmul_latency(repeat=20)
    # a call's fixed cost: far below a millisecond, and the tiny matmul's arithmetic is nothing
    assert 0 < latency < 1e-3 and latency == tiny.median and "n=20" in str(tiny)
    with pytest.raises(ValueError, match="n must be between 1 and 64, got 128"):
        roofline.measure_matmul_latency(n=128)


def test_hierarchy_tables_and_ratios():
    text = hierarchy.table("H100 SXM")
    assert "450 GB/s" in text and "3,350 GB/s" in text and "80 GB" in text
    assert hierarchy.ratio("H100 SXM", "NVLink", "InfiniBand") == pytest.approx(9.0)
    for gpu in HIERARCHY:
        fig = plot_hierarchy(gpu)
        assert fig.axes[0].get_title().startswith(gpu)
        assert fig.axes[0].get_xscale() == "log"     # bandwidth on a log axis
        assert len(hierarchy.sources(gpu).splitlines()) == len(HIERARCHY[gpu])
    assert [ax.get_title().split(":")[0] for ax in plot_hierarchy(list(HIERARCHY)).axes] == \
        list(HIERARCHY)


def test_hierarchy_per_direction_agrees_with_the_cost_model_records():
    """The simulator counts link bandwidth in both directions; notebook 00 shows one direction."""
    from helpers.hardware import GTX_580, H100_SXM
    def per_direction(gpu, prefix):
        return hierarchy.level(gpu, prefix).bandwidth_Bps
    assert H100_SXM.network_levels[0].bandwidth_Bps / 2 == per_direction("H100 SXM", "NVLink")
    assert H100_SXM.network_levels[1].bandwidth_Bps / 2 == per_direction("H100 SXM", "InfiniBand")
    assert GTX_580.network_levels[0].bandwidth_Bps / 2 == per_direction("GTX 580", "PCIe")
    assert GTX_580.network_levels[1].bandwidth_Bps / 2 == per_direction("GTX 580", "InfiniBand")
    assert hierarchy.level("GTX 580", "PCIe").latency_s == GTX_580.network_levels[0].latency_s


def test_a100_40gb_is_hbm2():
    assert hierarchy.level("A100 SXM", "HBM2").name == "HBM2"
    assert "HBM2e" not in hierarchy.table("A100 SXM")


def test_topo_sample_is_cited_and_consistent():
    from helpers.hardware import TOPO_H100
    text = hierarchy.topo_text()
    assert "nccl/issues/1453" in TOPO_H100.source
    lines = text.splitlines()
    assert lines[0].split()[:8] == [f"GPU{i}" for i in range(8)]
    for i in range(8):
        row = lines[1 + i].split()
        assert row[0] == f"GPU{i}" and row[1 + i] == "X" and row.count("NV18") == 7
        assert row.count("PIX") == 1        # one NIC behind the same PCIe switch per GPU
    assert "NV#" in text


def test_node_picture_has_sixteen_gpus_and_the_cited_links():
    from helpers.views.hardware import plot_node
    fig = plot_node("H100 SXM", nodes=2)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("GPU ") for t in texts) == 16
    assert texts.count("NVSwitch") == 8 and texts.count("NIC") == 16
    assert any("450 GB/s" in t and "50 GB/s" in t for t in texts)


def test_cache_sizes_and_a_copy_smaller_than_a_mebibyte():
    caches = roofline.cache_sizes()
    assert all(isinstance(level, int) and size > 0 for level, size in caches.items())
    assert list(caches) == sorted(caches)
    bandwidth, copy = roofline.measure_copy_bandwidth(megabytes=0.25, repeat=2)
    assert bandwidth > 0 and str(copy).startswith("copy 256 KiB")
    with pytest.raises(ValueError, match="megabytes must be > 0"):
        roofline.measure_copy_bandwidth(megabytes=0)
