"""The package's layout is its architecture: each folder keeps to its idea.

* cost/      pure arithmetic: no torch, nothing from parallel/, labs/, launch/ or views/;
* parallel/  blocks on any process group: they never launch ranks, never run a lab, never draw;
* labs/      each notebook's runs; with views/ and benchmarks/ the only code that starts ranks;
* launch/    starting ranks (helpers.ranks and helpers.run are its public faces);
* views/     every figure and widget, so nothing outside it loads matplotlib or ipywidgets.

Two kinds of check. The import rules read every `import` statement in the source, function-local
ones included, so an import that only runs on one path still counts. The loading checks import
modules in a fresh interpreter and look at what got loaded, so a rule cannot be dodged through a
module that imports another. A third kind holds the tree to its descriptions: every lab has its
block and view module (and its cost module where the topic has arithmetic), and the README's
package map names exactly the modules on disk.
"""
from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

ROOT = Path(helpers.__file__).resolve().parent
REPO = ROOT.parent

LAUNCHING = ("helpers.launch", "helpers.ranks", "helpers.run")
# Who may start ranks: the launcher itself, its two public faces, the labs, the views (widgets run
# labs), the exercises (a coding exercise is checked on live ranks) and, outside the package,
# benchmarks and tests.
MAY_LAUNCH = ("helpers.launch", "helpers.ranks", "helpers.run", "helpers.labs", "helpers.views",
              "helpers.exercises")

# Each lab, the topic's block module, view module and cost module (None: no arithmetic of its own).
TOPICS = {
    "collectives":    ("collectives", "collectives", "alpha_beta"),
    "bench":          ("bench", "bench", "bench"),
    "dp":             ("dp", "dp", "memory"),
    "tp":             ("tp", "tp", "tp"),
    "pp":             ("pp", "pp", "schedules"),
    "parallel3d":     ("parallel3d", "parallel3d", "parallel3d"),
    "layouts":        ("parallel3d", "parallel3d", "parallel3d"),
    "memory":         ("memory", "memory", "memory"),
    "experts":        ("experts", "experts", "experts"),
    "ring_attention": ("ring_attention", "ring_attention", "context"),
}


def modules(under: str = "") -> list[str]:
    """Every module of the package (or of one sub-package), by dotted name."""
    base = ROOT / under if under else ROOT
    prefix = "helpers." + (under.replace("/", ".") + "." if under else "")
    return sorted(info.name for info in pkgutil.walk_packages([str(base)], prefix)
                  if not info.name.endswith("__main__"))


def source_files() -> dict[str, Path]:
    """Dotted module name → file, for every .py file of the package (__main__ included)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(path: Path, module: str) -> set[str]:
    """Every module `path` imports, anywhere in it (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import mod`
    return found


IMPORTS = {name: imports_of(path, name) for name, path in source_files().items()}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def offenders(folder: str, forbidden) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in IMPORTS.items()
                  if _within(module, [folder]) for target in targets if _within(target, forbidden))


def test_the_import_reader_sees_function_local_and_relative_imports(tmp_path):
    (tmp_path / "mod.py").write_text("import os\n\ndef f():\n    from helpers.ranks import spawn\n"
                                     "    from .search import best_plan\n")
    found = imports_of(tmp_path / "mod.py", "helpers.simulator.mod")
    assert {"os", "helpers.ranks", "helpers.simulator.search"} <= found
    assert "helpers.ranks.spawn" in found  # a name imported from a package may be a module


def test_blocks_neither_launch_nor_run_labs_nor_draw():
    assert offenders("helpers.parallel", LAUNCHING + ("helpers.labs", "helpers.views")) == []


def test_cost_is_pure_arithmetic():
    assert offenders("helpers.cost", ("torch", "helpers.parallel", "helpers.labs", "helpers.views")
                     + LAUNCHING) == []


def test_only_labs_views_and_benchmarks_launch():
    wrong = sorted(f"{module} imports {target}" for module, targets in IMPORTS.items()
                   if not _within(module, MAY_LAUNCH)
                   for target in targets if _within(target, LAUNCHING))
    assert wrong == []


def test_nothing_but_views_imports_views_or_drawing():
    wrong = offenders("helpers", ("helpers.views", "matplotlib", "ipywidgets"))
    assert [w for w in wrong if not w.startswith("helpers.views")] == []


def test_every_lab_has_its_block_view_and_cost_modules():
    labs = {m.rsplit(".", 1)[1] for m in modules("labs")}
    assert labs == set(TOPICS), "a lab without a row in TOPICS, or a row without its lab"
    for lab, (block, view, cost) in TOPICS.items():
        assert (ROOT / "parallel" / f"{block}.py").exists(), (lab, block)
        assert (ROOT / "views" / f"{view}.py").exists(), (lab, view)
        assert cost is None or (ROOT / "cost" / f"{cost}.py").exists(), (lab, cost)


def readme_package_map() -> set[str]:
    """The module paths the README's package map names (`helpers/...py` lines of its block)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## The package\n.*?```text\n(.*?)```", text, re.S)
    assert block, "README.md has no '## The package' section with a ```text block"
    names, folder = set(), []
    for line in block.group(1).splitlines():
        entry = re.match(r"^(\s*)(\S+)", line)
        if not entry:
            continue
        depth, word = len(entry.group(1)) // 4, entry.group(2)
        folder = folder[:depth]
        if word.endswith("/"):
            folder.append(word.rstrip("/"))
            continue
        # A line may name several modules of its folder ("tp.py  04   pp.py  05").
        names |= {"/".join(folder + [m]) for m in re.findall(r"(?<!\S)(\w+\.py)(?!\S)", line)}
    return names


def test_the_readme_package_map_lists_exactly_the_modules_on_disk():
    on_disk = {str(p.relative_to(REPO)) for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    named = readme_package_map()
    assert sorted(on_disk - named) == [], "on disk but not in README.md's package map"
    assert sorted(named - on_disk) == [], "in README.md's package map but not on disk"


# ------------------------------------------------------------------------------------------
# What actually gets loaded, in a fresh interpreter (pytest's own imports do not count).
# ------------------------------------------------------------------------------------------

CORE = [m for m in modules() if not m.startswith("helpers.views")]
COST = modules("cost")


def loaded_after_import(names: list[str]) -> set[str]:
    """Top-level package names in sys.modules after importing `names` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} | "
            "{m for m in sys.modules if m.startswith(('helpers.views', 'helpers.launch'))})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_package_has_the_documented_folders():
    for folder in ("cost", "parallel", "labs", "launch", "views", "simulator"):
        assert (ROOT / folder / "__init__.py").exists(), folder
    assert CORE and COST


def test_core_modules_load_neither_matplotlib_nor_ipywidgets_nor_views():
    loaded = loaded_after_import(CORE)
    assert "matplotlib" not in loaded
    assert "ipywidgets" not in loaded
    assert not any(m.startswith("helpers.views") for m in loaded), sorted(loaded)


def test_cost_modules_are_pure_arithmetic():
    assert "torch" not in loaded_after_import(COST)


def test_the_records_stand_alone():
    # Models build from the configurations and cost reads them, so they import neither.
    assert offenders("helpers.configs", ("helpers.cost", "helpers.models", "helpers.parallel")) == []
    assert offenders("helpers.layout", ("helpers.cost", "helpers.models", "helpers.parallel")) == []
    assert "torch" not in loaded_after_import(["helpers.configs", "helpers.layout"])


@pytest.mark.parametrize("folder", ["parallel", "cost"])
def test_blocks_and_cost_load_no_launcher(folder):
    assert not any(m.startswith("helpers.launch") for m in loaded_after_import(modules(folder)))


def test_every_view_module_imports():
    # One fresh interpreter for all of them: each would pay torch's and matplotlib's import again.
    assert {"matplotlib", "ipywidgets"} <= loaded_after_import(modules("views"))
