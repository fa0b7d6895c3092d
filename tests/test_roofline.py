"""helpers.roofline and helpers.hierarchy: notebook 00's measurements, roofline and widget."""
import matplotlib
import pytest

matplotlib.use("Agg")

from helpers import hierarchy, roofline
from helpers.hardware import HIERARCHY, ROOFLINE_PEAKS


def test_h100_ridge_is_the_syllabus_number():
    assert round(roofline.published("H100 SXM").ridge) == 295


def test_attainable_is_the_lower_of_the_two_roofs():
    m = roofline.Machine("toy", peak_flops=100.0, memory_Bps=10.0)  # ridge 10
    assert roofline.attainable_flops(1, m) == 10
    assert roofline.attainable_flops(10, m) == 100
    assert roofline.attainable_flops(1000, m) == 100
    assert roofline.bound(9.9, m) == "memory-bound" and roofline.bound(10, m) == "compute-bound"


def test_matmul_intensity():
    # 2 n^3 FLOPs over 3 n^2 elements: n/6 for fp32, n/3 for bf16
    assert roofline.matmul_intensity(1200, "float32") == pytest.approx(200)
    assert roofline.matmul_intensity(1200, "bfloat16") == pytest.approx(400)


@pytest.mark.parametrize("call, words", [
    (lambda: roofline.matmul_intensity(0), "n must be >= 1"),
    (lambda: roofline.matmul_intensity(8, "int4"), "dtype must be one of"),
    (lambda: roofline.attainable_flops(0, roofline.published("GTX 580")), "intensity must be > 0"),
])
def test_bad_input(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("n", [1, 16384])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_widget_callback_at_slider_extremes(n, dtype):
    machines = [roofline.published(name) for name in ROOFLINE_PEAKS]
    rows = roofline.intensity_report(n, dtype, machines)
    assert [r["machine"] for r in rows] == list(ROOFLINE_PEAKS)
    for r in rows:
        assert 0 < r["attainable_fraction"] <= 1
        assert r["bound"] == ("compute-bound" if r["intensity"] >= r["ridge"] else "memory-bound")
    if n == 1:  # a 1x1x1 matmul is memory-bound on every machine
        assert {r["bound"] for r in rows} == {"memory-bound"}
    ax = roofline.plot(machines, {"n": rows[0]["intensity"]})
    assert len(ax.get_lines()) >= len(machines)


def test_measurements_are_positive_and_plausible():
    bandwidth, copy = roofline.measure_copy_bandwidth(megabytes=16, repeat=2)
    flops, matmul = roofline.measure_matmul_flops(n=128, repeat=2)
    assert 1e8 < bandwidth < 1e13 and 1e6 < flops < 1e15
    assert "median" in str(copy) and "n=2" in str(matmul)


def test_hierarchy_tables_and_ratios():
    text = hierarchy.table("H100 SXM")
    assert "450 GB/s" in text and "3,350 GB/s" in text and "80 GB" in text
    assert hierarchy.ratio("H100 SXM", "NVLink", "InfiniBand") == pytest.approx(9.0)
    for gpu in HIERARCHY:
        ax = hierarchy.draw(gpu)
        assert ax.get_title().startswith(gpu)
        assert len(hierarchy.sources(gpu).splitlines()) == len(HIERARCHY[gpu])


def test_hierarchy_per_direction_agrees_with_the_cost_model_records():
    """The simulator counts link bandwidth in both directions; notebook 00 shows one direction."""
    from helpers.hardware import GTX_580, H100_SXM
    def per_direction(gpu, prefix):
        return next(lv.bandwidth_Bps for lv in HIERARCHY[gpu] if lv.name.startswith(prefix))
    assert H100_SXM.network_levels[0].bandwidth_Bps / 2 == per_direction("H100 SXM", "NVLink")
    assert H100_SXM.network_levels[1].bandwidth_Bps / 2 == per_direction("H100 SXM", "InfiniBand")
    assert GTX_580.network_levels[1].bandwidth_Bps / 2 == per_direction("GTX 580", "InfiniBand")
