"""Make executed notebooks fit to commit: no widget state, no execution timestamps.

A widget's output only points at live state (a model id), so it is dropped and the text
form kept: an un-run notebook then says what the widget is instead of "model not found".

    python scripts/strip_notebooks.py notebooks/*.ipynb

It also refuses (exit 1) a notebook whose outputs show a path of this machine.
"""
import json
import os
import sys
import tempfile

MACHINE_PATHS = [p for p in {os.path.expanduser("~") + "/", os.getcwd() + "/",
                             tempfile.gettempdir() + "/"} if len(p) > 2]


def strip(path: str) -> list[str]:
    with open(path) as f:
        nb = json.load(f)
    nb["metadata"].pop("widgets", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        cell.get("metadata", {}).pop("widgets", None)
        for output in cell.get("outputs", []):
            output.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return [p for p in MACHINE_PATHS if p in text]


if __name__ == "__main__":
    bad = {path: leaks for path in sys.argv[1:] if (leaks := strip(path))}
    for path, leaks in bad.items():
        print(f"{path}: outputs contain machine paths {leaks}", file=sys.stderr)
    sys.exit(1 if bad else 0)
