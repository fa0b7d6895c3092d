"""The committed notebooks, read as files: their claims passed, and they speak to a reader.

* Every `claim(..., kind="exact")` in a cell has its tick in that cell's committed output (the
  notebook was executed after the claim was written, and it held), and no output holds a
  failed claim.
* Every `module.name` a notebook's prose or code names, through the modules it imports from
  `helpers`, exists (a reader's "try this" must not meet an AttributeError after code moved).
* No ticket language on a reader's page: the tracker's words ("the issue", "closing note",
  "target met", ...) stay out of markdown and outputs.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from helpers.claims import NOT_SHOWN, PASSED, SHOWN

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
TICKET = re.compile(r"\b(?:the|this|that|our) issue\b|\bissue's\b|\bclosing note|\btarget met\b"
                    r"|\bticket\b|\bdeliverable|\bacceptance criteri|\bfiled as\b|\bTODO\b",
                    re.IGNORECASE)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        parts.append("".join(out.get("data", {}).get("text/plain", "")))
        parts.append("".join(out.get("data", {}).get("text/markdown", "")))
        if out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "\n".join(parts)


def exact_claims(source: str) -> list[str | None]:
    """The text of every exact claim the cell makes when it runs (None where the text is built
    at run time); a claim inside a function the cell defines prints where the function is called."""
    found = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "claim"
                and any(k.arg == "kind" and getattr(k.value, "value", None) == "exact"
                        for k in node.keywords)):
            text = node.args[0] if node.args else None
            found.append(text.value if isinstance(text, ast.Constant) else None)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(python_of(source)))
    return found


def python_of(source: str) -> str:
    """A code cell's source without IPython's magics and shell lines, so `ast` can read it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def helper_modules(notebook: list[dict]) -> dict[str, str]:
    """alias → module, for every module of `helpers` the notebook's code imports."""
    aliases = {}
    for cell in notebook:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse(python_of("".join(cell["source"])))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if importlib.util.find_spec(node.module).submodule_search_locations and \
                            importlib.util.find_spec(name) is not None:
                        aliases[alias.asname or alias.name] = name
            elif isinstance(node, ast.Import):
                aliases |= {a.asname or a.name: a.name for a in node.names
                            if a.name.startswith("helpers")}
    return aliases


def missing_names(name: str, notebook: list[dict]) -> list[str]:
    """`alias.attribute` in any cell where the module imported as `alias` has no `attribute`."""
    aliases = helper_modules(notebook)
    missing = []
    for index, cell in enumerate(notebook):
        for alias, module in aliases.items():
            pattern = rf"(?<![\w.]){re.escape(alias)}\.(\w+)\b(?!\.(?:png|svg|json))"
            for hit in re.finditer(pattern, "".join(cell["source"])):
                if hit.group(1) not in ("py", "png", "svg") and \
                        not hasattr(importlib.import_module(module), hit.group(1)):
                    missing.append(f"{name} cell {index}: {alias}.{hit.group(1)} ({module} has no "
                                   f"{hit.group(1)})")
    return missing


def test_the_reader_finds_the_notebooks():
    assert len(NOTEBOOKS) >= 10


def claim_problems(name: str, notebook: list[dict]) -> list[str]:
    """Exact claims without their tick in the committed output, and failed claims."""
    problems = []
    for index, cell in enumerate(notebook):
        if cell["cell_type"] != "code":
            continue
        claims = exact_claims("".join(cell["source"]))
        out = output_text(cell)
        where = f"{name} cell {index}"
        if "ClaimError" in out:
            problems.append(f"{where}: a claim failed when the notebook was executed")
        ticks = [line for line in out.splitlines()
                 if line.startswith(PASSED + " ") and not line.startswith(SHOWN)]
        if len(ticks) < len(claims):
            problems.append(f"{where}: {len(claims)} exact claim(s) in the source, {len(ticks)} "
                            "tick(s) in the committed output: execute the notebook again")
        problems += [f"{where}: no tick for {text!r}" for text in claims
                     if text is not None and not any(t.startswith(f"{PASSED} {text}") for t in ticks)]
    return problems


def ticket_problems(name: str, notebook: list[dict]) -> list[str]:
    """The tracker's words in markdown or outputs."""
    problems = []
    for index, cell in enumerate(notebook):
        texts = [output_text(cell)] + (["".join(cell["source"])] if cell["cell_type"] == "markdown"
                                       else [])
        for text in texts:
            for hit in TICKET.finditer(text):
                problems.append(f"{name} cell {index}: tracker's words on a reader's page: "
                                f"...{text[max(0, hit.start() - 40):hit.end() + 40]}...")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exact_claim_passed_in_the_committed_output(path):
    assert claim_problems(path.name, cells(path)) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_name_a_notebook_gives_exists(path):
    assert missing_names(path.name, cells(path)) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_ticket_language_on_a_readers_page(path):
    assert ticket_problems(path.name, cells(path)) == []


def code(source: str, *lines: str) -> dict:
    return {"cell_type": "code", "source": source,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "".join(lines)}]}


def test_the_checks_catch_what_they_exist_for():
    """A claim not re-executed, a failed claim, a tick for another text, ticket language."""
    made = 'claim("bytes equal the formula", a == b, kind="exact")\n%time x'
    assert exact_claims(made) == ["bytes equal the formula"]
    assert exact_claims('claim(f"{n} bytes", a == b, kind="exact")') == [None]
    assert exact_claims('claim("fast", a < b, kind="measured")') == []
    assert exact_claims('def f(run):\n    claim("valid", ok(run), kind="exact")') == []
    assert claim_problems("nb", [code(made, "✓ bytes equal the formula (16 MiB)\n")]) == []
    assert claim_problems("nb", [code(made)]) != []                       # never executed
    assert claim_problems("nb", [code(made, "✓ right: 16 MiB\n")]) != []  # an exercise's tick
    assert claim_problems("nb", [code(made, "✓ this run shows that bytes equal the formula\n")])
    assert claim_problems("nb", [code(made, "✓ flops equal the formula\n")]) != []
    failed = code(made)
    failed["outputs"] = [{"output_type": "error", "ename": "ClaimError", "evalue": "✗ ..."}]
    assert claim_problems("nb", [failed]) != []
    page = [{"cell_type": "markdown", "source": "The accuracy target of the issue: met."},
            code("", "every rank must issue collectives in the same order\n")]
    assert ticket_problems("nb", page) != [] and ticket_problems("nb", page[1:]) == []
    moved = [code("from helpers.parallel import pp\nfrom helpers.labs import pp as pp_lab"),
             {"cell_type": "markdown", "source": "Try `pp.run_pipeline(...)`, `pp_lab.replayed(run)`, "
              "`pp.py` and `pp.Mailbox`."}]
    assert missing_names("nb", moved) == ["nb cell 1: pp.run_pipeline (helpers.parallel.pp has no "
                                          "run_pipeline)"]
    assert TICKET.search("the model's accuracy target (median ≤ 15 %): met in this run") is None
    assert f"{NOT_SHOWN} does not show".startswith("✗")
