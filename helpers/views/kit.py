"""What every view uses and none is about: axes that redraw cheaply, figures turned into PNG
bytes (once, or again and again over saved pixels), the notebook outputs that carry them,
and the few words and settings every view writes the same way.

A view module takes these from here, never from another view module, so each of those keeps
to its notebook's topic.
"""
from __future__ import annotations

import base64
import io
import math

import numpy as np
from matplotlib.figure import Figure

# --- controls ---------------------------------------------------------------------------

FULL_LABEL = {"description_width": "initial"}   # a control's style: its description never cut


def aligned(label_px: int) -> dict:
    """A style for a column of sliders: every description `label_px` wide (wide enough for the
    longest), so every track starts at the same place and, at one layout width, has the same
    length."""
    return {"description_width": f"{label_px}px"}


# --- axes that a widget redraws cheaply -------------------------------------------------

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def decade_label(value: float, _pos=None) -> str:
    """A log axis's tick label as plain text ("10³", "0.1" … "100"): matplotlib's default is
    mathtext, whose layout is most of a small figure's draw time in a widget."""
    if value <= 0:
        return ""
    exponent = round(math.log10(value))
    if not math.isclose(value, 10.0 ** exponent, rel_tol=1e-9):
        return f"{value:g}"
    if -1 <= exponent <= 2:
        return f"{value:g}"
    return "10" + str(exponent).translate(_SUPERSCRIPT)


def fixed_layout(ax, xlabel_y: float = -0.12, ylabel_x: float = -0.1) -> None:
    """Pin the axis labels where fixed margins put them, so a redraw does not measure every tick
    label to place them (with a title given an explicit y, the other half of a small figure's
    draw time)."""
    ax.xaxis.set_label_coords(0.5, xlabel_y)
    ax.yaxis.set_label_coords(ylabel_x, 0.5)


# --- figures as PNG bytes ---------------------------------------------------------------

def png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (one draw; no tight bounding box, which draws twice)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class Blitted:
    """A figure drawn once; afterwards only `moving` artists are redrawn over the saved
    background and the pixels encoded (what makes a slider move cheap)."""

    def __init__(self, fig: Figure, moving: list, dpi: int = 80):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        fig.set_dpi(dpi)
        self.figure, self.moving = fig, moving
        self.canvas = FigureCanvasAgg(fig)
        for artist in moving:
            artist.set_animated(True)
        self.canvas.draw()
        fig.set_layout_engine("none")   # the layout is settled; do not redo it per frame
        self.background = self.canvas.copy_from_bbox(fig.bbox)

    def set_moving(self, artists: list) -> None:
        """Draw these artists over the background from now on (in this order)."""
        for artist in artists:
            artist.set_animated(True)
        self.moving = list(artists)

    def png(self) -> bytes:
        from PIL import Image
        self.canvas.restore_region(self.background)
        for artist in self.moving:
            self.figure.draw_artist(artist)
        buffer = io.BytesIO()
        # zlib's fastest level: 40% less time to encode than the default, 15% more bytes
        Image.fromarray(np.asarray(self.canvas.buffer_rgba())).save(buffer, format="png",
                                                                     compress_level=1)
        return buffer.getvalue()


# --- notebook outputs (what an Output widget's `outputs` takes, no display hook) ---------

def png_output(fig: Figure) -> dict:
    """A figure as one display_data output (PNG bytes encoded here, not by a display hook)."""
    return image_output(png(fig, dpi=90), fig.axes[0].get_title() if fig.axes else "")


def image_output(png_bytes: bytes, title: str = "") -> dict:
    """PNG bytes as one display_data output."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(png_bytes).decode("ascii"),
                     "text/plain": f"<Figure: {title}>"}}


def text_output(text: str) -> dict:
    """A line of text as one stdout stream output."""
    return {"output_type": "stream", "name": "stdout", "text": text + "\n"}


# --- what a widget shows where no kernel runs it -----------------------------------------

# Where a widget cannot run (GitHub's viewer, nbconvert's HTML, a notebook opened before Run
# All), its output shows this line, or the picture it first drew, instead of a Python repr.
RUN_FIRST = ("[a live widget: run the cells above (Run ▸ Run All Cells) in Jupyter to use its "
             "controls]")


def first_picture(widget) -> bytes | None:
    """The first picture `widget` shows now (depth first): a W.Image's PNG bytes, or an image
    among an Output widget's outputs; None when it shows none."""
    import ipywidgets as W
    if isinstance(widget, W.Image) and widget.format == "png" and widget.value:
        return bytes(widget.value)
    if isinstance(widget, W.Output):
        for output in widget.outputs:
            encoded = output.get("data", {}).get("image/png")
            if encoded:
                return base64.b64decode(encoded)
    for child in getattr(widget, "children", ()):
        picture = first_picture(child)
        if picture:
            return picture
    return None


def previewed(widget):
    """`widget`, displayed with a stand-in for a reader without a kernel: beside the live
    view, its output carries the widget's first picture (image/png) and RUN_FIRST (text/plain).
    A live JupyterLab draws the widget; anything that cannot draws the picture, or the line
    where the widget has no picture yet (a run button, printed text). The committed notebooks
    keep these and drop the live view (scripts/strip_notebooks.py): no widget state."""
    picture = first_picture(widget)
    live = widget._repr_mimebundle_

    def bundle(**kwargs):
        data = dict(live(**kwargs) or {})
        data["text/plain"] = RUN_FIRST
        if picture:
            data["image/png"] = base64.b64encode(picture).decode("ascii")
        return data

    widget._repr_mimebundle_ = bundle
    return widget
