"""`python -m helpers.simulator`: one configuration's curve, written as JSON.

    python -m helpers.simulator --preset "H100 SXM" --json out.json
    python -m helpers.simulator --config my_gpu.json --sparse --months 6 --json out.json

Settings come from the spec's defaults, then the config file's "settings" section, then
the flags given here. A record or setting that cannot work stops with one message naming
the field (exit status 2) before anything is computed.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from helpers.hardware import PRESETS

from .config import load_config, preset, validate
from .curve import run_curve
from .report import dumps, price_of
from .settings import BATCH_LAWS, Settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m helpers.simulator",
                                description="Largest efficient training runs (Erdil & "
                                            "Schneider-Joseph 2024 cost model).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME",
                     help="one of: " + ", ".join(f'"{n}"' for n in PRESETS))
    src.add_argument("--config", metavar="FILE.json",
                     help="a hardware record as JSON (spec §1), optionally with \"settings\"")
    p.add_argument("--sparse", action="store_true", default=None,
                   help="mixture-of-experts models (the spec's sparsity law)")
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
    settings = settings or Settings()
    overrides = {"sparse": args.sparse, "batch_law": args.batch_law, "months": args.months,
                 "threshold": args.threshold, "price_per_gpu": args.price_per_gpu}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    validate(gpu, settings)
    return gpu, settings


def summary(name: str, curve) -> str:
    def fmt(p):
        if p is None:
            return "none"
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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        gpu, settings = build(args)
    except ValueError as e:
        print(f"python -m helpers.simulator: error: {e}", file=sys.stderr)
        return 2
    curve = run_curve(gpu, settings)
    Path(args.json).write_text(dumps({gpu.name: curve}) + "\n")
    if not args.quiet:
        print(summary(gpu.name, curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
