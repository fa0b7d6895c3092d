"""JupyterLab's "Select Kernel" dialog, which once swallowed Run All's clicks in a CI run.

Under load, a Run All clicked while a just-opened notebook still had no kernel tried to start a
second one, and that failed into the modal dialog. The harness now waits for a kernel before Run
All and answers the dialog with the notebook's own kernel. Here the dialog is brought up on
purpose (Kernel ▸ Shut Down, then Kernel ▸ Change Kernel…) and Run All must still run every cell.
"""
from __future__ import annotations

from tests.browser.harness import KERNEL_DISPLAY_NAME, Notebook

NOTEBOOK = "00_hardware_hierarchy.ipynb"  # the quickest to run



def test_a_select_kernel_dialog_before_run_all_is_answered_with_the_notebooks_kernel(lab, browser):
    nb = Notebook(lab, browser, NOTEBOOK)
    try:
        nb.open()
        # The kernel just started can be busy again a moment after it first read idle (the
        # page's own start-up requests): wait for the state, never sample it once.
        nb.wait_kernel("idle", timeout=60)
        nb.menu("Kernel", "Shut Down Kernel")
        nb.wait_kernel("no kernel", timeout=60)
        nb.menu("Kernel", "Change Kernel")
        nb.page.locator(".jp-Dialog").wait_for(timeout=30_000)

        nb.start_run_all()
        nb.wait_run_all(timeout=120)

        assert nb.dialogs and nb.dialogs[0].startswith("Select Kernel"), nb.dialogs
        assert nb.page.locator(".jp-Dialog").count() == 0
        assert nb.page.locator(".jp-KernelName").inner_text().strip() == KERNEL_DISPLAY_NAME
        assert not nb.error_outputs(), nb.error_outputs()
    finally:
        lab.remember_processes()
        nb.close()
