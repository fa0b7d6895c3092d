"""Regenerate the static figures of the README and the notebooks.

    python -m figures.make_figures        (or: make figures)

Figures come from the same helpers the notebooks call, so they change when the content does.
"""
import os

from helpers.labs import collectives
from helpers.views.collectives import plot_collectives
from helpers.views.hardware import plot_hierarchy, plot_node

HERE = os.path.dirname(os.path.abspath(__file__))


def hierarchy_figure(path):
    plot_hierarchy(("H100 SXM", "GTX 580")).savefig(path, dpi=100)


def node_figure(path):
    plot_node("H100 SXM", nodes=2).savefig(path, dpi=100)


def collectives_figure(path, world_size=4, length=4):
    results = {op: collectives.expected(op, world_size, length) for op in collectives.OPS}
    fig = plot_collectives(results, title=(
        f"The eight collectives on {world_size} ranks (rank r starts with [0, 1, 2, 3] + r; "
        "all-to-all with 10r + [0, 1, 2, 3])"))
    fig.savefig(path, dpi=90)


FIGURES = {"hierarchy.png": hierarchy_figure, "node.png": node_figure,
           "collectives.png": collectives_figure}


def main():
    for name, make in FIGURES.items():
        path = os.path.join(HERE, name)
        make(path)
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
