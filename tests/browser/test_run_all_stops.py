"""A Run All that stops early is reported at once, with the traceback.

Where a cell raises, JupyterLab runs none of the cells after it, and a wait for every cell to
show an execution count would only end at its timeout (in one CI run the later rows of such a
notebook then waited out their own timeouts: minutes of nothing). `Notebook.wait_run_all`
instead fails as soon as the kernel is idle with nothing queued and cells left unrun.
"""
from __future__ import annotations

import nbformat
import pytest

from tests.browser.harness import Notebook


def test_a_cell_that_raises_stops_the_wait_with_its_traceback(lab, browser):
    name = "zz_raises.ipynb"
    cells = [nbformat.v4.new_code_cell("x = 1"),
             nbformat.v4.new_code_cell("raise ValueError('planted for the test')"),
             nbformat.v4.new_code_cell("y = 2")]
    nb_file = lab.tmp / "course" / "notebooks" / name
    nbformat.write(nbformat.v4.new_notebook(
        cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python",
                                              "display_name": "Python 3 (ipykernel)"}}),
        str(nb_file))
    nb = Notebook(lab, browser, name)
    try:
        nb.open()
        nb.start_run_all()
        with pytest.raises(AssertionError) as failure:
            nb.wait_run_all(timeout=240)
        message = str(failure.value)
        assert message.startswith("Run All stopped"), message   # not "not finished after 240 s"
        assert "1 of 3 code cells never ran" in message, message
        assert "planted for the test" in message, message
    finally:
        lab.remember_processes()
        nb.close()
