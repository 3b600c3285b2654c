"""One head at full resolution: every one of the T x T cells drawn as itself, not pooled to the figure's pixels.

The cells are computed from the run source in row chunks and colour-mapped straight into one
(T, T, 4) uint8 buffer, the only T x T array that exists (no float copy of the matrix is kept):

* PNG: the heatmap is laid out on whole pixels, ``p`` x ``p`` pixels per cell (``p >= 1``, as
  many as the usual 7-inch side allows), and the buffer is drawn into Agg's canvas as it is.
* SVG and PDF: the buffer is embedded unresampled (a T x T PNG inside the SVG, a T x T image
  XObject in the PDF); the page keeps the usual size and viewers zoom into the cells.

Past ``MAX_CELLS`` cells per side (the buffer would pass 1 GiB, a PNG's canvas more) the matrix is
max-pooled in b x b blocks, and the subtitle says so. Masked cells are the masked grey, without
hatching: hatch lines would overwrite cells, and every pixel is meant to decode to its own cell.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.artist import Artist
from matplotlib.colors import Normalize
from matplotlib.transforms import Affine2D

from ..core.errors import InspectorError
from ..core.pooling import fit_block, pool_max
from .labels import _finite_span, value_range

MAX_CELLS = 16384  # cells per side drawn one by one; past it, b x b block maxima
ROWS_BUDGET = 1 << 23  # numbers per row chunk (32 MB of float32) across every head of the layer


def head_matrix(source, layer: int, head: int, kind: str, masking: bool) -> tuple[np.ndarray, np.ndarray]:
    """(values (T, T) float32, masked (T, T) bool): one head's whole matrix; ``masking``: the mask's cells too."""
    values = np.asarray(source.attention(layer, head, kind), dtype=np.float32)
    masked = ~np.isfinite(values)
    if masking:
        masked |= ~np.asarray(source.allowed(layer, head), dtype=bool)
    return values, masked


def _row_chunks(source, layer: int, head: int, kind: str, masking: bool, block: int, reverse: bool = False):
    """(r0, values (n, T) float32, masked (n, T) bool) over the query rows, n a multiple of ``block``;
    ``reverse``: the last chunk first (each chunk's rows still top-down)."""
    t = int(source.cache_length)
    if not hasattr(source, "attention_rows"):  # a duck-typed source offers only whole matrices
        yield 0, *head_matrix(source, layer, head, kind, masking)
        return
    heads = int(source.n_heads)  # allowed_rows answers for every head of the layer
    step = max(block, ROWS_BUDGET // max(1, heads * t) // block * block)
    starts = range(0, t, step)
    for r0 in reversed(starts) if reverse else starts:
        r1 = min(t, r0 + step)
        values = source.attention_rows(layer, r0, r1, kind, heads=(head,))[0].numpy()  # (n, T)
        masked = ~np.isfinite(values)
        if masking:
            masked |= ~source.allowed_rows(layer, r0, r1)[head].numpy()  # (n, T)
        yield r0, values, masked


def _pooled_rows(source, layer: int, head: int, kind: str, block: int, masking: bool, reverse: bool = False):
    """(first block row, block maxima (m, nb), all-masked blocks (m, nb), (min, max) of the cells or None) per chunk."""
    for r0, v, m in _row_chunks(source, layer, head, kind, masking, block, reverse):
        pv, pm = pool_max(v, m, block, block)
        yield r0 // block, pv, pm, _finite_span(v, m)


def head_blocks(source, layer: int, head: int, kind: str, block: int, masking: bool):
    """(values (nb, nb) float32, masked (nb, nb) bool, per row chunk (min, max) of its unmasked cells or None).

    One head's ``block`` x ``block`` maxima, top-down, from row chunks: the pooled head figure at
    long T without the (T, T) matrix, nor the all-heads mask that ``attention(layer, head)`` builds.
    """
    t = int(source.cache_length)
    nb = -(-t // block)
    values = np.zeros((nb, nb), dtype=np.float32)
    masked = np.ones((nb, nb), dtype=bool)
    spans = []
    for R0, pv, pm, span in _pooled_rows(source, layer, head, kind, block, masking):
        values[R0 : R0 + pv.shape[0]], masked[R0 : R0 + pv.shape[0]] = pv, pm
        spans.append(span)
    return values, masked, spans


def head_cells(source, layer: int, head: int, kind: str, block: int, cmap, masking: bool):
    """(rgba (nb, nb, 4) uint8, norm, any cell masked) for one head, nb = ceil(T / block).

    Rows are stored bottom-up (rgba[0] is the last query block), the order every matplotlib
    renderer's ``draw_image`` takes, so no format needs a flipped copy.

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
    for R0, pv, pm, span in _pooled_rows(source, layer, head, kind, block, masking):
        spans.append(span)
        any_masked = any_masked or bool(pm.any())
        values[nb - R0 - pv.shape[0] : nb - R0] = np.where(pm, np.nan, pv)[::-1]  # bottom-up
    norm = Normalize(*value_range(spans, kind))
    step = max(1, ROWS_BUDGET // max(1, nb))
    for R0 in range(0, nb, step):
        chunk = values[R0 : R0 + step].copy()  # read before the same bytes are overwritten
        rgba[R0 : R0 + step] = cmap(norm(chunk), bytes=True)  # NaN -> the colormap's "bad": masked grey
    return rgba, norm, any_masked


def usual_side(n: int) -> float:
    """The heatmap's side in inches in a pooled head figure of ``n`` positions (and in a vector full one)."""
    return min(max(n * 0.28, 2.0), 7.0)


def png_layout(t: int, dpi: float) -> tuple[int, int, int]:
    """(block, cells per side, whole pixels per cell) of a full-resolution PNG of ``t`` positions at ``dpi``.

    As many pixels per cell as the usual side allows, at least one: past ~7 x ``dpi`` positions
    the heatmap grows to one pixel per cell.
    """
    block = fit_block(t, MAX_CELLS)
    n = -(-t // block)
    return block, n, max(1, int(usual_side(n) * dpi // n))


class CellImage(Artist):
    """The cells as they are, drawn through the renderer's own ``draw_image``.

    Vector renderers (SVG, PDF) get the whole buffer with a transform onto the axes: embedded
    unresampled. Raster (Agg) gets it as the axes' pixels: the buffer itself when the axes span one
    pixel per cell, each cell repeated when they span ``p``; at any other size, nearest cells.
    ``AxesImage`` would first copy the buffer and give it a full-size mask (``set_data``), then
    convert it to float32 RGBA to resample: three more T x T arrays for what is a copy here.
    """

    def __init__(self, rgba: np.ndarray):
        super().__init__()
        self.rgba = rgba  # (n, n, 4) uint8, rows bottom-up as renderers take them
        self.set_in_layout(False)

    def draw(self, renderer) -> None:
        if not self.get_visible():
            return
        box = self.axes.bbox  # display units at the dpi being written
        gc = renderer.new_gc()
        if renderer.option_scale_image():
            renderer.draw_image(gc, box.x0, box.y0, self.rgba, Affine2D().scale(box.width, box.height))
        else:
            n = self.rgba.shape[0]
            w, h = round(box.width), round(box.height)
            a = self.rgba if (w, h) == (n, n) else self.rgba[_nearest(n, h)][:, _nearest(n, w)]  # (h, w, 4)
            renderer.draw_image(gc, round(box.x0), round(box.y0), a)
        gc.restore()
        self.stale = False


# what a vector renderer is given where the streamed cells go; the writer swaps in the real image
STAND_IN = np.full((1, 1, 4), 255, dtype=np.uint8)
STAND_IN_ID = "gpt-inspector-cells"


class StreamedCells(Artist):
    """A full-resolution head's cells that are never all held: ``figures.stream`` writes them into the
    file in row bands, computed from the run source chunk by chunk as it writes.

    Built, it has read the rows once for the colour range (probabilities need no pass: [0, 1]);
    ``rows`` computes them again. A vector renderer gets a one-pixel stand-in where the image goes
    (the same placement an n x n image would get), which the writer replaces; Agg draws nothing here
    (the PNG writer pastes the cells into its bands itself).
    """

    def __init__(self, source, layer: int, head: int, kind: str, block: int, cmap, masking: bool):
        super().__init__()
        self.source, self.where, self.block, self.cmap = source, (layer, head, kind), block, cmap
        self.masking, self.n = masking, -(-int(source.cache_length) // block)
        self.any_masked, self.pdf_name = False, None
        spans = []
        if kind != "probs":  # the colour range is what the cells span: one pass first
            for _, _, pm, span in _pooled_rows(source, layer, head, kind, block, masking):
                spans.append(span)
                self.any_masked = self.any_masked or bool(pm.any())
        self.norm = Normalize(*value_range(spans, kind))
        self.set_in_layout(False)

    def rows(self, reverse: bool = False):
        """(first cell row, colours (k, n, 4) uint8, rows top-down) per chunk; ``reverse``: the last chunk first."""
        layer, head, kind = self.where
        for R0, pv, pm, _ in _pooled_rows(self.source, layer, head, kind, self.block, self.masking, reverse):
            self.any_masked = self.any_masked or bool(pm.any())
            # the same elementwise float32 steps as head_cells, so the same bytes
            yield R0, self.cmap(self.norm(np.where(pm, np.float32(np.nan), pv)), bytes=True)

    def draw(self, renderer) -> None:
        if not self.get_visible() or not renderer.option_scale_image():
            return
        box = self.axes.bbox
        gc = renderer.new_gc()
        gc.set_gid(STAND_IN_ID)
        tr = Affine2D().scale(box.width, box.height)
        if hasattr(renderer, "writer"):  # SVG divides by the image's pixels: placed as an n x n image would be
            tr = Affine2D().scale(1.0 / self.n) + tr
        renderer.draw_image(gc, box.x0, box.y0, STAND_IN, tr)
        if hasattr(renderer, "file"):  # PDF: the image XObject's name, to find its object
            self.pdf_name = renderer.file.imageObject(STAND_IN)
        gc.restore()
        self.stale = False


def _nearest(n: int, pixels: int) -> np.ndarray:
    """The cell under each of ``pixels`` pixel centres across ``n`` cells (``p`` in a row when pixels = n * p)."""
    return np.minimum(((np.arange(pixels) + 0.5) * n / pixels).astype(np.intp), n - 1)


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
