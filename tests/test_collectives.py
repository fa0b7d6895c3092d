"""helpers.labs.collectives (on helpers.parallel.collectives): each collective on real ranks equals its one-process definition."""
import numpy as np
import pytest
import torch

from helpers.labs import collectives as C
from helpers.parallel.groups import group_rank, split_groups
from helpers.views.collectives import plot_collectives

PAIRS = [[0, 1], [2, 3]]


def in_pairs(rank, world_size, length):
    """Rank function: every collective inside this rank's pair of PAIRS, side by side."""
    group = split_groups(PAIRS)
    results = {op: C.run_collective(rank, world_size, op, length, group=group) for op in C.OPS}
    return {"group_rank": group_rank(group), "results": results,
            "two_ways": C.all_reduce_two_ways(rank, world_size, length, group=group),
            "probe": C.probe_backend(rank, world_size, group=group)}


@pytest.fixture(scope="module")
def live(start_ranks):
    return start_ranks(4, timeout=30)


def test_expected_matches_the_lecture():
    assert C.expected("all_reduce", 4)[2].after.tolist() == [6, 10, 14, 18]
    assert [r.after.tolist() for r in C.expected("reduce_scatter", 4)] == [[6], [10], [14], [18]]
    a2a = C.expected("all_to_all", 2, 2)
    assert a2a[0].after.tolist() == [0, 10] and a2a[1].after.tolist() == [1, 11]


@pytest.mark.parametrize("world_size, length", [(1, 1), (4, 4), (3, 6), (8, 8)])
def test_every_collective_on_real_ranks_matches_its_definition(live, world_size, length):
    # run_all raises AssertionError on the first rank whose tensor differs from `expected`.
    done = C.run_all(live, world_size, length)
    assert set(done.results) == set(C.OPS) and done.skipped == ()


def test_lengths_that_do_not_split_skip_only_the_splitting_ops(live):
    done = C.run_all(live, 3, 4)
    assert sorted(done.skipped) == sorted(C.SPLITTING_OPS)
    assert set(done.results) == set(C.OPS) - set(C.SPLITTING_OPS)


@pytest.mark.parametrize("length", [2, 4])
def test_two_groups_of_two_each_match_the_two_rank_definition(live, length):
    live.resize(4)
    got = live.run(in_pairs, length)
    for members in PAIRS:
        mine = [got[r] for r in members]
        assert [g["group_rank"] for g in mine] == [0, 1]
        for op in C.OPS:
            wrong = C.mismatch([g["results"][op] for g in mine], C.expected(op, 2, length))
            assert wrong is None, f"pair {members} {op}: {wrong}"
        for g in mine:
            assert torch.equal(g["two_ways"]["all_reduce"], g["two_ways"]["then_all_gather"])
            assert torch.equal(g["two_ways"]["all_reduce"],
                               C.expected("all_reduce", 2, length)[0].after)
            assert g["probe"]["all_reduce_mean"] == "works"


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
    ("all_reduce", 2, 0, "length must be >= 1, got 0"),
    ("scatter", 3, 4, r"length must be a multiple of 3 \(scatter cuts"),
    ("allreduce", 2, 4, "op must be one of"),
])
def test_bad_input_is_named(op, world_size, length, words):
    with pytest.raises(ValueError, match=words):
        C.expected(op, world_size, length)


def test_world_size_out_of_range_is_refused_before_resizing(live):
    live.resize(4)
    with pytest.raises(ValueError, match="world_size must be between 1 and"):
        C.run_all(live, 0, 4)
    with pytest.raises(ValueError, match="op must be one of"):
        C.run_all(live, 2, 4, ops=("allreduce",))
    assert live.world_size == 4


@pytest.mark.parametrize("world_size, length", [(1, 1), (8, 8), (8, 16), (2, 16)])
def test_drawing_at_the_extremes_stays_legible(world_size, length):
    from helpers.views.collectives import DIGIT_CELLS, MIN_DIGIT_PT
    results = {op: C.expected(op, world_size, length) for op in C.OPS
               if not (op in C.SPLITTING_OPS and length % world_size)}
    fig = plot_collectives(results)
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(results)
    for ax, op in zip(fig.axes, results):
        digits = [t for t in ax.texts if t.get_text().isdigit()]
        assert all(t.get_fontsize() >= MIN_DIGIT_PT for t in digits)
        # a block without digits says why, under the panel
        if not digits or len(digits) < sum(np.isfinite(im.get_array()).sum() for im in ax.images):
            assert any("chunks of" in t.get_text() or "too small for digits" in t.get_text()
                       for t in ax.texts), op
        after = ax.images[1].get_extent()
        assert after[1] - after[0] <= max(length, DIGIT_CELLS) + 1e-9   # long rows are shrunk
    if world_size * length > DIGIT_CELLS:   # gather's 32-64 cells: chunked, no digits
        gather = fig.axes[list(results).index("gather")]
        assert any("chunks of" in t.get_text() for t in gather.texts)


def test_the_figure_title_has_room_of_its_own():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    results = {op: C.expected(op, 4, 4) for op in C.OPS}
    fig = plot_collectives(results, title="The eight collectives")
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes[:2]:
        assert ax.title.get_window_extent(renderer).y1 < title.y0


def test_the_widget_draws_on_live_ranks_at_its_extremes(live):
    from helpers.views.collectives import (MAX_LENGTH, MAX_WORLD_SIZE, CollectivesView,
                                           widget_collectives)
    box = widget_collectives(live)
    size, length = box.children[0].children
    note, image = box.children[1], box.children[2]
    assert size.max == MAX_WORLD_SIZE and length.max == MAX_LENGTH
    assert not size.continuous_update and not length.continuous_update
    size.value = 3                 # length 4 does not split in 3: the splitting ops are skipped
    assert live.world_size == 3 and "Skipped scatter" in note.value
    view = CollectivesView(live)
    for world_size, n in [(1, 1), (MAX_WORLD_SIZE, 8), (2, MAX_LENGTH)]:
        picture, text = view.update(world_size, n)
        assert picture[:4] == b"\x89PNG" and f"world size {world_size}" in text
        assert live.world_size == world_size
    assert view.update(2, MAX_LENGTH)[0] is picture     # drawn once per (world size, length)
