"""Make executed notebooks fit to commit: no widget state, no execution timestamps.

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
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return [p for p in MACHINE_PATHS if p in text]


if __name__ == "__main__":
    bad = {path: leaks for path in sys.argv[1:] if (leaks := strip(path))}
    for path, leaks in bad.items():
        print(f"{path}: outputs contain machine paths {leaks}", file=sys.stderr)
    sys.exit(1 if bad else 0)
