"""The package's layout is its architecture: each folder keeps to its idea.

* views/ holds every figure and widget, so nothing outside it may load matplotlib or ipywidgets;
* cost/ is pure arithmetic, so it may not load torch (or start anything);
* core modules never reach into views/.
Each check imports the modules in a fresh interpreter, so what pytest itself loaded does not count.
"""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path


import helpers

ROOT = Path(helpers.__file__).resolve().parent


def modules(under: str = "") -> list[str]:
    """Every module of the package (or of one sub-package), by dotted name."""
    base = ROOT / under if under else ROOT
    prefix = "helpers." + (under.replace("/", ".") + "." if under else "")
    names = []
    for info in pkgutil.walk_packages([str(base)], prefix):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return sorted(names)


CORE = [m for m in modules() if not m.startswith("helpers.views")]
COST = [m for m in modules("cost")]


def loaded_after_import(names: list[str]) -> set[str]:
    """Top-level package names in sys.modules after importing `names` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} | "
            "{m for m in sys.modules if m.startswith('helpers.views')})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_package_has_the_documented_folders():
    for folder in ("cost", "parallel", "views", "simulator"):
        assert (ROOT / folder / "__init__.py").exists(), folder
    assert CORE and COST


def test_core_modules_load_neither_matplotlib_nor_ipywidgets_nor_views():
    loaded = loaded_after_import(CORE)
    assert "matplotlib" not in loaded
    assert "ipywidgets" not in loaded
    assert not any(m.startswith("helpers.views") for m in loaded), sorted(loaded)


def test_cost_modules_are_pure_arithmetic():
    loaded = loaded_after_import(COST)
    assert "torch" not in loaded


def test_every_view_module_imports():
    # One fresh interpreter for all of them: each would pay torch's and matplotlib's import again.
    loaded = loaded_after_import(modules("views"))
    assert {"matplotlib", "ipywidgets"} <= loaded
