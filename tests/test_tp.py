"""Tensor parallelism (notebook 04): every sharded layout against the unsharded MLP it replaces.

Outputs and every gradient with assert_close, bytes counted against the formula, activations
kept for backward against the formula, PyTorch's own TP against ours, bad input in the parent.
"""
import json
import multiprocessing as mp

import pytest
import torch

from helpers.parallel import tp
from helpers.cost import tp as tp_cost
from helpers.ranks import LiveRanks

B, H, L = 128, 1024, 4  # the lecture's running example
N_BYTES = B * H * 4     # one fp32 activation


@pytest.fixture(scope="module")
def ranks():
    with LiveRanks(4, backend="gloo", timeout=60) as live:
        yield live


@pytest.fixture(scope="module")
def reference():
    return tp.reference_step(B, H, L)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_lecture_forward_equals_unsharded(ranks, t):
    results = tp.run_lecture_forward(ranks, t)
    expected = tp.reference_mlp(H, L)(tp.reference_batch(B, H)[0]).detach()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["output"], expected, msg=f"rank {rank}")
        assert result["local_shape"] == (B, H // t)
        # One all-gather per layer, its output a full activation: L·(t−1)/t·n bytes.
        assert result["comm"]["ring_bytes"] == L * (t - 1) * N_BYTES // t


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("layout", tp.LAYOUTS)
def test_step_output_and_every_gradient_equal_unsharded(ranks, reference, layout, t):
    results = tp.run_step(ranks, t, layout)
    assert tp.replicas_agree(results, layout)
    diffs = tp.compare(tp.assemble(results, layout), reference)
    assert set(diffs) == {"output", "loss", "input grad"} | {f"grad {2 * i}.weight" for i in range(L)}

    # Bytes handed to torch.distributed (ring convention), per op and pass, on every rank.
    for result in results:
        assert result["comm"]["ring_bytes"] == tp.formula_bytes(layout, t, B, H, L)
        calls = {}
        for key, entry in result["comm"]["per_op"].items():
            op, phase = key.split(" (")
            calls.setdefault(op, [0, 0])[phase == "backward)"] += entry["calls"]
        expected_calls = ({op: list(c) for op, c in tp.formula_collectives(layout, L).items()}
                          if t > 1 else {})
        assert calls == expected_calls
        assert result["activation_bytes"] == tp.formula_activation_bytes(layout, t, B, H, L)


def test_unsharded_activations_match_formula_at_t1(reference):
    # The formula's t = 1 case is the plain MLP: input and pre-GELU of every layer.
    for layout in tp.LAYOUTS:
        assert tp.formula_activation_bytes(layout, 1, B, H, L) == 2 * L * N_BYTES
    assert reference["activation_bytes"] == 2 * L * N_BYTES


@pytest.mark.parametrize("layout", ["megatron", "sequence"])
def test_biases_column_and_row_match_nn_linear(ranks, layout):
    # Row-parallel bias is added once after the sum; sequence-parallel needs f on it.
    results = tp.run_step(ranks, 4, layout, bias=True)
    assert tp.replicas_agree(results, layout)
    tp.compare(tp.assemble(results, layout), tp.reference_step(bias=True))


@pytest.mark.parametrize("layout", tp.LAYOUTS)
def test_torch_parallelize_module_matches_helpers(ranks, layout):
    ours = tp.run_step(ranks, 4, layout)
    theirs = tp.run_step(ranks, 4, layout, implementation="torch")
    tp.compare(tp.assemble(theirs, layout), tp.assemble(ours, layout))
    # Same collectives, same number of them.
    counted = {}
    for entry_key, entry in ours[0]["comm"]["per_op"].items():
        op = entry_key.split(" (")[0]
        counted[op] = counted.get(op, 0) + entry["calls"]
    torch_names = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter"}
    assert {torch_names[k]: v for k, v in theirs[0]["collectives"].items()} == counted


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="NCCL path needs CUDA devices (one per rank); the same code is tested "
                           "on gloo above")
def test_nccl_same_code(t):
    if torch.cuda.device_count() < t:
        pytest.skip(f"t={t} needs {t} CUDA devices, this machine has {torch.cuda.device_count()}")
    with LiveRanks(t, backend="nccl") as live:
        for layout in tp.LAYOUTS:
            results = tp.run_step(live, t, layout)
            tp.compare(tp.assemble(results, layout), tp.reference_step(), **tp.TOLERANCES["nccl"])
            assert results[0]["comm"]["ring_bytes"] == tp.formula_bytes(layout, t, B, H, L)


# ---- bad input: one clear error, in the parent, before any process starts -------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(t=3, hidden=1024), "hidden"),
    (dict(t=4, hidden=1022), "hidden"),
    (dict(t=4, hidden=1024, layers=3, layout="megatron"), "layers"),
    (dict(t=4, hidden=1024, batch=126, layout="sequence"), "batch"),
    (dict(t=0, hidden=1024), "t"),
    (dict(t=4, hidden=1024, layout="diagonal"), "layout"),
])
def test_bad_config_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        tp.check_config(**kwargs)


def test_bad_hidden_raises_before_any_process_starts():
    before = set(mp.active_children())
    fresh = LiveRanks(4, backend="gloo")
    try:
        with pytest.raises(ValueError, match="hidden must be divisible by the tensor degree t"):
            tp.run_step(fresh, 3, "megatron", hidden=1024)
        with pytest.raises(ValueError, match="hidden"):
            tp.run_lecture_forward(fresh, 4, hidden=1022)
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
        tp.check_config(4, 1024.0)


# ---- the widget's model, at its slider extremes ----------------------------------------------

def _fit_file(tmp_path):
    path = tmp_path / "collective_fit.json"
    path.write_text(json.dumps({"backend": "gloo", "world_size": 2, "cores_per_rank": 1,
                                "fit": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}}}))
    return path


def test_fit_is_optional(tmp_path):
    assert tp_cost.load_fit(tmp_path / "missing.json") is None
    assert "this machine: gloo fit from notebook 02" not in tp_cost.machines(None)
    fit = tp_cost.load_fit(_fit_file(tmp_path))
    assert fit["alpha_s"] == 1e-4 and fit["beta_s_per_byte"] == 1e-9
    machine = tp_cost.machines(fit, cpu_flops=1e10)["this machine: gloo fit from notebook 02"]
    assert tp_cost.link_for(machine, 2).bandwidth_Bps == pytest.approx(1e9)


def test_links_come_from_hardware_hierarchy():
    nvlink, ib = tp_cost.h100_links()
    assert (nvlink.bandwidth_Bps, ib.bandwidth_Bps) == (450e9, 50e9)


@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("hidden", [256, 32768])
@pytest.mark.parametrize("tokens", [128, 65536])
def test_widget_model_at_slider_extremes(tmp_path, t, hidden, tokens):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    choices = tp_cost.machines(tp_cost.load_fit(_fit_file(tmp_path)), cpu_flops=5e10)
    for name, machine in choices.items():
        row = tp_cost.layer_times(t, hidden, machine, tokens)
        assert row["compute_s"] == pytest.approx(6 * tokens * hidden**2 / t / machine.flops)
        assert (row["comm_s"] == 0) == (t == 1) and row["comm_s"] >= 0
        text = tp_cost.describe(t, hidden, machine, tokens)
        assert f"t={t}, h={hidden}" in text
        assert tp_cost.show_choice(choices, t, hidden, tokens, name) == text
        assert len(plt.gcf().axes[0].lines) >= 4  # compute, communication, step, best t
        plt.close("all")
    assert t in tp_cost.T_OPTIONS and hidden in tp_cost.HIDDEN_OPTIONS and tokens in tp_cost.TOKEN_OPTIONS
    assert tp_cost.widget(choices, t, hidden, tokens).children  # the sliders build at this setting


def test_tp_stays_inside_a_node():
    cluster, ib_only, _ = tp_cost.machines().values()
    big = dict(hidden=8192, tokens=16384)
    # On NVLink the step keeps shrinking up to the node (8); crossing into InfiniBand it grows.
    rows = {r["t"]: r for r in tp_cost.tp_curve(big["hidden"], cluster, big["tokens"])}
    assert rows[8]["step_s"] < rows[4]["step_s"] < rows[1]["step_s"]
    assert rows[16]["step_s"] > rows[8]["step_s"] and rows[16]["link"] == "InfiniBand NDR"
    assert tp_cost.best_t(tp_cost.tp_curve(big["hidden"], cluster, big["tokens"])) == 8
    # With InfiniBand only, TP does not pay at all; at the lecture's size it never pays.
    assert tp_cost.best_t(tp_cost.tp_curve(big["hidden"], ib_only, big["tokens"])) == 1
    assert tp_cost.best_t(tp_cost.tp_curve(1024, cluster, 128)) == 1


def test_layer_times_rejects_bad_input():
    machine = next(iter(tp_cost.machines().values()))
    with pytest.raises(ValueError, match="hidden"):
        tp_cost.layer_times(3, 1024, machine)
    with pytest.raises(ValueError, match="tokens"):
        tp_cost.layer_times(2, 1024, machine, tokens=0)


def test_timed_steps_count_the_formula_bytes(ranks):
    # What the benchmark reports: its comm_bytes must equal formula_bytes.
    ranks.resize(2)
    for layout in tp.LAYOUTS:
        out = ranks.run(tp.timed_steps, layout, B, 256, L, repeat=2, warmup=1, threads=1)[0]
        assert out["comm"]["ring_bytes"] == tp.formula_bytes(layout, 2, B, 256, L)
        assert len(out["measurement"].times_s) == 2 and 0 < out["comm_share"] < 1


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_and_all_gather_along_any_dim(ranks, dim):
    ranks.resize(2)
    shape = (2, 8, 4)
    results = ranks.run(tp.collectives_along, dim, shape)
    base = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(shape)
    total = base * 2 + 1  # rank 0 holds base, rank 1 base + 1
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["scattered"], total.chunk(2, dim=dim)[rank], rtol=0, atol=0)
        torch.testing.assert_close(result["gathered"], total, rtol=0, atol=0)


@pytest.mark.parametrize("layout", tp.LAYOUTS)
def test_layout_figure_shows_the_counted_collectives(layout):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = {"AR": "all_reduce", "AG": "all_gather", "RS": "reduce_scatter"}
    drawn = {}
    for item in tp.layout_schedule(layout, L):
        if item[0] == "comm":
            for direction, op in enumerate(item[1:3]):
                if op:
                    drawn.setdefault(names[op], [0, 0])[direction] += 1
    assert {op: tuple(c) for op, c in drawn.items()} == tp.formula_collectives(layout, L)
    fig = tp.plot_layouts(L)
    assert len(fig.axes) == len(tp.LAYOUTS)
    plt.close(fig)


def test_fit_saved_by_notebook_02_is_read_even_with_fractional_cores(tmp_path):
    """4 ranks on 2 cores have 0.5 core each: notebook 02 saves that, notebook 04 must cope."""
    from helpers.cost import alpha_beta
    path = alpha_beta.save_fit({"all_reduce": alpha_beta.Fit("all_reduce", 2e-4, 1.5e-9)},
                               "gloo", 4, 0.5, path=tmp_path / "collective_fit.json")
    fit = tp_cost.load_fit(path)
    assert (fit["world_size"], fit["cores_per_rank"]) == (4, 0.5)
    assert fit["beta_s_per_byte"] == 1.5e-9
    assert tp_cost.measure_cpu_flops(256, tokens=64, threads=fit["cores_per_rank"]) > 0
