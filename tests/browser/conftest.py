"""One JupyterLab and one headless Chromium for the whole browser session; notebooks in sequence.

Skipped, with the reason, where Debian's Chromium (/usr/bin/chromium) or Python playwright is
missing. At the end: kernels and their rank processes stopped, the port free, the temp folder gone.
"""
from __future__ import annotations

import signal
import time

import pytest

from tests.browser.harness import CHROMIUM, SHOTS, Lab, Notebook, chromium_missing_reason, port_busy

REASON = chromium_missing_reason()


def pytest_report_header(config):
    if REASON:
        return f"browser tests: SKIPPED: {REASON}"
    return f"browser tests: {CHROMIUM} (headless), screenshots in {SHOTS}"


def pytest_collection_modifyitems(config, items):
    if REASON:
        skip = pytest.mark.skip(reason=f"browser tests skipped: {REASON}")
        for item in items:
            if "tests/browser/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if REASON:
        terminalreporter.write_line(f"browser tests SKIPPED: {REASON}", yellow=True, bold=True)


@pytest.fixture(scope="session")
def lab():
    # a SIGTERM (a CI timeout) still runs the teardown below: no orphan JupyterLab or kernels
    previous = signal.signal(signal.SIGTERM, _interrupt)
    server = Lab().start()
    yield server
    port, tmp = server.port, server.tmp
    forced = server.stop()
    assert not forced, f"had to kill: {forced}"
    assert not port_busy(port), f"port {port} still answers after JupyterLab stopped"
    assert not tmp.exists(), f"{tmp} still there"
    signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def browser(lab):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})
        yield context
        for close in (context.close, chromium.close):
            try:
                close()
            except Exception:  # already gone (interrupted run)
                pass


@pytest.fixture(scope="session")
def course(lab, browser):
    """course(name): that notebook, opened and run (Run All) once; the previous one's page is
    closed and its kernel shut down when the tests move on (notebooks in sequence)."""
    current: list[Notebook] = []

    def get(name: str) -> Notebook:
        if current and current[0].name == name:
            return current[0]
        if current:
            lab.remember_processes()
            current.pop().close()
        nb = Notebook(lab, browser, name)
        nb.run_seconds, nb.run_error = None, ""
        t0 = time.monotonic()
        try:
            nb.open()
            nb.run_seconds = nb.run_all()
            lab.remember_processes()
        except Exception as error:  # reported by the Run All row; later rows fail on their own
            nb.run_error = f"open + Run All failed after {time.monotonic() - t0:.0f} s: {error}"
        print(f"\n{name}: Run All {nb.run_seconds or float('nan'):.1f} s")
        current.append(nb)
        return nb

    yield get
    if current:
        lab.remember_processes()
        current.pop().close()
