"""Layouts on nodes: which group crosses the link (helpers.layout's placement functions), the cost
model priced per level (helpers.cost.parallel3d with a placement), and one small live run on two
emulated nodes whose link counters are checked against the TP formula (bytes, not time)."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from helpers.cost.alpha_beta import Fit
from helpers.cost.parallel3d import (BYTES_PER_FLOAT, LAYOUTS_4, Breakdown, Calibration,
                                     Comparison, activation_bytes, cluster_summary, placed_table,
                                     plan_calibration, predict, shapes_used, stage_parameters,
                                     stages_used)
from helpers.hardware import NetworkLevel
from helpers.launch import cluster
from helpers.layout import (Groups, Layout, Split, blocks_on, check_placement, crossing_hops,
                            factorizations, placement_name, placement_of, placements, splits)
from helpers.simulator.comm import pp_frequencies
from helpers.simulator.reference import placements as simulator_placements

TINY = SimpleNamespace(vocab=8, hidden=4, heads=2, layers=4, seq=3, batch=8)
MISSING = cluster.missing()
needs_namespaces = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}")
CONSECUTIVE, ALTERNATE = (0, 0, 1, 1), (0, 1, 0, 1)


# -- which group crosses the link ---------------------------------------------------------------

def test_splits_of_the_two_placements_of_2x2x1_by_hand():
    lay = Layout(2, 2, 1)
    # consecutive ranks on a node: tp groups [0,1] [2,3] inside, dp groups [0,2] [1,3] across
    assert splits(lay, CONSECUTIVE) == Groups(dp=Split(1, 2), tp=Split(2, 1), pp=Split(1, 1))
    assert splits(lay, ALTERNATE) == Groups(dp=Split(2, 1), tp=Split(1, 2), pp=Split(1, 1))
    assert placement_name(lay, CONSECUTIVE) == "tp inside · dp across"
    assert placement_name(lay, ALTERNATE) == "tp across · dp inside"
    assert Split(1, 2).crosses and not Split(2, 1).crosses and Split(1, 2).ranks == 2


def test_a_four_stage_pipeline_on_two_nodes_crosses_at_its_middle_boundary_only():
    lay = Layout(1, 1, 4, 4)
    assert splits(lay, CONSECUTIVE).pp == Split(2, 2)
    assert crossing_hops(lay, CONSECUTIVE) == (False, True, False)
    assert crossing_hops(lay, ALTERNATE) == (True, True, True)
    assert crossing_hops(Layout(2, 2, 1), CONSECUTIVE) == ()


def test_the_layouts_of_4_ranks_on_2_nodes_and_their_placements():
    got = {str(lay): [placement_name(lay, pl) for pl in placements(lay, 2)] for lay in LAYOUTS_4}
    assert got == {"4·1·1 m=1": ["dp across"], "1·4·1 m=1": ["tp across"],
                   "1·1·4 m=4": ["pp across"],
                   "2·2·1 m=1": ["tp inside · dp across", "tp across · dp inside"],
                   "2·1·2 m=4": ["dp inside · pp across", "dp across · pp inside"],
                   "1·2·2 m=4": ["tp inside · pp across", "tp across · pp inside"]}
    # the first is always the launcher's: consecutive ranks share a node
    assert all(placements(lay, 2)[0] == CONSECUTIVE for lay in LAYOUTS_4)
    assert placements(Layout(2, 2, 1), 2)[1] == ALTERNATE


@pytest.mark.parametrize("world, nodes", [(4, 2), (8, 2), (8, 4)])
def test_every_simulator_placement_is_a_placement_of_ranks_with_the_same_split(world, nodes):
    # The simulator splits each degree over the levels, innermost first: place[type] = (inside a
    # node, across nodes). placement_of turns its inner degrees into the node of each rank, and
    # splits reads them back from the ranks: the one definition, two ways round.
    levels = [NetworkLevel(1.0, 0.0, world // nodes), NetworkLevel(1.0, 0.0)]
    seen = 0
    for lay in factorizations(world):
        for place in simulator_placements(levels, world, (lay.d, lay.t, 1, lay.p, 1)):
            dp, tp, _, pp, _ = place
            placed = placement_of(lay, Groups(dp=dp[0], tp=tp[0], pp=pp[0]))
            assert splits(lay, placed) == Groups(Split(*dp), Split(*tp), Split(*pp)), (lay, place)
            if lay.p > 1:  # the stage boundaries that cross: the simulator's share on level 1
                across = pp_frequencies(lay.p, 1, pp).get(1, 0.0) * (lay.p - 1)
                assert sum(crossing_hops(lay, placed)) == round(across), (lay, place)
            assert sorted(placed) == sorted(r // (world // nodes) for r in range(world))
            seen += 1
    assert seen > len(factorizations(world))  # some layouts have several placements


def test_placements_differ_in_what_crosses_and_cover_every_simulator_split():
    lay = Layout(2, 2, 2)
    levels = [NetworkLevel(1.0, 0.0, 4), NetworkLevel(1.0, 0.0)]
    ours = {(splits(lay, pl), crossing_hops(lay, pl)) for pl in placements(lay, 2)}
    # 4 ranks a node as dp × tp × pp inside it, each dividing its degree 2: 1·2·2, 2·1·2, 2·2·1
    assert len(ours) == len(placements(lay, 2)) == 3
    theirs = {Groups(Split(*dp), Split(*tp), Split(*pp))
              for dp, tp, _, pp, _ in simulator_placements(levels, 8, (2, 2, 1, 2, 1))}
    assert {s for s, _ in ours} == theirs


def test_blocks_on_a_placement_by_hand():
    assert blocks_on(CONSECUTIVE, Split(2, 1)) == [[0, 1], [2, 3]]
    assert blocks_on(CONSECUTIVE, Split(1, 2)) == [[0, 2], [1, 3]]
    assert blocks_on(ALTERNATE, Split(1, 2)) == [[0, 1], [2, 3]]
    assert blocks_on(CONSECUTIVE, Split(2, 2)) == [[0, 1, 2, 3]]
    assert blocks_on((0,) * 4, Split(2, 1)) == [[0, 1], [2, 3]]  # flat: consecutive groups
    with pytest.raises(ValueError, match="cannot hold groups of 4"):
        blocks_on(CONSECUTIVE, Split(4, 1))


def test_bad_placements_are_named():
    with pytest.raises(ValueError, match="each of the 4 ranks"):
        check_placement(Layout(2, 2, 1), (0, 0, 1))
    with pytest.raises(ValueError, match="as many ranks on every node"):
        check_placement(Layout(2, 2, 1), (0, 0, 0, 1))
    with pytest.raises(ValueError, match="unequal shares"):  # tp group [0..3] has 3 on node 0
        splits(Layout(1, 4, 2), (0, 0, 0, 1, 1, 1, 0, 1))
    with pytest.raises(ValueError, match="lie on the nodes in different ways"):
        splits(Layout(2, 4, 1), (0, 0, 0, 1, 1, 1, 0, 1))  # dp [0,4] across, [2,6] inside
    with pytest.raises(ValueError, match="must divide the tp degree"):
        placement_of(Layout(2, 2, 1), Groups(dp=1, tp=4, pp=1))


# -- the cost model, priced per level -----------------------------------------------------------

def _calibration(layouts, **changes) -> Calibration:
    """4 ranks, 4 cores; every piece takes 1 s, the optimizer nothing; inside a node a TP
    all-reduce costs α = 10 ms, across the link 100 ms; a DP all-reduce 20 ms inside, 200 ms
    across; a hop 0.1 s inside, 1 s across."""
    fields = dict(world=4, compute_s=dict.fromkeys(shapes_used(layouts, TINY), 1.0), cores=4.0,
                  tp_all_reduce={2: Fit("all_reduce", 0.01, 0.0)},
                  all_reduce={2: Fit("all_reduce", 0.02, 0.0)},
                  send_recv=Fit("send_recv", 0.1, 0.0),
                  optimizer_s=dict.fromkeys(stages_used(layouts, TINY), 0.0), lateness={2: 0.0},
                  tp_across={Split(1, 2): Fit("all_reduce", 0.1, 0.0)},
                  all_reduce_across={Split(1, 2): Fit("all_reduce", 0.2, 0.0),
                                     Split(2, 2): Fit("all_reduce", 0.2, 0.0)},
                  send_recv_across=Fit("send_recv", 1.0, 0.0))
    return Calibration(**{**fields, **changes})


def test_each_communication_term_is_priced_at_the_level_its_group_crosses():
    lay = Layout(2, 2, 1)
    cal = _calibration([lay])
    inside, across = predict(lay, TINY, cal, CONSECUTIVE), predict(lay, TINY, cal, ALTERNATE)
    # 4 blocks × 4 all-reduces of 2(t−1)α; DP: one all-reduce of 2(d−1)α
    assert inside.breakdown.tp_comm_s == pytest.approx(16 * 2 * 0.01)
    assert inside.breakdown.dp_comm_s == pytest.approx(2 * 0.2)
    assert across.breakdown.tp_comm_s == pytest.approx(16 * 2 * 0.1)
    assert across.breakdown.dp_comm_s == pytest.approx(2 * 0.02)
    # the flat network prices every group inside a node
    flat = predict(lay, TINY, cal)
    assert flat.breakdown.tp_comm_s == inside.breakdown.tp_comm_s
    assert flat.breakdown.dp_comm_s == pytest.approx(2 * 0.02)
    assert inside.placement == CONSECUTIVE and flat.placement is None


def test_hops_add_up_boundary_by_boundary():
    lay = Layout(1, 1, 4, 4)
    cal = _calibration([lay])
    # boundaries inside, across, inside: 2·(Σ hops + (m−1)·slowest) = 2·(1.2 + 3·1.0)
    assert predict(lay, TINY, cal, CONSECUTIVE).p2p_s == pytest.approx(8.4)
    # all across: 2·(3 + 3) = 12; flat: the old 2·(p−1+m−1) hops of 0.1 s
    assert predict(lay, TINY, cal, ALTERNATE).p2p_s == pytest.approx(12.0)
    assert predict(lay, TINY, cal).p2p_s == pytest.approx(2 * 6 * 0.1)


def test_a_missing_level_is_named():
    lay = Layout(2, 2, 1)
    with pytest.raises(ValueError, match="no TP all_reduce fit for groups across 2 nodes"):
        predict(lay, TINY, _calibration([lay], tp_across={}), ALTERNATE)
    with pytest.raises(ValueError, match="no send_recv fit across nodes"):
        predict(Layout(1, 1, 4, 4), TINY, _calibration([Layout(1, 1, 4, 4)], send_recv_across=None),
                CONSECUTIVE)


def test_the_calibration_plan_times_each_group_the_way_the_layouts_lay_it():
    flat = plan_calibration([(lay, None) for lay in LAYOUTS_4], TINY)
    assert all(not split.crosses for split in [s for _, s in flat.tp]
               + [s for s, _ in flat.all_reduce + flat.send_recv])
    placed = [(lay, pl) for lay in LAYOUTS_4 for pl in placements(lay, 2)]
    plan = plan_calibration(placed, TINY)
    tp_splits = {split for shape, split in plan.tp if shape.t == 2}
    assert tp_splits == {Split(2, 1), Split(1, 2)}
    assert {split for shape, split in plan.tp if shape.t == 4} == {Split(2, 2)}
    assert {split for split, _ in plan.all_reduce} == {Split(2, 1), Split(1, 2), Split(2, 2)}
    assert {split for split, _ in plan.send_recv} == {Split(2, 1), Split(1, 2)}
    # the TP activation is timed quiet only inside a node (across, the step's own timing is used)
    act = activation_bytes(Layout(1, 4, 1), TINY)
    assert (Split(2, 2), act) not in plan.all_reduce


def _comparison(lay, placement, step, predicted) -> Comparison:
    zero = Breakdown(0.0, 0.0, 0.0, 0.0, 0.0)
    got = predict(lay, TINY, _calibration([lay]), placement)
    got = dataclasses.replace(got, breakdown=dataclasses.replace(zero, compute_s=predicted))
    return Comparison(lay, dataclasses.replace(zero, compute_s=step), got)


def test_cluster_summary_orders_ratio_and_fastest():
    a, b = Layout(2, 2, 1), Layout(2, 1, 2, 4)
    rows = [_comparison(a, CONSECUTIVE, 1.0, 1.1), _comparison(a, ALTERNATE, 2.0, 1.9),
            _comparison(b, CONSECUTIVE, 1.5, 1.2), _comparison(b, ALTERNATE, 1.4, 1.3),
            _comparison(Layout(4, 1, 1), CONSECUTIVE, 3.0, 3.0)]
    s = cluster_summary(rows)
    assert s.orders == {"2·2·1": True, "2·1·2": False}
    assert s.gaps == pytest.approx({"2·2·1": 1.0, "2·1·2": 1.5 / 1.4 - 1})
    assert s.tp_across_over_inside == pytest.approx(2.0) and s.tp_ratios == {"2·2·1": 2.0}
    assert s.best_predicted_slower == 0.0
    assert s.best_measured == "2·2·1 tp inside · dp across"
    assert s.best_predicted == "2·2·1 tp inside · dp across"
    errors = sorted(abs(p - m) / m for m, p in ((1, 1.1), (2, 1.9), (1.5, 1.2), (1.4, 1.3), (3, 3)))
    assert s.median_rel_error == pytest.approx(errors[2])
    # the model's fastest measured 1.4 s where the fastest took 1.0 s
    worse = cluster_summary([_comparison(a, CONSECUTIVE, 1.0, 1.1), _comparison(b, ALTERNATE, 1.4, 1.0)])
    assert worse.best_predicted_slower == pytest.approx(0.4)
    row = s.as_json()["results"][1]
    assert (row["placement"], row["nodes"], row["step_s"]) == ("tp across · dp inside", ALTERNATE, 2.0)
    with pytest.raises(ValueError, match="each predicted with a placement"):
        cluster_summary([Comparison(a, rows[0].measured, predict(a, TINY, _calibration([a])))])


def test_the_placed_table_names_each_ranks_node_and_the_bytes_across():
    lay = Layout(2, 2, 1)
    rows = [_comparison(lay, CONSECUTIVE, 0.1, 0.12), _comparison(lay, ALTERNATE, 0.2, 0.22)]
    lines = placed_table(rows, {(lay, CONSECUTIVE): 1e6, (lay, ALTERNATE): 1.7e7}).splitlines()
    assert "0011" in lines[1] and "tp inside · dp across" in lines[1] and "+20%" in lines[1]
    assert "0101" in lines[2] and "tp across · dp inside" in lines[2] and lines[2].endswith("17.00")


def test_the_benchmark_record_of_placed_runs():
    from helpers.labs.layouts import PlacedMeasured, Run, cluster_record
    lay = Layout(2, 2, 1)
    runs = {(lay, nodes): [Run(lay, step, Breakdown(step, 0.0, 0.0, 0.0, 0.0), (), (step,), 5.0)]
            for nodes, step in ((CONSECUTIVE, 1.0), (ALTERNATE, 2.0))}
    wire = {(lay, CONSECUTIVE): 1e5, (lay, ALTERNATE): 2e6}
    record = json.loads(json.dumps(cluster_record(PlacedMeasured(runs, wire, _calibration([lay])), TINY)))
    assert [(r["placement"], r["nodes"], r["step_s"], r["wire_bytes_per_step"])
            for r in record["layouts"]] == [("tp inside · dp across", list(CONSECUTIVE), 1.0, 1e5),
                                             ("tp across · dp inside", list(ALTERNATE), 2.0, 2e6)]
    assert record["tp_across_over_inside"] == 2.0 and record["orders"] == {"2·2·1": True}
    assert set(record) >= {"median_rel_error", "best_measured", "best_predicted"}


# -- live: two emulated nodes -------------------------------------------------------------------

@needs_namespaces
def test_tp_across_the_link_sends_the_formulas_bytes_and_tp_inside_only_the_gradients():
    from helpers.labs.layouts import CLUSTER_CONFIG, build_layout, run_layout
    from helpers.launch.cluster import whereabouts
    from helpers.ranks import LiveRanks
    config, lay = CLUSTER_CONFIG.with_(batch=16), Layout(2, 2, 1)
    wire, netns = {}, {}
    # a fast link: the bytes are counted, not timed
    with LiveRanks(4, nodes=2, link_bps=2e9) as ranks:
        for nodes in (CONSECUTIVE, ALTERNATE):
            ranks.place(nodes)
            ranks.run(build_layout, lay, config)
            before = ranks.wire_bytes()
            run_layout(ranks, lay, config, steps=1)
            wire[nodes] = ranks.wire_bytes() - before
            netns[nodes] = [w.netns_inode for w in ranks.run(whereabouts)]
    for nodes, inodes in netns.items():  # ranks share a namespace exactly when they share a node
        assert all((inodes[a] == inodes[b]) == (nodes[a] == nodes[b])
                   for a in range(4) for b in range(4)), (nodes, inodes)
    # across: both TP groups send each (b, s, h) activation over the link, each rank its copy
    # once (a 2-rank all-reduce), 4 per block; the DP groups stay inside the nodes
    formula = 2 * 2 * 4 * config.layers * activation_bytes(lay, config)
    assert formula <= wire[ALTERNATE] <= 1.15 * formula + 64 * 1024  # + Ethernet/IP/TCP headers
    # inside: only the DP all-reduce of each rank's gradients crosses (every rank sends them once)
    gradients = 4 * BYTES_PER_FLOAT * stage_parameters(lay, config, 0)
    assert gradients <= wire[CONSECUTIVE] <= 1.15 * gradients + 64 * 1024
    assert wire[CONSECUTIVE] < wire[ALTERNATE] / 4
