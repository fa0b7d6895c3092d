"""`python -m helpers.simulator`: one configuration's curve, written as JSON.

    python -m helpers.simulator --preset "H100 SXM" --json out.json
    python -m helpers.simulator --config my_gpu.json --sparse --months 6 --json out.json

Settings come from the model's defaults, then the config file's "settings" section, then
the flags given here. Everything is checked before anything is computed: a record, a setting
or an output path that cannot work stops with one line naming the field (exit status 2),
never a traceback, never a partial file (the curve is written to a temporary file next to
the target, then renamed). A curve with no feasible point is a result: "no cluster finishes
in time", exit status 0, a valid JSON file.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from helpers.hardware import PRESETS

from .config import load_config, preset, validate
from .curve import run_curve
from .report import dumps, price_of
from .settings import BATCH_LAWS, Settings


PROG = "python -m helpers.simulator"


class UsageError(ValueError):
    """A bad command line or input: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage first, then exit
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog=PROG,
                                description="Largest efficient training runs (Erdil & "
                                            "Schneider-Joseph 2024 cost model).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME",
                     help="one of: " + ", ".join(f'"{n}"' for n in PRESETS))
    src.add_argument("--config", metavar="FILE.json",
                     help="a hardware record as JSON (docs/cost_model.md §1), optionally with \"settings\"")
    p.add_argument("--sparse", action="store_true", default=None,
                   help="mixture-of-experts models (the model's sparsity law)")
    p.add_argument("--batch-law", choices=BATCH_LAWS, default=None)
    p.add_argument("--months", type=float, default=None, help="run duration (default 3)")
    p.add_argument("--threshold", type=float, default=None,
                   help="fraction of the GPU's best MFU that counts as efficient (default 0.8)")
    p.add_argument("--price-per-gpu", type=float, default=None, metavar="USD")
    p.add_argument("--json", required=True, metavar="OUT.json", help="where to write the curve")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """The GPU and settings the arguments describe, validated; ValueError if they cannot work."""
    if args.preset is not None:
        gpu, settings = preset(args.preset), None
    else:
        try:
            gpu, settings = load_config(args.config)
        except OSError as e:
            raise ValueError(f"config: cannot read {args.config}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"config: {args.config} is not UTF-8 text") from None
        except RecursionError:
            raise ValueError(f"config: {args.config} nests too deeply") from None
    settings = settings or Settings()
    overrides = {"sparse": args.sparse, "batch_law": args.batch_law, "months": args.months,
                 "threshold": args.threshold, "price_per_gpu": args.price_per_gpu}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    validate(gpu, settings)
    return gpu, settings


def check_output(path: str, config: str | None) -> Path:
    """The `--json` target, checked before anything is computed: its folder exists and is
    writable, it is not a folder, and it is not the config file it would overwrite."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--json: {path} is a folder, not a file")
    folder = out.parent
    if not folder.is_dir():
        raise ValueError(f"--json: folder {str(folder)!r} does not exist")
    # (The config was read already, so it exists; samefile sees through links and "./".)
    if config is not None and out.exists() and os.path.samefile(config, out):
        raise ValueError(f"--json: {path} is the --config file; writing would overwrite the input")
    if out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"--json: {path} is not writable")
    return out


def reserve(out: Path) -> str:
    """Create the temporary file the curve will be written to, beside `out`: proof, before
    computing, that the folder takes new files."""
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise ValueError(f"--json: cannot create files in folder {str(out.parent)!r}: "
                         f"{e.strerror}") from None
    os.close(fd)
    return tmp


def write_atomically(out: Path, tmp: str, text: str) -> None:
    """Fill the reserved temporary file, then rename it over `out`: a reader (or a crash)
    never sees half a file."""
    with open(tmp, "w") as f:
        f.write(text)
    mode = out.stat().st_mode & 0o777 if out.exists() else 0o666 & ~_umask()
    os.chmod(tmp, mode)  # mkstemp's 0600 would make the result private
    os.replace(tmp, out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def summary(name: str, curve) -> str:
    if not curve.feasible:
        return f"{name}: no cluster finishes in time (0 feasible grid points)"

    def fmt(p):
        if p is None or p.plan is None:
            return "none (no cluster finishes in time)"
        q = p.plan
        return (f"C = {p.model.C:.3g} FLOP, MFU {p.mfu:.3f} on {q.n_gpus:.3g} GPUs "
                f"(TP ({q.tp_model}, {q.tp_ff}), PP {q.pp}, DP {q.dp}, EP {q.ep})")

    price = price_of(curve)
    last = curve.largest_feasible()
    cost = "" if price is None or last is None else f", ${last.plan.n_gpus * price:.3g} of GPUs"
    return "\n".join([
        f"{name}: {len(curve.feasible)} feasible grid points",
        f"  linear scaling ends:     {fmt(curve.linear_scaling_ends())}",
        f"  max feasible at τ = {curve.settings.threshold:<4g} "
        f"{fmt(curve.max_feasible_at_threshold())}",
        f"  largest feasible run:    {fmt(last)}{cost}",
    ])


def _fail(message: str, status: int = 2) -> int:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        gpu, settings = build(args)
        out = check_output(args.json, args.config)
        tmp = reserve(out)
    except (ValueError, OSError) as e:  # UsageError is a ValueError
        return _fail(e)
    try:
        curve = run_curve(gpu, settings)
        write_atomically(out, tmp, dumps({gpu.name: curve}) + "\n")
    except OSError as e:  # the disk filled up, the folder vanished
        return _fail(f"--json: cannot write {args.json}: {e.strerror or e}")
    except Exception as e:  # noqa: BLE001 - a bug: still one line, with a status of its
        # own so that tests tell it from bad input
        return _fail(f"internal error ({type(e).__name__}: {e}); please report this input", 1)
    finally:  # whatever happened (Ctrl-C too), no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    if not args.quiet:
        print(summary(gpu.name, curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
