"""Regenerate the static figures of the README and the notebooks.

    python -m figures.make_figures        (or: make figures)

Figures come from the same helpers the notebooks call, so they change when the content does.
"""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from helpers import hierarchy  # noqa: E402
from helpers.parallel import collectives

HERE = os.path.dirname(os.path.abspath(__file__))


def hierarchy_figure(path):
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    hierarchy.draw("H100 SXM", ax=axes[0])
    hierarchy.draw("GTX 580", ax=axes[1])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collectives_figure(path, world_size=4, length=4):
    results = {op: collectives.expected(op, world_size, length) for op in collectives.OPS}
    fig = collectives.draw_many(collectives.OPS, results)
    fig.suptitle(f"The eight collectives on {world_size} ranks (rank r starts with [0,1,2,3] + r; "
                 "all-to-all with 10r + [0,1,2,3])", y=1.0)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main():
    for name, make in (("hierarchy.png", hierarchy_figure), ("collectives.png", collectives_figure)):
        path = os.path.join(HERE, name)
        make(path)
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
