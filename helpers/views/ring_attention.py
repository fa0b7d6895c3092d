"""Notebook 09's ring-attention pictures: who computes which part of the causal triangle,
the per-rank timeline of a ring step with its waits, and step time and bytes against the
sequence length. Every `plot_*` returns a Figure."""
from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import LogLocator, ScalarFormatter

from helpers.cost.context import causal_work, chunks_of
from helpers.labs.ring_attention import RingStep


def plot_causal_split(c: int) -> Figure:
    """The causal score matrix cut into 2c × 2c blocks, each computed block coloured by the
    rank holding its queries (triangles: the diagonal's causal half), naive and zig-zag."""
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    n = 2 * c
    for ax, layout in zip(fig.subplots(1, 2), ("naive", "zigzag")):
        owner = {}
        for rank in range(c):
            for chunk in chunks_of(rank, c, layout):
                per = n // (c * len(chunks_of(rank, c, layout)))
                for a in range(chunk * per, (chunk + 1) * per):
                    owner[a] = rank
        for a in range(n):
            for b in range(a + 1):
                color = f"C{owner[a]}"
                if a == b:
                    ax.fill([b, b, b + 1], [a, a + 1, a + 1], color=color, alpha=0.8, lw=0)
                else:
                    ax.add_patch(Rectangle((b, a), 1, 1, color=color, alpha=0.8, lw=0))
        work = causal_work(c, layout)
        ax.set(xlim=(0, n), ylim=(n, 0), aspect="equal", xlabel="key position →",
               ylabel="query position →", xticks=[], yticks=[],
               title=f"{layout}: work per rank " + " : ".join(f"{w / min(work):.2g}" for w in work))
    fig.legend(handles=[Patch(color=f"C{r}", label=f"rank {r}") for r in range(c)],
               loc="outside right center", fontsize=8)
    return fig


def plot_ring_timeline(steps_by_layout: dict[str, list[RingStep]]) -> Figure:
    """One panel per layout, one row per rank: forward and backward compute and the waits for a
    neighbour's block, from each rank's spans (one clock for the whole machine), on one shared
    time axis."""
    fig = Figure(figsize=(10, 1.0 + 1.6 * len(steps_by_layout)), layout="constrained")
    # one time axis for every panel: the layouts' steps compare at a glance
    axes = fig.subplots(len(steps_by_layout), 1, squeeze=False, sharex=True)[:, 0]
    colors = {("compute", "forward"): "C0", ("compute", "backward"): "C1",
              ("wait", "forward"): "0.75", ("wait", "backward"): "0.55"}
    for ax, (layout, steps) in zip(axes, steps_by_layout.items()):
        origin = min(s.start for step in steps for s in step.spans)
        for rank, step in enumerate(steps):
            for span in step.spans:
                ax.barh(rank, (span.end - span.start) * 1e3, left=(span.start - origin) * 1e3,
                        color=colors[span.kind, span.phase], height=0.7)
        ax.set(yticks=range(len(steps)), yticklabels=[f"rank {r}" for r in range(len(steps))],
               ylim=(len(steps) - 0.5, -0.5), ylabel=layout)
    axes[-1].set_xlabel("ms since the first rank started")
    fig.legend(handles=[Patch(color=v, label=f"{k[0]} ({k[1]})") for k, v in colors.items()],
               loc="outside upper center", ncols=4, fontsize=8)
    return fig


@dataclass(frozen=True)
class ScalingPoint:
    c: int
    seq: int
    step_s: float
    sent_bytes: int
    formula_bytes: int


def plot_ring_scaling(points: list[ScalingPoint]) -> Figure:
    """Step time (left) and bytes sent per rank (right, measured dots on the formula's line)
    against the sequence length, one colour per c."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, c in enumerate(sorted({p.c for p in points})):
        mine = sorted((p for p in points if p.c == c), key=lambda p: p.seq)
        seqs = [p.seq for p in mine]
        left.plot(seqs, [p.step_s * 1e3 for p in mine], "o-", color=f"C{i}", label=f"c = {c}")
        if c > 1:
            right.plot(seqs, [p.formula_bytes / 1e6 for p in mine], "-", color=f"C{i}",
                       label=f"c = {c} formula")
            right.plot(seqs, [p.sent_bytes / 1e6 for p in mine], "o", color=f"C{i}",
                       label=f"c = {c} measured")
    for ax in (left, right):
        ax.set(xscale="log", xlabel="sequence length s (tokens)")
        ax.legend(fontsize=8)
    left.set(yscale="log", ylabel="forward + backward, ms", title="step time (zig-zag)")
    right.set(ylabel="MB sent per rank (1 MB = 10⁶ B)", title="bytes per rank per step")
    for ax in (left, right):
        ax.minorticks_off()
        ax.set_xticks(seqs, [str(s) for s in seqs])
    left.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    left.yaxis.set_major_formatter(ScalarFormatter())
    return fig
