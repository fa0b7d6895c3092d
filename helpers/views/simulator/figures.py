"""Notebook 06's figures, pure functions of `Curve`s and their points: MFU against
compute (`plot_mfu`), the best layout's degrees against compute (`plot_degrees`), and why one
step takes the time it does (`plot_breakdown`, from `breakdown_parts`), with the app's cheap
redraw of that breakdown (`BreakdownView`). Every figure is redrawn as a control moves, so none
lays out mathtext or measures tick labels (see helpers.views.kit).
"""
from __future__ import annotations

from matplotlib.figure import Figure

from helpers.simulator.curve import Curve, Point
from helpers.simulator.report import bubble_seconds
from helpers.simulator.settings import Settings
from helpers.views.kit import Blitted, decade_label, fixed_layout, png


def same_curve(a: Curve, b: Curve) -> bool:
    """Two curves with the same points (compute and MFU): one would hide the other."""
    return [(p.model.C, p.mfu) for p in a.points] == [(p.model.C, p.mfu) for p in b.points]


def plot_mfu(curves: dict[str, Curve], relative: bool = False) -> Figure:
    """MFU against training compute, one line per configuration.

    Each curve gets its bar, τ × its ceiling, as a dashed line of its colour, a star on its
    largest compute at or above the bar and a circle where linear scaling ends. With
    `relative`, MFU is divided by each GPU's ceiling (its effective utilization), so GPUs
    with different ceilings share one bar, τ. A curve identical to an earlier one is drawn
    dashed and hollow and says so in the legend instead of hiding under it.
    """
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    seen: list[tuple[str, Curve]] = []
    for name, curve in curves.items():
        scale = 1 / curve.gpu.effective_utilization if relative else 1.0
        pts = curve.feasible
        twin = next((other for other, c in seen if same_curve(c, curve)), None)
        label = (name if twin is None or f"(= {twin})" in name
                 else f"{name} (same curve as {twin})")
        style = dict(marker=".") if twin is None else dict(ls="--", marker="o", mfc="none",
                                                           ms=7)
        line, = ax.plot([p.model.C for p in pts], [p.mfu * scale for p in pts], label=label,
                        **style)
        color = line.get_color()
        ax.axhline(curve.mfu_bar * scale, color=color, ls="--", lw=0.8, alpha=0.7)
        end = curve.linear_scaling_ends()
        if end is not None and end.feasible:
            ax.plot([end.model.C], [end.mfu * scale], "o", mfc="none", ms=10, color=color)
        best = curve.max_feasible_at_threshold()
        if best is not None:
            ax.plot([best.model.C], [best.mfu * scale], "*", ms=13, color=color, mec="black",
                    mew=0.6)
        if len(curve.points) > len(pts):  # the latency wall: first infeasible grid point
            ax.axvline(curve.points[-1].model.C, color=color, ls=":", lw=1)
        seen.append((name, curve))
    ax.set_xscale("log")
    ax.minorticks_off()   # decades only: minor ticks cost most of a redraw
    # plain-text tick labels and pinned title and labels: redrawn on every slider release,
    # so nothing is laid out by mathtext or placed by measuring ticks (as plot_degrees)
    ax.xaxis.set_major_formatter(decade_label)
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("MFU ÷ the GPU's ceiling" if relative else "MFU (against peak FLOP/s)")
    fixed_layout(ax, xlabel_y=-0.08, ylabel_x=-0.08)
    ax.set_ylim(0, 1.05 if relative else 1)
    ax.grid(alpha=0.3)
    if seen:  # with every configuration unticked there is nothing to name
        ax.legend(fontsize=8, loc="upper right")
    ax.set_title("dashed: τ × ceiling · ★ largest compute at or above it · ○ linear scaling "
                 "ends · dotted: first infeasible point", fontsize=9, y=1.0)
    return fig


DEGREES = (("dp", "DP"), ("tp_model", "TP_model"), ("tp_ff", "TP_ff"), ("pp", "PP"),
           ("ep", "EP"), ("m", "micro-batches m"))


def plot_degrees(curve: Curve, name: str = "") -> Figure:
    """How each parallel degree of the best layout grows with compute."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    pts = curve.feasible
    for attr, label in DEGREES:
        ax.plot([p.model.C for p in pts], [getattr(p.plan, attr) for p in pts],
                marker=".", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.minorticks_off()
    # plain-text tick labels and pinned title and labels: redrawn on every choice of the
    # configuration menu, so nothing is laid out by mathtext or placed by measuring ticks
    ax.xaxis.set_major_formatter(decade_label)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    ax.set_xlabel("training compute C (FLOP)")
    ax.set_ylabel("degree")
    fixed_layout(ax, xlabel_y=-0.08, ylabel_x=-0.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(name, y=1.0)
    return fig


def breakdown_parts(point: Point, settings: Settings) -> dict[str, float]:
    """Seconds of one step by cause, as the model charges them (exposed latency only).

    The matmul time is split: its fixed latency per matmul (a floor no number of GPUs
    lowers) and the rest, arithmetic or memory traffic."""
    t = point.plan.time
    lat = t.dp_lat + (0.0 if point.plan.zero_bubble else t.tp_lat + t.ppep_lat)
    floor = point.matmul_latency_s
    return {"matmul arithmetic": t.matmul - floor, "matmul latency floor": floor,
            "TP bandwidth": t.tp_bw, "PP/EP bandwidth": t.ppep_bw,
            "DP bandwidth": t.dp_bw, "network latency": lat,
            "bubble": bubble_seconds(t, settings)}


def plot_breakdown(point: Point, settings: Settings, title: str = "") -> Figure:
    """Why utilization falls: each cause of one step's time next to the step itself."""
    fig = Figure(figsize=(8, 3.4))
    # fixed margins, wide enough for the longest cause's name: tight_layout would measure every
    # label, and cost about as much as the draw itself
    fig.subplots_adjust(left=0.22, right=0.98, top=0.9, bottom=0.2)
    ax = fig.subplots()
    if point.plan is None:
        ax.text(0.5, 0.5, "infeasible: no cluster finishes in time", ha="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    parts = breakdown_parts(point, settings)
    hidden = {"TP bandwidth": settings.overlap_tp, "PP/EP bandwidth": settings.overlap_pp,
              "DP bandwidth": settings.overlap_dp}
    names = list(parts)[::-1]
    colors = ["#bbb" if hidden.get(n) else "C1" if n == "matmul latency floor" else "C0"
              for n in names]
    ax.barh(names, [parts[n] for n in names], color=colors)
    ax.axvline(point.plan.time.step, color="C3", lw=1.5, label="step time")
    ax.set_xlabel("seconds per training step")
    fixed_layout(ax, xlabel_y=-0.14, ylabel_x=-0.25)
    ax.set_title(title or breakdown_title(point), fontsize=10, y=1.0)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, "grey: overlaps the matmuls (only its excess over them costs time); "
             "orange: the fixed latency of every matmul", fontsize=8)
    return fig


def breakdown_title(point: Point) -> str:
    q = point.plan
    return f"C = {point.model.C:.3g} FLOP on {q.n_gpus:.3g} GPUs, MFU {point.mfu:.3f}"


class BreakdownView:
    """The step breakdown of one curve's grid points as the widget shows it: the figure is drawn
    once; a move to another feasible point redraws only what changes (the bars, the step line,
    the title, the seconds axis and the legend above them) over the saved pixels. An infeasible
    point is drawn on its own."""

    def __init__(self, curve: Curve):
        self.curve = curve
        self._blit = None

    def png(self, index: int) -> bytes:
        point = self.curve.points[index]
        if point.plan is None:
            return png(plot_breakdown(point, self.curve.settings))
        if self._blit is None:
            fig = plot_breakdown(point, self.curve.settings)
            ax = fig.axes[0]
            self._ax, self._bars, self._line = ax, list(ax.patches), ax.lines[0]
            self._blit = Blitted(fig, [*self._bars, self._line, ax.xaxis, ax.title,
                                       ax.get_legend()])
        parts = breakdown_parts(point, self.curve.settings)
        step = point.plan.time.step
        names = list(parts)[::-1]   # as plot_breakdown draws them, bottom to top
        for bar, name in zip(self._bars, names):
            bar.set_width(parts[name])
        self._line.set_xdata([step, step])
        # The limits a fresh draw gets: the bars with matplotlib's 5% margin, widened to the
        # step line only where it falls beyond them (axvline rescales only then).
        right = 1.05 * max(parts.values())
        self._ax.set_xlim(0, right if step <= right else 1.05 * step)
        self._ax.title.set_text(breakdown_title(point))
        return self._blit.png()
