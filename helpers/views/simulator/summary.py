"""What notebook 06's app says in words and tables: a configuration's three summary
points (`summary_rows`) and their table (`summary_html`), one grid point in one line
(`describe`), and the complete output as a JSON download (`download_html`). Pure functions of
`Curve`s and their points.
"""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass

from helpers.simulator.curve import Curve, Point
from helpers.simulator.report import SECONDS_PER_MONTH, dumps, price_of


@dataclass(frozen=True)
class SummaryCell:
    """One summary point of a configuration; every field None where no point qualifies."""

    compute_flop: float | None = None
    mfu: float | None = None
    n_gpus: float | None = None
    months: float | None = None
    cost_usd: float | None = None

    @classmethod
    def of(cls, point: Point | None, price: float | None) -> "SummaryCell":
        if point is None or not point.feasible:
            return cls()
        return cls(float(point.model.C), point.mfu, point.plan.n_gpus,
                   point.run_time_s / SECONDS_PER_MONTH,
                   None if price is None else price * point.plan.n_gpus)


@dataclass(frozen=True)
class SummaryRow:
    """A configuration's three summary points (the `Curve` methods' names)."""

    configuration: str
    price_per_gpu: float | None
    linear_scaling_ends: SummaryCell
    max_feasible_at_threshold: SummaryCell
    largest_feasible: SummaryCell


SUMMARIES = (("linear_scaling_ends", "linear scaling ends"),
             ("max_feasible_at_threshold", "largest compute at MFU ≥ τ × ceiling"),
             ("largest_feasible", "largest feasible run"))


def summary_rows(curves: dict[str, Curve]) -> list[SummaryRow]:
    """Per configuration, the three summary points with GPUs, duration and cost."""
    rows = []
    for name, curve in curves.items():
        price = price_of(curve)
        rows.append(SummaryRow(name, price, **{
            attr: SummaryCell.of(getattr(curve, attr)(), price) for attr, _ in SUMMARIES}))
    return rows


def describe(point: Point, price: float | None = None) -> str:
    """One line that says what a grid point is and how the search parallelised it."""
    m = point.model
    head = (f"C = {m.C:.3g} FLOP (width {m.d}, L = {m.L}, experts {m.s}, "
            f"{m.B:.3g} tokens per batch)")
    q = point.plan
    if q is None:
        return head + ": infeasible — no cluster of up to experts × 2^59 GPUs finishes in time"
    sched = "zero-bubble" if q.zero_bubble else f"1F1B, v = {q.v}"
    cost = "" if price is None else f", ${price * q.n_gpus:.3g} of GPUs"
    return (f"{head}: {q.n_gpus:.3g} GPUs, MFU {point.mfu:.3f}, "
            f"{point.run_time_s / SECONDS_PER_MONTH:.2f} months{cost}\n"
            f"    TP ({q.tp_model}, {q.tp_ff}), PP {q.pp} ({sched}, m = {q.m}), DP {q.dp}, "
            f"EP {q.ep}; per level {q.degrees_on_levels()}")


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


_CELLS = (("compute_flop", ".3g"), ("mfu", ".3f"), ("n_gpus", ".3g"), ("months", ".2f"),
          ("cost_usd", ".3g"))


def summary_html(rows: list[SummaryRow]) -> str:
    """The largest-runs table: one line per configuration and summary point, in narrow
    columns, so it fits the tab. The cost column shows only where some configuration has a
    cited price (notebook 06 cites one for the GTX 580 only; none is invented for the
    others), and the note under the table names the configurations without one."""
    priced = any(r.price_per_gpu is not None for r in rows)
    cells = _CELLS if priced else tuple(c for c in _CELLS if c[0] != "cost_usd")
    head = ("<tr><th>configuration</th><th>summary point</th><th>C (FLOP)</th><th>MFU</th>"
            "<th>GPUs</th><th>months</th>" + ("<th>cost (USD)</th>" if priced else "") + "</tr>")
    body = []
    for r in rows:
        for k, (attr, label) in enumerate(SUMMARIES):
            c = getattr(r, attr)
            name = html.escape(r.configuration) if k == 0 else ""
            top = " style='border-top:1px solid #999'" if k == 0 else ""
            body.append(f"<tr{top}><td>{name}</td><td>{html.escape(label)}</td>" + "".join(
                f"<td>{_fmt(getattr(c, key), spec)}</td>" for key, spec in cells) + "</tr>")
    unpriced = [html.escape(r.configuration) for r in rows if r.price_per_gpu is None]
    note = ("" if not priced else "cost = GPUs × price per GPU (hardware only); — where no "
            "point qualifies" + (f" or no price is cited ({', '.join(unpriced)})" if unpriced
                                  else "") + ".")
    return ("<table cellpadding='3' style='font-size:12px;border-collapse:collapse;max-width:100%'>"
            + head + "".join(body) + "</table>"
            + (f"<p style='font-size:12px'>{note}</p>" if note else ""))


_BUTTON = ("display:inline-block;padding:5px 14px;background:#1976d2;color:#fff;"
           "border-radius:4px;text-decoration:none;font-weight:600;cursor:pointer")


def download_html(curves: dict[str, Curve], filename: str = "simulator_output.json") -> str:
    """A download button (an anchor styled as one) for the complete output, the CLI's JSON."""
    payload = base64.b64encode(dumps(curves).encode()).decode()
    n = len(curves)
    return (f'<a download="{filename}" href="data:application/json;base64,{payload}" '
            f'style="{_BUTTON}" title="the format of python -m helpers.simulator --json">'
            f"⬇ Download results ({n} configuration{'s' if n != 1 else ''}, JSON)</a>")
