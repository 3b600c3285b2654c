"""Figures out to bytes and files (PNG, SVG, PDF): format and scale checks, encoding, sizes, freeing."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core import outfile
from ..core.errors import InspectorError
from .drawing import _LOCK, DPI, HeatmapFigure, _style
from .fullres import CellImage

FORMATS = (".png", ".svg", ".pdf")
MIN_SCALE, MAX_SCALE = 0.1, 10.0
MAX_PIXELS = 150_000_000  # past this a PNG is unusable and Agg may run out of memory
MAX_SIDE = 32000
# a full-resolution head (figures.fullres) may take more: up to 16,384 cells a side plus margins, ~1.3 GB of canvas
MAX_FULL_PIXELS = 330_000_000


# ---------------------------------------------------------------------- checks
def check_format(path) -> str:
    """'png', 'svg' or 'pdf' from the file name; anything else is the user's to fix."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise InspectorError(f"export to a .png, .svg or .pdf file, got {Path(path).name!r}")
    return suffix[1:]


def check_scale(scale) -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise InspectorError(f"scale must be a number, got {scale!r}") from None
    if not (math.isfinite(s) and MIN_SCALE <= s <= MAX_SCALE):
        raise InspectorError(f"scale must be between {MIN_SCALE:g} and {MAX_SCALE:g}, got {scale!r}")
    return s


def scale_to_dpi(scale) -> float:
    return check_scale(scale) * DPI


# ---------------------------------------------------------------------- output
def pixel_size(fig: Figure, dpi: float | None = None) -> tuple[int, int]:
    """The PNG's width and height in pixels at ``dpi`` (the figure's own by default)."""
    d = fig.dpi if dpi is None else float(dpi)
    w, h = fig.get_size_inches()
    # Agg truncates, like this
    return max(1, int(w * d)), max(1, int(h * d))


# what each format records besides the title (no date: the same figure gives the same bytes)
_METADATA = {"png": {"Software": "gpt-inspector"}, "svg": {"Creator": "gpt-inspector", "Date": None},
             "pdf": {"Creator": "gpt-inspector", "CreationDate": None}}  # fmt: skip


def to_bytes(fig: Figure, fmt: str = "png", dpi: float | None = None) -> bytes:
    """The figure encoded as ``fmt`` ('png', 'svg' or 'pdf'); ``dpi`` sets a PNG's pixel density."""
    fmt = check_format(f"x.{fmt}")
    d = fig.dpi if dpi is None else float(dpi)
    full = getattr(fig, "full_resolution", False)
    if fmt == "png":
        if full and fig.layout_dpi is None:
            raise InspectorError("this full-resolution figure was laid out for SVG or PDF; build it again for a PNG")
        if full and abs(d - fig.layout_dpi) > 1e-6:  # its cells are whole pixels at that density only
            raise InspectorError(f"this full-resolution figure is laid out for {fig.layout_dpi:g} dpi, not {d:g}")
        w, h = pixel_size(fig, d)
        if w > MAX_SIDE or h > MAX_SIDE or w * h > (MAX_FULL_PIXELS if full else MAX_PIXELS):
            raise InspectorError(f"the image would be {w}x{h} pixels; use a smaller scale, SVG or PDF")
    buf = io.BytesIO()
    with _style():
        if not isinstance(fig.canvas, FigureCanvasAgg):
            FigureCanvasAgg(fig)
        try:
            fig.savefig(
                buf,
                format=fmt,
                dpi=d,
                facecolor="white",
                metadata={"Title": getattr(fig, "heading", "") or "", **_METADATA[fmt]},
            )
        except MemoryError:
            raise InspectorError("not enough memory for this image; use a smaller scale, SVG or PDF") from None
    return buf.getvalue()


def save(fig: Figure, path, dpi: float | None = None) -> Path:
    """Write ``fig`` as PNG (at ``dpi``), SVG or PDF, chosen by ``path``'s suffix."""
    path = Path(path)
    fmt = check_format(path)
    outfile.check_target(path)  # a folder or device named here is refused before the (possibly long) encoding
    data = to_bytes(fig, fmt, dpi)
    outfile.write_bytes(path, data)
    return path


def close(fig: Figure) -> None:
    """Let go of a figure's big buffers now (the Agg canvas, the drawn arrays) rather than at garbage collection.

    Without pyplot nothing else holds a figure, so dropping the last reference frees the rest;
    ``fig.clear()`` would cost more than the figure took to draw (it rebuilds every axis).
    """
    with _LOCK:
        canvas = fig.canvas
        if isinstance(canvas, FigureCanvasAgg) and hasattr(canvas, "renderer"):
            del canvas.renderer
        for ax in fig.axes:
            for im in ax.images:
                im.set_data(np.zeros((1, 1)))
            for art in ax.artists:
                if isinstance(art, CellImage):  # a full-resolution head's (T, T, 4) buffer
                    art.rgba = np.zeros((1, 1, 4), dtype=np.uint8)
        if isinstance(fig, HeatmapFigure):
            fig.panel_values = []


def cell_center(
    fig: HeatmapFigure, row: int, col: int, dpi: float | None = None, panel: int = 0
) -> tuple[float, float]:
    """Where position (``row``, ``col``) of heatmap ``panel`` lies in a PNG at ``dpi``, as (x, y) from the top left."""
    d = fig.dpi if dpi is None else float(dpi)
    ax = fig.heatmaps[panel]
    x, y = ax.transData.transform((col, row))  # display pixels at fig.dpi, from the bottom
    s = d / fig.dpi
    return x * s, fig.get_size_inches()[1] * d - y * s
