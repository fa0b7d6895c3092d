import os
import sys

# Rank functions used by tests live in `tests.rank_fns`; spawned ranks import it by name.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
