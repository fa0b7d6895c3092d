"""The cost simulator (notebook 06): the spec's §8 numbers, validation, CLI, fast == reference.

Curves are computed once per module (the fast search takes about a second each) and shared.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.hardware import (GTX_580, H100_GLOBAL_NVLINK, H100_SUPERPOD, H100_SXM, NetworkLevel,
                              PRESETS)
from helpers.simulator import reference, search
from helpers.simulator.config import gpu_from_json, gpu_to_json, load_config, preset, validate
from helpers.simulator.curve import run_curve
from helpers.simulator.machine import Machine
from helpers.simulator.matmul import tile
from helpers.simulator.report import to_json
from helpers.simulator.scaling import grid, snap, width_grid
from helpers.simulator.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def sig3(x: float) -> float:
    """A number as the spec prints it: three significant figures."""
    return float(f"{x:.3g}")


@pytest.fixture(scope="module")
def dense():
    return run_curve(H100_SXM, Settings())


@pytest.fixture(scope="module")
def no_batch_scaling():
    return run_curve(H100_SXM, Settings(batch_law="none"))


@pytest.fixture(scope="module")
def deepseek():
    return run_curve(H100_SXM, Settings(batch_law="deepseek"))


# --- the model's building blocks -------------------------------------------------------

def test_snap_picks_nearest_round_number_and_the_smaller_on_ties():
    assert snap(197.8) == 192
    assert snap(3414) == 3584
    assert snap(5) == 5 and snap(37) == 36
    assert snap(11) == 10 and snap(13) == 12  # halfway between two: the smaller wins


def test_width_grid_is_odd_multiples_of_powers_of_two_in_range():
    ws = width_grid()
    assert ws[0] == 12288 and ws[-1] == 12288 * 128
    assert len(ws) == 55  # 13·2^10 and 15·2^10 fall in range but need i < 11
    assert ws == sorted(set(ws))


def test_tile_fits_capacity():
    rows, cols = tile(4096, 4096, 1 << 20, 2)
    tiles = rows * cols
    assert 4096 * 4096 * 2 / tiles <= (1 << 20) * (1 + 1e-12)


# --- spec §8: the public reference numbers --------------------------------------------

def test_first_grid_point(dense):
    p = dense.points[0]
    q = p.plan
    assert sig3(p.model.C) == 6.45e24
    assert (p.model.d, p.model.L) == (12288, 192)
    assert sig3(p.model.B) == 7.34e6
    assert q.n_gpus == 2048
    assert (q.tp_model, q.tp_ff, q.pp, q.dp) == (4, 8, 64, 1)
    assert round(p.mfu, 3) == 0.699


def test_point_at_1_12e26(dense):
    p = next(p for p in dense.points if sig3(p.model.C) == 1.12e26)
    q = p.plan
    assert (p.model.d, p.model.L, q.n_gpus) == (20480, 288, 32768)
    assert (q.tp_model, q.tp_ff, q.pp, q.dp) == (8, 8, 32, 16)
    assert round(p.mfu, 3) == 0.687


def _fastest_step_with_tp(gpu, model, settings, plan, tp_model, tp_ff):
    """The best step of `plan`'s layout with another TP split, over all its placements."""
    degrees = (plan.dp, tp_model, tp_ff, plan.pp, plan.ep)
    return min(reference.step_time(gpu, model, settings, gpu.network_levels, place, plan.m,
                                   plan.v, plan.zero_bubble, plan.n_gpus).step
               for place in reference.placements(gpu.network_levels, plan.n_gpus, degrees))


def test_linear_scaling_ends_at_2_05e28(dense):
    p = dense.linear_scaling_ends()
    q = p.plan
    assert sig3(p.model.C) == 2.05e28
    assert round(p.mfu, 3) == 0.553
    assert sig3(q.n_gpus) == 8.39e6
    assert (q.pp, q.dp) == (64, 256)
    # The spec prints TP (8, 64); it ties (16, 32) exactly, in step and in bandwidth time.
    # The public reference code keeps the earlier of two exact ties, and TP_ff ascends, so
    # (16, 32) is its choice and ours.
    assert (q.tp_model, q.tp_ff) == (16, 32)
    assert _fastest_step_with_tp(H100_SXM, p.model, Settings(), q, 8, 64) == q.time.step


def test_largest_feasible_run_and_the_latency_wall(dense):
    p = dense.largest_feasible()
    assert sig3(p.model.C) == 2.71e31
    assert round(p.mfu, 3) == 0.052
    # The next grid point exists but no cluster up to s·2^59 GPUs finishes it in time.
    assert not dense.points[-1].feasible
    assert dense.points[-2] is p
    assert len(dense.points) < len(grid(Settings()))


def test_every_point_before_the_wall_is_feasible_and_mfu_below_ceiling(dense):
    assert all(p.feasible for p in dense.points[:-1])
    assert all(0 < p.mfu <= H100_SXM.effective_utilization for p in dense.points[:-1])
    assert all(p.run_time_s < Settings().duration_s for p in dense.points[:-1])


def test_batch_law_comparison(dense, no_batch_scaling, deepseek):
    ends = {name: sig3(c.linear_scaling_ends().model.C)
            for name, c in (("none", no_batch_scaling), ("default", dense),
                            ("deepseek", deepseek))}
    assert ends == {"none": 2.85e27, "default": 2.05e28, "deepseek": 3.21e33}


def test_max_feasible_at_threshold_is_the_largest_efficient_point(dense):
    best = dense.max_feasible_at_threshold()
    bar = 0.8 * H100_SXM.effective_utilization
    assert best.mfu >= bar
    assert all(p.mfu < bar for p in dense.feasible if p.model.C > best.model.C)


# --- the fast search returns exactly the direct transcription's plans ------------------

SAMPLES = [
    (H100_SXM, Settings(), [0, 4, 11]),
    (H100_SXM, Settings(sparse=True), [0, 2]),
    (GTX_580, Settings(), [0, 3]),
    (H100_SUPERPOD, Settings(), [0]),
    (H100_SUPERPOD, Settings(sparse=True), [1]),
    (H100_SXM, Settings(schedules=("1f1b", "zero_bubble"), overlap_dp=True,
                        overlap_tp=False), [1]),
    # one network level: no inner level for TP and DP to share
    (H100_GLOBAL_NVLINK, Settings(), [0, 6]),
    # notebook 06's sliders: latency ÷ 10 and bandwidth × 10, a shorter run
    (replace(H100_SXM, latency_per_matmul_s=H100_SXM.latency_per_matmul_s / 10,
             network_levels=tuple(replace(lv, bandwidth_Bps=10 * lv.bandwidth_Bps,
                                          latency_s=lv.latency_s / 10)
                                  for lv in H100_SXM.network_levels)),
     Settings(months=1), [3]),
]


@pytest.mark.parametrize("gpu, settings, indices", SAMPLES,
                         ids=lambda x: getattr(x, "name", None) or "")
def test_fast_search_equals_reference(gpu, settings, indices):
    models = grid(settings)
    for i in indices:
        search.clear_caches()
        fast = search.size_cluster(gpu, models[i], settings)
        slow = reference.size_cluster(gpu, models[i], settings)
        assert fast == slow, (gpu.name, i)


def test_fast_best_plan_equals_reference_on_a_big_cluster():
    """Where linear scaling ends: 8.4 million GPUs, many near-tied layouts."""
    model = next(m for m in grid(Settings()) if m.d == 53248)
    fast = search.best_plan(H100_SXM, model, Settings(), 2**23)
    slow = reference.best_plan(H100_SXM, model, Settings(), 2**23)
    assert fast == slow
    assert (fast.tp_model, fast.tp_ff) == (16, 32)  # ties the spec's (8, 64): see above


def test_fast_search_equals_reference_on_the_dense_curve(dense):
    """Every other point of the default H100 curve and its last two (the largest feasible one
    and the latency wall), layout and placement included: the reference takes about 15 s for
    these. `python -m benchmarks.simulator` compares every point."""
    picked = sorted(set(range(0, len(dense.points), 2)) | {len(dense.points) - 2,
                                                           len(dense.points) - 1})
    assert dense.points[-1].plan is None and dense.points[-2].plan is not None
    for i in picked:
        point = dense.points[i]
        assert reference.size_cluster(H100_SXM, point.model, Settings()) == point.plan, \
            f"{point.model.C:.3g}"


def test_exact_ties_follow_the_reference_codes_order(dense):
    """At 2.71e31, TP (128, 256) and (64, 512) take the same run time; the reference code
    keeps the one with strictly less bandwidth time (latency not counted): (64, 512)."""
    p = dense.largest_feasible()
    q = p.plan
    assert (q.tp_model, q.tp_ff) == (64, 512)
    assert _fastest_step_with_tp(H100_SXM, p.model, Settings(), q, 128, 256) == q.time.step


@pytest.mark.parametrize("gpu, settings",
                         [(H100_SXM, Settings()), (H100_SXM, Settings(sparse=True)),
                          (GTX_580, Settings())], ids=["dense", "sparse", "gtx"])
def test_step_floor_is_below_every_plan_and_not_trivial(gpu, settings):
    """size_cluster skips the cluster sizes whose floor exceeds the largest step: the floor
    must never be above a real plan's step (the fast == reference tests would not see a
    size skipped wrongly where a larger one also works), and it must bind somewhere."""
    curve = run_curve(gpu, settings)
    ratios = []
    for point in curve.feasible:
        plan = point.plan
        floor = search.step_floor(Machine.of(gpu), point.model, plan.n_gpus)
        assert floor <= plan.time.step, f"{point.model.C:.3g}"
        ratios.append(floor / plan.time.step)
    assert max(ratios) > 0.5  # compute-bound points: the FLOP is most of the step


def test_latency_wall_is_below_every_plan_that_could_use_it_and_ends_the_dense_curve(dense):
    """size_cluster stops at the first failed size from which on this bound holds for every
    larger one: it must be below each plan found on such sizes, and it must be what ends the
    dense curve (the wall above the largest step of its infeasible last point)."""
    walls = []
    for point in dense.points:
        m = point.model
        wall = search.latency_wall(Machine.of(H100_SXM), m, Settings())
        if point.plan is not None:
            assert wall <= point.plan.time.step, f"{m.C:.3g}"
        walls.append(wall * m.D / m.B / Settings().duration_s)  # in run times over T
    assert walls[-1] > 1 > walls[-2]


def test_matmul_caches_are_shared_by_gpus_that_differ_only_in_their_network():
    """The matmul caches key on `Machine.chip`: equal (and equally hashed) for a GPU that
    differs only in its network, different for one whose matmuls differ."""
    faster = replace(H100_SXM, network_levels=tuple(
        replace(lv, bandwidth_Bps=2 * lv.bandwidth_Bps) for lv in H100_SXM.network_levels))
    slower_matmul = replace(H100_SXM, latency_per_matmul_s=2 * H100_SXM.latency_per_matmul_s)
    h100, fast, slow = (Machine.of(g) for g in (H100_SXM, faster, slower_matmul))
    assert fast.chip == h100.chip and hash(fast.chip) == hash(h100.chip)
    assert fast.levels != h100.levels
    assert slow.chip != h100.chip
    search.clear_caches()
    for machine in (h100, fast, slow):
        search._six_matmuls(machine.chip, 4096, 1024, 64)
    assert search._six_matmuls.cache_info()[:2] == (1, 2)  # (hits, misses)


# --- validation: one clear error naming the field, before anything is computed ----------

def _never(*_):
    raise AssertionError("the curve must not be computed for an invalid configuration")


BAD_GPUS = [
    (dict(hbm_Bps=0), "hbm_Bps"),
    (dict(l2_Bps=-1.0), "l2_Bps"),
    (dict(hbm_bytes=0), "hbm_bytes"),
    (dict(l2_bytes=-5), "l2_bytes"),
    (dict(max_clock_Hz=0), "max_clock_Hz"),
    (dict(flop_per_clock_per_thread={16: 0}), "flop_per_clock_per_thread[16]"),
    (dict(flop_per_clock_per_thread={32: 1.0}), "flop_per_clock_per_thread"),
    (dict(num_sms=0), "num_sms"),
    (dict(effective_utilization=1.5), "effective_utilization"),
    (dict(register_bytes_per_processing_block=float("nan")),
     "register_bytes_per_processing_block"),
    (dict(network_levels=(NetworkLevel(0.0, 1e-6, 8), NetworkLevel(1e11, 1e-6))),
     "network_levels[0].bandwidth_Bps"),
    (dict(network_levels=(NetworkLevel(9e11, 1e-6, 8), NetworkLevel(-1e11, 1e-6))),
     "network_levels[1].bandwidth_Bps"),
    (dict(network_levels=(NetworkLevel(9e11, -1e-6, 8), NetworkLevel(1e11, 1e-6))),
     "network_levels[0].latency_s"),
    (dict(network_levels=(NetworkLevel(9e11, 1e-6), NetworkLevel(1e11, 1e-6))),
     "network_levels[0].size"),
    (dict(network_levels=(NetworkLevel(9e11, 1e-6, 8), NetworkLevel(1e11, 1e-6, 64))),
     "network_levels[1].size"),
    (dict(network_levels=()), "network_levels"),
]


@pytest.mark.parametrize("change, field", BAD_GPUS, ids=[f for _, f in BAD_GPUS])
def test_invalid_hardware_is_rejected_by_name(change, field):
    gpu = replace(H100_SXM, **change)
    with pytest.raises(ValueError) as err:
        run_curve(gpu, Settings(), sizer=_never)
    assert str(err.value).startswith(field + " must be")


BAD_SETTINGS = [
    (dict(threshold=0), "threshold"), (dict(threshold=1.01), "threshold"),
    (dict(threshold=-0.5), "threshold"), (dict(months=0), "months"),
    (dict(months=-3), "months"), (dict(batch_law="chinchilla"), "batch_law"),
    (dict(schedules=()), "schedules"), (dict(schedules=("gpipe",)), "schedules"),
    (dict(tokens_per_param=0), "tokens_per_param"), (dict(price_per_gpu=-1), "price_per_gpu"),
]


@pytest.mark.parametrize("change, field", BAD_SETTINGS,
                         ids=[f"{f}={list(c.values())[0]}" for c, f in BAD_SETTINGS])
def test_invalid_settings_are_rejected_by_name(change, field):
    with pytest.raises(ValueError) as err:
        run_curve(H100_SXM, Settings(**change), sizer=_never)
    assert str(err.value).startswith(field + " must be")


def test_threshold_one_is_allowed():
    validate(H100_SXM, Settings(threshold=1.0))


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="^preset must be one of"):
        preset("H200 SXM")


def test_every_preset_is_valid_and_round_trips_through_json():
    for gpu in PRESETS.values():
        validate(gpu, Settings())
        assert gpu_from_json(json.loads(json.dumps(gpu_to_json(gpu)))) == gpu


def test_config_file_errors_name_the_field(tmp_path):
    data = gpu_to_json(H100_SXM)
    del data["hbm_Bps"]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="^hbm_Bps is required"):
        load_config(path)
    data = gpu_to_json(H100_SXM) | {"settings": {"months": 0}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="^months must be"):
        load_config(path)


# --- JSON output and the CLI -----------------------------------------------------------

POINT_KEYS = {"compute_flop", "d_model", "d_ff", "layers", "sparsity", "batch_tokens",
              "n_gpus", "mfu", "months", "dp", "tp_model", "tp_ff", "pp", "ep", "interleave",
              "microbatches", "zero_bubble", "placement", "cost_usd", "time_breakdown_s",
              "feasible"}


def _check_schema(out: dict, name: str, n_levels: int) -> list[dict]:
    (conf,) = out["configurations"]
    assert conf["name"] == name
    assert set(conf) == {"name", "hardware", "settings", "linear_scaling_ends_flop",
                         "max_feasible_flop", "largest_feasible_flop", "points"}
    points = conf["points"]
    assert all(set(p) == POINT_KEYS for p in points)
    assert all(p["feasible"] for p in points[:-1])
    for p in points:
        if p["feasible"]:
            assert p["dp"] * p["tp_model"] * p["tp_ff"] * p["pp"] * p["ep"] == p["n_gpus"]
            for t, per_level in p["placement"].items():
                assert len(per_level) == n_levels and math.prod(per_level) == p[t]
            assert p["months"] <= conf["settings"]["months"]
    return points


def test_json_report_of_the_dense_curve(dense):
    out = json.loads(json.dumps(to_json({"H100 SXM": dense})))
    points = _check_schema(out, "H100 SXM", 2)
    assert points[-1]["feasible"] is False and points[-1]["n_gpus"] is None
    conf = out["configurations"][0]
    assert sig3(conf["linear_scaling_ends_flop"]) == 2.05e28
    assert sig3(conf["largest_feasible_flop"]) == 2.71e31
    assert points[0]["cost_usd"] is None  # no price known for an H100 unless given


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "helpers.simulator", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_with_a_preset(tmp_path):
    r = _cli("--preset", "GTX 580", "--months", "3", "--threshold", "0.8", "--json",
             str(tmp_path / "out.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    points = _check_schema(out, "GTX 580", 2)
    conf = out["configurations"][0]
    assert conf["settings"]["price_per_gpu"] == 300.0  # the spec's price for a GTX 580
    assert points[0]["cost_usd"] == points[0]["n_gpus"] * 300.0
    assert "linear scaling ends" in r.stdout


def test_cli_with_a_config_file_of_three_levels(tmp_path):
    gpu = gpu_to_json(H100_SUPERPOD) | {"name": "my pod",
                                         "settings": {"months": 6, "schedules": ["1f1b"]}}
    (tmp_path / "pod.json").write_text(json.dumps(gpu))
    r = _cli("--config", "pod.json", "--batch-law", "none", "--price-per-gpu", "25000",
             "--json", "out.json", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    points = _check_schema(out, "my pod", 3)
    settings = out["configurations"][0]["settings"]
    assert settings["months"] == 6 and settings["batch_law"] == "none"
    assert settings["schedules"] == ["1f1b"]
    assert all(p["zero_bubble"] is False for p in points if p["feasible"])
    assert points[0]["cost_usd"] == points[0]["n_gpus"] * 25000


def test_cli_rejects_bad_input_with_the_field_named(tmp_path):
    r = _cli("--preset", "H100 SXM", "--threshold", "1.5", "--json", "x.json", cwd=tmp_path)
    assert r.returncode == 2 and "threshold must be in (0, 1]" in r.stderr
    assert not (tmp_path / "x.json").exists()
    r = _cli("--preset", "nope", "--json", "x.json", cwd=tmp_path)
    assert r.returncode == 2 and "preset must be one of" in r.stderr
    bad = gpu_to_json(GTX_580)
    bad["network_levels"][0]["bandwidth_Bps"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = _cli("--config", "bad.json", "--months", "-1", "--json", "x.json", cwd=tmp_path)
    assert r.returncode == 2 and "network_levels[0].bandwidth_Bps must be" in r.stderr


def test_infinite_bandwidth_is_written_as_strict_json_and_read_back():
    gpu = PRESETS["H100 SXM Infinite network + LL"]
    curve = run_curve(gpu, Settings(), max_compute=7e24)  # the first grid point only
    text = json.dumps(to_json({gpu.name: curve}), allow_nan=False)
    hardware = json.loads(text)["configurations"][0]["hardware"]
    assert hardware["network_levels"][0]["bandwidth_Bps"] == "Infinity"
    assert gpu_from_json(hardware) == gpu


def test_settings_section_rejects_unknown_fields(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(gpu_to_json(H100_SXM) | {"settings": {"month": 3}}))
    with pytest.raises(ValueError, match="^settings: unknown field"):
        load_config(path)


def test_benchmark_prints_its_json_last():
    # The reference comparison (15 s) is test_fast_search_equals_reference_on_the_dense_curve.
    r = subprocess.run([sys.executable, "-m", "benchmarks.simulator", "--runs", "1",
                        "--skip-reference"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result) == {"dense_s", "sparse_s", "dense_points", "sparse_points",
                           "target_dense_s", "identical_to_reference", "reference_dense_s",
                           "months_move_s", "latency_move_s", "bandwidth_move_s"}
    assert result["identical_to_reference"] is None and result["target_dense_s"] == 0.1
    # Dense: the grid points up to 2.71e31 (§8) and the first infeasible one after them.
    assert result["dense_points"] == 1 + sum(1 for m in grid(Settings()) if m.C < 2.72e31)
    assert result["sparse_points"] > 1 and result["dense_s"] > 0 and result["sparse_s"] > 0
    assert all(result[f"{x}_move_s"] > 0 for x in ("months", "latency", "bandwidth"))
