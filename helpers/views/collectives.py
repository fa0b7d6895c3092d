"""Notebook 01's pictures: one row per rank, the tensor before and after, cells coloured by
value; and the widget that re-runs every collective on live ranks."""
from __future__ import annotations

import atexit
import html
import queue
import threading
from dataclasses import dataclass

import ipywidgets as W
import numpy as np
from matplotlib import colormaps
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from helpers.labs.collectives import expected, run_all
from helpers.parallel.collectives import OPS, SPLITTING_OPS
from helpers.views.kit import FULL_LABEL, png, previewed

MAX_WORLD_SIZE = 8   # the world-size slider's end
MAX_LENGTH = 16             # the length slider's end
DIGIT_CELLS = 16            # a block shows its numbers when a cell is at least 1/16 of it
GAP = 1.6                   # cells between the before and after blocks
CMAP = colormaps["viridis"]
MAX_DIGIT_PT = 8.5          # digits no larger than this
# ... and no smaller: 7.5 pt is 8 px at the widget's 80 dpi, the smallest text the course shows
# (4.5 pt digits came out about 4 px tall at 8 ranks x 16 elements); below it a block shows
# colours only, and says so
MIN_DIGIT_PT = 7.5
MIN_CELLS_ACROSS = 14       # a panel is at least this many cells wide (no stretched cells)


def _grid(tensors: list, length: int) -> np.ndarray:
    """Ranks x cells, NaN where a rank holds nothing (drawn blank)."""
    grid = np.full((len(tensors), max(length, 1)), np.nan)
    for row, tensor in enumerate(tensors):
        if tensor is not None:
            grid[row, :len(tensor)] = tensor.tolist()
    return grid


def _separators(x0: float, x1: float, rows: int, every: float, cells: int):
    """White lines between cells (`every` wide, `cells` of them) and between ranks."""
    segments = [((x0 + every * i, 0), (x0 + every * i, rows)) for i in range(1, cells)]
    segments += [((x0, r), (x1, r)) for r in range(1, rows)]
    return segments


@dataclass(frozen=True)
class _Block:
    """One side (before or after) of one panel, in cell units."""
    grid: np.ndarray      # ranks x cells, NaN = holds nothing
    x0: float
    cell: float           # width of one cell (1, or less when shrunk)
    chunk: int            # cells per source rank when shrunk, else 0

    @property
    def width(self) -> float:
        return self.cell * self.grid.shape[1]


def _blocks(results: list[dict]) -> tuple[_Block, _Block]:
    befores = [r.before for r in results]
    afters = [r.after for r in results]
    before_len = max([len(t) for t in befores if t is not None] + [1])
    after_len = max([len(t) for t in afters if t is not None] + [1])
    after_width = min(after_len, max(before_len, DIGIT_CELLS))
    shrunk = after_width < after_len
    before = _Block(_grid(befores, before_len), 0.0, 1.0, 0)
    after = _Block(_grid(afters, after_len), before_len + GAP, after_width / after_len,
                   before_len if shrunk else 0)
    return before, after


def _draw(ax, op: str, results: list[dict], x_max: float, digits: int) -> None:
    """One collective on one Axes: what each rank held before and after `op`.

    Cells are coloured by value (one image per block, white separators in one collection)
    and numbered, the digits sized to the cell. A block whose
    rows are long (gather and all-gather on many ranks: world size x length cells) is
    shrunk to DIGIT_CELLS cells' width, drawn without digits, and cut into one chunk per
    source rank."""
    world_size = len(results)
    before, after = _blocks(results)
    hi = max(np.nanmax(b.grid) if not np.isnan(b.grid).all() else 0 for b in (before, after))
    hi = max(hi, 1.0)
    ax.set_xlim(-2.2, x_max)
    ax.set_ylim(-0.9, world_size + 0.9)
    cell_pt = 72 * ax.get_position().width * ax.figure.get_figwidth() / (x_max + 2.2)
    # The top of the colour scale stays mid-green, so white digits read on every cell.
    image = dict(cmap=CMAP, vmin=-0.1 * hi, vmax=1.35 * hi, interpolation="nearest",
                 aspect="auto", origin="upper")
    segments = []
    colours_only = False
    for block in (before, after):
        x1 = block.x0 + block.width
        ax.imshow(block.grid, extent=(block.x0, x1, 0, world_size), **image)
        step = block.cell * (block.chunk or 1)
        cuts = round(block.width / step)
        segments += _separators(block.x0, x1, world_size, step, cuts)
        size = min(MAX_DIGIT_PT, 0.9 * block.cell * cell_pt / (0.62 * digits))
        for rank in range(world_size):
            y = world_size - 1 - rank + 0.5
            row = block.grid[rank]
            if np.isnan(row).all():
                ax.text(block.x0 + 0.2, y, "—", va="center", color="0.5", fontsize=8)
            elif not block.chunk and size < MIN_DIGIT_PT:
                colours_only = True
            elif not block.chunk:
                for i, v in enumerate(row):
                    if not np.isnan(v):
                        ax.text(block.x0 + block.cell * (i + 0.5), y, f"{v:g}", ha="center",
                                va="center", fontsize=size, color="white")
    ax.add_collection(LineCollection(segments, colors="white", linewidths=1.2))
    for rank in range(world_size):
        ax.text(-0.3, world_size - rank - 0.5, f"rank {rank}", ha="right", va="center",
                fontsize=8)
    for block, name in ((before, "before"), (after, "after")):
        ax.text(block.x0 + block.width / 2, world_size + 0.15, name, ha="center",
                va="bottom", fontsize=9, weight="bold")
    notes = []
    if after.chunk:
        chunks = round(after.width / (after.cell * after.chunk))
        notes.append(f"after: {chunks} chunks of {after.chunk}, rank 0's … rank {chunks - 1}'s "
                     "(colours as in 'before')")
    if colours_only:
        notes.append("cells too small for digits: darker = smaller value")
    if notes:
        ax.text((before.width + after.x0 + after.width) / 2, -0.15, "\n".join(notes),
                ha="center", va="top", fontsize=8, color="0.3")
    ax.annotate("", xy=(after.x0 - 0.2, world_size / 2),
                xytext=(before.width + 0.2, world_size / 2),
                arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.set_title(op, fontsize=10, pad=2, loc="left")
    ax.axis("off")


def plot_collectives(results_by_op: dict[str, list[dict]], columns: int = 2,
                     title: str = "") -> Figure:
    """Every op of `results_by_op` ({op: per-rank before/after}), `columns` to a row, all
    panels with the same cell size. `title` goes above the panels with room of its own."""
    ops = list(results_by_op)
    rows = max(1, -(-len(ops) // columns))
    world_size = len(next(iter(results_by_op.values()))) if ops else 1
    layouts = [_blocks(results_by_op[op]) for op in ops]
    x_max = max([a.x0 + a.width for _, a in layouts] + [MIN_CELLS_ACROSS]) + 0.2
    values = [v for b, a in layouts for g in (b.grid, a.grid) for v in g[~np.isnan(g)]]
    digits = max([len(f"{v:g}") for v in values] + [1])
    panel_h = 0.9 + 0.3 * world_size
    head = 0.55 if title else 0.25
    fig = Figure(figsize=(6 * columns, panel_h * rows + head))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - head / fig.get_figheight(),
                        wspace=0.08, hspace=0.3 / panel_h)
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax, op, in zip(axes, ops):
        _draw(ax, op, results_by_op[op], x_max, digits)
    for ax in axes[len(ops):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, y=1 - 0.08 / fig.get_figheight(), va="top", fontsize=10)
    return fig


class CollectivesView:
    """The widget's callback without the widget: `update(world_size, length)` re-runs every
    collective on the live ranks (checked against `expected`: `run_all` raises if a rank
    differs) and returns the picture as PNG and a note.

    Drawing costs far more than the run, and a checked run's picture is the picture of
    `expected`, so pictures are drawn from `expected` once per (world size, length) and kept;
    after each move, a background thread draws the settings a reader is likely to move to
    next (one step either way on each slider, and both world-size extremes)."""

    def __init__(self, live, dpi: int = 72, prerender: bool = True):
        self.live, self.dpi, self.prerender = live, dpi, prerender
        self._pictures: dict[tuple[int, int], bytes] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._queued: set[tuple[int, int]] = set()
        self._drawing: tuple[tuple[int, int], threading.Event] | None = None
        self._worker: threading.Thread | None = None
        self._stopped = False
        atexit.register(self.stop)   # never leave the thread mid-draw at interpreter exit

    def stop(self) -> None:
        """Stop drawing ahead (waits for the picture being drawn, if any)."""
        self._stopped = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)

    def _draw(self, world_size: int, length: int) -> bytes:
        results = {op: expected(op, world_size, length) for op in OPS
                   if not (op in SPLITTING_OPS and length % world_size)}
        return png(plot_collectives(results), self.dpi)

    def picture(self, world_size: int, length: int) -> bytes:
        key = (world_size, length)
        with self._lock:
            if key in self._pictures:
                return self._pictures[key]
            drawing = self._drawing
        if drawing and drawing[0] == key:     # the background thread is on it: wait
            drawing[1].wait()
            return self._pictures[key]
        picture = self._draw(*key)
        with self._lock:
            self._pictures[key] = picture
        return picture

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            if key is None or self._stopped:
                return
            with self._lock:
                self._queued.discard(key)
                if key in self._pictures:
                    continue
                self._drawing = (key, threading.Event())
            picture = self._draw(*key)
            with self._lock:
                self._pictures.setdefault(key, picture)
                self._drawing[1].set()
                self._drawing = None

    def _draw_ahead(self, world_size: int, length: int) -> None:
        nearby = [(world_size + 1, length), (world_size - 1, length), (1, length),
                  (MAX_WORLD_SIZE, length), (world_size, length + 1),
                  (world_size, length - 1)]
        with self._lock:
            for w, n in nearby:
                key = (w, n)
                if (1 <= w <= MAX_WORLD_SIZE and 1 <= n <= MAX_LENGTH
                        and key not in self._pictures and key not in self._queued):
                    self._queued.add(key)
                    self._queue.put(key)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, daemon=True,
                                            name="collectives-draw-ahead")
            self._worker.start()

    def update(self, world_size: int, length: int) -> tuple[bytes, str]:
        done = run_all(self.live, world_size, length)
        picture = self.picture(world_size, length)
        if self.prerender and not self._stopped:
            self._draw_ahead(world_size, length)
        note = (f"world size {world_size}, length {length}: all {len(done.results)} "
                "collectives ran on the live ranks and matched their definition.")
        if done.skipped:
            note += (f" Skipped {', '.join(done.skipped)}: length {length} does not split "
                     f"into {world_size} equal chunks.")
        return picture, note


def widget_collectives(live) -> W.Widget:
    """Sliders for world size (1–8 ranks) and length (1–16 elements per rank), acting on
    release; reruns every collective on the live ranks and redraws."""
    style = FULL_LABEL
    size = W.IntSlider(value=min(live.world_size, MAX_WORLD_SIZE), min=1,
                       max=MAX_WORLD_SIZE, description="world size (ranks)",
                       continuous_update=False, style=style)
    length = W.IntSlider(value=4, min=1, max=MAX_LENGTH, description="length (elements per rank)",
                         continuous_update=False, style=style)
    view = CollectivesView(live)
    image = W.Image(format="png", layout=W.Layout(width="860px"))
    note = W.HTML()   # beside the picture, naming what it shows

    def redraw(*_):
        picture, text = view.update(size.value, length.value)
        image.value, note.value = picture, html.escape(text)

    size.observe(redraw, names="value")
    length.observe(redraw, names="value")
    redraw()
    return previewed(W.VBox([W.HBox([size, length]), note, image]))
