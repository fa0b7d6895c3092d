"""The static figures are produced by code in the repo and can be regenerated."""
import matplotlib

matplotlib.use("Agg")

from figures import make_figures


def test_figures_regenerate(tmp_path):
    for name, make in make_figures.FIGURES.items():
        make(str(tmp_path / name))
        assert (tmp_path / name).stat().st_size > 10_000
