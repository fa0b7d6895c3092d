"""Two network levels: the hierarchical all-reduce against dist.all_reduce (flat ranks and
2 emulated nodes × 2 ranks), its arithmetic (bytes per node uplink, predicted times) by hand,
and those bytes against what the link's shapers counted."""
import pytest
import torch
import torch.distributed as dist

from helpers.cost import alpha_beta as ab
from helpers.cost import bench as cost
from helpers.labs import bench as lab
from helpers.launch import cluster
from helpers.parallel.hierarchical import hierarchical_all_reduce, node_groups

MISSING = cluster.missing()
LINK_BPS = 400e6          # given, so that no loopback measurement runs first
CONSECUTIVE, ALTERNATING = (0, 0, 1, 1), (0, 1, 0, 1)


def both_sums(rank, world_size, placement, numel):
    """Rank function: dist.all_reduce and the hierarchical all-reduce of the same random
    inputs, as the largest difference between them (exact: on integers) and allclose (on
    random floats, summed in another order)."""
    inside, across = node_groups(placement)
    generator = torch.Generator().manual_seed(rank)
    out = []
    for x in (torch.randint(-1000, 1000, (numel,), generator=generator).float(),
              torch.randn(numel, generator=generator)):
        flat, hier = x.clone(), x.clone()
        dist.all_reduce(flat)
        hierarchical_all_reduce(hier, inside, across)
        out.append((flat, hier))
    (flat_int, hier_int), (flat, hier) = out
    return float((flat_int - hier_int).abs().max()), torch.allclose(flat, hier, atol=1e-5)


# -- the arithmetic, by hand ------------------------------------------------------------

def test_blocks_and_crossings_of_a_placement():
    assert ab.node_blocks(CONSECUTIVE) == [[0, 1], [2, 3]]
    assert ab.node_blocks(ALTERNATING) == [[0, 2], [1, 3]]
    assert ab.cross_blocks(CONSECUTIVE) == [[0, 2], [1, 3]]
    assert ab.cross_blocks((0, 0, 0, 1, 1, 1)) == [[0, 3], [1, 4], [2, 5]]
    # the ring 0→1→2→3→0: consecutive leaves each node once; alternating at every hop
    assert ab.ring_crossings(CONSECUTIVE) == [1, 1]
    assert ab.ring_crossings(ALTERNATING) == [2, 2]
    assert ab.ring_crossings((0, 0, 1, 1, 2, 2)) == [1, 1, 1]


def test_uplink_bytes_flat_and_hierarchical():
    n = 1000
    # flat: 2(P−1)/P · n per hop that leaves the node, P = 4
    assert ab.flat_uplink_bytes(n, CONSECUTIVE) == [1500, 1500]
    assert ab.flat_uplink_bytes(n, ALTERNATING) == [3000, 3000]
    # hierarchical: 2 shards of n/2, each all-reduced over N = 2 nodes: 2 · 1 · n/2 per node
    assert ab.hierarchical_uplink_bytes(n, CONSECUTIVE) == [1000, 1000]
    assert ab.hierarchical_uplink_bytes(n, ALTERNATING) == [1000, 1000]
    # 4 nodes of 2: flat 2·7/8 n per node; hierarchical 2·3/4 n
    four = (0, 0, 1, 1, 2, 2, 3, 3)
    assert ab.flat_uplink_bytes(n, four) == [1750] * 4
    assert ab.hierarchical_uplink_bytes(n, four) == [1500] * 4


def test_predicted_times_by_hand():
    link = ab.Fit("all_reduce", 1e-4, 1e-8)          # 100 µs, 100 MB/s
    inside = {"reduce_scatter": ab.Fit("reduce_scatter", 5e-5, 1e-9),
              "all_gather": ab.Fit("all_gather", 2e-5, 2e-9)}
    n = 4e6
    # flat on 4 ranks: 6 steps of α + c · n/4 · β
    assert ab.predict_flat_all_reduce(n, CONSECUTIVE, link) == pytest.approx(6 * (1e-4 + 1e6 * 1e-8))
    assert ab.predict_flat_all_reduce(n, ALTERNATING, link) == pytest.approx(6 * (1e-4 + 2e6 * 1e-8))
    # hierarchical: rs(k=2): α + n/2 β_in; across: 2α + n β; ag(k=2): α + n/2 β_in
    expected = (5e-5 + 2e6 * 1e-9) + (2e-4 + 4e6 * 1e-8) + (2e-5 + 2e6 * 2e-9)
    assert ab.predict_hierarchical_all_reduce(n, CONSECUTIVE, inside, link) == pytest.approx(expected)


@pytest.mark.parametrize("placement, words", [
    ((0, 0, 1), "as many ranks on every node"), ((0,), "as many ranks"), ((0, True), "as many"),
    ((1, 1, 2, 2), "as many ranks on every node"), ((0, -1), "as many"),
])
def test_a_bad_placement_is_named(placement, words):
    with pytest.raises(ValueError, match=words):
        ab.node_blocks(placement)


def test_predictions_refuse_what_has_no_second_level():
    link = ab.Fit("all_reduce", 1e-4, 1e-8)
    with pytest.raises(ValueError, match="no hop crosses"):
        ab.predict_flat_all_reduce(1e6, (0, 0, 0, 0), link)
    with pytest.raises(ValueError, match="2 or more ranks"):
        ab.predict_hierarchical_all_reduce(1e6, (0, 1), {}, link)


def test_level_fits_and_their_benchmark_records():
    def timing(level_p, n, t):
        return cost.Timing("all_reduce", level_p, n, "gloo", (t,) * 10, 1)
    alpha, beta = 2e-4, 1e-8
    records = {cost.INSIDE: [timing(2, n, 2 * alpha + n * beta / 10) for n in (1024, 2**20)],
               cost.ACROSS: [timing(2, n, 2 * alpha + n * beta) for n in (1024, 2**20)]}
    inside, across = cost.level_fits(records)
    assert (inside.level, across.level) == ("loopback", "link")
    assert across.alpha_s == pytest.approx(alpha) and across.beta_s_per_byte == pytest.approx(beta)
    assert across.median_rel_error == pytest.approx(0, abs=1e-9)
    assert across.busbw_GBps == pytest.approx(2**20 / (2 * alpha + 2**20 * beta) / 1e9)
    assert across.as_record() == {"level": "link", "alpha_s": across.alpha_s,
                                  "beta_s_per_byte": across.beta_s_per_byte,
                                  "median_rel_error": across.median_rel_error}


def test_flat_vs_hierarchical_ratio_uses_the_fast_mode():
    # 10 calls each; the 10th percentile of 10 lies between the fastest two
    run = cost.FlatVsHierarchical((0, 0, 1, 1), 1024, (0.1,) * 9 + (1.0,), (0.05,) * 10, 0.0)
    assert run.ratio == pytest.approx(0.5)


# -- on live ranks ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def flat(start_ranks):
    return start_ranks(4)


@pytest.mark.parametrize("placement", [CONSECUTIVE, ALTERNATING])
def test_hierarchical_equals_all_reduce_on_the_flat_network(flat, placement):
    for difference, close in flat.run(both_sums, placement, 1000):
        assert difference == 0.0 and close


def test_a_buffer_that_does_not_split_over_the_node_is_refused(flat):
    def odd(rank, world_size):
        inside, across = node_groups(CONSECUTIVE)
        try:
            hierarchical_all_reduce(torch.ones(7), inside, across)
        except ValueError as e:
            return str(e)
    assert all("2 equal shards" in said for said in flat.run(odd))


@pytest.fixture(scope="module")
def on_nodes(start_ranks):
    if MISSING:
        pytest.skip(MISSING)
    return start_ranks(4, nodes=2, link_bps=LINK_BPS)


def test_the_benchmarks_functions_answer_in_their_shapes(on_nodes):
    assert on_nodes.placement == CONSECUTIVE   # runs first: no restart
    small = {cost.INSIDE: (1024, 65536), cost.ACROSS: (1024, 512 * 1024)}
    levels = lab.measure_levels(on_nodes, ("all_reduce",), small, iters=3)
    assert [t.bytes for t in levels[cost.INSIDE]] == [1024, 65536]
    assert {t.world_size for level in levels.values() for t in level} == {2}
    records = [f.as_record() for f in cost.level_fits(levels)]
    assert [r["level"] for r in records] == ["loopback", "link"]
    assert all(r["alpha_s"] >= 0 and r["beta_s_per_byte"] >= 0 and r["median_rel_error"] >= 0
               for r in records)
    run = lab.measure_flat_and_hierarchical(on_nodes, 256 * 1024, iters=2)
    assert run.max_abs_difference == 0.0 and len(run.flat_s) == len(run.hierarchical_s) == 2
    assert run.ratio > 0


def test_on_two_nodes_hierarchical_equals_all_reduce_and_the_link_counts_the_formulas_bytes(on_nodes):
    # The first measured byte counts of the course: the kernel's shapers against the formulas,
    # with 0–15 % on top for Ethernet, IP and TCP headers (≈ 5 % on a 1500-byte MTU) and the
    # receivers' acknowledgements. The
    # consecutive placement first (the ranks' own), then one restart for the alternating one.
    n = 512 * 1024
    for placement in (CONSECUTIVE, ALTERNATING):
        on_nodes.place(placement)
        assert lab.placement_of(on_nodes) == placement
        for difference, close in on_nodes.run(both_sums, placement, 1000):
            assert difference == 0.0 and close
        hierarchical = lab.wire_bytes_per_all_reduce(on_nodes, n, hierarchical=True, calls=2)
        assert 1.0 < hierarchical / sum(ab.hierarchical_uplink_bytes(n, placement)) < 1.15
        if placement == CONSECUTIVE:  # the alternating flat ring's bytes: tests/test_cluster.py
            flat = lab.wire_bytes_per_all_reduce(on_nodes, n, hierarchical=False, calls=2)
            assert 1.0 < flat / sum(ab.flat_uplink_bytes(n, placement)) < 1.15
    assert on_nodes.cluster.drops() == 0


def test_on_the_flat_network_nothing_is_counted(flat):
    assert lab.placement_of(flat) == CONSECUTIVE   # two pretend nodes, both on loopback
    assert lab.wire_bytes_per_all_reduce(flat, 1024, hierarchical=False) is None
