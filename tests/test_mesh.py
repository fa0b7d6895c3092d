"""helpers.parallel.mesh: coordinates and groups of the 3-D mesh, equal to torch's DeviceMesh."""
import pytest

from helpers.labs.parallel3d import RankPlace, place
from helpers.layout import Coords, Groups, Layout, factorizations
from tests import rank_fns


def NAME(mesh):  # test ids
    return f"d{mesh.d}t{mesh.t}p{mesh.p}"


def test_tp_varies_fastest_then_dp_then_pp():
    mesh = Layout(d=2, t=2, p=2)
    assert mesh.world == 8 and mesh.shape == (2, 2, 2) and Layout.names == ("pp", "dp", "tp")
    assert [tuple(mesh.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert mesh.coords(5) == Coords(dp=0, tp=1, pp=1)
    assert mesh.groups() == Groups(dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                                   tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
                                   pp=[[0, 4], [1, 5], [2, 6], [3, 7]])
    assert mesh.groups_of(6) == Groups(dp=[4, 6], tp=[6, 7], pp=[2, 6])


@pytest.mark.parametrize("mesh", factorizations(12) + [Layout(3, 1, 1), Layout(1, 1, 1)], ids=NAME)
def test_coordinates_and_groups_are_consistent(mesh):
    assert [mesh.rank(*mesh.coords(r)) for r in range(mesh.world)] == list(range(mesh.world))
    for dim, blocks in zip(Groups._fields, mesh.groups()):
        size = getattr(mesh, dim[0])
        # each dimension's groups partition the world into world/size groups of `size`
        assert sorted(r for block in blocks for r in block) == list(range(mesh.world))
        assert all(len(block) == size for block in blocks)
        for block in blocks:  # members differ only in this dimension's coordinate, 0 … size−1
            coords = [mesh.coords(r) for r in block]
            assert [getattr(c, dim) for c in coords] == list(range(size))
            assert len({c._replace(**{dim: 0}) for c in coords}) == 1


def test_factorizations_of_4():
    assert [(m.d, m.t, m.p) for m in factorizations(4)] == [
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def test_bad_degrees_and_worlds_are_refused_naming_them():
    with pytest.raises(ValueError, match="t must be >= 1, got 0"):
        Layout(2, 0, 2)
    with pytest.raises(TypeError, match="p must be an int"):
        Layout(2, 2, 2.0)
    with pytest.raises(ValueError, match=r"world_size must be d·t·p = 2·2·1 = 4, got 8"):
        Layout(2, 2, 1).check_world_size(8)
    with pytest.raises(ValueError, match="rank must be between 0 and 3, got 4"):
        Layout(2, 2, 1).coords(4)


@pytest.fixture(scope="module")
def live(start_ranks):
    return start_ranks(8, backend="gloo", timeout=60)


@pytest.mark.parametrize("mesh", factorizations(4) + [Layout(2, 2, 2)], ids=NAME)
def test_groups_on_live_ranks_equal_device_mesh_groups(live, mesh):
    live.resize(mesh.world)
    got = live.run(rank_fns.mesh_against_device_mesh, mesh.d, mesh.t, mesh.p)
    for rank, result in enumerate(got):
        assert result["ours"] == result["torch"] == mesh.groups_of(rank), rank
        assert tuple(result["torch_coords"]) == (mesh.coords(rank).pp, mesh.coords(rank).dp,
                                                 mesh.coords(rank).tp)


def test_place_reports_each_ranks_coordinates_and_groups(live):
    live.resize(4)
    mesh = Layout(2, 2, 1)
    assert live.run(place, 2, 2, 1) == [
        RankPlace(rank=r, coords=mesh.coords(r), members=mesh.groups_of(r)) for r in range(4)]


def test_a_wrong_world_is_refused_on_the_ranks(live):
    live.resize(4)
    with pytest.raises(Exception, match=r"world_size must be d·t·p = 2·2·2 = 8, got 4"):
        live.run(place, 2, 2, 2)


@pytest.mark.parametrize("mesh", [Layout(2, 2, 2), Layout(4, 1, 1), Layout(1, 1, 1)], ids=NAME)
def test_plot_mesh_draws_every_rank_and_every_link(mesh):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    from helpers.views.mesh import plot_mesh
    fig = plot_mesh(mesh)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    labels = {text.get_text() for text in ax.texts}
    assert {str(r) for r in range(mesh.world)} <= labels
    arrows = [a for a in ax.patches if isinstance(a, FancyArrowPatch)]
    assert len(arrows) == (mesh.p - 1) * mesh.d * mesh.t          # one per PP hop
    assert len(ax.lines) == (mesh.d - 1) * mesh.t * mesh.p        # one per DP neighbour pair
    assert len(ax.get_legend().get_texts()) == 3
