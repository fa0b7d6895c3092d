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
