"""Benchmarking collectives: bandwidth factors, the α–β fit, bad inputs, and live sweeps."""
import json
import math

import numpy as np
import pytest
import torch

from helpers.cost import alpha_beta as ab
from helpers.cost import bench as cost
from helpers.labs import bench as lab
from helpers.parallel.groups import split_groups
from helpers.ranks import LiveRanks
from helpers.views.bench import MAX_SWEEP_WORLD_SIZE, plot_sweep, widget_sweep

PAIRS = [[0, 1], [2, 3]]


def time_in_pairs(rank, world_size, ops, nbytes):
    """Rank function: time every op inside this rank's pair of PAIRS, both pairs at once."""
    group = split_groups(PAIRS)
    return [lab.time_collective(rank, world_size, op, nbytes, iters=2, warmup=1, group=group)[0]
            for op in ops]


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(2, timeout=60)


# -- nccl-tests factors and units, hand-computed ---------------------------------------

@pytest.mark.parametrize("op, p, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 4, 1.0), ("reduce", 8, 1.0), ("send_recv", 2, 1.0),
])
def test_busbw_factor(op, p, factor):
    assert ab.busbw_factor(op, p) == pytest.approx(factor)


def test_bandwidths_use_decimal_gigabytes():
    assert ab.algbw_GBps(1e9, 1.0) == pytest.approx(1.0)
    assert ab.algbw_GBps(2**30, 1.0) == pytest.approx(1.073741824)
    # all-reduce of 4e8 bytes in 0.1 s on 4 ranks: algbw 4 GB/s, busbw 4 × 2·3/4 = 6 GB/s
    assert ab.busbw_GBps("all_reduce", 4, 4e8, 0.1) == pytest.approx(6.0)


def test_ring_all_reduce_coefficients():
    # 2(p−1)α + 2(p−1)/p·n·β at p = 4: 6 latencies, 1.5 n·β
    assert ab.coefficients("all_reduce", 4) == (6.0, 1.5)
    assert ab.predict("all_reduce", 4, 1000, alpha_s=1e-5, beta_s_per_byte=1e-9) == \
        pytest.approx(6e-5 + 1.5e-6)


# -- the fit ---------------------------------------------------------------------------

def _synthetic(op, alpha, beta, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    points = []
    for p in (2, 4, 8):
        for n in cost.FULL_SIZES:
            t = ab.predict(op, p, n, alpha, beta) * (1 + noise * rng.standard_normal())
            points.append((p, n, t))
    return points


@pytest.mark.parametrize("op", sorted(ab.COST_MODELS))
@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_recovers_alpha_beta_exactly_without_noise(op, weighting):
    fit = ab.fit_alpha_beta(op, _synthetic(op, 25e-6, 1 / 40e9), weighting)
    assert fit.alpha_s == pytest.approx(25e-6, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(1 / 40e9, rel=1e-6)
    assert fit.bandwidth_GBps == pytest.approx(40.0, rel=1e-6)


def test_fit_recovers_alpha_beta_from_noisy_data():
    fit = ab.fit_alpha_beta("all_reduce", _synthetic("all_reduce", 5e-4, 8e-10, noise=0.05, seed=3))
    assert fit.alpha_s == pytest.approx(5e-4, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(8e-10, rel=0.1)


def test_relative_weighting_predicts_small_messages_where_plain_least_squares_fails():
    # A latency floor plus a bandwidth term, with one slow large point: plain least squares
    # bends α to fit it and misses the small sizes; the relative fit keeps them.
    pts = _synthetic("all_reduce", 3e-4, 1e-9)
    pts[-1] = (pts[-1][0], pts[-1][1], pts[-1][2] * 1.5)
    rel, plain = (ab.fit_alpha_beta("all_reduce", pts, w) for w in ("relative", "absolute"))
    small = [(p, n, t) for p, n, t in pts if n <= 64 * 1024]
    err = lambda fit: max(ab.relative_error(fit.predict(p, n), t) for p, n, t in small)
    assert err(rel) < 0.05 < err(plain)


def test_fit_never_returns_negative_latency():
    # Times exactly proportional to size minus a constant would need α < 0: it is pinned at 0.
    pts = [(2, n, n * 1e-9 - 1e-7) for n in (1e3, 1e4, 1e5, 1e6)]
    fit = ab.fit_alpha_beta("send_recv", pts)
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0


def test_fit_needs_two_points_and_positive_times():
    with pytest.raises(ValueError, match="at least 2"):
        ab.fit_alpha_beta("all_reduce", [(2, 1024, 1e-4)])
    with pytest.raises(ValueError, match="> 0"):
        ab.fit_alpha_beta("all_reduce", [(2, 1024, 1e-4), (2, 2048, 0.0)])


def test_save_and_load_fit(tmp_path):
    path = tmp_path / "fit.json"
    assert ab.load_fit(path) is None
    fits = {"all_reduce": ab.Fit("all_reduce", 1e-4, 1e-9)}
    ab.save_fit(fits, "gloo", 4, 0.5, path)
    record = ab.load_fit(path)
    assert record == {"backend": "gloo", "world_size": 4, "cores_per_rank": 0.5,
                      "fit": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}}}
    assert ab.fits_from_record(record)["all_reduce"].predict(4, 1e6) == pytest.approx(6e-4 + 1.5e-3)


# -- the lecture's numbers -------------------------------------------------------------

def test_lecture_numbers_are_gib_and_a_missing_factor_p():
    ar, rs = cost.explain_lecture_numbers()
    # 277 "GB/s" printed = 277 GiB/s = 297.4 GB/s; its formula is nccl-tests' busbw.
    assert ar.printed_in_GB == pytest.approx(297.4265, rel=1e-5)
    assert ar.nccl_busbw_GBps == pytest.approx(297.4265, rel=1e-5)
    # 70 printed counts the output (1/p of the input): busbw = 70 × 4 GiB/s = 300.6 GB/s.
    assert rs.nccl_busbw_GBps == pytest.approx(70 * 4 * 1.073741824, rel=1e-9)
    assert (ar.formula_factor, rs.formula_factor) == (1.0, 4.0)
    # all-reduce of 400 MiB at 4 ranks: 1.5 × 419430400 B / 297.4 GB/s = 2.115 ms
    assert ar.time_s == pytest.approx(1.5 * 419430400 / (277 * 2**30), rel=1e-12)


def test_lecture_formulas_beside_nccl_tests_on_one_measurement():
    ar, rs = cost.lecture_vs_nccl_tests(all_reduce_s=0.01, reduce_scatter_s=0.01, n_bytes=2**24, world_size=4)
    assert ar.busbw_over_lecture == pytest.approx(2**30 / 1e9)
    assert rs.busbw_over_lecture == pytest.approx(4 * 2**30 / 1e9)


# -- the estimator and the iteration counts ------------------------------------------------

def _timing(op="all_reduce", nbytes=1024, times_s=(1e-3,), world_size=2):
    return cost.Timing(op, world_size, nbytes, backend="gloo", times_s=tuple(times_s),
                       threads_per_rank=1)


def test_uncontended_time_is_the_fast_mode_of_a_bimodal_record():
    # 55 calls that waited a 4 ms tick, 45 that did not: the median is a tick, the 10th
    # percentile is the collective's own 300 µs, and it stays there as the share of waits moves.
    for waited in (0, 30, 55, 85):
        times = [300e-6 + 1e-6 * i for i in range(100 - waited)] + [4.3e-3] * waited
        record = _timing(times_s=times)
        assert cost.uncontended_time(record) == pytest.approx(300e-6, rel=0.05)
    assert cost.median_time(record) == pytest.approx(4.3e-3)


def test_iteration_counts_shrink_with_size_and_split_over_rounds():
    assert cost.iterations_for(1024, 100) == 100
    assert cost.iterations_for(2**20, 100) == 100
    assert cost.iterations_for(4 * 2**20, 100) == 25
    assert cost.iterations_for(64 * 2**20, 100) == 5          # never fewer than 5 ...
    assert cost.iterations_for(64 * 2**20, 3) == 3            # ... unless fewer were asked
    assert cost.per_round(1024, 100, 5) == 20
    assert cost.per_round(64 * 2**20, 100, 5) == 1
    assert cost.per_round(4 * 2**20, 100, 3) == 9             # rounded up: 27 calls


def test_scheduler_waits_reports_threads(ranks):
    ranks.resize(2)
    result = ranks.run(lab.scheduler_waits, 1024, 20)[0]
    if result is None:
        pytest.skip("no /proc/self/task here")
    assert len(result.times_s) == 20 and result.elapsed_s > 0
    assert any("gloo" in name for name in result.threads)
    assert all(v.run_s >= 0 and v.wait_s >= 0 for v in result.threads.values())


# -- gloo's reduce-scatter, detected from measurements ---------------------------------

def _records(rs_over_ar):
    out = []
    for n in (1024, 2**20, 2**22):
        out.append(_timing("all_reduce", n, [1e-3]))
        out.append(_timing("reduce_scatter", n, [1e-3 * rs_over_ar]))
    return out


def test_reduce_scatter_emulation_is_detected_from_the_ratio():
    assert cost.reduce_scatter_is_emulated(_records(1.1)) is True
    assert "all-reduce inside" in cost.op_labels(_records(1.1))["reduce_scatter"]
    assert cost.reduce_scatter_is_emulated(_records(0.5)) is False
    assert cost.op_labels(_records(0.5))["reduce_scatter"] == "reduce_scatter"
    assert cost.reduce_scatter_is_emulated(_records(1.1)[:2]) is None  # only 1 KiB measured
    assert cost.reduce_scatter_ratios(_records(0.5)) == [
        cost.ReduceScatterRatio(2, n, 0.5) for n in (1024, 2**20, 2**22)]


def test_result_rows_and_their_table():
    # A ring all-reduce at p = 2 pays 2(p−1) = 2 latencies of α = 50 µs and 2(p−1)/p = 1 n·β
    # with β = 1 ns/B; both points measured 10 % slower than that.
    fits = {"all_reduce": ab.Fit("all_reduce", 50e-6, 1e-9)}
    records = [_timing("all_reduce", n, [1.1 * (100e-6 + n * 1e-9)]) for n in (2**10, 2**20)]
    rows = cost.result_rows(records, fits)
    assert [(r.op, r.world_size, r.bytes) for r in rows] == [("all_reduce", 2, 2**10),
                                                             ("all_reduce", 2, 2**20)]
    assert rows[1].time_s == pytest.approx(1.1 * (100e-6 + 2**20 * 1e-9))
    assert rows[1].predicted_s == pytest.approx(100e-6 + 2**20 * 1e-9)
    assert rows[1].algbw_GBps == pytest.approx(2**20 / rows[1].time_s / 1e9)
    assert rows[1].busbw_GBps == pytest.approx(rows[1].algbw_GBps)      # factor 1 at p = 2
    assert cost.median_rel_error(rows) == pytest.approx(0.1 / 1.1)
    assert "1 MiB" in cost.format_table(rows).splitlines()[-1]


# -- bad inputs: one clear error, before any process starts ----------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"ops": ("all_reduce", "allreduce")}, "op must be one of .*, got 'allreduce'"),
    ({"ops": ()}, "ops must name"),
    ({"ops": ("all_gather",), "sizes": (1000,), "world_sizes": (3,)},
     r"sizes \(bytes, all_gather at N=3\) must be a multiple of 12"),
    ({"ops": ("reduce_scatter",), "sizes": (4096, 4100), "world_sizes": (2,)}, "got 4100"),
    ({"ops": ("all_reduce",), "sizes": (6,)}, "multiple of 4"),
    ({"ops": ("all_reduce",), "sizes": (0,)}, "must be >= 1"),
    ({"ops": ("all_reduce",), "world_sizes": (1,)}, "at least 2 ranks"),
    ({"iters": 0}, "iters"),
    ({"warmup": -1}, "warmup"),
    ({"rounds": 0}, "rounds"),
])
def test_bad_sweep_input_raises_before_starting_ranks(kwargs, match):
    idle = LiveRanks(2)
    with pytest.raises(ValueError, match=match):
        lab.run_sweep(idle, **{"progress": False, **kwargs})
    assert idle.pids == []


def test_bad_benchmark_input_raises_before_starting_ranks():
    from benchmarks import collectives
    with pytest.raises(ValueError, match="op must be one of"):
        collectives.main(["--ops", "all_reduce", "bogus"])
    with pytest.raises(ValueError, match="multiple of 12"):
        collectives.main(["--world-size", "3", "--ops", "all_to_all", "--sizes", "1KiB"])


def test_parse_size():
    assert [cost.parse_size(s) for s in ("4096", "4KiB", "1 MiB", "1MB", "1e3")] == \
        [4096, 4096, 2**20, 10**6, 1000]
    with pytest.raises(ValueError, match="sizes must be whole bytes"):
        cost.parse_size("four")
    with pytest.raises(ValueError, match="sizes must be whole bytes"):
        cost.parse_size("1.5")


# -- live ranks ------------------------------------------------------------------------

def test_every_op_runs_and_all_ranks_agree_on_the_times(ranks):
    ranks.resize(2)
    per_rank = ranks.run(lab.time_collective, "all_reduce", 4096, iters=4, warmup=1)
    assert per_rank[0] == per_rank[1]          # the slowest rank's time, known everywhere
    (record,) = per_rank[0]
    assert isinstance(record, cost.Timing)
    assert len(record.times_s) == 4 and min(record.times_s) > 0
    # Several sizes in interleaved rounds: each size gets its share of calls in every round.
    sizes = (1024, 2 * 2**20)
    per_rank = ranks.run(lab.time_collective, "all_reduce", sizes, iters=6, warmup=1, rounds=3)
    assert per_rank[0] == per_rank[1]
    assert [(r.bytes, len(r.times_s)) for r in per_rank[0]] == [(1024, 6), (2 * 2**20, 6)]
    records = lab.run_sweep(ranks, sorted(ab.COST_MODELS), (1024, 65536), (2,), iters=2, warmup=1,
                            rounds=2, progress=False)
    assert [(r.op, r.bytes) for r in records] == \
        [(op, n) for op in sorted(ab.COST_MODELS) for n in (1024, 65536)]
    rows = cost.result_rows(records, cost.fit_sweep(records))
    assert all(row.time_s > 0 and row.predicted_s > 0 for row in rows)


def test_two_groups_of_two_time_side_by_side(ranks):
    ranks.resize(4)
    ops = sorted(ab.COST_MODELS)
    per_rank = ranks.run(time_in_pairs, ops, 4096)
    for members in PAIRS:
        first, second = (per_rank[r] for r in members)
        assert first == second        # each pair agrees on its own slowest times
        assert [r.op for r in first] == ops
        assert all(r.world_size == 2 and min(r.times_s) > 0 for r in first)
    ranks.resize(2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the NCCL path (CUDA events) needs 2 GPUs; the gloo path is tested above")
def test_time_collective_on_nccl():
    with LiveRanks(2, backend="nccl") as gpus:
        records = lab.run_sweep(gpus, ("all_reduce", "reduce_scatter"), (2**20,), (2,), iters=3,
                                progress=False)
    assert all(r.backend == "nccl" and min(r.times_s) > 0 for r in records)


def test_the_backend_probe_on_a_gloo_group(ranks):
    from helpers.labs.collectives import probe_backend
    ranks.resize(2)
    facts = ranks.run(probe_backend, on_gloo=True)[0]
    assert facts["backend"] == "gloo"
    assert facts["reduce_scatter (N·2, 3) = (4, 3) -> (2, 3)"] == "works"
    assert facts["reduce_scatter (2, N·3) = (2, 6) -> (2, 3)"].startswith("fails: ")
    assert "(4 vs. 2)" in facts["reduce_scatter (2, N·3) = (2, 6) -> (2, 3)"]  # no time, no path
    assert facts["all_reduce_mean"] == "works"


def test_benchmark_prints_its_json_last(capsys):
    from benchmarks import collectives
    collectives.main(["--sizes", "4KiB", "64KiB", "1MiB", "--iters", "3", "--warmup", "1",
                      "--rounds", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["world_size"] == 2 and set(result["fit"]) == {"all_reduce"}
    assert [r["bytes"] for r in result["results"]] == [4096, 65536, 2**20]
    assert set(result["results"][0]) == {"op", "bytes", "time_s", "algbw_GBps", "busbw_GBps",
                                         "predicted_s", "rel_error"}
    assert math.isfinite(result["median_rel_error"])


# -- the widget, at its slider extremes ------------------------------------------------

@pytest.mark.parametrize("op, p, exps, expected", [
    ("all_reduce", 2, (10, 10), (1024,)),
    ("all_reduce", 8, (28, 28), (2**28,)),
    ("all_gather", 3, (10, 10), (1020,)),                 # 1 KiB snapped to 85 × 12 bytes
    ("send_recv", 2, (10, 28), (2**10, 2**14, 2**19, 2**24, 2**28)),
])
def test_small_sweep_plan_at_extremes(op, p, exps, expected):
    assert lab.plan_small_sweep(op, p, exps).sizes == expected


@pytest.mark.parametrize("exps", [(9, 12), (12, 10), (10, 29)])
def test_small_sweep_plan_rejects_sizes_outside_the_slider(exps):
    with pytest.raises(ValueError, match="size_exponents"):
        lab.plan_small_sweep("all_reduce", 2, exps)


@pytest.mark.parametrize("op, p, exps", [
    ("all_reduce", 2, (10, 10)),        # smallest size: one point, nothing to fit
    ("all_gather", MAX_SWEEP_WORLD_SIZE, (10, 12)),   # the slider's largest world size
    ("all_reduce", 2, (27, 28)),        # largest sizes
])
def test_small_sweep_at_extremes(ranks, op, p, exps):
    sweep = lab.run_small_sweep(ranks, op, p, exps)
    assert {r.world_size for r in sweep.records} == {p}
    assert tuple(r.bytes for r in sweep.records) == sweep.plan.sizes
    assert (sweep.fits is None) == (len(sweep.records) < 2)
    fig = plot_sweep(sweep.records, sweep.fits)
    assert "1 GB = 10⁹ B" in fig.axes[1].get_ylabel()


def test_the_widget_runs_a_sweep_per_click(ranks, capsys):
    box = widget_sweep(ranks)
    (op, p), (sizes, button) = box.children[0].children, box.children[1].children
    assert p.max == MAX_SWEEP_WORLD_SIZE
    sizes.value = (10, 11)
    button.click()
    assert "all_reduce: α = " in capsys.readouterr().out


# -- notebook 02's checked exercises --------------------------------------------------------

def test_bench_exercises_say_right_and_name_the_usual_mistakes():
    from helpers import exercises as ex
    assert ex.grade_bench_busbw(297.5).right
    assert "GiB" in str(ex.grade_bench_busbw(277)) and "algbw" in str(ex.grade_bench_busbw(198.3))
    assert ex.grade_bench_predict(103.1).right and not ex.grade_bench_predict(67.5).right
    assert ex.grade_bench_crossover(1.6e6).right
    assert "coefficients" in str(ex.grade_bench_crossover(4e5))
