"""One JupyterLab and one headless Chromium for the whole browser session.

Notebooks are tested in the order of the table (tests/browser/test_widgets.py), and while one is
tested the next AHEAD are already open and running (Run All started in their own pages and
kernels), so their kernels' time overlaps the moves and the waits of the one under test.
Skipped, with the reason (shown by `-rs` in the summary), where Debian's Chromium
(/usr/bin/chromium) or Python playwright is missing. At the end: kernels and their rank
processes stopped, the port free, the temp folder gone.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.browser.harness import (CHROMIUM, SHOTS, Lab, Notebook, chromium_missing_reason,
                                   descendants, lower_session_priority, port_busy)

REASON = chromium_missing_reason()
# Notebooks running ahead of the one under test (0: one at a time). Two keep both cores of a
# 2-core machine busy without starving the widget under test.
AHEAD = int(os.environ.get("PLAB_BROWSER_AHEAD", "2"))


def pytest_report_header(config):
    if REASON:
        return f"browser tests: SKIPPED: {REASON}"
    return f"browser tests: {CHROMIUM} (headless), screenshots in {SHOTS}"


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if _ours(item)]
    if REASON:
        skip = pytest.mark.skip(reason=f"browser tests skipped: {REASON}")
        for item in ours:
            item.add_marker(skip)


def _ours(item) -> bool:
    return "tests/browser/" in str(item.fspath).replace("\\", "/")


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
        for pid in descendants(os.getpid()):   # Chromium's own session
            if Path(f"/proc/{pid}/comm").read_text().strip() == "chromium":
                lower_session_priority(pid)
                break
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})
        yield context
        for close in (context.close, chromium.close):
            try:
                close()
            except Exception:  # already gone (interrupted run)
                pass


class Course:
    """The notebooks of the session, each opened and Run All started AHEAD of its tests."""

    def __init__(self, lab: Lab, context, order: list[str]):
        self.lab, self.context, self.order = lab, context, order
        self.open: dict[str, Notebook] = {}   # started, not yet closed
        self.done: set[str] = set()

    def _start(self, name: str) -> None:
        nb = Notebook(self.lab, self.context, name)
        nb.run_seconds, nb.run_error = None, ""
        try:
            nb.open()
            nb.start_run_all()
        except Exception as error:  # reported by the Run All row; later rows fail on their own
            nb.run_error = (f"open + Run All failed: {error}\ndialogs: {nb.dialogs}\n"
                            f"JupyterLab's log ends:\n{self.lab.log_tail()}")
        self.open[name] = nb

    def get(self, name: str) -> Notebook:
        """That notebook, run (Run All) to the end; the notebooks before it are closed, with
        their kernels, and the next AHEAD are started."""
        for other in [n for n in self.open if n != name and self.order.index(n) < self.order.index(name)]:
            self.close(other)
        index = self.order.index(name)
        for ahead in self.order[index:index + 1 + AHEAD]:
            if ahead not in self.open and ahead not in self.done:
                self._start(ahead)
        nb = self.open[name]
        if nb.run_seconds is None and not nb.run_error:
            t0 = time.monotonic()
            try:
                nb.run_seconds = nb.wait_run_all()
            except Exception as error:
                nb.run_error = f"Run All failed after {time.monotonic() - t0:.0f} s: {error}"
            self.lab.remember_processes()
            print(f"\n{name}: Run All done {nb.run_seconds or float('nan'):.1f} s after it "
                  f"started ({time.monotonic() - t0:.1f} s waited here)")
        return nb.front()

    def close(self, name: str) -> None:
        self.lab.remember_processes()
        self.open.pop(name).close()
        self.done.add(name)

    def close_all(self) -> None:
        for name in list(self.open):
            self.close(name)


@pytest.fixture(scope="session")
def course(request, lab, browser):
    """course(name): that notebook, opened and run (Run All) once."""
    order: list[str] = []   # the notebooks in the order their (selected) tests run
    for item in request.session.items:
        name = _ours(item) and getattr(item, "callspec", None) and item.callspec.params.get("name")
        if name and name not in order:
            order.append(name)
    course = Course(lab, browser, order)
    yield course.get
    course.close_all()
