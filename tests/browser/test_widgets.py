"""Every notebook's widgets in a real browser, as a student meets them (issue 11).

JupyterLab (started by conftest.py over a temporary copy of notebooks/ and figures/) in headless
Chromium: each notebook is opened and run with Run ▸ Run All Cells, then every control of every
widget is moved to each of its extremes once and the widget's output must change as it should.
A screenshot of the widget after Run All and after each move goes to browser-shots/ (ignored by
git) for review. Timings are not asserted here: `python -m benchmarks.browser` measures them.

THE TABLE below is the only thing to edit when a notebook or a widget changes (a new notebook is
one more `Widget(...)`): a control is found by its label text (its description, or a Label just
before it), the output by the widget's cell.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest

from tests.browser.harness import busy_spanned, watch_kernel_status_js


@dataclass(frozen=True)
class Step:
    control: str              # regex (case-insensitive) on the control's label text
    kind: str                 # slider | dropdown | text | checkbox | button | tab | toggle | section
    to: str | None = None     # slider: min | max | a readout; dropdown: first | last | an option;
                              # toggle: the button's text
    image: bool = True        # the output shows an image afterwards, and a different one
    images: int = 1           # ... at least this many images
    text: str = ""            # regex the output text matches afterwards; {value} = the new value
    change: bool | None = True  # False: output must stay as it was (waits for a button);
                              # None: either (a button that may find nothing new to show)
    handle: str | None = None  # range sliders: "low" or "high" (default: the one towards `to`)
    timeout: float = 180      # seconds allowed for the output to change (a safety net: a slow
                              # move under make test's load is slow, not wrong)
    keeps: tuple[tuple[str, str, str], ...] = ()  # (label, kind, value): other controls that
                              # must show this value in the page afterwards

    @property
    def id(self) -> str:
        name = re.sub(r"[^A-Za-z0-9]+", "_", self.control.split("|")[0]).strip("_") or "ctl"
        to = re.sub(r"[^A-Za-z0-9]+", "_", self.to or "click").strip("_")
        return f"{name}-{self.handle + '_' if self.handle else ''}{to}"

    def text_pattern(self, value: str) -> str:
        """`text` with {value} filled in (a regex; "" when the step expects no text)."""
        return self.text.replace("{value}", value_regex(value))


@dataclass(frozen=True)
class Widget:
    notebook: str
    cell: str                 # text in the source of the cell that displays the widget
    steps: tuple[Step, ...]
    shows: str = ""           # regex the widget's text matches right after Run All
    race: tuple[Step, ...] = ()   # changed in quick succession while the ranks are cold
    race_from: tuple[Step, ...] = ()  # moves (settled) that set the race's starting point
    cold: str = ""            # code run in the kernel before the race so that the ranks are cold


RANKS = r"\bworld size {value}\b"   # notebook 01's note names the world size the figure shows

WIDGETS = (
    Widget("00_hardware_hierarchy.ipynb", "widget_roofline(", (
        Step(r"^matrix size", "slider", "max", text=r"\bn = {value}\b"),
        Step(r"^matrix size", "slider", "min", text=r"\bn = {value}\b"),
        Step(r"dtype", "dropdown", "last", text=r"\b{value}\b"),
        Step(r"dtype", "dropdown", "first", text=r"\b{value}\b"),
    ), shows=r"\bn = 1,024\b"),
    Widget("01_collectives.ipynb", "widget_collectives(", (
        Step(r"world size", "slider", "max", text=RANKS),
        Step(r"length", "slider", "max", text=r"\blength {value}\b"),   # 8 ranks × 16: the widest
        Step(r"length", "slider", "min", text=r"\blength {value}\b"),
        Step(r"world size", "slider", "min", text=RANKS),
    ), shows=r"\bworld size 4\b"),
    Widget("02_benchmarking_collectives.ipynb", "widget_sweep(", (
        # controls wait for the button; each run times one message size, at one extreme each
        # (the largest, 256 MiB, with the cheapest operation: one send and one receive)
        Step(r"operation", "dropdown", "first", image=False, change=False),
        Step(r"world size", "slider", "max", image=False, change=False),
        Step(r"message sizes", "slider", "min", handle="high", image=False, change=False),
        Step(r"run sweep", "button", text=r"\b4 ranks\b", timeout=240),
        Step(r"operation", "dropdown", "last", image=False, change=False),
        Step(r"world size", "slider", "min", image=False, change=False),
        Step(r"message sizes", "slider", "max", handle="high", image=False, change=False),
        Step(r"message sizes", "slider", "max", handle="low", image=False, change=False),
        Step(r"run sweep", "button", text=r"\b2 ranks\b", timeout=240),
    )),
    Widget("03_data_parallelism.ipynb", "widget_zero_memory(", (
        Step(r"^Ψ", "slider", "min", image=False, text=r"Ψ = 1e\+06 parameters"),
        Step(r"^Ψ", "slider", "max", image=False, text=r"Ψ = 1e\+12 parameters"),
        Step(r"^d \(", "slider", "min", image=False, text=r"\bd = {value} ranks?\b"),
        Step(r"^d \(", "slider", "max", image=False, text=r"\bd = {value} ranks?\b"),
        Step(r"stage", "slider", "min", image=False, text=r"^>\s*plain DP"),
        Step(r"stage", "slider", "max", image=False, text=r"^>\s*ZeRO-3"),
        Step(r"^K \(", "slider", "min", image=False, text=r"\bK = {value} \(optimizer\)"),
        Step(r"^K \(", "slider", "max", image=False, text=r"\bK = {value} \(optimizer\)"),
    ), shows=r"Ψ = 7\.5e\+09 parameters on d = 64 ranks"),
    Widget("04_tensor_parallelism.ipynb", "widget_when_tp_pays(", (
        Step(r"^t \(", "slider", "max", text=r"\bt={value}\b"),
        Step(r"^t \(", "slider", "min", text=r"\bt={value}\b"),
        Step(r"^h \(", "slider", "min", text=r"\bh={value}\b"),
        Step(r"^h \(", "slider", "max", text=r"\bh={value}\b"),
        Step(r"b·s", "slider", "min", text=r"b·s={value}\b"),
        Step(r"b·s", "slider", "max", text=r"b·s={value}\b"),
        Step(r"GPUs and links", "dropdown", "last"),   # the text names the link only where t > 1
        Step(r"GPUs and links", "dropdown", "first"),
    )),
    Widget("05_pipeline_parallelism.ipynb", "widget_pipeline(", (
        Step(r"^p \(", "slider", "max", text=r"\bp={value}\b"),
        Step(r"^p \(", "slider", "min", text=r"\bp={value}\b"),
        Step(r"^m \(", "slider", "max", text=r"\bm={value}\b"),
        Step(r"^m \(", "slider", "min", text=r"\bm={value}\b"),
        Step(r"schedule", "dropdown", "last", text=r"^{value} p=2 m=2, v=\d+ "),  # m = p: the first m offered
        Step(r"schedule", "dropdown", "first", text=r"^{value} p=2 "),
        # A move of p that changes the schedules offered keeps the schedule chosen (p 4→5,
        # 5→8 through 7→8, 8→5, from 1F1B: each adds or drops "interleaved")
        Step(r"^p \(", "slider", "4", text=r"^gpipe p=4 "),
        Step(r"schedule", "dropdown", "1f1b", text=r"^1f1b p=4 "),
        Step(r"^p \(", "slider", "5", text=r"^1f1b p=5 ", keeps=((r"schedule", "dropdown", "1f1b"),)),
        Step(r"^p \(", "slider", "8", text=r"^1f1b p=8 ", keeps=((r"schedule", "dropdown", "1f1b"),)),
        Step(r"^p \(", "slider", "5", text=r"^1f1b p=5 ", keeps=((r"schedule", "dropdown", "1f1b"),)),
    ),
        shows=r"^1f1b p=4 m=4 \(wait mode\)",
        race=(Step(r"schedule", "dropdown", "gpipe"), Step(r"^m \(", "slider", "max")),
        race_from=(Step(r"^p \(", "slider", "4"), Step(r"^m \(", "slider", "4"),
                   Step(r"schedule", "dropdown", "1f1b")),  # the widget's defaults
        cold="ranks.close()"),
    Widget("06_cost_simulator.ipynb", "widget_simulator(", (
        Step(r"^y axis", "toggle", "MFU ÷ ceiling"),
        Step(r"^y axis", "toggle", "MFU"),
        Step(r"run duration", "slider", "min", text=r"3 configurations, \d+ grid points"),
        Step(r"run duration", "slider", "max", text=r"3 configurations, \d+ grid points"),
        Step(r"threshold", "slider", "max"),
        Step(r"threshold", "slider", "min"),
        Step(r"every latency", "slider", "min"),
        Step(r"every latency", "slider", "max"),
        Step(r"every network bandwidth", "slider", "max"),
        Step(r"every network bandwidth", "slider", "min"),
        Step(r"^GTX 580 dense$", "checkbox", "off", text=r"\b2 configurations\b"),
        Step(r"^GTX 580 dense$", "checkbox", "on", text=r"\b3 configurations\b"),
        # every box unticked, then one ticked back: its curve shows
        Step(r"^H100 SXM dense$", "checkbox", "off", text=r"\b2 configurations\b"),
        Step(r"^H100 SXM sparse", "checkbox", "off", text=r"\b1 configuration,"),
        Step(r"^GTX 580 dense$", "checkbox", "off", image=False, text=r"\b0 configurations\b"),
        Step(r"^GTX 580 dense$", "checkbox", "on", text=r"\b1 configuration,"),
        Step(r"^H100 SXM sparse", "checkbox", "on", text=r"\b2 configurations\b"),
        Step(r"^H100 SXM dense$", "checkbox", "on", text=r"\b3 configurations\b"),
        Step(r"layout vs compute", "tab"),
        Step(r"^configuration$", "dropdown", "last"),
        Step(r"^configuration$", "dropdown", "first"),
        Step(r"largest runs", "tab", image=False, text=r"largest feasible run"),
        Step(r"step breakdown", "tab"),
        Step(r"grid point", "slider", "min"),
        Step(r"grid point", "slider", "max"),
        Step(r"MFU vs compute", "tab"),
        Step(r"add a configuration", "section", image=False, change=None),
        Step(r"start from the preset", "dropdown", "last", image=False, change=False),
        Step(r"network levels", "slider", "max", image=False, change=False),
        Step(r"network levels", "slider", "min", image=False, change=False),
        Step(r"start from the preset", "dropdown", "H100 SXM", image=False, change=False),
        Step(r"^add configuration$", "button",
             text=r"added custom H100 SXM \(= H100 SXM dense\) — same hardware and settings"),
    ), shows=r"3 configurations, \d+ grid points[\s\S]*Download results \(3 configurations, JSON\)"),
    Widget("07_parallelism_3d.ipynb", "widget_parallel3d(", (
        Step(r"d·t·p", "dropdown", "last", image=False, change=False),
        Step(r"^m$", "dropdown", "last", image=False, change=False),
        Step(r"^run ", "button", text=r"median of 3 steps \d+ ms", images=2, timeout=240),  # + Gantt
        Step(r"d·t·p", "dropdown", "first", image=False, change=False),
        Step(r"^m$", "dropdown", "first", image=False, change=False),
        Step(r"^run ", "button", text=r"median of 3 steps \d+ ms", images=2, timeout=240),
    )),
    Widget("08_memory.ipynb", "widget_memory_planner(", (
        # d = 2 (the default) is valid for every model: a new model keeps it
        Step(r"^model$", "dropdown", "last", keeps=((r"^d \(", "slider", "2"),)),
        Step(r"^model$", "dropdown", "first"),
        Step(r"^d \(", "slider", "max"),
        Step(r"^d \(", "slider", "min"),
        Step(r"^ZeRO stage", "toggle", "0"),
        Step(r"^ZeRO stage", "toggle", "3"),
        Step(r"activation checkpointing", "checkbox", "on"),
        Step(r"activation checkpointing", "checkbox", "off"),
        Step(r"^dtypes$", "dropdown", "last"),
        Step(r"^dtypes$", "dropdown", "first"),
    )),
    Widget("09_experts_long_context.ipynb", "widget_experts(", (
        Step(r"experts per token", "toggle", "top-2", text=r"token slots; \d+ dropped"),
        Step(r"experts per token", "toggle", "top-1", text=r"token slots; \d+ dropped"),
        Step(r"capacity factor", "slider", "min", text=r"token slots; [1-9]\d* dropped"),
        Step(r"capacity factor", "slider", "max", text=r"token slots; \d+ dropped"),
        Step(r"router skew", "slider", "max", text=r"the busiest rank computes"),
        Step(r"router skew", "slider", "min", text=r"the busiest rank computes"),
        Step(r"router seed", "slider", "max", text=r"token slots"),
        Step(r"router seed", "slider", "min", text=r"token slots"),
    ), shows=r"token slots; \d+ dropped"),
    Widget("10_planning_a_run.ipynb", "widget_planner(", (
        Step(r"^t \(", "dropdown", "4",
             text=r"^limits broken: interleaved needs m ≥ 16 micro-batches, has 8"),
        Step(r"^t \(", "dropdown", "8", text=r"MFU \d+\.\d% · step \d+\.\d\d s"),
        Step(r"^model$", "dropdown", "last", text=r"MFU \d+\.\d%"),
        Step(r"^model$", "dropdown", "Llama 3 405B", text=r"^memory 75\.7 GB of 80 GB HBM"),
        Step(r"^ZeRO stage", "toggle", "1", text=r"^limits broken: memory 82\.6 GB > 80 GB HBM"),
        Step(r"^ZeRO stage", "toggle", "2", text=r"^limits broken: none"),
        Step(r"^GPUs", "dropdown", "12,288",     # d = 96 does not split the batch of 2048
             text=r"^limits broken: the batch of 2048 sequences must split into d·b = 96"),
        Step(r"^GPUs", "dropdown", "16,384", text=r"MFU 40\.9% · step 6\.64 s"),
    ), shows=r"MFU 40\.9% · step 6\.64 s[\s\S]*limits broken: none"),
)

BY_NOTEBOOK = {w.notebook: w for w in WIDGETS}


def value_regex(value: str) -> str:
    """A regex for a control's value as text may print it: 16384, 16,384, 16 384 or 16_384."""
    v = " ".join(value.split())
    digits = v.replace(",", "")
    if re.fullmatch(r"\d{4,}", digits):
        head = len(digits) % 3 or 3
        groups = [digits[:head]] + [digits[i:i + 3] for i in range(head, len(digits), 3)]
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
        if len(after["images"]) < step.images:
            problems.append(f"{len(after['images'])} images in the output, want {step.images}; "
                            f"text: {after['text'][-300:]!r}")
        elif after["images"] == before["images"]:
            problems.append("the image did not change")
    if step.text:
        pattern = step.text_pattern(value)
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
            yield pytest.param(w.notebook, i, id=f"{nb}-{i:02d}-{step.id}")
        if w.race:
            yield pytest.param(w.notebook, "race", id=f"{nb}-race_keeps_figure")


@pytest.mark.parametrize("name,what", list(_cases()))
def test_widgets(course, name, what):
    """One table row: Run All, one move of one control, or the race (see the table above)."""
    nb = course(name)
    if what == "run":
        run_all_clean(nb)
        return
    # Every later row of a notebook whose Run All failed fails at once, pointing at that row,
    # rather than waiting out each step's timeout on a notebook that never rendered its widget.
    assert nb.run_seconds is not None, f"Run All of {name} failed (its run_all row says why)"
    if what == "race":
        race_keeps_figure(nb)
    else:
        one_move(nb, what)


def run_all_clean(nb):
    """Run All leaves no traceback, renders the widget as the table says, logs no console error."""
    assert nb.run_seconds is not None, nb.run_error
    assert not nb.error_outputs(), nb.error_outputs()
    widget = BY_NOTEBOOK[nb.name]
    area = nb.widget_area(widget.cell)
    state = nb.settle(area, {"text": "", "images": [], "errors": []}, expect_change=False)
    nb.screenshot(area, "00-after-run-all")
    assert not state["errors"], "Error displaying widget"
    if widget.shows:
        assert re.search(widget.shows, state["text"], re.MULTILINE), \
            f"widget text does not match /{widget.shows}/: {state['text'][-400:]!r}"
    assert not nb.new_console_errors()


def one_move(nb, index: int):
    """One move of one control to one extreme; the output changes as the table says."""
    widget = BY_NOTEBOOK[nb.name]
    step = widget.steps[index]
    area = nb.widget_area(widget.cell)
    ctl = nb.control(area, step.control, step.kind)
    if _at(nb, ctl, step):  # already there: go to the other end first
        opposite = {"min": "max", "max": "min", "first": "last", "last": "first",
                    "on": "off", "off": "on"}[step.to]
        start = nb.state(area)  # read before the move: a quick redraw may land before a later read
        nb.act(ctl, step.kind, opposite, step.handle)
        nb.settle(area, start, expect_change=step.change is True, timeout=step.timeout)
    before = nb.state(area)
    t0 = time.monotonic()
    value = nb.act(ctl, step.kind, step.to, step.handle)
    drawn = step.image and step.change is not False
    after = nb.settle(area, before, expect_change=step.change is True, timeout=step.timeout,
                      want_image=drawn, want_new_image=drawn,
                      want_text=step.text_pattern(value) or None, images=step.images)
    print(f"{nb.stem} {step.id} → {value!r}: settled in {time.monotonic() - t0:.2f} s")
    nb.screenshot(area, f"{index:02d}-{step.id}")
    problems = check(step, before, after, value)
    for label, kind, want in step.keeps:
        shown = nb.value_of(nb.control(area, label, kind), kind)
        if shown != want:
            problems.append(f"{label!r} shows {shown!r} afterwards, want {want!r}")
    problems += [f"console: {m}" for m in nb.new_console_errors()]
    assert not problems, f"{nb.name} {step.control!r} → {value!r}: " + "; ".join(problems)


def _at(nb, ctl, step: Step) -> bool:
    """Is the control already where the step moves it (so the move would change nothing)?"""
    if step.kind == "slider" and step.to in ("min", "max") and step.change is not False:
        handle = nb._handle(ctl, step.to, step.handle)
        now, lo, hi = (float(handle.get_attribute(a))
                       for a in ("aria-valuenow", "aria-valuemin", "aria-valuemax"))
        return now == (lo if step.to == "min" else hi)
    if step.kind == "dropdown" and step.to in ("first", "last") and step.change is not False:
        index, n = ctl.locator("select").evaluate("s => [s.selectedIndex, s.options.length]")
        return index == (0 if step.to == "first" else n - 1)
    if step.kind == "checkbox":
        return nb.value_of(ctl, "checkbox") == str(step.to == "on")
    return False


def race_keeps_figure(nb):
    """Two controls changed in quick succession while the ranks are cold (the second while the
    first redraw restarts them): the widget must end with its figure (an <img> in its output),
    not only the text (issue 11's lost figure)."""
    widget = BY_NOTEBOOK[nb.name]
    area = nb.widget_area(widget.cell)
    for s in widget.race_from:  # the starting point (the widget's defaults)
        ctl = nb.control(area, s.control, s.kind)
        if nb.value_of(ctl, s.kind) != s.to:
            start = nb.state(area)  # before the move (a redraw can beat a read after it)
            nb.act(ctl, s.kind, s.to)
            nb.settle(area, start, timeout=180)
    controls = [nb.control(area, s.control, s.kind) for s in widget.race]
    for ctl, s in zip(controls, widget.race):  # start away from the race's targets
        if nb.value_of(ctl, s.kind) == s.to:
            start = nb.state(area)
            nb.act(ctl, s.kind, "last" if s.kind == "dropdown" else "min")
            nb.settle(area, start, timeout=180)
    if widget.cold:
        nb.kernel_exec(widget.cold)
    inputs = [nb.prepare(ctl, s.kind, s.to) for ctl, s in zip(controls, widget.race)]
    before = nb.state(area)
    nb.wait_kernel("idle")
    nb.page.evaluate(watch_kernel_status_js())
    first = nb.page.evaluate("performance.now()")
    for send in inputs:
        send()
    last = nb.page.evaluate("performance.now()")
    values = [nb.value_of(ctl, s.kind) for ctl, s in zip(controls, widget.race)]
    assert all(v == s.to for v, s in zip(values, widget.race) if s.to not in ("min", "max")), \
        f"controls ended at {values}"
    after = nb.settle(area, before, timeout=180, quiet=1.0, want_image=True)
    nb.screenshot(area, "race")
    # The race's condition, read from the page's log of kernel status changes rather than one
    # look at the indicator: the kernel turned busy after the first input and was still busy (the
    # first redraw starts the cold ranks: seconds) when the last input had been sent.
    log = nb.page.evaluate("window.__plabStatus")
    busy = busy_spanned(log, first, last)
    print(f"race inputs sent within {(last - first) / 1000:.2f} s; kernel status log "
          f"{[(round((t - first) / 1000, 2), s) for t, s in log]}")
    assert busy, "the inputs did not overlap the first redraw (the kernel was idle after them)"
    assert after != before, "output did not change"
    assert after["images"], (f"figure lost after {values} within {(last - first) / 1000:.2f} s: "
                             f"text only: {after['text'][-300:]!r}")
    assert not nb.new_console_errors()
