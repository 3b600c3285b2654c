"""One head at full resolution written in row bands: its T x T cells never exist at once.

The figure (frame, ticks, labels, colour bar, headings) is matplotlib's, built as for the in-memory
full-resolution figure but holding a ``fullres.StreamedCells`` instead of the cells; the cells are
computed from the run source chunk by chunk while the file is written, and each chunk is dropped
once written. The pixels are the in-memory exporter's (tests compare them decoded):

* PNG: written by hand (``zlib.compressobj`` and ``struct``), rows top-down in bands. The cell
  rectangle's rows are the cells pasted between two strips that Agg draws once each: the canvas
  left and right of the cells, full height, so their rows are computed exactly as a whole canvas
  computes them (a tick on a half pixel rounds the same way). Above and below the cells, Agg draws
  full-width tiles. Pillow (which matplotlib uses) takes a whole image, and pypng filters each
  row in pure Python (minutes at 16k); here each band is filtered with numpy.
* SVG: matplotlib writes the page with a one-pixel stand-in image; the stand-in's data is replaced
  by the n x n PNG, encoded band by band into base64 as it is written (rows bottom-up, as
  matplotlib embeds them).
* PDF: matplotlib's PDF writer keeps every image until the file closes (and converts each twice),
  so it writes the page with the one-pixel stand-in, and the stand-in's image object is replaced
  by an image XObject whose Flate stream (PNG predictors, RGB) is compressed band by band; the
  objects after it move and the cross-reference table is written again.

One image, not one per band: no seams for a viewer to antialias between bands.
"""

from __future__ import annotations

import base64
import re
import struct
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import RendererAgg
from matplotlib.backends.backend_pdf import pdfRepr
from matplotlib.transforms import Bbox

from ..core import outfile
from ..core.errors import InspectorError
from .drawing import _style, head_figure
from .fullres import STAND_IN_ID, StreamedCells, _nearest
from .output import _METADATA, MAX_FULL_PIXELS, MAX_SIDE, check_format, close, pixel_size, scale_to_dpi

TILE_BYTES = 1 << 26  # the most a tile above or below the cells may take (the side strips are drawn whole)
BAND_BYTES = 1 << 19  # pixel rows filtered and compressed at a time (the filters take ~30 times that)
_LEVEL = 6  # zlib's default, as Pillow writes a PNG


def write_head(source, layer: int, head: int, kind: str, path, scale: float = 2.0, title: str | None = None) -> Path:
    """Write one head at full resolution to ``path`` (.png at ``scale``, .svg or .pdf), streamed."""
    fmt = check_format(path)
    dpi = scale_to_dpi(scale)
    outfile.check_target(path)  # before the work: a folder or device named here is the user's to fix
    fig = head_figure(source, layer, head, kind, title, dpi=dpi, full_resolution=True, vector=fmt != "png",
                      streamed=True)  # fmt: skip
    try:
        cells = next(a for a in fig.heatmaps[0].artists if isinstance(a, StreamedCells))
        if fmt == "png":
            w, h = pixel_size(fig, dpi)
            if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_FULL_PIXELS:
                raise InspectorError(f"the image would be {w}x{h} pixels; use a smaller scale, SVG or PDF")
        writer = {"png": _png, "svg": _svg, "pdf": _pdf}[fmt]

        def fill(tmp: str) -> None:
            with open(tmp, "wb") as fh, _style():
                writer(fig, cells, fh, dpi)

        written = outfile.write_with(path, fill)
        fig.has_masked = cells.any_masked
        return written
    finally:
        close(fig)


# ---------------------------------------------------------------------- PNG
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _filtered(band: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    """(h, 1 + w * bpp) uint8: each row of ``band`` (h, w * bpp) PNG-filtered, the filter type first.

    Per row the filter with the least sum of |byte as signed| (libpng's heuristic) among None, Sub,
    Up and Paeth (Average is seldom the best on a heatmap); ``prev`` is the row above the band.
    """
    h = band.shape[0]
    up = np.concatenate([prev[None], band[:-1]])  # (h, w * bpp) uint8
    left = np.zeros_like(band)
    left[:, bpp:] = band[:, :-bpp]
    ul = np.zeros_like(band)
    ul[:, bpp:] = up[:, :-bpp]
    a, b, c = left.astype(np.int16), up.astype(np.int16), ul.astype(np.int16)
    pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)  # |p - a|, |p - b|, |p - c| for p = a + b - c
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, ul))
    cands = (band, band - left, band - up, band - paeth)  # uint8 arithmetic wraps as PNG's does
    # |byte as signed|; abs(-128) stays -128 in int8, which only makes the heuristic a little off
    cost = np.stack([np.abs(x.view(np.int8)).sum(axis=1, dtype=np.int64) for x in cands])  # (4, h)
    best = cost.argmin(axis=0)
    out = np.empty((h, band.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = np.array([0, 1, 2, 4], dtype=np.uint8)[best]  # PNG's numbers: None 0, Sub 1, Up 2, Paeth 4
    for k, x in enumerate(cands):
        out[best == k, 1:] = x[best == k]
    return out


class _Scanlines:
    """Rows in, a zlib stream of PNG-filtered scanlines out (a PNG's IDAT data, a PDF image's Flate stream)."""

    def __init__(self, width: int, bpp: int, sink):
        self.bpp, self.sink = bpp, sink
        self.prev = np.zeros(width * bpp, dtype=np.uint8)
        self.z = zlib.compressobj(_LEVEL)

    def write(self, rows: np.ndarray) -> None:
        """``rows`` (h, width, bpp) uint8, top-down."""
        flat = np.ascontiguousarray(rows).reshape(rows.shape[0], -1)
        step = max(1, BAND_BYTES // max(1, flat.shape[1]))
        for r in range(0, flat.shape[0], step):
            band = flat[r : r + step]
            out = self.z.compress(_filtered(band, self.prev, self.bpp).tobytes())
            self.prev = band[-1].copy()
            if out:
                self.sink(out)

    def close(self) -> None:
        self.sink(self.z.flush())


class _PngFile:
    """A PNG written as its rows come: IHDR, text, pHYs, IDAT chunks of ~1 MiB, IEND."""

    def __init__(self, write, width: int, height: int, bpp: int, dpi: float, text: dict):
        self.write, self.pending = write, []
        write(b"\x89PNG\r\n\x1a\n")
        write(_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[bpp], 0, 0, 0)))
        for k, v in text.items():  # as Pillow's PngInfo.add_text: Latin-1 as tEXt, the rest as iTXt
            try:
                write(_chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1")))
            except UnicodeError:
                write(_chunk(b"iTXt", k.encode("latin-1") + b"\0\0\0\0\0" + v.encode("utf-8")))
        if dpi:
            ppm = int(dpi / 0.0254 + 0.5)
            write(_chunk(b"pHYs", struct.pack(">IIB", ppm, ppm, 1)))
        self.lines = _Scanlines(width, bpp, self._idat)

    def _idat(self, data: bytes) -> None:
        self.pending.append(data)
        if sum(map(len, self.pending)) >= 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.write(_chunk(b"IDAT", b"".join(self.pending)))
            self.pending = []

    def close(self) -> None:
        self.lines.close()
        self._flush()
        self.write(_chunk(b"IEND", b""))


def _texts(fig) -> list:
    """(tick label, its extent on the whole canvas padded by its font's size in pixels) per tick label.

    Drawing text is most of a figure's drawing time, and each tile draws the whole figure: a tile
    skips the tick labels whose padded extent misses it (hundreds of them), which cannot change its
    pixels. Only tick labels: they stand where their ticks put them before any drawing, whereas an
    axis label is moved beside the tick labels while the axis draws.
    """
    measure = RendererAgg(1, 1, fig.dpi)
    out = []
    for ax in fig.axes:
        for t in ax.xaxis.get_majorticklabels() + ax.yaxis.get_majorticklabels():  # made when first asked for
            if t.get_visible() and t.get_text():
                pad = t.get_fontsize() * fig.dpi / 72.0
                out.append((t, t.get_window_extent(measure).padded(pad)))
    return out


def _no_draw(renderer) -> None:
    pass


def _tile(fig, texts: list, x0: int, y0: int, w: int, h: int, canvas_h: int) -> np.ndarray:
    """(h, w, 4) uint8: the canvas's pixels [y0, y0 + h) x [x0, x0 + w) (from the top left) at ``fig.dpi``.

    The figure is drawn onto a w x h canvas moved by whole pixels, as matplotlib's own
    ``savefig(bbox_inches=...)`` moves it; with x0 = 0 and the canvas's height every coordinate is
    computed as a whole canvas computes it.
    """
    renderer = RendererAgg(w, h, fig.dpi)
    trans = fig.transFigure
    saved = trans._boxout
    W, H = fig.bbox.size
    bottom = canvas_h - y0 - h
    here = Bbox.from_bounds(x0, bottom, w, h)  # on the whole canvas, from the bottom
    skipped = [t for t, box in texts if not box.overlaps(here)]
    for t in skipped:
        # not set_visible(False): the axis label is placed beside the visible tick labels' extents
        t.draw = _no_draw
    # whole-pixel offsets: W - x0 and H - bottom are exact, so the box keeps its exact width and height
    trans._boxout = Bbox.from_bounds(-x0, -bottom, W, H)
    trans.invalidate()
    try:
        fig.draw(renderer)
    finally:
        trans._boxout = saved
        trans.invalidate()
        for t in skipped:
            del t.draw
    return np.asarray(renderer.buffer_rgba())


def _png(fig, cells: StreamedCells, fh, dpi: float) -> None:
    saved_dpi = fig.dpi
    fig.dpi = dpi  # as savefig does for the time it draws
    try:
        _png_rows(fig, cells, fh, dpi)
    finally:
        fig.dpi = saved_dpi


def _png_rows(fig, cells: StreamedCells, fh, dpi: float) -> None:
    W, H = pixel_size(fig, dpi)
    box = fig.heatmaps[0].bbox  # where CellImage would draw the cells, from the bottom
    cw, ch = round(box.width), round(box.height)
    cx, cy = round(box.x0), H - round(box.y0) - ch
    if not (0 <= cx and cx + cw <= W and 0 <= cy and cy + ch <= H):
        raise InspectorError(f"the heatmap ({cw}x{ch} at {cx},{cy}) does not fit the {W}x{H} image")
    cols, rows = _nearest(cells.n, cw), _nearest(cells.n, ch)
    text = {"Software": "gpt-inspector", "Title": getattr(fig, "heading", "") or ""}
    png = _PngFile(fh.write, W, H, 4, dpi, text)
    texts = _texts(fig)

    def tiles(r0: int, r1: int) -> None:  # full-width rows, drawn in tiles that fit TILE_BYTES
        step = max(1, TILE_BYTES // (4 * W))
        for a in range(r0, r1, step):
            png.lines.write(_tile(fig, texts, 0, a, W, min(r1, a + step) - a, H))

    tiles(0, cy)
    # left and right of the cells: drawn whole (full height), so their rows round as the whole canvas's
    left = _tile(fig, texts, 0, 0, cx, H, H) if cx else np.zeros((H, 0, 4), np.uint8)
    right = _tile(fig, texts, cx + cw, 0, W - cx - cw, H, H) if cx + cw < W else np.zeros((H, 0, 4), np.uint8)
    step = max(1, BAND_BYTES // (4 * W))
    for c0, colours in cells.rows():  # (k, n, 4) cell rows, top-down
        p0, p1 = np.searchsorted(rows, [c0, c0 + colours.shape[0]])  # the pixel rows these cells cover
        for a in range(int(p0), int(p1), step):
            b = min(int(p1), a + step)
            band = np.empty((b - a, W, 4), dtype=np.uint8)
            band[:, :cx] = left[cy + a : cy + b]
            band[:, cx : cx + cw] = colours[rows[a:b] - c0][:, cols]
            band[:, cx + cw :] = right[cy + a : cy + b]
            png.lines.write(band)
    del left, right
    tiles(cy + ch, H)
    png.close()


# ---------------------------------------------------------------------- SVG
def _svg(fig, cells: StreamedCells, fh, dpi: float) -> None:
    buf = BytesIO()
    fig.savefig(buf, format="svg", dpi=dpi, facecolor="white",
                metadata={"Title": getattr(fig, "heading", "") or "", **_METADATA["svg"]})  # fmt: skip
    page = buf.getvalue()
    m = re.search(rb'<image [^>]*id="' + STAND_IN_ID.encode() + rb'"[^>]*/>', page)
    if m is None:
        raise InspectorError("internal: the SVG has no place for the cells")
    tag = m.group(0)
    href = re.search(rb'xlink:href="data:image/png;base64,\n[A-Za-z0-9+/=]*"', tag)
    n = str(cells.n).encode()
    # the stand-in's size is 1 x 1 pixel; the image's is n x n (the transform is already the n x n image's)
    before, after = (
        re.sub(rb' (width|height)="1"', rb' \1="' + n + b'"', x) for x in (tag[: href.start()], tag[href.end() :])
    )
    fh.write(page[: m.start()] + before + b'xlink:href="data:image/png;base64,\n')
    b64 = _Base64(fh.write)
    png = _PngFile(b64.write, cells.n, cells.n, 4, 0, {})
    for _, colours in cells.rows(reverse=True):  # matplotlib embeds the rows bottom-up and flips them
        png.lines.write(colours[::-1])
    png.close()
    b64.close()
    fh.write(b'"' + after + page[m.end() :])


class _Base64:
    """Bytes in, base64 out, in pieces of whole 3-byte groups (one line, as matplotlib writes it)."""

    def __init__(self, write):
        self.out, self.rest = write, b""

    def write(self, data: bytes) -> None:
        data = self.rest + data
        cut = len(data) - len(data) % 3
        self.rest = data[cut:]
        self.out(base64.b64encode(data[:cut]))

    def close(self) -> None:
        self.out(base64.b64encode(self.rest))


# ---------------------------------------------------------------------- PDF
def _pdf(fig, cells: StreamedCells, fh, dpi: float) -> None:
    buf = BytesIO()
    fig.savefig(buf, format="pdf", dpi=dpi, facecolor="white",
                metadata={"Title": getattr(fig, "heading", "") or "", **_METADATA["pdf"]})  # fmt: skip
    pdf = buf.getvalue()
    start = int(pdf[pdf.rindex(b"startxref") :].split()[1])
    head = re.match(rb"xref\n0 (\d+)\n", pdf[start:])  # matplotlib writes one subsection, 20 bytes an entry
    if head is None or cells.pdf_name is None:
        raise InspectorError("internal: the PDF's cross-references or the cells' image were not found")
    count = int(head.group(1))
    table = pdf[start + head.end() : start + head.end() + 20 * count]
    offsets = [int(table[20 * i : 20 * i + 10]) for i in range(count)]
    trailer = pdf[start + head.end() + 20 * count :]
    obj = int(re.search(re.escape(pdfRepr(cells.pdf_name)) + rb" (\d+) 0 R", pdf).group(1))
    at = offsets[obj]
    end = min([o for o in offsets if o > at] + [start])
    fh.write(pdf[:at])
    n = cells.n
    fh.write(b"%d 0 obj\n<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceRGB "
             b"/BitsPerComponent 8 /Filter /FlateDecode /DecodeParms << /Predictor 15 /Colors 3 /Columns %d >> "
             b"/Length " % (obj, n, n, n))  # fmt: skip
    length_at = fh.tell()
    fh.write(b" " * 20 + b">>\nstream\n")
    size = 0

    def sink(data: bytes) -> None:
        nonlocal size
        size += len(data)
        fh.write(data)

    lines = _Scanlines(n, 3, sink)
    for _, colours in cells.rows():  # a PDF image's first row is its top
        lines.write(colours[:, :, :3])
    lines.close()
    fh.write(b"\nendstream\nendobj\n")
    done = fh.tell()
    shift = done - end  # where the objects after it start now, less where they were
    fh.seek(length_at)
    fh.write(str(size).encode())
    fh.seek(done)
    fh.write(pdf[end:start])
    fh.write(b"xref\n0 %d\n" % count)
    for i, o in enumerate(offsets):
        fh.write(table[20 * i : 20 * i + 20] if o <= at else b"%010d" % (o + shift) + table[20 * i + 10 : 20 * i + 20])
    fh.write(re.sub(rb"startxref\n\d+", b"startxref\n%d" % (start + shift), trailer))
