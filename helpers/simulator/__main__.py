"""`python -m helpers.simulator`: one configuration's curve, written as JSON.

    python -m helpers.simulator --preset "H100 SXM" --json out.json
    python -m helpers.simulator --config my_gpu.json --sparse --months 6 --json out.json

Settings come from the model's defaults, then the config file's "settings" section, then
the flags given here. Everything is checked before anything is computed: a record, a setting
or an output path that cannot work stops with one line naming the field (exit status 2, at
most MAX_MESSAGE characters: long input quoted in it is cut), never a traceback, never a
partial file (the curve is written to a temporary file next to the target, then renamed).
A curve with no feasible point is a result: "no cluster finishes in time", exit status 0, a
valid JSON file.

The rename puts a new file in place of whatever the `--json` name holds, so a name that holds
anything but a regular file (a device such as /dev/null, a pipe, a symbolic link) is refused,
before computing and again just before the rename. A `--config` that is not a regular file
or is larger than config.MAX_CONFIG_BYTES is refused before it is read. Text the terminal
cannot encode (a GPU's name under PYTHONIOENCODING=ascii) is printed as escapes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from helpers.checks import shorten
from helpers.hardware import PRESETS

from .config import load_config, preset
from .curve import run_curve
from .report import dumps, price_of
from .settings import BATCH_LAWS, Settings


PROG = "python -m helpers.simulator"
MAX_MESSAGE = 200  # characters of an error line after "error: "


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
    """The GPU and settings the arguments describe (a file's shape is checked as it is read;
    run_curve validates the record); ValueError if they cannot be read."""
    if args.preset is not None:
        gpu, settings = preset(args.preset), None
    else:
        try:
            gpu, settings = load_config(args.config)
        except OSError as e:
            raise ValueError(f"config: cannot read {shorten(args.config)}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"config: {shorten(args.config)} is not UTF-8 text") from None
        except RecursionError:
            raise ValueError(f"config: {shorten(args.config)} nests too deeply") from None
    settings = settings or Settings()
    overrides = {"sparse": args.sparse, "batch_law": args.batch_law, "months": args.months,
                 "threshold": args.threshold, "price_per_gpu": args.price_per_gpu}
    # not validated here: run_curve validates the record it is given, once
    return gpu, replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def check_target(out: Path) -> bool:
    """Whether `out` exists; a ValueError unless it is absent or a regular file. The rename
    that writes the curve replaces whatever the name holds: a device node (as root,
    /dev/null itself), a pipe, or a symbolic link, which would be replaced, not followed."""
    shown = shorten(str(out))
    try:
        mode = os.lstat(out).st_mode  # lstat: the name itself, not what a link points to
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ValueError(f"--json: cannot use {shown}: {e.strerror}") from None
    if stat.S_ISLNK(mode):
        raise ValueError(f"--json: {shown} is a symbolic link; name the file it points to")
    if stat.S_ISDIR(mode):
        raise ValueError(f"--json: {shown} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"--json: {shown} is not a regular file (a device, a pipe or a "
                         "socket); writing would replace it")
    return True


def check_output(path: str, config: str | None) -> Path:
    """The `--json` target, checked before anything is computed: its folder exists and is
    writable, it is absent or a regular file, and not the config file it would overwrite."""
    out = Path(path)
    exists = check_target(out)
    folder = out.parent
    if not folder.is_dir():
        raise ValueError(f"--json: folder '{shorten(str(folder))}' does not exist")
    # (The config was read already, so it exists; samefile sees through links and "./".)
    if config is not None and exists and os.path.samefile(config, out):
        raise ValueError(f"--json: {shorten(path)} is the --config file; writing would "
                         "overwrite the input")
    if exists and not os.access(out, os.W_OK):
        raise ValueError(f"--json: {shorten(path)} is not writable")
    return out


def reserve(out: Path) -> str:
    """Create the temporary file the curve will be written to, beside `out`: proof, before
    computing, that the folder takes new files."""
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise ValueError(f"--json: cannot create files in folder '{shorten(str(out.parent))}': "
                         f"{e.strerror}") from None
    os.close(fd)
    return tmp


def write_atomically(out: Path, tmp: str, text: str) -> None:
    """Fill the reserved temporary file, then rename it over `out`: a reader (or a crash)
    never sees half a file."""
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    # The computation took minutes: check again what the name holds now.
    mode = out.stat().st_mode & 0o777 if check_target(out) else 0o666 & ~_umask()
    os.chmod(tmp, mode)  # mkstemp's 0600 would make the result private
    os.replace(tmp, out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _say(text: str, stream) -> None:
    """Print `text` in what `stream` can encode: characters its encoding lacks (a GPU's
    name in an ASCII terminal) become escapes instead of a UnicodeEncodeError."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)


def summary(name: str, curve) -> str:
    name = shorten(name)
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


def _fail(message, status: int = 2) -> int:
    _say(f"{PROG}: error: {shorten(' '.join(str(message).split()), MAX_MESSAGE)}", sys.stderr)
    return status


def main(argv=None) -> int:
    tmp = None
    try:
        try:
            args = parse_args(argv)
            gpu, settings = build(args)
            out = check_output(args.json, args.config)
            tmp = reserve(out)
            curve = run_curve(gpu, settings)  # a record it refuses is a ValueError too
        except (ValueError, OSError) as e:  # UsageError is a ValueError
            return _fail(e)
        text = dumps({gpu.name: curve}) + "\n"
        try:
            write_atomically(out, tmp, text)
        except ValueError as e:  # the target became a link or a device meanwhile
            return _fail(e)
        except OSError as e:  # the disk filled up, the folder vanished
            return _fail(f"--json: cannot write {shorten(args.json)}: {e.strerror or e}")
        if not args.quiet:
            _say(summary(gpu.name, curve), sys.stdout)
        return 0
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as e:  # noqa: BLE001 - a bug: still one line, with a status of its
        # own so that tests tell it from bad input
        return _fail(f"internal error ({type(e).__name__}: {e}); please report this input", 1)
    finally:  # whatever happened (Ctrl-C too), no temporary file is left behind
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


if __name__ == "__main__":
    sys.exit(main())
