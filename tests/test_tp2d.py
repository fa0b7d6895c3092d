"""2-D tensor parallelism as notebook 06's model has it (TP_model × TP_ff): one step on live
ranks against one process, the bytes handed to torch.distributed against the model's formula
(`helpers.simulator.comm.tp_comm`, through `helpers.cost.tp.model_bytes_2d`), and, on emulated
nodes, the bytes the link's shapers counted.

Small widths keep the step cheap; the byte counts do not depend on the width's size, only on
the formula getting every factor right, which a wrong factor anywhere breaks.
"""
from __future__ import annotations

import pytest
import torch

from helpers.configs import LECTURE
from helpers.cost import tp as tp_cost
from helpers.cost.tp import Grid2D
from helpers.labs import tp as tp_lab
from helpers.launch import cluster
from helpers.ranks import LiveRanks

CONFIG = LECTURE.with_(batch=16, hidden=64, layers=2)
MISSING = cluster.missing()


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def reference():
    return tp_lab.reference_step_2d(CONFIG)


@pytest.mark.parametrize("tp_model, tp_ff", [(2, 2), (4, 1), (1, 4)])
def test_step_equals_one_process_and_bytes_equal_the_model(ranks, reference, tp_model, tp_ff):
    grid = Grid2D(tp_model, tp_ff)
    results = tp_lab.run_step_2d(ranks, grid, CONFIG)
    diffs = tp_lab.compare(tp_lab.assemble_2d(results, grid), reference)
    assert set(diffs) == {"output", "loss", "input grad"} | {
        f"grad layer {i} {name}" for i in range(CONFIG.layers) for name in ("up", "down")}
    assert tp_lab.replicas_agree_2d(results, grid)
    expected = tp_cost.formula_bytes_2d_by_group(grid, CONFIG)
    for result in results:
        counted = result.by_group()
        assert {name: c.ring_bytes for name, c in counted.items()} == expected
        assert {name: c.calls for name, c in counted.items()} == \
            tp_cost.formula_collectives_2d(grid, CONFIG.layers)
        assert result.ring_bytes == tp_cost.formula_bytes_2d(grid, CONFIG)


def test_the_model_counts_each_groups_all_reduces_by_hand():
    """The formula, written out once here by hand: each layer all-reduces b·h_ff/TP_ff
    elements over TP_model and b·h/TP_model over TP_ff, forward and backward; a ring sends
    2(p−1)/p of each."""
    grid, w, b, h, L = Grid2D(2, 4), 4, CONFIG.batch, CONFIG.hidden, CONFIG.layers
    by_model = 2 * L * (b * 4 * h // 4) * w * 2 * (2 - 1) // 2
    by_ff = 2 * L * (b * h // 2) * w * 2 * (4 - 1) // 4
    assert tp_cost.formula_bytes_2d_by_group(grid, CONFIG) == {"TP_model": by_model,
                                                                "TP_ff": by_ff}
    assert tp_cost.formula_bytes_2d(grid, CONFIG) == by_model + by_ff
    # Split over two levels, each level carries its own group's bytes.
    assert tp_cost.model_bytes_2d(CONFIG, (2, 1), (1, 4)) == (by_model, by_ff)
    assert tp_cost.model_bytes_2d(CONFIG, (1, 2), (4, 1)) == (by_ff, by_model)


def test_placements_read_as_the_models_levels():
    grid = Grid2D(2, 2)
    assert tp_cost.split_on_nodes(grid, (0, 0, 1, 1)) == ((2, 1), (1, 2))
    assert tp_cost.split_on_nodes(grid, (0, 1, 0, 1)) == ((1, 2), (2, 1))
    # Both kinds cross (every byte does): the model's outer level then holds both degrees.
    assert tp_cost.split_on_nodes(grid, (0, 1, 1, 0)) == ((1, 2), (1, 2))
    with pytest.raises(ValueError, match="some TP_model groups on more nodes"):
        tp_cost.split_on_nodes(Grid2D(2, 4), (0, 0, 0, 0, 1, 1, 0, 1))
    with pytest.raises(ValueError, match="must name a node for each of the 4 ranks"):
        tp_cost.split_on_nodes(grid, (0, 1))


def test_a_grid_that_does_not_split_the_widths_is_named_before_any_rank_runs():
    with pytest.raises(ValueError, match="TP_model=3 splits h"):
        tp_lab.run_step_2d(None, Grid2D(3, 1), CONFIG)


@pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}")
def test_bytes_on_the_link_are_the_models_plus_headers():
    """TP_model inside each node, TP_ff across: only TP_ff's all-reduces cross the link, each
    byte once. Then the other way round, 4× the bytes (h_ff/TP_ff = 4 · h/TP_model at 2 × 2).
    Headers and TCP acknowledgements add about 5 %, the groups' connections some 25 kB (so the
    step must cross MBs for the 3–8 % to hold)."""
    grid, config = Grid2D(2, 2), CONFIG.with_(batch=512, hidden=256)
    with LiveRanks(4, nodes=2, link_bps=1e9) as live:
        ff_across = tp_lab.run_on_nodes_2d(live, grid, (0, 0, 1, 1), config)
        model_across = tp_lab.run_on_nodes_2d(live, grid, (0, 1, 0, 1), config)
        assert live.cluster.drops() == 0
    by_group = tp_cost.formula_bytes_2d_by_group(grid, config)
    assert ff_across.formula_bytes == 4 * by_group["TP_ff"]
    assert model_across.formula_bytes == 4 * by_group["TP_model"]
    for run in (ff_across, model_across):
        assert 0.03 <= run.overhead <= 0.08, run
        torch.testing.assert_close(tp_lab.assemble_2d(run.results, grid).output,
                                   tp_lab.reference_step_2d(config).output)
