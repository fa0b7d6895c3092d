import os
import sys

import pytest

# Rank functions used by tests live in `tests.rank_fns`; spawned ranks import it by name.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def start_ranks():
    """`start_ranks(world_size, **options)`: live ranks (`helpers.ranks.LiveRanks`) for the
    test module that asks, started once per module rather than once per test (a start costs
    seconds), and every group it started closed when the module's tests are done."""
    from helpers.ranks import LiveRanks
    started = []

    def start(world_size: int, **options) -> LiveRanks:
        started.append(LiveRanks(world_size, **options))
        return started[-1]
    yield start
    for live in started:
        live.close()


# -- every figure a test draws is readable ----------------------------------------------------

# The course shows figures at 80 dpi at the least (a widget's blitted PNG; 90 for a widget's
# other pictures, 100 in a notebook's cells): a text of `MIN_TEXT_PT` points or more is at
# least 8 px on the reader's screen.
LOWEST_DPI = 80
MIN_TEXT_PX = 8
MIN_TEXT_PT = MIN_TEXT_PX * 72 / LOWEST_DPI


def small_texts(fig) -> list[str]:
    """The visible texts of `fig` smaller than MIN_TEXT_PX at LOWEST_DPI: 'text' (size pt)."""
    from matplotlib.text import Text
    return [f"{t.get_text()!r} ({t.get_fontsize():g} pt)" for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_TEXT_PT]


@pytest.fixture(autouse=True)
def figures_are_readable(monkeypatch):
    """Each figure made during a test (a view's, or a test's own) is measured afterwards: a
    text smaller than 8 px as the course displays it fails the test."""
    from matplotlib.figure import Figure
    made = []
    original = Figure.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(Figure, "__init__", recording)
    yield
    small = {id(fig): small_texts(fig) for fig in made}
    small = [texts for texts in small.values() if texts]
    assert not small, (f"texts under {MIN_TEXT_PX} px at {LOWEST_DPI} dpi "
                       f"(< {MIN_TEXT_PT:.1f} pt): {small[:3]}")
