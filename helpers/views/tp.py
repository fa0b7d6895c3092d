"""Notebook 04's pictures: the route of a step through each tensor-parallel layout, and the
"when does TP pay" curve with its widget. `plot_*` return a Figure, `widget_*` a widget,
`TPCurveView.update` the widget's picture and sentence; nothing here displays."""
from __future__ import annotations

import html

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from helpers.cost.tp import LAYOUTS, TPHardware, best_t, describe, tp_curve
from helpers.cost.tp import Comm, Holds, Layer, layout_schedule
from helpers.views.kit import FULL_LABEL, Blitted, decade_label, fixed_layout, previewed

T_OPTIONS = (1, 2, 4, 8, 16, 32, 64)
HIDDEN_OPTIONS = tuple(2**k for k in range(8, 16))   # 256 … 32768
TOKEN_OPTIONS = tuple(2**k for k in range(7, 17))    # 128 … 65536 (b·s)


def plot_layouts(layers: int) -> Figure:
    """One strip per layout: the layers, what each rank holds between them, and the collectives
    on the way forward (above) and backward (below)."""
    fig = Figure(figsize=(12, 1.25 * len(LAYOUTS) + 0.4))
    axes = fig.subplots(len(LAYOUTS), 1)
    for ax, layout in zip(axes, LAYOUTS):
        x = 0.0
        for item in layout_schedule(layout, layers):
            if isinstance(item, Layer):
                color = "C0" if item.kind == "column" else "C1"
                ax.add_patch(Rectangle((x, -0.35), 1.1, 0.7, color=color, alpha=0.25))
                ax.text(x + 0.55, 0, f"{item.kind}\nW{item.index}", ha="center", va="center",
                        fontsize=8)
                x += 1.3
            elif isinstance(item, Comm):
                ax.axvline(x + 0.15, color="0.4", lw=0.8, ls="--", ymin=0.1, ymax=0.9)
                ax.text(x + 0.15, 0.62, item.forward, ha="center", color="C2", fontsize=9,
                        weight="bold")
                ax.text(x + 0.15, -0.72, item.backward, ha="center", color="C3", fontsize=9,
                        weight="bold")
                ax.text(x + 0.22, 0.3, item.operator, ha="left", color="0.3", fontsize=9,
                        style="italic")
                x += 0.3
            elif isinstance(item, Holds):
                ax.text(x + 0.45, 0, item.activation, ha="center", va="center", fontsize=8,
                        color="0.25")
                x += 0.9
        ax.set(xlim=(-0.1, x), ylim=(-0.9, 0.9), yticks=[], xticks=[])
        ax.set_ylabel(layout, rotation=0, ha="right", va="center")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    axes[0].set_title("forward collectives above (green), backward below (red); "
                      "AG all-gather, RS reduce-scatter, AR all-reduce", fontsize=9)
    fig.tight_layout()
    return fig


def plot_curve(hidden: int, hardware: TPHardware, tokens: int, t: int | None = None,
               ax=None) -> Figure:
    """Compute and communication time per layer against t (log-log), the chosen t marked.
    Draws on `ax` when given (and returns its figure)."""
    widget = ax is None
    if widget:   # fixed margins: no layout engine re-run on every redraw of the widget
        fig = Figure(figsize=(6.4, 3.6))
        fig.subplots_adjust(left=0.12, right=0.98, bottom=0.14, top=0.92)
        ax = fig.subplots()
    rows = tp_curve(hidden, hardware, tokens)
    ts = [r.t for r in rows]
    ax.plot(ts, [r.compute_s * 1e6 for r in rows], "o-", label="compute / rank")
    ax.plot(ts[1:], [r.comm_s * 1e6 for r in rows[1:]], "s-", label="communication / rank")
    ax.plot(ts, [r.step_s * 1e6 for r in rows], "k--", lw=1, label="step (no overlap)")
    node, inner = hardware.links[0]
    if node is not None:  # shade the t that fit on the innermost (fastest) link
        ax.axvspan(1, node, color="C2", alpha=0.08, label=f"{inner.name}, t ≤ {node}")
    ax.axvline(best_t(rows), color="grey", lw=0.8, ls=":", label=f"fastest t = {best_t(rows)}")
    if t is not None:
        ax.axvline(t, color="C3", lw=1.5, alpha=0.5, label=f"t = {t}")
    ax.set(xscale="log", yscale="log", xlabel="tensor degree t", ylabel="µs per layer per step")
    ax.set_xticks(ts, [str(v) for v in ts])
    ax.minorticks_off()   # the labelled powers of two and decades are enough (and cheap to draw)
    ax.yaxis.set_major_formatter(decade_label)   # plain-text decades, no mathtext to lay out
    title = f"{hardware.name}: h = {hidden}, b·s = {tokens}"
    if widget:   # an explicit y: the title is not re-placed by measuring the tick labels
        ax.set_title(title, y=1.0)
        fixed_layout(ax, xlabel_y=-0.1, ylabel_x=-0.1)
    else:
        ax.set_title(title)
    ax.legend(fontsize=8)
    return ax.figure


class TPCurveView:
    """The widget's figure: one per (h, b·s, hardware) setting, drawn once (the last few are
    kept); a move of t only moves its marker over the saved pixels (`Blitted`), so it costs
    the PNG encoding, not a draw. `update` returns the PNG and the sentence, and is what the
    widget calls (callable without a browser)."""

    KEEP = 8

    def __init__(self, choices: dict[str, TPHardware]):
        self.choices = choices
        self._drawn: dict[tuple, tuple] = {}   # (h, b·s, hardware) -> (Blitted, line, label)

    def update(self, t: int, hidden: int, tokens: int, hardware: str) -> tuple[bytes, str]:
        key = (hidden, tokens, hardware)
        if key not in self._drawn:
            fig = plot_curve(hidden, self.choices[hardware], tokens)
            ax = fig.axes[0]
            line = ax.axvline(t, color="C3", lw=1.5, alpha=0.5)
            label = ax.text(t, 0.97, "", transform=ax.get_xaxis_transform(), color="C3",
                            fontsize=9, va="top")
            if len(self._drawn) >= self.KEEP:
                self._drawn.pop(next(iter(self._drawn)))
            self._drawn[key] = (Blitted(fig, [line, label]), line, label)
        blit, line, label = self._drawn[key]
        line.set_xdata([t, t])
        label.set_x(t)
        # right of the line, or left of it in the axis' right half (not cut at the edge)
        lo, hi = label.axes.get_xlim()   # a log axis: its middle is the geometric mean
        right_half = t * t > lo * hi
        label.set_horizontalalignment("right" if right_half else "left")
        label.set_text(f"t = {t} " if right_half else f" t = {t}")
        return blit.png(), describe(t, hidden, self.choices[hardware], tokens)


def widget_when_tp_pays(choices: dict[str, TPHardware], t: int, hidden: int,
                        tokens: int) -> W.Widget:
    """Sliders for t, h and b·s (powers of two, acting on release) and a link menu over a
    `TPCurveView`: the picture is an Image widget whose bytes are replaced, and the sentence an
    HTML widget, so nothing is cleared and displayed again."""
    common = dict(continuous_update=False, style=FULL_LABEL,
                  layout=W.Layout(width="520px"))  # act on release: no queue of redraws
    controls = dict(
        t=W.SelectionSlider(options=T_OPTIONS, value=t, description="t (tensor degree)", **common),
        hidden=W.SelectionSlider(options=HIDDEN_OPTIONS, value=hidden,
                                 description="h (hidden size)", **common),
        tokens=W.SelectionSlider(options=TOKEN_OPTIONS, value=tokens,
                                 description="b·s (tokens per step)", **common),
        hardware=W.Dropdown(options=list(choices), description="GPUs and links",
                            style=FULL_LABEL,
                            layout=W.Layout(width="520px")))
    view = TPCurveView(choices)
    image = W.Image(format="png", layout=W.Layout(width="512px"))
    text = W.HTML()

    def redraw(*_):
        picture, sentence = view.update(**{k: c.value for k, c in controls.items()})
        image.value = picture
        text.value = f"<pre style='font-size: 12px'>{html.escape(sentence)}</pre>"

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return previewed(W.VBox([*controls.values(), image, text]))
