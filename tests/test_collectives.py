"""helpers.parallel.collectives: each collective on real ranks equals its one-process definition."""
import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from helpers.parallel import collectives as C
from helpers.ranks import LiveRanks


@pytest.fixture(scope="module")
def live():
    with LiveRanks(4, timeout=30) as group:
        yield group


def test_expected_matches_the_lecture():
    assert C.expected("all_reduce", 4)[2]["after"].tolist() == [6, 10, 14, 18]
    assert [r["after"].tolist() for r in C.expected("reduce_scatter", 4)] == [[6], [10], [14], [18]]
    a2a = C.expected("all_to_all", 2, 2)
    assert a2a[0]["after"].tolist() == [0, 10] and a2a[1]["after"].tolist() == [1, 11]


@pytest.mark.parametrize("world_size, length", [(1, 1), (4, 4), (3, 6), (8, 8)])
def test_every_collective_on_real_ranks_matches_its_definition(live, world_size, length):
    # run_all raises AssertionError on the first rank whose tensor differs from `expected`.
    done = C.run_all(live, world_size, length)
    assert set(done["results"]) == set(C.OPS) and done["skipped"] == []


def test_lengths_that_do_not_split_skip_only_the_splitting_ops(live):
    done = C.run_all(live, 3, 4)
    assert sorted(done["skipped"]) == sorted(C.SPLITTING_OPS)
    assert set(done["results"]) == set(C.OPS) - set(C.SPLITTING_OPS)


def test_all_reduce_is_reduce_scatter_then_all_gather(live):
    live.resize(4)
    for result in live.run(C.all_reduce_two_ways, 8):
        assert torch.equal(result["all_reduce"], result["then_all_gather"])


def test_lecture_example(live):
    live.resize(4)
    got = live.run(C.lecture_example)
    assert [g["all_reduce"] for g in got] == [[6, 10, 14, 18]] * 4
    assert [g["reduce_scatter"] for g in got] == [[6], [10], [14], [18]]


def test_backend_gaps_are_probed_and_the_portable_calls_work(live):
    live.resize(2)
    report = live.run(C.probe_backend)[0]
    assert report["backend"] == "gloo"
    assert report["reduce_scatter_rows (flattened)"] == "works"
    assert report["all_reduce_mean"] == "works"
    # gloo checks dim 0 of a reduce-scatter: the lecture's (w, n) -> (n,) call is refused.
    assert report["reduce_scatter(2-D input (w, n) -> output (n,))"].startswith("fails")


@pytest.mark.parametrize("op, world_size, length, words", [
    ("all_reduce", 2, 0, "length must be an int >= 1"),
    ("scatter", 3, 4, "length must be a multiple of world_size=3"),
    ("allreduce", 2, 4, "op must be one of"),
])
def test_bad_input_is_named(op, world_size, length, words):
    with pytest.raises(ValueError, match=words):
        C.expected(op, world_size, length)


def test_widget_world_size_out_of_range_is_refused_before_resizing(live):
    with pytest.raises(ValueError, match="world_size must be between 1 and 8"):
        C.run_all(live, 9, 4)


def test_drawing_at_the_extremes():
    for world_size, length in [(1, 1), (8, 16)]:
        results = {op: C.expected(op, world_size, length) for op in C.OPS}
        fig = C.draw_many(C.OPS, results)
        assert len(fig.axes) == len(C.OPS)
        assert [ax.get_title() for ax in fig.axes] == list(C.OPS)
