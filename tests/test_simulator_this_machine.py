"""This machine as the simulator's GPU record: the fields from the measurements, the levels from
the fits, bad input refused by name, and the search running on the record."""
import math

import pytest

from helpers.hardware import H100_SXM
from helpers.simulator.curve import Point
from helpers.simulator.scaling import model_for_width
from helpers.simulator.search import best_plan
from helpers.simulator.settings import Settings
from helpers.simulator.this_machine import (across_costs, cache_bytes, level_of,
                                            this_machine_gpu)

INSIDE = {"alpha_s": 7e-4, "beta_s_per_byte": 1.6e-9}
ACROSS = {"alpha_s": 2.6e-4, "beta_s_per_byte": 2.3e-8}


def record(**changes):
    args = dict(matmul_flops=4e10, copy_Bps=1e10, memory_bytes=24e9, inside=INSIDE,
                across=ACROSS, ranks_per_node=2, ranks=4, latency_per_matmul_s=8e-6)
    args.update(changes)
    return this_machine_gpu(**args)


def test_the_record_divides_the_machine_among_its_ranks():
    gpu = record()
    assert math.isclose(gpu.peak_flops, 1e10) and math.isclose(gpu.sustained_flops, 1e10)
    assert math.isclose(gpu.hbm_bytes, 6e9) and math.isclose(gpu.hbm_Bps, 2.5e9)
    inner, outer = gpu.network_levels
    # 1/β one way, counted both ways (×2); the link shared by the node's two ranks
    assert math.isclose(inner.bandwidth_Bps, 2 / 1.6e-9) and inner.size == 2
    assert math.isclose(outer.bandwidth_Bps, 2 / 2.3e-8 / 2) and outer.size is None
    assert (inner.latency_s, outer.latency_s) == (7e-4, 2.6e-4)


def test_level_of_counts_both_directions_and_the_ranks_that_share_it():
    level = level_of({"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}, ranks_sharing=4, size=8)
    assert math.isclose(level.bandwidth_Bps, 5e8) and level.size == 8


@pytest.mark.parametrize("change, name", [
    ({"ranks": 0}, "ranks"), ({"ranks_per_node": 5}, "ranks_per_node"),
    ({"matmul_flops": 0.0}, "matmul_flops"), ({"copy_Bps": -1.0}, "copy_Bps"),
    ({"latency_per_matmul_s": float("nan")}, "latency_per_matmul_s"),
    ({"across": {"alpha_s": 1e-4, "beta_s_per_byte": 0.0}}, "beta_s_per_byte"),
    ({"inside": {"alpha_s": -1.0, "beta_s_per_byte": 1e-9}}, "alpha_s")])
def test_bad_input_is_refused_by_name(change, name):
    with pytest.raises(ValueError, match=name):
        record(**change)


def test_per_flop_this_record_has_a_roomier_link_than_an_h100():
    here_byte, here_message = across_costs(record())
    h100_byte, h100_message = across_costs(H100_SXM)
    assert math.isclose(h100_byte, H100_SXM.peak_flops / 5e10)   # 100 GB/s both ways
    assert here_byte < h100_byte and here_message < h100_message


def test_cache_sizes_come_from_linux_or_a_stated_typical_value():
    for level in (1, 2):
        size, from_sys = cache_bytes(level)
        assert size > 0 and isinstance(from_sys, bool)


def test_the_search_lays_out_a_grid_model_on_four_ranks_of_it():
    gpu, settings = record(), Settings(months=1, overlap_tp=False, overlap_pp=False,
                                       overlap_dp=False)
    model = model_for_width(512, settings)
    plan = best_plan(gpu, model, settings, 4)
    assert plan is not None and plan.n_gpus == 4
    assert plan.dp * plan.tp_model * plan.tp_ff * plan.pp == 4
    point = Point(model, plan, gpu.peak_flops, settings.duration_s, gpu.latency_per_matmul_s)
    # the grid's batch makes the step almost all matmul even with nothing overlapped
    assert plan.time.matmul / plan.time.step > 0.9 and 0.9 < point.mfu <= 1.0
