"""One head at full resolution: every one of the T x T cells drawn as itself, not pooled to the figure's pixels.

The cells are computed from the run source in row chunks and colour-mapped straight into one
(T, T, 4) uint8 buffer, the only T x T array that exists (no float copy of the matrix is kept):

* PNG: the heatmap is laid out on whole pixels, ``p`` x ``p`` pixels per cell (``p >= 1``, as
  many as the usual 7-inch side allows), and the buffer is pasted into Agg's canvas as it is.
  Matplotlib would otherwise resample it, converting the whole image to float32 RGBA twice over
  (2 GB at T = 8,192) for what is an exact copy here.
* SVG and PDF: ``interpolation="none"`` embeds the buffer unresampled (a T x T PNG inside the SVG,
  a T x T image XObject in the PDF); the page keeps the usual size and viewers zoom into the cells.

Past ``MAX_CELLS`` cells per side (the buffer would pass 1 GiB, a PNG's canvas more) the matrix is
max-pooled in b x b blocks, and the subtitle says so. Masked cells are the masked grey, without
hatching: hatch lines would overwrite cells, and every pixel is meant to decode to its own cell.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import Normalize
from matplotlib.image import AxesImage
from matplotlib.transforms import IdentityTransform

from ..core.errors import InspectorError
from .labels import _finite_span, pool_max, value_range

MAX_CELLS = 16384  # cells per side drawn one by one; past it, b x b block maxima
ROWS_BUDGET = 1 << 23  # numbers per row chunk (32 MB of float32) across every head of the layer


def block_for(t: int, max_cells: int | None = None) -> int:
    """1 when T fits ``max_cells`` per side, else the smallest block size that makes it fit."""
    limit = MAX_CELLS if max_cells is None else int(max_cells)
    return max(1, math.ceil(t / limit))


def _row_chunks(source, layer: int, head: int, kind: str, masking: bool, block: int):
    """(r0, values (n, T) float32, masked (n, T) bool) over the query rows, n a multiple of ``block``."""
    t = int(source.cache_length)
    if not hasattr(source, "attention_rows"):  # a duck-typed source offers only whole matrices
        values = np.asarray(source.attention(layer, head, kind), dtype=np.float32)
        masked = ~np.isfinite(values)
        if masking:
            masked |= ~np.asarray(source.allowed(layer, head), dtype=bool)
        yield 0, values, masked
        return
    heads = int(source.n_heads)  # allowed_rows answers for every head of the layer
    step = max(block, ROWS_BUDGET // max(1, heads * t) // block * block)
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        values = source.attention_rows(layer, r0, r1, kind, heads=(head,))[0].numpy()  # (n, T)
        masked = ~np.isfinite(values)
        if masking:
            masked |= ~source.allowed_rows(layer, r0, r1)[head].numpy()  # (n, T)
        yield r0, values, masked


def head_cells(source, layer: int, head: int, kind: str, block: int, cmap, masking: bool):
    """(rgba (nb, nb, 4) uint8, norm, any cell masked) for one head, nb = ceil(T / block).

    Rows are stored bottom-up (rgba[0] is the last query block), the order Agg draws an image's rows
    in, so neither a PNG nor an SVG/PDF (``origin="lower"``) needs a flipped copy.

    Two passes over one buffer: the (pooled) values go in as float32 (masked cells as NaN) while the
    colour range is found, then each row chunk is colour-mapped in place; a float32 and an RGBA
    cell both take 4 bytes, so the buffer is reinterpreted rather than a second one allocated.
    """
    t = int(source.cache_length)
    nb = -(-t // block)
    try:
        rgba = np.empty((nb, nb, 4), dtype=np.uint8)
    except MemoryError:
        raise InspectorError(f"not enough memory for a {nb}x{nb} image; use a pooled export") from None
    values = rgba.view(np.float32)[..., 0]  # (nb, nb): the same bytes
    spans, any_masked = [], False
    for r0, v, m in _row_chunks(source, layer, head, kind, masking, block):
        spans.append(_finite_span(v, m))
        pv, pm = pool_max(v, m, block, block)  # (n / block, nb)
        any_masked = any_masked or bool(pm.any())
        R1 = nb - r0 // block  # bottom-up
        values[R1 - pv.shape[0] : R1] = np.where(pm, np.nan, pv)[::-1]
    norm = Normalize(*value_range(spans, kind))
    step = max(1, ROWS_BUDGET // max(1, nb))
    for R0 in range(0, nb, step):
        chunk = values[R0 : R0 + step].copy()  # read before the same bytes are overwritten
        rgba[R0 : R0 + step] = cmap(norm(chunk), bytes=True)  # NaN -> the colormap's "bad": masked grey
    return rgba, norm, any_masked


def pixels_per_cell(n: int, side_in: float, dpi: float) -> int:
    """Whole pixels per cell that fit ``side_in`` at ``dpi``, at least 1 (the side then grows past it)."""
    return max(1, int(side_in * dpi // n))


class CellImage(AxesImage):
    """The cells as they are: embedded unresampled in SVG and PDF, pasted ``p`` x ``p`` per cell in a PNG.

    Raster output pastes the buffer only when the axes span exactly ``p * n`` pixels (the figure
    is laid out for one dpi); at any other size it is resampled like any image.
    """

    def __init__(self, ax, rgba: np.ndarray, p: int, **kwargs):
        super().__init__(ax, interpolation="none", origin="lower", **kwargs)
        self.set_data(rgba)
        self.cells_per_side, self.p = rgba.shape[0], int(p)

    def make_image(self, renderer, magnification=1.0, unsampled=False):
        if unsampled:
            return super().make_image(renderer, magnification, unsampled)
        box = self.axes.bbox  # display pixels at the dpi being written
        side = self.cells_per_side * self.p * magnification
        x0, y0 = round(box.x0 * magnification), round(box.y0 * magnification)
        exact = abs(box.width * magnification - side) < 0.01 and abs(box.height * magnification - side) < 0.01
        if not exact or abs(box.x0 * magnification - x0) > 0.01 or abs(box.y0 * magnification - y0) > 0.01:
            return super().make_image(renderer, magnification, unsampled)
        a = self.get_array()
        k = int(round(self.p * magnification))
        if k > 1:
            a = np.repeat(np.repeat(a, k, axis=0), k, axis=1)  # (n*k, n*k, 4)
        # Agg draws row 0 at the bottom of the given box: the buffer is stored that way round
        return a, x0 / magnification, y0 / magnification, IdentityTransform()


def snap_to_pixels(fig, ax, dpi: float) -> None:
    """Move every axes (together) so ``ax`` starts on a whole pixel at ``dpi``, the canvas a whole number of pixels.

    The canvas is built from the top-left, as Agg lays it out, so a cell's pixel is its row and column plus a fixed offset.
    """
    W, H = fig.get_size_inches()
    p = ax.get_position()
    left_px, top_px = p.x0 * W * dpi, (1 - p.y1) * H * dpi
    dx, dy = (math.ceil(left_px - 1e-6) - left_px) / dpi, (math.ceil(top_px - 1e-6) - top_px) / dpi
    w_px, h_px = math.ceil((W + dx) * dpi - 1e-6), math.ceil((H + dy) * dpi - 1e-6)
    # a hair over the whole number: Agg truncates the canvas size, and float rounding must not lose a pixel
    nw, nh = (w_px + 1e-6) / dpi, (h_px + 1e-6) / dpi
    boxes = [(a, a.get_position()) for a in fig.axes]
    fig.set_size_inches(nw, nh, forward=False)
    for a, q in boxes:
        x_in = q.x0 * W + dx
        top_in = (1 - q.y1) * H + dy  # from the top, where Agg's rows start
        y_in = nh - top_in - q.height * H
        a.set_position((x_in / nw, y_in / nh, q.width * W / nw, q.height * H / nh))
