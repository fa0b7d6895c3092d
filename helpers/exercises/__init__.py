"""The reader's exercises.

* `arithmetic`: each `grade_*` takes a number or a short answer and returns a `Verdict`.
* `coding`: the reader writes a block of distributed code; `check(fn)` runs it on live ranks,
  handed only each rank's shard, and compares it with the single-process reference and with the
  communication the lesson asks for (`calls`: what the code handed to torch.distributed).
  `reveal(name)` shows the course's version folded away.
* One module per notebook holds its coding exercises, each registered with its cases and the
  real mistakes its checker must name (the tests run them).
"""
from helpers.exercises.arithmetic import *  # noqa: F401,F403  (the graders, by their names)
from helpers.exercises.arithmetic import Verdict  # noqa: F401
from helpers.exercises.coding import EXERCISES, check, reveal  # noqa: F401


def _register_all() -> None:
    """Import every notebook's module (each registers its coding exercises on import)."""
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("arithmetic", "calls", "coding"):
            importlib.import_module(f"{__name__}.{info.name}")


_register_all()
