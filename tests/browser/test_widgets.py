"""Every notebook's widgets in a real browser, as a student meets them (issue 11).

JupyterLab (started by conftest.py over a temporary copy of notebooks/ and figures/) in headless
Chromium: each notebook is opened and run with Run ▸ Run All Cells, then every control of every
widget is moved to its extremes and the widget's output must change as it should. Screenshots of
each widget after each move go to browser-shots/ (ignored by git) for review.

THE TABLE below is the only thing to edit when a widget changes: a control is found by its label
text (its description, or a Label just before it), the output by the widget's cell. Expectations
the current widgets are known to miss carry `known="why"`: they run and report XFAIL (XPASS once
the widget is fixed; then delete the `known`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Step:
    control: str              # regex (case-insensitive) on the control's label text
    kind: str                 # slider | dropdown | text | checkbox | button | tab | section
    to: str | None = None     # slider: min | max | a readout; dropdown: first | last | an option
    image: bool = True        # the output shows an image afterwards, and a different one
    text: str = ""            # regex the output text matches afterwards; {value} = the new value
    change: bool | None = True  # False: output must stay as it was (waits for a button);
                              # None: either (a button that may find nothing new to show)
    known: str = ""           # why the current widgets miss this expectation (reported as xfail)
    timeout: float = 60       # seconds allowed for the output to change

    @property
    def id(self) -> str:
        name = re.sub(r"[^A-Za-z0-9]+", "_", self.control.split("|")[0]).strip("_") or "ctl"
        return f"{name}-{self.to or 'click'}"


@dataclass(frozen=True)
class Widget:
    notebook: str
    cell: str                 # text in the source of the cell that displays the widget
    steps: tuple[Step, ...]
    race: tuple[Step, ...] = ()   # changed within RACE_WINDOW_S of each other, ranks cold
    race_from: tuple[Step, ...] = ()  # moves (settled) that set the race's starting point
    cold: str = ""            # code run in the kernel before the race so that the ranks are cold
    race_known: str = ""


RANKS = r"(\b{value} ranks?\b|world size\D{{0,3}}{value}\b|\bp\s*=\s*{value}\b)"
NO_RANKS_LINE = "prints no line naming the world size (only the figure shows it)"

WIDGETS = (
    Widget("00_hardware_hierarchy.ipynb", "widget_roofline(", (
        Step(r"^n\b|matrix", "slider", "max", text=r"\bn\s*=\s*{value}\b",
             known="prints verdicts but no line naming n"),
        Step(r"^n\b|matrix", "slider", "min", text=r"\bn\s*=\s*{value}\b",
             known="prints verdicts but no line naming n"),
        Step(r"dtype", "dropdown", "last"),
        Step(r"dtype", "dropdown", "first"),
    )),
    Widget("01_collectives.ipynb", "widget_collectives(", (
        Step(r"world size", "slider", "max", text=RANKS, known=NO_RANKS_LINE, timeout=90),
        Step(r"world size", "slider", "min", text=RANKS, known=NO_RANKS_LINE),
        Step(r"length", "slider", "max"),
        Step(r"length", "slider", "min"),
    )),
    Widget("02_benchmarking_collectives.ipynb", "widget_sweep(", (
        Step(r"operation", "dropdown", "last", image=False, change=False),
        Step(r"world size|^p\b", "slider", "max", image=False, change=False),
        Step(r"log2 n|bytes", "slider", "min", image=False, change=False),
        Step(r"run", "button", text=r"\b\d+ ranks\b", timeout=120),
        Step(r"operation", "dropdown", "first", image=False, change=False),
        Step(r"world size|^p\b", "slider", "min", image=False, change=False),
        Step(r"log2 n|bytes", "slider", "max", image=False, change=False),
        Step(r"run", "button", text=r"\b2 ranks\b", timeout=180),
    )),
    Widget("03_data_parallelism.ipynb", "widget_zero_memory(", (
        Step(r"psi|Ψ|parameters", "slider", "min", image=False,
             text=r"Ψ\s*=\s*1(\.0*)?\s*(e\+0?6|M\b|million)"),
        Step(r"psi|Ψ|parameters", "slider", "max", image=False,
             text=r"Ψ\s*=\s*1(\.0*)?\s*(e\+12|T\b|trillion)"),
        Step(r"^d\b|ranks", "slider", "min", image=False, text=r"\bd\s*=\s*{value}\b"),
        Step(r"^d\b|ranks", "slider", "max", image=False, text=r"\bd\s*=\s*{value}\b"),
        Step(r"stage", "slider", "min", image=False, text=r">\s*plain DP"),
        Step(r"stage", "slider", "max", image=False, text=r">\s*ZeRO-3"),
        Step(r"^K\b|optimi", "slider", "min", image=False, text=r"\b{value} \(optimizer\)"),
        Step(r"^K\b|optimi", "slider", "max", image=False, text=r"\b{value} \(optimizer\)"),
    )),
    Widget("04_tensor_parallelism.ipynb", "widget_when_tp_pays(", (
        Step(r"^t\b|tensor", "slider", "max", text=r"\bt={value}\b"),
        Step(r"^t\b|tensor", "slider", "min", text=r"\bt={value}\b"),
        Step(r"^h\b|hidden", "slider", "min", text=r"\bh={value}\b"),
        Step(r"^h\b|hidden", "slider", "max", text=r"\bh={value}\b"),
        Step(r"b·s|tokens", "slider", "min", text=r"b·s={value}\b"),
        Step(r"b·s|tokens", "slider", "max", text=r"b·s={value}\b"),
        Step(r"link", "dropdown", "last"),   # the text names the link only where t > 1
        Step(r"link", "dropdown", "first"),
    )),
    Widget("05_pipeline_parallelism.ipynb", "widget_pipeline(", (
        Step(r"^p\b|stages|ranks", "slider", "max", text=r"\bp\s*=\s*{value}\b", timeout=90),
        Step(r"^p\b|stages|ranks", "slider", "min", text=r"\bp\s*=\s*{value}\b"),
        Step(r"^m\b|micro", "slider", "max", text=r"\bm\s*=\s*{value}\b"),
        Step(r"^m\b|micro", "slider", "min", text=r"\bm\s*=\s*{value}\b"),
        Step(r"schedule", "dropdown", "last", text=r"{value}",
             known="offers interleaved at m=1, which prints 'not a valid pipeline' and no chart"),
        Step(r"schedule", "dropdown", "first", text=r"{value}"),
    ),
        race=(Step(r"schedule", "dropdown", "gpipe"), Step(r"^m\b|micro", "slider", "8")),
        race_from=(Step(r"^p\b|stages|ranks", "slider", "4"), Step(r"^m\b|micro", "slider", "4"),
                   Step(r"schedule", "dropdown", "1f1b")),  # the widget's defaults
        cold="ranks.close()",
        # Not marked: on this branch widget_pipeline already builds the figure after the run and
        # displays it explicitly, and the race keeps its chart (passed 3 of 3 runs here). Issue 11
        # saw the loss when the figure was flushed by matplotlib's hook; set race_known="why" to
        # mark it expected-to-fail if a widget change brings that back before it is fixed.
        ),
    Widget("06_cost_simulator.ipynb", "widget_simulator(", (
        Step(r"parallelism vs", "tab"),
        Step(r"largest runs", "tab", image=False, text=r"\S"),
        Step(r"step-time|breakdown", "tab"),
        Step(r"grid point", "slider", "min", timeout=30),
        Step(r"grid point", "slider", "max", timeout=30),
        Step(r"MFU", "tab"),
        Step(r"months|duration", "slider", "min", timeout=10,
             known="re-runs only on Run (issue 11 asks to re-run on release)"),
        Step(r"threshold", "slider", "max", timeout=10,
             known="re-runs only on Run (issue 11 asks to re-run on release)"),
        Step(r"^run$", "button", image=False, change=None, text=r"\d+ configurations", timeout=120),
        Step(r"months|duration", "slider", "max", timeout=10,
             known="re-runs only on Run (issue 11 asks to re-run on release)"),
        Step(r"threshold", "slider", "min", timeout=10,
             known="re-runs only on Run (issue 11 asks to re-run on release)"),
        Step(r"^run$", "button", image=False, change=None, text=r"\d+ configurations", timeout=120),
        Step(r"parallelism vs", "tab"),
        Step(r"configuration", "dropdown", "last"),
        Step(r"configuration", "dropdown", "first"),
        Step(r"download|JSON", "button", image=False, text=r"download|\.json"),
        Step(r"add configuration", "section", image=False, change=None),
        Step(r"start from|preset", "dropdown", "last", image=False, change=False),
        Step(r"network levels|levels", "slider", "max", image=False, change=False),
        Step(r"network levels|levels", "slider", "min", image=False, change=False),
        Step(r"^add configuration$", "button", image=False, text=r"added"),
    )),
)

RACE_WINDOW_S = 0.2
BY_NOTEBOOK = {w.notebook: w for w in WIDGETS}


def value_regex(value: str) -> str:
    """A regex for a control's value as text may print it: 16384, 16,384, 16 384 or 16_384."""
    v = " ".join(value.split())
    if re.fullmatch(r"\d{4,}", v):
        head, groups = len(v) % 3 or 3, []
        groups = [v[:head]] + [v[i:i + 3] for i in range(head, len(v), 3)]
        return r"[,\s_\u2009\u202f]?".join(groups)
    return r"\s+".join(re.escape(word) for word in v.split(" "))


def check(step: Step, before: dict, after: dict, value: str) -> list[str]:
    """What is wrong with the output after `step` (empty: it changed as it should)."""
    problems = list(after["errors"])
    if step.change is True and after == before:
        problems.append(f"output did not change within {step.timeout:.0f} s")
    if step.change is False and (after["text"], after["images"]) != (before["text"], before["images"]):
        problems.append("output changed although this control should wait for a button")
    if step.image and step.change is not False:
        if not after["images"]:
            problems.append(f"no image in the output; text: {after['text'][-300:]!r}")
        elif after["images"] == before["images"]:
            problems.append("the image did not change")
    if step.text:
        pattern = step.text.replace("{value}", value_regex(value))
        if not re.search(pattern, after["text"], re.MULTILINE):
            problems.append(f"output text does not match /{pattern}/; text: "
                            f"{after['text'][-400:]!r}")
    return problems


def _cases():
    """The run order: per notebook, Run All, then each step of its table, then its race test."""
    for w in WIDGETS:
        nb = w.notebook[:2]
        yield pytest.param(w.notebook, "run", id=f"{nb}-run_all")
        for i, step in enumerate(w.steps):
            marks = [pytest.mark.xfail(reason=f"current widget: {step.known}", strict=False)] \
                if step.known else []
            yield pytest.param(w.notebook, i, id=f"{nb}-{i:02d}-{step.id}", marks=marks)
        if w.race:
            marks = [pytest.mark.xfail(reason=f"lost-figure race, current widget: {w.race_known}",
                                       strict=False)] if w.race_known else []
            yield pytest.param(w.notebook, "race", id=f"{nb}-race_keeps_figure", marks=marks)


@pytest.mark.parametrize("name,what", list(_cases()))
def test_widgets(course, name, what):
    """One table row: Run All, one move of one control, or the race (see the table above)."""
    nb = course(name)
    if what == "run":
        run_all_clean(nb)
    elif what == "race":
        race_keeps_figure(nb)
    else:
        one_move(nb, what)


def run_all_clean(nb):
    """Run All leaves no traceback, renders the widget, logs no console error."""
    assert nb.run_seconds is not None, nb.run_error
    assert not nb.error_outputs(), nb.error_outputs()
    area = nb.widget_area(BY_NOTEBOOK[nb.name].cell)
    state = nb.state(area)
    nb.screenshot(area, "00-after-run-all")
    assert not state["errors"], "Error displaying widget"
    assert not nb.new_console_errors()


def one_move(nb, index: int):
    """One move of one control to one extreme; the output changes as the table says."""
    widget = BY_NOTEBOOK[nb.name]
    step = widget.steps[index]
    area = nb.widget_area(widget.cell)
    ctl = nb.control(area, step.control, step.kind)
    if step.kind in ("slider", "dropdown") and step.to in ("min", "max", "first", "last"):
        opposite = {"min": "max", "max": "min", "first": "last", "last": "first"}[step.to]
        if _at(nb, ctl, step) and step.change is not False:  # already there: go to the other end first
            nb.act(ctl, step.kind, opposite)
            nb.settle(area, nb.state(area), expect_change=True, timeout=step.timeout)
    before = nb.state(area)
    t0 = time.monotonic()
    value = nb.act(ctl, step.kind, step.to)
    after = nb.settle(area, before, expect_change=step.change is True, timeout=step.timeout,
                      want_image=step.image and step.change is not False)
    print(f"{nb.stem} {step.id} → {value!r}: settled in {time.monotonic() - t0:.1f} s")
    nb.screenshot(area, f"{index:02d}-{step.id}")
    problems = check(step, before, after, value)
    problems += [f"console: {m}" for m in nb.new_console_errors()]
    assert not problems, f"{nb.name} {step.control!r} → {value!r}: " + "; ".join(problems)


def _at(nb, ctl, step: Step) -> bool:
    if step.kind == "slider":
        handle = ctl.locator(".noUi-handle").last if step.to == "max" else \
            ctl.locator(".noUi-handle").first
        now, lo, hi = (float(handle.get_attribute(a))
                       for a in ("aria-valuenow", "aria-valuemin", "aria-valuemax"))
        return now == (lo if step.to == "min" else hi)
    index, n = ctl.locator("select").evaluate("s => [s.selectedIndex, s.options.length]")
    return index == (0 if step.to == "first" else n - 1)


def race_keeps_figure(nb):
    """Two controls changed within RACE_WINDOW_S while the ranks are cold: the widget must end
    with its figure (an <img> in its output), not only the text (issue 11's lost figure)."""
    widget = BY_NOTEBOOK[nb.name]
    area = nb.widget_area(widget.cell)
    for s in widget.race_from:  # the starting point (the widget's defaults)
        ctl = nb.control(area, s.control, s.kind)
        if nb.value_of(ctl, s.kind) != s.to:
            nb.act(ctl, s.kind, s.to)
            nb.settle(area, nb.state(area), timeout=60)
    controls = [nb.control(area, s.control, s.kind) for s in widget.race]
    for ctl, s in zip(controls, widget.race):  # start away from the race's targets
        if nb.value_of(ctl, s.kind) == s.to:
            nb.act(ctl, s.kind, "last" if s.kind == "dropdown" else "min")
            nb.settle(area, nb.state(area), timeout=60)
    if widget.cold:
        nb.kernel_exec(widget.cold)
    inputs = [nb.prepare(ctl, s.kind, s.to) for ctl, s in zip(controls, widget.race)]
    before = nb.state(area)
    t0 = time.monotonic()
    values = [send() for send in inputs]
    spread = time.monotonic() - t0
    assert values == [s.to for s in widget.race], f"controls ended at {values}"
    after = nb.settle(area, before, timeout=60, quiet=3.0, want_image=True)
    nb.screenshot(area, "race")
    assert spread <= RACE_WINDOW_S + 0.3, f"inputs took {spread:.2f} s (want ~{RACE_WINDOW_S} s)"
    assert after != before, "output did not change"
    assert after["images"], (f"figure lost after {values} within {spread:.2f} s: "
                             f"text only: {after['text'][-300:]!r}")
    assert not nb.new_console_errors()
