"""What a reader without a kernel sees of each widget: the committed notebooks rendered to HTML
by nbconvert (as GitHub's viewer, a projected notebook before Run All, or a student reading
ahead would see them). A widget whose first view is a figure shows that figure; a run button or
printed text shows one line saying to run the cells above; no Python repr anywhere."""
from __future__ import annotations

import html
import pathlib
import re

import nbformat
import pytest
from nbconvert import HTMLExporter

from helpers.views.kit import RUN_FIRST

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
# notebook: (the call that displays its widget, what a reader without a kernel sees)
WIDGETS = {
    "00": ("widget_roofline(", "figure"),
    "01": ("widget_collectives(", "figure"),
    "02": ("widget_sweep(", "line"),        # a run button: nothing drawn until it is pressed
    "03": ("widget_zero_memory(", "line"),  # printed text
    "04": ("widget_when_tp_pays(", "figure"),
    "05": ("widget_pipeline(", "figure"),
    "06": ("widget_simulator(", "figure"),
    "07": ("widget_parallel3d(", "line"),   # a run button
    "08": ("widget_memory_planner(", "figure"),
    "09": ("widget_experts(", "figure"),
    "10": ("widget_planner(", "figure"),
}
# What ipywidgets prints for a widget where nothing renders it: "VBox(children=(…".
REPR = re.compile(r"\b(VBox|HBox|Tab|interactive|Output)\(children=")


def _rendered_cell(page: str, cell_id: str) -> str:
    """One cell of the rendered page (nbconvert's lab template: a div per cell, its id
    "cell-id=…"), up to the next cell."""
    start = page.index(f'id="cell-id={cell_id}"')
    end = page.find('id="cell-id=', start + 1)
    return page[start:end if end >= 0 else len(page)]


@pytest.fixture(scope="module")
def exporter():
    return HTMLExporter()


@pytest.mark.parametrize("number", sorted(WIDGETS))
def test_a_widget_reads_without_a_kernel(number, exporter):
    (path,) = NOTEBOOKS.glob(f"{number}_*.ipynb")
    notebook = nbformat.read(path, as_version=4)
    page, _ = exporter.from_notebook_node(notebook)
    assert not REPR.search(page), f"{path.name} shows a widget's repr: {REPR.search(page)[0]}"
    call, kind = WIDGETS[number]
    (cell,) = [c for c in notebook.cells if c.cell_type == "code"
               and call in c.source.strip().splitlines()[-1]]
    assert cell.outputs, f"{path.name}: the cell that calls {call} is committed unexecuted"
    rendered = _rendered_cell(page, cell.id)
    shown = rendered[rendered.find("jp-OutputArea"):]
    if kind == "figure":
        assert re.search(r'<img[^>]+src="data:image/png;base64,', shown), \
            f"{path.name}: {call} shows no picture"
        assert html.escape(RUN_FIRST) not in shown
    else:
        assert html.escape(RUN_FIRST) in shown, f"{path.name}: {call} does not say to run"
        assert "<img" not in shown
