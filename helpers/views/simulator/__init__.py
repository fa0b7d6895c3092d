"""Notebook 06's interactive simulator: pure functions for figures and tables, and a thin
ipywidgets shell that only wires them to controls. One module per concern:

    configuration.py  what is simulated: a configuration (GPU + settings), the ones the app
                      starts with, the GPU under the what-if sliders, the add form's values
    figures.py        MFU, the layout's degrees and the step breakdown against compute
    summary.py        words and tables: a grid point in one line, the largest runs, the download
    app.py            `SimulatorApp` (controls → those functions → outputs), `widget_simulator`

Everything a reader sees is computed by those pure functions from `Curve`s, so the tests call
the same functions (and the app's callbacks) without a browser. Printed text says width,
experts and tokens per batch, never d, s or B: in this course d is the data-parallel degree,
s the sequence length and b the micro-batch (see `helpers.simulator`).

The notebook, tests and benchmarks import every name from here (`helpers.views.simulator`).
"""
from helpers.views.simulator.app import TABS, SimulatorApp, widget_simulator
from helpers.views.simulator.configuration import (GPU_FIELDS, LEVEL_FIELDS, Configuration,
                                                   configuration_from_form,
                                                   default_configurations, form_values,
                                                   from_form_units, same_configuration,
                                                   scaled_gpu, to_form_units)
from helpers.views.simulator.figures import (DEGREES, BreakdownView, breakdown_parts,
                                             breakdown_title, plot_breakdown, plot_degrees,
                                             plot_mfu, same_curve)
from helpers.views.simulator.summary import (SUMMARIES, SummaryCell, SummaryRow, describe,
                                             download_html, summary_html, summary_rows)

__all__ = [
    # configuration.py
    "Configuration", "default_configurations", "scaled_gpu", "GPU_FIELDS", "LEVEL_FIELDS",
    "to_form_units", "from_form_units", "form_values", "configuration_from_form",
    "same_configuration",
    # figures.py
    "same_curve", "plot_mfu", "DEGREES", "plot_degrees", "breakdown_parts", "plot_breakdown",
    "breakdown_title", "BreakdownView",
    # summary.py
    "SummaryCell", "SummaryRow", "SUMMARIES", "summary_rows", "describe", "summary_html",
    "download_html",
    # app.py
    "SimulatorApp", "TABS", "widget_simulator",
]
