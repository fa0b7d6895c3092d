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
    """Ranks 0, 2 on one node and 1, 3 on the other: every TP_model group crosses the link and
    no TP_ff group does, so the link carries TP_model's all-reduces, each byte once, and
    nothing of TP_ff's (whose bytes would miss or exceed the bound by 25 %). Headers and TCP
    acknowledgements add 5–13 % (through the shaper a flow's segments are not merged), the
    groups' connections some 25 kB (so the step must cross MBs for the 3–15 % to hold). One
    placement: each costs a start of four ranks."""
    grid, config = Grid2D(2, 2), CONFIG.with_(batch=512, hidden=256)
    with LiveRanks(4, nodes=2, link_bps=1e9) as live:
        run = tp_lab.run_on_nodes_2d(live, grid, (0, 1, 0, 1), config)
        assert live.cluster.drops() == 0
    assert (run.tp_model, run.tp_ff) == ((1, 2), (2, 1))
    assert run.formula_bytes == 4 * tp_cost.formula_bytes_2d_by_group(grid, config)["TP_model"]
    assert 0.03 <= run.overhead <= 0.15, run
    torch.testing.assert_close(tp_lab.assemble_2d(run.results, grid).output,
                               tp_lab.reference_step_2d(config).output)


def test_megatrons_layout_is_the_grid_that_does_not_cut_h():
    """TP_model = 1: `up` column-parallel, `down` row-parallel, one all-reduce of h words per
    layer and pass: notebook 04's Megatron bytes for the same number of matrices."""
    for t in (2, 4, 8):
        assert tp_cost.formula_bytes_2d(Grid2D(1, t), CONFIG) == tp_cost.formula_bytes(
            "megatron", t, CONFIG.with_(layers=2 * CONFIG.layers))


def test_the_grids_and_the_ones_the_search_tries():
    assert tp_cost.grids_2d(4, CONFIG) == [Grid2D(1, 4), Grid2D(2, 2), Grid2D(4, 1)]
    wide = CONFIG.with_(hidden=16384)
    # The GTX 580 answer's TP 512 is 16 × 32 (notebook 06): one of the two the search tries.
    assert tp_cost.searched_grids_2d(512, wide) == [Grid2D(8, 64), Grid2D(16, 32)]
    # Per rank, the 2-D cut sends more than Megatron's at 4 ranks and less from 16 on.
    for t, fewer in ((4, False), (16, True), (64, True), (1024, True)):
        best = min(tp_cost.formula_bytes_2d(g, wide) for g in tp_cost.searched_grids_2d(t, wide))
        assert (best < tp_cost.formula_bytes_2d(Grid2D(1, t), wide)) is fewer, t


def test_communication_over_compute_falls_as_the_width_grows():
    grid = Grid2D(2, 8)
    ratios = [tp_cost.comm_over_compute_2d(grid, CONFIG.with_(hidden=h), 50e9, 1e15)
              for h in (1024, 2048, 4096)]
    assert ratios[0] == pytest.approx(2 * ratios[1]) == pytest.approx(4 * ratios[2])
