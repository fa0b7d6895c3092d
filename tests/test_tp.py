"""Tensor parallelism (notebook 04): every sharded layout against the unsharded MLP it replaces.

Outputs and every gradient with assert_close, bytes counted against the formula, activations
kept for backward against the formula, PyTorch's own TP against ours, two tensor-parallel
groups side by side, bad input in the parent.
"""
import multiprocessing as mp

import pytest
import torch

from helpers.configs import LECTURE
from helpers.cost import tp as tp_cost
from helpers.cost.tp import formula_collectives
from helpers.labs import tp as tp_lab
from helpers.models import make_batch, make_mlp
from helpers.ranks import LiveRanks

L = LECTURE.layers
N_BYTES = LECTURE.batch * LECTURE.hidden * 4     # one fp32 activation
PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def reference():
    return tp_lab.reference_step()


@pytest.mark.parametrize("t", [1, 2, 4])
def test_lecture_forward_equals_unsharded(ranks, t):
    results = tp_lab.run_lecture_forward(ranks, t)
    expected = make_mlp(LECTURE)(make_batch(LECTURE)).detach()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result.output, expected, msg=f"rank {rank}")
        assert result.local_shape == (LECTURE.batch, LECTURE.hidden // t)
        # One all-gather per layer, its output a full activation: L·(t−1)/t·n bytes.
        assert result.comm.ring_bytes == L * (t - 1) * N_BYTES // t


def _check_step(results, layout, reference, t):
    assert tp_lab.replicas_agree(results, layout)
    diffs = tp_lab.compare(tp_lab.assemble(results, layout), reference)
    assert set(diffs) == {"output", "loss", "input grad"} | {
        f"grad {tp_lab.Param(i, 'weight')}" for i in range(L)}
    # Bytes handed to torch.distributed (ring convention), per op and pass, on every rank.
    for result in results:
        assert result.comm.ring_bytes == tp_cost.formula_bytes(layout, t)
        assert result.comm.calls_by_op() == (formula_collectives(layout, L) if t > 1 else {})
        assert result.activation_bytes == tp_cost.formula_activation_bytes(layout, t)


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("layout", tp_cost.LAYOUTS)
def test_step_output_and_every_gradient_equal_unsharded(ranks, reference, layout, t):
    _check_step(tp_lab.run_step(ranks, t, layout), layout, reference, t)


@pytest.mark.parametrize("layout", tp_cost.LAYOUTS)
def test_two_groups_side_by_side_each_equal_unsharded(ranks, reference, layout):
    """4 ranks split into [0, 1] and [2, 3]: each pair runs its own t = 2 step."""
    ranks.resize(4)
    results = ranks.run(tp_lab.train_step, layout, LECTURE, blocks=PAIRS)
    for block in PAIRS:
        _check_step([results[r] for r in block], layout, reference, 2)


def test_two_groups_lecture_forward(ranks):
    ranks.resize(4)
    results = ranks.run(tp_lab.lecture_forward, LECTURE, blocks=PAIRS)
    expected = make_mlp(LECTURE)(make_batch(LECTURE)).detach()
    for result in results:
        torch.testing.assert_close(result.output, expected)
        assert result.local_shape == (LECTURE.batch, LECTURE.hidden // 2)
        assert result.comm.ring_bytes == L * N_BYTES // 2


def test_unsharded_activations_match_formula_at_t1(reference):
    # The formula's t = 1 case is the plain MLP: input and pre-GELU of every layer.
    for layout in tp_cost.LAYOUTS:
        assert tp_cost.formula_activation_bytes(layout, 1) == 2 * L * N_BYTES
    assert reference.activation_bytes == 2 * L * N_BYTES


def test_formula_bytes_by_hand():
    # lecture 3L(t−1)/t·n, megatron and sequence 2L(t−1)/t·n
    assert [tp_cost.formula_bytes(layout, 4) for layout in tp_cost.LAYOUTS] == [
        3 * L * 3 * N_BYTES // 4, 2 * L * 3 * N_BYTES // 4, 2 * L * 3 * N_BYTES // 4]
    assert all(tp_cost.formula_bytes(layout, 1) == 0 for layout in tp_cost.LAYOUTS)


@pytest.mark.parametrize("layout", ["megatron", "sequence"])
def test_biases_column_and_row_match_nn_linear(ranks, layout):
    # Row-parallel bias is added once after the sum; sequence-parallel needs f on it.
    results = tp_lab.run_step(ranks, 4, layout, bias=True)
    assert tp_lab.replicas_agree(results, layout)
    tp_lab.compare(tp_lab.assemble(results, layout), tp_lab.reference_step(bias=True))


@pytest.mark.parametrize("layout", ["megatron", "sequence"])
def test_two_groups_with_biases(ranks, layout):
    ranks.resize(4)
    results = ranks.run(tp_lab.train_step, layout, LECTURE, bias=True, blocks=PAIRS)
    expected = tp_lab.reference_step(bias=True)
    for block in PAIRS:
        pair = [results[r] for r in block]
        assert tp_lab.replicas_agree(pair, layout)
        tp_lab.compare(tp_lab.assemble(pair, layout), expected)


@pytest.mark.parametrize("layout", tp_cost.LAYOUTS)
def test_torch_parallelize_module_matches_helpers(ranks, layout):
    ours = tp_lab.run_step(ranks, 4, layout)
    theirs = tp_lab.run_step(ranks, 4, layout, implementation="torch")
    tp_lab.compare(tp_lab.assemble(theirs, layout), tp_lab.assemble(ours, layout))
    # Same collectives, same number of them.
    counted = {op: sum(calls) for op, calls in ours[0].comm.calls_by_op().items()}
    torch_names = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter"}
    assert {torch_names[k]: v for k, v in theirs[0].collectives.items()} == counted


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="NCCL path needs CUDA devices (one per rank); the same code is tested "
                           "on gloo above")
def test_nccl_same_code(t):
    if torch.cuda.device_count() < t:
        pytest.skip(f"t={t} needs {t} CUDA devices, this machine has {torch.cuda.device_count()}")
    with LiveRanks(t, backend="nccl") as live:
        for layout in tp_cost.LAYOUTS:
            results = tp_lab.run_step(live, t, layout)
            tp_lab.compare(tp_lab.assemble(results, layout), tp_lab.reference_step(), **tp_lab.TOLERANCES["nccl"])
            assert results[0].comm.ring_bytes == tp_cost.formula_bytes(layout, t)


# ---- bad input: one clear error, in the parent, before any process starts -------------------

@pytest.mark.parametrize("t, changes, layout, name", [
    (3, {}, "megatron", "hidden"),
    (4, dict(hidden=1022), "megatron", "hidden"),
    (4, dict(layers=3), "megatron", "layers"),
    (4, dict(batch=126), "sequence", "batch"),
    (0, {}, "megatron", "t"),
    (4, {}, "diagonal", "layout"),
])
def test_bad_config_names_the_argument(t, changes, layout, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        tp_cost.check_config(t, LECTURE.with_(**changes), layout)


def test_odd_layers_are_fine_for_the_lecture_layout():
    tp_cost.check_config(4, LECTURE.with_(layers=3), "lecture")


def test_bad_hidden_raises_before_any_process_starts():
    before = set(mp.active_children())
    fresh = LiveRanks(4, backend="gloo")
    try:
        with pytest.raises(ValueError, match=r"hidden must be a multiple of 3 \(the tensor degree"):
            tp_lab.run_step(fresh, 3, "megatron")
        with pytest.raises(ValueError, match="hidden"):
            tp_lab.run_lecture_forward(fresh, 4, LECTURE.with_(hidden=1022))
        with pytest.raises(ValueError, match="implementation"):
            tp_lab.run_step(fresh, 4, "megatron", implementation="jax")
        assert fresh.pids == [] and set(mp.active_children()) == before
    finally:
        fresh.close()


def test_benchmark_rejects_bad_hidden_before_starting_ranks():
    from benchmarks.tp import main
    before = set(mp.active_children())
    with pytest.raises(ValueError, match="hidden"):
        main(["--hidden", "1022", "--degrees", "1", "4"])
    assert set(mp.active_children()) == before


def test_type_errors():
    with pytest.raises(TypeError, match="hidden must be an int"):
        tp_cost.check_config(4, LECTURE.with_(hidden=1024.0))
    with pytest.raises(TypeError, match="t must be an int"):
        tp_cost.check_config(4.0)


def test_timed_steps_count_the_formula_bytes(ranks):
    # What the benchmark reports: its comm_bytes must equal formula_bytes.
    ranks.resize(2)
    small = LECTURE.with_(hidden=256)
    for layout in tp_cost.LAYOUTS:
        out = ranks.run(tp_lab.timed_steps, layout, small, repeat=2, warmup=1, threads=1)[0]
        assert out.comm.ring_bytes == tp_cost.formula_bytes(layout, 2, small)
        assert len(out.measurement.times_s) == 2 and 0 < out.comm_share < 1



def test_time_degrees_times_t1_and_t2_in_turn(ranks):
    # t = 1 is the unsharded MLP on rank 0 (no collective); t = 2 the Megatron step, counted.
    small = LECTURE.with_(hidden=256)
    timed = tp_lab.compare_degrees(ranks, 2, small, repeat=3, warmup=1)
    assert sorted(timed) == [1, 2] and ranks.world_size == 2
    assert all(len(out.measurement.times_s) == 3 for out in timed.values())
    assert timed[1].comm.calls == 0 and timed[1].comm_shares == (0.0, 0.0, 0.0)
    assert timed[2].comm.calls_by_op() == formula_collectives("megatron", L)
    assert timed[2].comm.ring_bytes == tp_cost.formula_bytes("megatron", 2, small)
    assert 0 < timed[2].comm_share < 1


def test_compare_degrees_rejects_bad_input_before_any_process_starts():
    before = set(mp.active_children())
    fresh = LiveRanks(4, backend="gloo")
    try:
        with pytest.raises(ValueError, match=r"^t \(a tensor-parallel group"):
            tp_lab.compare_degrees(fresh, 1)
        with pytest.raises(ValueError, match="^hidden must be a multiple of 3"):
            tp_lab.compare_degrees(fresh, 3)
        with pytest.raises(ValueError, match="^repeat"):
            tp_lab.compare_degrees(fresh, 2, repeat=0)
        assert fresh.pids == [] and set(mp.active_children()) == before
    finally:
        fresh.close()


def test_fit_all_reduce_here_is_a_fit_of_this_machine(ranks):
    fit = tp_lab.fit_all_reduce_here(ranks, 2, sizes=(4096, 262144), iters=3, rounds=1)
    assert (fit.backend, fit.world_size, fit.source) == ("gloo", 2, "this notebook")
    assert fit.all_reduce.alpha_s >= 0 and fit.all_reduce.beta_s_per_byte >= 0
    assert fit.all_reduce.alpha_s + fit.all_reduce.beta_s_per_byte > 0
    assert "this machine: gloo fit from this notebook" in tp_cost.hardware_choices(fit, 1e10)

def _expected_collectives(ranks_in_group, shape, dim):
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    total = sum(base + r for r in ranks_in_group)  # global rank r holds base + r
    return total, total.chunk(len(ranks_in_group), dim=dim)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_and_all_gather_along_any_dim(ranks, dim):
    ranks.resize(2)
    shape = (2, 8, 4)
    total, pieces = _expected_collectives([0, 1], shape, dim)
    for rank, result in enumerate(ranks.run(tp_lab.collectives_along, dim, shape)):
        torch.testing.assert_close(result["scattered"], pieces[rank], rtol=0, atol=0)
        torch.testing.assert_close(result["gathered"], total, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, -1])
def test_collectives_in_two_groups(ranks, dim):
    ranks.resize(4)
    shape = (2, 8, 4)
    results = ranks.run(tp_lab.collectives_along, dim, shape, blocks=PAIRS)
    for block in PAIRS:
        total, pieces = _expected_collectives(block, shape, dim)
        for i, rank in enumerate(block):
            torch.testing.assert_close(results[rank]["scattered"], pieces[i], rtol=0, atol=0)
            torch.testing.assert_close(results[rank]["gathered"], total, rtol=0, atol=0)


@pytest.mark.parametrize("layout", tp_cost.LAYOUTS)
def test_layout_route_shows_the_counted_collectives(layout):
    names = {"AR": "all_reduce", "AG": "all_gather", "RS": "reduce_scatter"}
    drawn = {}
    for item in tp_cost.layout_schedule(layout, L):
        if isinstance(item, tp_cost.Comm):
            for direction, op in enumerate((item.forward, item.backward)):
                if op:
                    drawn.setdefault(names[op], [0, 0])[direction] += 1
    assert {op: tuple(c) for op, c in drawn.items()} == formula_collectives(layout, L)


def test_layout_figure_has_one_strip_per_layout():
    from helpers.views.tp import plot_layouts
    assert len(plot_layouts(L).axes) == len(tp_cost.LAYOUTS)


def test_measure_cpu_flops_with_fractional_cores():
    """4 ranks on 2 cores have 0.5 core each: notebook 02 saves that, notebook 04 must cope."""
    assert tp_lab.measure_cpu_flops(LECTURE.with_(hidden=256), tokens=64, threads=0.5) > 0
