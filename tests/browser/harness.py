"""JupyterLab in headless Chromium, as a student meets the notebooks: the machinery the browser tests
(tests/browser/test_widgets.py) and the benchmark (benchmarks/browser.py) share.

`Lab` starts JupyterLab on 127.0.0.1 (free port, token) over a throw-away COPY of notebooks/ and
figures/, with throw-away settings (autosave off), workspaces and runtime folders, and stops it with
every kernel and rank process it started. `Notebook` opens one notebook, runs all its cells from the
Run menu and finds widget controls by their label text and the widget's output by its area.

Chromium is Debian's (/usr/bin/chromium), driven by Python playwright: nothing downloads a browser.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("PLAB_CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "browser-shots"
# the kernel the notebooks name (tests/jupyter/kernels/python3/kernel.json), as JupyterLab shows it
KERNEL_DISPLAY_NAME = "Python 3 (ipykernel)"

# JupyterLab settings for the test: never autosave (the copy is thrown away anyway), every cell in
# the DOM (no windowing, so cells are found by their text), no news or update toasts over the page.
SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright not installed (pip install -r requirements.txt)"
    return None


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_busy(port: int) -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (kernels, their rank processes), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def lower_session_priority(pid: int) -> None:
    """Under make test (PLAB_SESSION_NICE set, beside the unit tests) lower the scheduling group
    of `pid`'s session as tests/jupyter's kernel does its own. JupyterLab and Chromium start
    sessions of their own, and where Linux schedules by session (autogroup) nice alone does not
    reach them: each would get as much CPU as all the unit tests together."""
    nice = int(os.environ.get("PLAB_SESSION_NICE", "0"))
    if nice > 0:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        except OSError:   # no autogroup: the inherited nice is what counts
            pass


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Lab:
    """One JupyterLab server for a whole test session, over a temporary copy of the course."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="plab-browser-"))
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.known_pids: set[int] = set()
        self.log_path = self.tmp / "jupyterlab.log"

    # -- server
    def start(self, timeout: float = 60) -> "Lab":
        root = self.tmp / "course"
        for folder in ("notebooks", "figures"):
            shutil.copytree(ROOT / folder, root / folder,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        app_settings, user_settings = self.tmp / "app-settings", self.tmp / "user-settings"
        app_settings.mkdir()
        (app_settings / "overrides.json").write_text(json.dumps(SETTINGS, indent=1))
        for plugin, values in SETTINGS.items():  # the user level too, so no level autosaves
            package, name = plugin.split(":")
            path = user_settings / package / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ,
                   JUPYTERLAB_SETTINGS_DIR=str(user_settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.tmp / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self.tmp / "runtime"),
                   JUPYTER_CONFIG_DIR=str(self.tmp / "config"),
                   IPYTHONDIR=str(self.tmp / "ipython"),
                   MPLCONFIGDIR=str(self.tmp / "mpl"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={root}", f"--LabApp.app_settings_dir={app_settings}",
               "--ServerApp.disable_check_xsrf=False", "--LabApp.news_url=None",
               "--ServerApp.shutdown_no_activity_timeout=0"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        lower_session_priority(self.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited:\n{self.log_tail(3000)}")
            try:
                self.api("status")
                return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"JupyterLab did not answer in {timeout} s:\n"
                           f"{self.log_tail(3000)}")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def remember_processes(self) -> None:
        """Note every process under the server now (kernels and their ranks) for `stop`."""
        if self.proc is not None:
            self.known_pids.update(descendants(self.proc.pid))

    def stop(self) -> list[str]:
        """Shut down kernels, the server, any process left below them; remove the temp folder.
        Returns what had to be forced (empty when everything went quietly)."""
        forced: list[str] = []
        if self.proc is not None:
            self.remember_processes()
            try:
                for kernel in self.api("kernels"):
                    self.api(f"kernels/{kernel['id']}", method="DELETE")
            except OSError:
                pass
            self.remember_processes()
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    forced.append("jupyterlab server (SIGKILL)")
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(alive(p) for p in self.known_pids):
                time.sleep(0.2)
            for pid in sorted(self.known_pids):
                if alive(pid):
                    forced.append(f"pid {pid} (SIGKILL)")
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.log.close()
            self.proc = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        return forced


# --- the page side ---------------------------------------------------------------------------------

# Find a control by its label text: the widget's own description, or a Label/HTML widget right
# before it in the same box. Marks the match with data-plab-id so Python can address it.
FIND_CONTROL_JS = r"""
([root, pattern, kind, id]) => {
  const re = new RegExp(pattern, 'i');
  const KINDS = {
    slider: '.widget-slider, .widget-hslider',
    dropdown: '.widget-dropdown',
    text: '.widget-text, .widget-inline-hbox:has(> input[type=number])',
    checkbox: '.widget-checkbox',
    button: 'button.jupyter-button',
    tab: '.lm-TabBar-tab, .p-TabBar-tab',
    toggle: '.widget-toggle-buttons',
    section: '.jupyter-widget-Collapse-header, .p-Collapse-header, .lm-AccordionPanel-title',
  };
  const BARE = 'button, .lm-TabBar-tab, .p-TabBar-tab, .jupyter-widget-Collapse-header, ' +
               '.p-Collapse-header, .lm-AccordionPanel-title';
  const labelOf = (el) => {
    if (el.matches(BARE) || el.matches('.widget-checkbox'))
      return el.textContent.replace(/\u200b/g, '').trim();
    const own = el.querySelector(':scope > .widget-label, :scope > label');
    let text = own ? own.textContent.trim() : '';
    if (!text) {
      let prev = el.previousElementSibling;
      if (prev && prev.matches('.widget-label, .widget-html, .widget-htmlmath'))
        text = prev.textContent.trim();
    }
    return text;
  };
  const cands = [...root.querySelectorAll(KINDS[kind])].filter(el => el.offsetParent !== null);
  const hits = cands.filter(el => re.test(labelOf(el)));
  if (hits.length === 0) return {error: `no ${kind} labelled /${pattern}/i; ${kind}s here: ` +
                                        JSON.stringify(cands.map(labelOf))};
  hits[0].setAttribute('data-plab-id', id);
  return {label: labelOf(hits[0]), count: hits.length};
}
"""

# What the widget shows as its result: text and images of its Output widgets (the controls'
# own readouts excluded), plus HTML widgets inside them. A signature to compare before/after.
OUTPUT_STATE_JS = r"""
(area) => {
  const visible = (el) => el.offsetParent !== null;
  const outs = [...area.querySelectorAll('.widget-output')].filter(
      o => !o.parentElement.closest('.widget-output'));
  const scope = (outs.length ? outs : [area]).filter(visible);
  const htmls = [...area.querySelectorAll('.widget-html')].filter(
      h => visible(h) && !h.closest('.widget-output'));
  const imgs = scope.flatMap(o => [...o.querySelectorAll('img')]).filter(visible);
  const text = scope.map(o => o.innerText).concat(htmls.map(h => h.innerText)).join('\n');
  const hash = (s) => { let h = 0; for (let i = 0; i < s.length; i += 7) h = (h * 31 + s.charCodeAt(i)) | 0;
                        return h + ':' + s.length; };
  return {text, images: imgs.map(i => hash(i.src)),
          errors: area.innerText.includes('Error displaying widget') ? ['Error displaying widget'] : []};
}
"""


# Resolves with the output's state once it is ready (changed from `before` where a change is
# expected, with an image where one is wanted), the kernel idle and nothing changed for quietMs.
SETTLE_JS = """
(area, [before, expectChange, wantImage, quietMs, timeoutMs, wantText, wantNewImage, minImages]) => new Promise(resolve => {
  const state = %s;
  const sig = (s) => JSON.stringify([s.text, s.images, s.errors]);
  const base = sig(before), t0 = performance.now(), oldImages = JSON.stringify(before.images);
  let re = null;
  try { re = wantText ? new RegExp(wantText, 'm') : null; } catch (e) { re = null; }
  let last = null, lastChange = t0, changed = false;
  const tick = () => {
    const now = state(area), s = sig(now), t = performance.now();
    if (s !== last) { last = s; lastChange = t; }
    changed = changed || s !== base;
    const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const idle = !ind || ind.getAttribute('data-status') === 'idle';
    // a widget may go on drawing after its callback returned (the kernel idle): wait for what
    // the step expects (its text, a new image), not merely for the first change
    const ready = (changed || !expectChange) && (now.images.length >= minImages || !wantImage)
                  && (!re || re.test(now.text))
                  && (!wantNewImage || (now.images.length > 0 && JSON.stringify(now.images) !== oldImages));
    if (((ready || t - t0 > timeoutMs) && idle && t - lastChange >= quietMs)
        || t - t0 > timeoutMs + 30000) return resolve(now);
    setTimeout(tick, 40);
  };
  tick();
})
""" % OUTPUT_STATE_JS.strip()


# Where Run All stands: code cells, those without an execution count (their index and prompt),
# whether any is queued or running ([*]), and the kernel's status.
RUN_ALL_STATE_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
                  .map(p => p.textContent.trim());
  const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
  const k = document.querySelector('.jp-KernelName');
  const status = ind ? ind.getAttribute('data-status') : null;
  return {cells: prompts.length,
          unrun: prompts.map((p, i) => [i, p]).filter(([i, p]) => !/\\[\\d+\\]/.test(p))
                        .map(([i, p]) => `cell ${i} ${JSON.stringify(p)}`),
          queued: prompts.some(p => p.includes('*')),
          idle: status === 'idle',
          kernel: `${k ? k.textContent.trim() : 'no kernel name'}, ${status}`};
}"""


def kernel_status_js() -> str:
    """The kernel's status as the notebook shows it, or "no kernel". Right after a notebook opens
    its indicator already reads "idle" while the toolbar says "No Kernel": the kernel is still
    being started, and a Run All clicked then starts another one, which can fail into a modal
    "Select Kernel" dialog (measured: 3.5 s "No Kernel"/"idle", 5.2 s a kernel and "idle")."""
    return ("() => { const e = document.querySelector('.jp-Notebook-ExecutionIndicator');"
            " const k = document.querySelector('.jp-KernelName');"
            " const name = k ? k.textContent.trim() : '';"
            " if (!name || name === 'No Kernel') return 'no kernel';"
            " return e ? e.getAttribute('data-status') : null; }")


def watch_kernel_status_js() -> str:
    """Start logging every change of the kernel status the page shows, with the page's clock
    (`performance.now()`), into `window.__plabStatus`. A single look right after an input can read
    "idle" only because the kernel's "busy" is still on its way to the page; the log keeps every
    transition, however late it arrives."""
    return ("() => { const status = " + kernel_status_js() + ";"
            " const log = window.__plabStatus = [[performance.now(), status()]];"
            " if (window.__plabStatusObserver) window.__plabStatusObserver.disconnect();"
            " const obs = window.__plabStatusObserver = new MutationObserver(() => {"
            "   const s = status(); if (s !== log[log.length - 1][1]) log.push([performance.now(), s]); });"
            " obs.observe(document.body, {subtree: true, childList: true, attributes: true,"
            "                            attributeFilter: ['data-status']}); }")


def busy_spanned(log: list, start: float, end: float) -> bool:
    """Did the kernel turn busy at or after `start` and stay busy past `end` (page clock)? Each
    comm message runs as one busy...idle period, so this says the inputs sent between `start` and
    `end` all arrived while the first one's handler was still running."""
    for i, (t, s) in enumerate(log):
        if s == "busy" and t >= start:
            idle = next((u for u, r in log[i + 1:] if r == "idle"), float("inf"))
            return idle > end
    return False


# The API paths JupyterLab polls in the background (and retries after a failure); the file
# browser's folder listings (api/contents/<folder>) are told apart where they are checked.
POLLED_BY_JUPYTERLAB = ("api/sessions", "api/kernels", "api/terminals", "api/kernelspecs",
                        "api/me", "api/status")


class Notebook:
    """One notebook open in its own page: run it, find its widgets' controls and outputs."""

    def __init__(self, lab: Lab, context, name: str):
        self.lab, self.name, self.stem = lab, name, Path(name).stem
        self.page = context.new_page()
        self.console: list[str] = []
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        self.seen_errors = 0
        self.dialogs: list[str] = []
        self.ids = 0
        self.run_started: float | None = None

    # -- notebook level
    def open(self, timeout: float = 90) -> None:
        # A workspace of its own, reset: JupyterLab restores no other notebook's tabs.
        self.page.goto(f"{self.lab.url}/lab/workspaces/plab-{self.stem[:2]}/tree/notebooks/"
                       f"{self.name}?reset&token={self.lab.token}")
        self.page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=timeout * 1000)
        deadline = time.monotonic() + timeout
        while True:  # idle with a kernel; JupyterLab may ask which kernel first
            self.answer_dialogs()
            try:
                return self.wait_kernel("idle", min(5.0, max(0.1, deadline - time.monotonic())))
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.name}: no idle kernel {timeout:.0f} s after opening (the notebook "
                        f"shows {self.page.evaluate(kernel_status_js())!r}; dialogs: {self.dialogs})")

    def wait_kernel(self, status: str = "idle", timeout: float = 120) -> None:
        self.page.wait_for_function(
            f"() => {{ const s = ({kernel_status_js()})(); return s === {json.dumps(status)}; }}",
            timeout=timeout * 1000, polling=200)

    def run_all(self, timeout: float = 240) -> float:
        """Run ▸ Run All Cells; wait until every code cell has run. Returns the seconds it took."""
        self.start_run_all()
        return self.wait_run_all(timeout)

    def start_run_all(self) -> None:
        """Run ▸ Run All Cells from the menu bar, returning once the cells are queued (the kernel
        goes on in the background: the session runs the next notebooks while it tests this one)."""
        self.run_started = time.monotonic()
        for attempt in range(3):  # a click while the app is still activating can be lost
            self.answer_dialogs()
            try:
                self.menu("Run", re.compile(r"^\s*Run All Cells\s*$"))
            except Exception:
                if attempt == 2:
                    raise
                continue
            try:  # queued: the prompts turn to [*]
                self.page.wait_for_function(
                    "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]"
                    ".some(p => p.textContent.includes('*'))", timeout=10_000, polling=50)
                return
            except Exception:
                self.page.keyboard.press("Escape")
                if attempt == 2:
                    raise

    def menu(self, menu: str, item: str | re.Pattern, timeout: float = 10) -> None:
        """Click `menu` in the menu bar, then its first visible item matching `item`."""
        self.page.locator(".lm-MenuBar-item").filter(
            has_text=re.compile(rf"^\s*{re.escape(menu)}\s*$")).click(timeout=timeout * 1000)
        self.page.locator(".lm-Menu-item:visible").filter(
            has_text=item).first.click(timeout=timeout * 1000)

    def answer_dialogs(self) -> None:
        """Answer a modal dialog, which would swallow the clicks of Run All. "Select Kernel" (seen
        twice in a few hundred opens under load) is answered with the notebook's own kernel: its
        Escape means "No Kernel", and Run All then runs nothing. Any other dialog is closed with
        Escape. Every dialog's text is kept in `dialogs`, which the failure messages quote."""
        dialogs = self.page.locator(".jp-Dialog")
        for _ in range(3):
            if dialogs.count() == 0:
                return
            dialog = dialogs.first
            text = " | ".join(t.strip() for t in dialog.inner_text().splitlines() if t.strip())
            self.dialogs.append(text)
            print(f"{self.name}: dialog: {text[:300]!r}")
            try:
                if text.startswith("Select Kernel"):
                    dialog.locator("select").select_option(label=KERNEL_DISPLAY_NAME)
                    dialog.locator("button.jp-mod-accept").click(timeout=5_000)
                else:
                    self.page.keyboard.press("Escape")
            except Exception as error:  # gone meanwhile, or not what we expected: told below
                self.dialogs.append(f"(answering it failed: {error})")
            self.page.wait_for_timeout(300)

    def front(self) -> "Notebook":
        """Bring this page to the front. Chromium produces no frames for a page behind another
        one, and playwright's screenshot then waits about 6 s for one (measured: 0.2 s in
        front, 6.0 s behind), so the page under test must be in front."""
        self.page.bring_to_front()
        return self

    def wait_run_all(self, timeout: float = 600, stopped_for: float = 3.0) -> float:
        """Wait until every code cell shows an execution count and the kernel is idle; seconds
        since `start_run_all`. Fails at once (after `stopped_for` seconds of the same picture)
        where Run All stopped early: the kernel idle, no cell queued, some never run (a cell
        raised, or the kernel died), quoting the tracebacks shown; on timeout, says which cells
        had not run."""
        deadline = time.monotonic() + timeout
        stopped_since = None
        while True:
            s = self.page.evaluate(RUN_ALL_STATE_JS)
            now = time.monotonic()
            if s["cells"] and not s["unrun"] and s["idle"]:
                return now - self.run_started
            if s["cells"] and s["unrun"] and not s["queued"] and s["idle"]:
                stopped_since = stopped_since or now
                if now - stopped_since >= stopped_for:
                    raise AssertionError(
                        f"Run All stopped: {len(s['unrun'])} of {s['cells']} code cells never "
                        f"ran (first: {s['unrun'][:4]}); kernel {s['kernel']}; tracebacks shown: "
                        f"{[e[-600:] for e in self.error_outputs()]}")
            else:
                stopped_since = None
            if now > deadline:
                raise AssertionError(
                    f"Run All not finished after {timeout:.0f} s: kernel {s['kernel']}, not run: "
                    f"{s['unrun'][:8]} of {s['cells']} code cells")
            self.page.wait_for_timeout(250)

    def error_outputs(self) -> list[str]:
        """Tracebacks shown in the notebook (cells that raised)."""
        return self.page.eval_on_selector_all(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
            "els => els.map(e => e.innerText).filter(t => /Traceback|Error/.test(t))")

    def _on_console(self, message) -> None:
        """Keep each console message with the address it names. A 5xx on one of JupyterLab's
        background polls (the session, kernel and folder lists it refreshes every few seconds,
        and retries) is kept apart and printed, not counted: the reader sees nothing of it.
        Every other error counts, the failed request's address with it."""
        url = (message.location or {}).get("url", "") if message.type == "error" else ""
        path = url.split("//", 1)[-1].partition("/")[2].split("?", 1)[0]
        folder_list = path.startswith("api/contents") and not path.endswith(".ipynb") \
            and "checkpoints" not in path  # the file browser refreshing a folder
        if ("status of 5" in message.text and message.text.startswith("Failed to load resource")
                and (path.startswith(POLLED_BY_JUPYTERLAB) or folder_list)):
            print(f"\n{self.name}: JupyterLab's poll failed once: {message.text} ({url})")
            return
        self.console.append(f"{message.type}: {message.text}" + (f" ({url})" if url else ""))

    def new_console_errors(self) -> list[str]:
        errors = [m for m in self.console if m.startswith(("error", "pageerror"))]
        new, self.seen_errors = errors[self.seen_errors:], len(errors)
        return new

    def close(self) -> None:
        self.page.close()
        try:
            for s in self.lab.api("sessions"):
                if s["path"].endswith(self.name):
                    self.lab.api(f"sessions/{s['id']}", method="DELETE")
        except OSError:
            pass

    # -- widget level
    def widget_area(self, cell_text: str, timeout: float = 60):
        """The output area of the code cell whose source contains `cell_text`, once it shows a
        widget (a rendered widget view, or the error box JupyterLab puts in its place)."""
        cell = self.page.locator(".jp-CodeCell").filter(
            has=self.page.locator(".jp-InputArea", has_text=cell_text))
        if cell.count() != 1:
            raise AssertionError(f"{cell.count()} code cells contain {cell_text!r} in {self.name}")
        area = cell.locator(".jp-Cell-outputArea, .jp-OutputArea").first
        area.locator(".jupyter-widgets, :text('Error displaying widget')").first.wait_for(
            timeout=timeout * 1000)
        return area

    def control(self, area, label: str, kind: str):
        self.ids += 1
        ident = f"c{self.ids}"
        found = area.evaluate(f"(root, args) => ({FIND_CONTROL_JS})([root, ...args])",
                              [label, kind, ident])
        if "error" in found:
            raise AssertionError(f"{self.name}: {found['error']}")
        return self.page.locator(f"[data-plab-id='{ident}']")

    def state(self, area) -> dict:
        return area.evaluate(OUTPUT_STATE_JS)

    def value_of(self, ctl, kind: str) -> str:
        if kind == "slider":
            return ctl.locator(".widget-readout").inner_text().strip()
        if kind == "dropdown":
            return ctl.locator("select").evaluate("s => s.options[s.selectedIndex]?.text ?? ''")
        if kind == "text":
            return ctl.locator("input").input_value()
        if kind == "checkbox":
            return str(ctl.locator("input").is_checked())
        if kind == "toggle":
            return ctl.locator("button.mod-active").inner_text().strip()
        return ctl.inner_text().strip()

    @staticmethod
    def _handle(ctl, to: str | None, which: str | None):
        """A slider's handle: `which` = "low" or "high" on a range slider, else the one that
        moves towards `to` (the upper one of a range towards "max")."""
        handles = ctl.locator(".noUi-handle")
        if which is None:
            which = "high" if to == "max" else "low"
        return handles.last if (which == "high" and handles.count() > 1) else handles.first

    def act(self, ctl, kind: str, to: str | None, handle: str | None = None) -> str:
        """Do one input on a control, as a reader would. Returns the control's new value text.
        A slider is dragged to `to` ("min", "max" or a readout, then steered there with arrow
        keys: each key press is one more change) or moved one step with "+1" / "-1" (one arrow
        key: the way to time a SelectionSlider, whose options the page does not list)."""
        page = self.page
        if kind == "slider" and to in ("+1", "-1"):  # one arrow key: one step, one change
            ctl.scroll_into_view_if_needed()
            self._handle(ctl, to, handle).press("ArrowRight" if to == "+1" else "ArrowLeft")
        elif kind == "slider":
            ctl.scroll_into_view_if_needed()
            handle = self._handle(ctl, to, handle)
            base = ctl.locator(".noUi-base").bounding_box()
            hb = handle.bounding_box()
            x0, y = hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2
            if to == "min":
                x = base["x"] - 60
            elif to == "max":
                x = base["x"] + base["width"] + 60
            else:
                x = base["x"] + base["width"] * self._fraction(ctl, handle, to)
            page.mouse.move(x0, y)
            page.mouse.down()
            page.mouse.move(x, y, steps=1)
            page.mouse.up()
            if to not in ("min", "max"):
                self._nudge(ctl, handle, to)
        elif kind == "dropdown":
            select = ctl.locator("select")
            n = select.evaluate("s => s.options.length")
            if to in ("first", "last"):
                select.select_option(index=0 if to == "first" else n - 1)
            else:
                select.select_option(label=to)
        elif kind == "text":
            box = ctl.locator("input")
            box.fill(to or "")
            box.press("Enter")
        elif kind == "checkbox":
            ctl.locator("input").click()
        elif kind == "toggle":
            ctl.locator("button").filter(
                has_text=re.compile(rf"^\s*{re.escape(to or '')}\s*$")).click()
        else:  # button, tab
            ctl.click()
        return self.value_of(ctl, kind)

    def prepare(self, ctl, kind: str, to: str | None):
        """The input of `act`, with everything measured beforehand, as a callable that only sends
        the input events (for inputs that must land within a fraction of a second)."""
        page = self.page
        if kind == "dropdown" and to not in ("first", "last"):
            select = ctl.locator("select")
            return lambda: select.select_option(label=to)
        if kind != "slider" or to in ("+1", "-1"):
            return lambda: self.act(ctl, kind, to)
        ctl.scroll_into_view_if_needed()
        handle = self._handle(ctl, to, None)
        base, hb = ctl.locator(".noUi-base").bounding_box(), handle.bounding_box()
        x0, y = hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2
        x = {"min": base["x"] - 60, "max": base["x"] + base["width"] + 60}.get(
            to, base["x"] + base["width"] * self._fraction(ctl, handle, to or ""))

        def send():
            page.mouse.move(x0, y)
            page.mouse.down()
            page.mouse.move(x, y, steps=1)
            page.mouse.up()
        return send

    def _fraction(self, ctl, handle, target: str) -> float:
        """Where along the track `target` sits. A SelectionSlider's aria values are option
        indices, not the numbers its readout shows (m's options 1, 2, 4, 8, 16 are indices
        0-4): there, start in the middle and let `_nudge` steer."""
        lo, hi, now = (float(handle.get_attribute(a))
                       for a in ("aria-valuemin", "aria-valuemax", "aria-valuenow"))
        readout = ctl.locator(".widget-readout")
        try:
            if float(readout.inner_text().replace(",", "").strip()) != now:
                return 0.5
            return min(1.0, max(0.0, (float(target) - lo) / (hi - lo)))
        except ValueError:  # a label: start in the middle, then nudge
            return 0.5

    def _nudge(self, ctl, handle, target: str, tries: int = 40) -> None:
        """Arrow keys until the readout says `target` (SelectionSliders, rounding)."""
        def readout():
            return ctl.locator(".widget-readout").inner_text().strip()

        def number(s):
            try:
                return float(re.sub(r"[^\d.eE+-]", "", s))
            except ValueError:
                return None
        for _ in range(tries):
            now = readout()
            if now == target:
                return
            a, b = number(now), number(target)
            if a is None or b is None:
                raise AssertionError(f"cannot steer slider to {target!r} (at {now!r})")
            handle.press("ArrowRight" if b > a else "ArrowLeft")
        raise AssertionError(f"slider did not reach {target!r} (at {readout()!r})")

    def settle(self, area, before: dict, expect_change: bool = True, timeout: float = 60,
               quiet: float = 0.25, want_image: bool = False, want_text: str | None = None,
               want_new_image: bool = False, images: int = 1) -> dict:
        """Wait until the output has changed from `before` (when a change is expected), shows an
        image (when `want_image`: callbacks that print before they draw), and then stayed the same
        for `quiet` seconds with the kernel idle. With `want_text` (a regex) or `want_new_image`,
        also until the text matches and an image other than before's is shown: a widget may draw
        after its callback returned. With `want_image`, `images` is how many images the output must
        show (a callback may display several, one message each, and the kernel's indicator does
        not wait for a callback run on a subshell). Returns the final state (at the timeout: as
        it is then).
        Watched in the page (every 40 ms), so a settled output is seen at once."""
        return area.evaluate(SETTLE_JS, [before, expect_change, want_image,
                                         quiet * 1000, timeout * 1000, want_text, want_new_image,
                                         images])

    def screenshot(self, area, name: str) -> Path:
        SHOTS.mkdir(exist_ok=True)
        path = SHOTS / f"{self.stem}--{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)}.png"
        area.scroll_into_view_if_needed()
        # every image decoded first (a large PNG still decoding shows as blank space)
        area.evaluate("a => Promise.all([...a.querySelectorAll('img')].map("
                      "i => i.decode().catch(() => null)))")
        area.screenshot(path=str(path))
        return path

    def kernel_exec(self, code: str, timeout: float = 60) -> None:
        """Run code in this notebook's kernel from a second client (for test setup only)."""
        from jupyter_client import BlockingKernelClient
        session = next(s for s in self.lab.api("sessions") if s["path"].endswith(self.name))
        conn = self.lab.tmp / "runtime" / f"kernel-{session['kernel']['id']}.json"
        client = BlockingKernelClient()
        client.load_connection_file(str(conn))
        client.start_channels()
        try:
            reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda m: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"kernel_exec({code!r}): {reply['content']}")
        finally:
            client.stop_channels()
