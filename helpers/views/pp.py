"""The pipeline picture: one row per rank, one bar per forward (F) or backward (B)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch


def _colour(mb: int):
    return plt.get_cmap("tab10")(mb % 10)


def plot_gantt(events: list[dict], p: int, title: str = "", ax=None, unit: str = "ms"):
    """Draw an event log (as returned by `run_pipeline` or `simulate`).

    Each micro-batch has its own colour: its forwards are pale, its backwards solid and
    hatched, so a reader can follow one micro-batch down the ranks and back up. White space
    is the bubble. Times are shifted so the schedule starts at 0; `unit` labels the axis.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(10, max(2.6, 0.5 * p + 1.4)), layout="constrained")
    t0 = min(e["start"] for e in events)
    scale = 1e3 if unit == "ms" else 1.0
    span = (max(e["end"] for e in events) - t0) * scale
    for e in events:
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        forward = e["kind"] == "F"
        ax.barh(e["rank"], width, left=start, height=0.8, color=_colour(e["mb"]),
                alpha=0.45 if forward else 0.95, hatch=None if forward else "//",
                edgecolor="black", linewidth=0.4)
        if width > span / 60:  # label the bar only when there is room
            label = f"{e['kind']}{e['mb']}" + (f".{e['chunk']}" if e.get("chunk") else "")
            ax.text(start + width / 2, e["rank"], label, ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time (units of t_F)")
    mbs = sorted({e["mb"] for e in events})
    handles = [Patch(facecolor=_colour(i), edgecolor="black", label=f"mb {i}") for i in mbs[:10]]
    handles += [Patch(facecolor="white", edgecolor="black", alpha=0.45, label="F: pale"),
                Patch(facecolor="grey", edgecolor="black", hatch="//", label="B: hatched")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_runs(runs, unit: str = "ms"):
    """Several runs (objects with .events, .p and .summary()) stacked on one time axis."""
    runs = list(runs)
    height = sum(max(2.6, 0.5 * r.p + 1.4) for r in runs)  # room for the legend
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, height), sharex=True, squeeze=False,
                             layout="constrained")
    for ax, run in zip(axes[:, 0], runs):
        plot_gantt(run.events, run.p, title=run.summary(), ax=ax, unit=unit)
    widest = max(max(e["end"] for e in r.events) - min(e["start"] for e in r.events) for r in runs)
    axes[0, 0].set_xlim(0, widest * (1e3 if unit == "ms" else 1.0) * 1.01)  # shared by all
    return fig
