"""The heatmap figure: its look, the drawing primitives, and the head, grid and matrix figures.

Only matplotlib's object API is used (``Figure`` + ``FigureCanvasAgg``), never pyplot; see the package docstring.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence
from contextlib import contextmanager

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path as MplPath

from ..core import pooling
from ..core.attention import KIND_LABELS, KIND_TITLES, MASKING_KINDS, check_kind
from ..core.errors import InspectorError, check_index
from . import fullres
from .labels import (
    _finite_span,
    _ticks,
    clean_label,
    display_model_name,
    ticks,
    token_labels,
    value_range,
)

CMAP_NAME = "viridis"
# viridis never comes within ~165 RGB units of this light grey, and the hatching sets it apart
# even for readers who cannot tell the colours apart
MASKED_RGB = (217, 217, 217)
MASKED_COLOR = "#d9d9d9"
HATCH_COLOR = "#8c8c8c"
HATCH = "///"

DPI = 100.0  # scale 1.0
# past this many masked runs, hatching costs more than it adds: the colour alone still tells them apart
MAX_HATCH_RUNS = 20000
# a grid over more (T x T x heads) cells than this is pooled from row chunks, never per-head T x T
LONG_GRID_CELLS = 1 << 22

_TEXT = "#202020"
_DIM = "#555555"
# rc values apply both when artists are made (parse_math) and when files are written (svg.*),
# and rcParams are process-global, so building and saving hold one lock
_RC = {
    "svg.fonttype": "none",  # text stays <text>: searchable, selectable, small
    "svg.hashsalt": "gpt-inspector",  # the same figure gives the same bytes (live vs trace)
    "pdf.fonttype": 42,
    "text.parse_math": False,  # token labels such as "$x$" are text, not TeX
    "hatch.linewidth": 0.7,
    "axes.unicode_minus": True,
    "font.size": 9,
}
_LOCK = threading.RLock()

# token labels in any script: DejaVu lacks CJK glyphs, which draws boxes, not an error worth a warning
warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from", category=UserWarning)


@contextmanager
def _style():
    with _LOCK, matplotlib.rc_context(_RC):
        yield


class HeatmapFigure(Figure):
    """A matplotlib Figure that remembers what it shows, for dialogs and tests."""

    heading: str = ""
    subheading: str = ""
    pool: int = 1  # block size of the max-pooling, 1 when every cell is drawn
    heatmaps: list  # the Axes holding heatmaps, in panel order
    panel_values: list  # the (pooled) value arrays drawn, in panel order
    row_labels: list
    col_labels: list
    has_masked: bool = False
    full_resolution: bool = False  # every cell drawn as itself (figures.fullres), or block maxima named in the subtitle
    layout_dpi: float | None = None  # a full-resolution PNG's dpi: its cells are whole pixels only there


# ---------------------------------------------------------------------- checks
def _positions(source) -> int:
    t = int(source.cache_length)
    if t == 0:
        raise InspectorError("nothing processed yet: run a step first")
    return t


def _cmap():
    return matplotlib.colormaps[CMAP_NAME].with_extremes(bad=MASKED_COLOR)


# ---------------------------------------------------------------------- drawing
def _new_figure(w_in: float, h_in: float) -> HeatmapFigure:
    # laid out at one dpi whatever the output, so a PNG at any dpi is the same picture scaled
    fig = HeatmapFigure(figsize=(w_in, h_in), dpi=DPI, facecolor="white")
    FigureCanvasAgg(fig)
    fig.heatmaps, fig.panel_values, fig.row_labels, fig.col_labels = [], [], [], []
    return fig


def _add_axes(fig: Figure, x_in: float, y_in: float, w_in: float, h_in: float):
    W, H = fig.get_size_inches()
    return fig.add_axes((x_in / W, y_in / H, w_in / W, h_in / H))


def _frame(ax, pad: float = 1.5, outward: float = 0.0) -> None:
    """The house frame and ticks of a heatmap or colour bar; ``outward``: points between frame and cells."""
    for s in ax.spines.values():
        s.set_color("#909090")
        s.set_linewidth(0.6)
        if outward:
            s.set_position(("outward", outward))  # a frame drawn on the edge would cover the edge cells
    ax.tick_params(length=2, width=0.5, pad=pad, colors=_TEXT)


def _hatch_path(masked: np.ndarray, k: int) -> MplPath | None:
    """One compound path over the masked cells, as one rectangle per run in a row."""
    polys = []
    for r in range(masked.shape[0]):
        row = masked[r]
        if not row.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], row.astype(np.int8), [0]))))
        for a, b in zip(edges[::2], edges[1::2]):
            x0, x1, y0, y1 = a * k - 0.5, b * k - 0.5, r * k - 0.5, (r + 1) * k - 0.5
            polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)])
            if len(polys) > MAX_HATCH_RUNS:
                return None
    if not polys:
        return None
    return MplPath.make_compound_path_from_polys(np.asarray(polys, dtype=float))


def _heatmap(ax, values: np.ndarray, masked: np.ndarray, k: int, shape: tuple[int, int], norm, cmap) -> None:
    nr, nc = shape
    R, C = values.shape
    data = np.ma.masked_array(np.asarray(values, dtype=np.float64), mask=masked)
    # the extent is in position units whatever the pooling, so ticks name positions
    ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto",
              extent=(-0.5, C * k - 0.5, R * k - 0.5, -0.5))  # fmt: skip
    ax.set_xlim(-0.5, nc - 0.5)
    ax.set_ylim(nr - 0.5, -0.5)
    hp = _hatch_path(masked, k)
    if hp is not None:
        # add_artist, not add_patch: the limits are set already, and add_patch would walk every rectangle
        ax.add_artist(PathPatch(hp, facecolor="none", edgecolor=HATCH_COLOR, linewidth=0, hatch=HATCH))
    _frame(ax)


def _set_ticks(ax, axis: str, labels, extent_in: float, fontsize: float, numbered: bool) -> None:
    pos, text = _ticks(labels, extent_in, fontsize, numbered)
    if axis == "x":
        ax.set_xticks(pos, text, rotation=90, fontsize=fontsize)
    else:
        ax.set_yticks(pos, text, fontsize=fontsize)


def _colorbar(
    fig, x_in: float, y_in: float, h_in: float, norm, cmap, label: str, masked: bool, hatch: str | None = HATCH
):
    # drawn by hand with fixed ticks: fig.colorbar costs most of a small figure's time, which
    # matters when a script exports thousands
    cax = _add_axes(fig, x_in, y_in, 0.14, h_in)
    lo, hi = norm.vmin, norm.vmax
    cax.imshow(np.linspace(lo, hi, 256).reshape(256, 1), cmap=cmap, norm=norm, aspect="auto", origin="lower",
               interpolation="nearest", extent=(0.0, 1.0, lo, hi))  # fmt: skip
    cax.set_xlim(0.0, 1.0)
    cax.set_ylim(lo, hi)
    cax.set_xticks([])
    cax.yaxis.tick_right()
    cax.yaxis.set_label_position("right")
    pos, text = zip(*ticks(lo, hi))
    cax.set_yticks(pos, text, fontsize=8)
    _frame(cax, pad=2)
    if label:
        cax.set_ylabel(label, fontsize=8, color=_DIM)
    if masked:
        patch = Patch(facecolor=MASKED_COLOR, edgecolor=HATCH_COLOR, hatch=hatch, linewidth=0.6,
                      label="masked (not attended)")  # fmt: skip
        cax.legend(handles=[patch], loc="upper left", bbox_to_anchor=(0.0, -0.03), frameon=False,
                   fontsize=8, handlelength=1.4, handleheight=1.4, borderaxespad=0.0, borderpad=0.0)  # fmt: skip
    return cax


def _headings(fig: HeatmapFigure, ax, title: str, subtitle: str) -> None:
    fig.heading, fig.subheading = clean_label(title), clean_label(subtitle) if subtitle else ""
    # anchored to the top-left heatmap, above anything drawn over it, in points so no overlap
    offset = 8 if not any(a.get_title() for a in fig.heatmaps) else 22
    if fig.subheading:
        ax.annotate(fig.subheading, (0, 1), xycoords="axes fraction", xytext=(0, offset), textcoords="offset points",
                    ha="left", va="bottom", fontsize=8.5, color=_DIM)  # fmt: skip
        offset += 14
    ax.annotate(fig.heading, (0, 1), xycoords="axes fraction", xytext=(0, offset), textcoords="offset points",
                ha="left", va="bottom", fontsize=11, weight="bold", color=_TEXT)  # fmt: skip


def mark_unverified(fig: Figure, reason: str | None) -> Figure:
    """A red UNVERIFIED band above the headings when the model failed its fidelity self-test.

    Anchored to the top-left panel in points, like the headings, so it moves with the layout.
    """
    if not reason:
        return fig
    anchor = (getattr(fig, "heatmaps", None) or fig.axes)[0]
    text = clean_label(f"UNVERIFIED: these numbers may not be the model's own ({reason})")
    anchor.annotate(text[:160], (0, 1), xycoords="axes fraction", xytext=(0, 56), textcoords="offset points",
                    ha="left", va="bottom", fontsize=9, weight="bold", color="white",
                    bbox={"boxstyle": "square,pad=0.3", "facecolor": "#b00020", "edgecolor": "none"})  # fmt: skip
    fig.unverified = reason
    with _style():
        _fit(fig)
    return fig


def _fit(fig: Figure, pad_in: float = 0.15) -> None:
    """Grow or shrink the canvas to what is drawn, axes keeping their size in inches.

    Done in the figure itself (not ``bbox_inches="tight"`` when saving), so PNG, SVG and PDF share
    one geometry and a cell's pixel position follows from ``transData``.
    """
    # a 1 x 1 canvas measures text as the figure's would: the figure's own canvas, kept until
    # the figure is closed, is 290 MB for a full-resolution head at 16k
    renderer = RendererAgg(1, 1, fig.dpi)
    bb = fig.get_tightbbox(renderer)  # inches
    W, H = fig.get_size_inches()
    nw, nh = bb.width + 2 * pad_in, bb.height + 2 * pad_in
    dx, dy = pad_in - bb.x0, pad_in - bb.y0
    boxes = [(a, a.get_position()) for a in fig.axes]
    fig.set_size_inches(nw, nh, forward=False)
    for a, p in boxes:
        a.set_position(((p.x0 * W + dx) / nw, (p.y0 * H + dy) / nh, p.width * W / nw, p.height * H / nh))


_KIND_NOTES = {
    "probs": "softmax probabilities",
    "masked_scores": "scaled scores after the mask",
    "scores": "scaled scores before the mask",
    "raw": "raw q·k before scaling and the mask",
}


def _positions_text(t: int) -> str:
    return "1 position" if t == 1 else f"{t} positions"


def _pool_text(k: int) -> str:
    return f"pooled {k}×{k} (block maximum)"


# ---------------------------------------------------------------------- figures
def matrix_figure(
    matrix,
    row_labels: Sequence[str] | None,
    col_labels: Sequence[str] | None,
    title: str,
    subtitle: str = "",
    col_title: str = "",
    *,
    row_title: str = "",
    masked=None,
    vmin: float | None = None,
    vmax: float | None = None,
    value_label: str = "",
    kind: str | None = None,
    dpi: float = DPI,
    block: int = 1,
) -> HeatmapFigure:
    """One heatmap of any 2-D matrix (attention, the K or V cache, ...) with labels on both axes.

    ``masked`` (bool, same shape) cells and non-finite values are drawn in the masked colour.
    Labels may be None for plain indices. The colour range defaults to the unmasked finite values.
    ``dpi`` is the density the figure will be saved at: cells are max-pooled only where they would
    be narrower than one pixel there. ``block > 1``: ``matrix`` already holds the ``block`` x ``block``
    maxima of a matrix with one row and column per label (give both, and vmin/vmax over its cells).
    """
    m = np.asarray(matrix, dtype=np.float32)
    if m.ndim != 2 or m.size == 0:
        raise InspectorError(f"a heatmap needs a non-empty 2-D matrix, got shape {m.shape}")
    nr, nc = m.shape
    if block > 1:
        nr, nc = len(row_labels), len(col_labels)
        if m.shape != (-(-nr // block), -(-nc // block)):
            raise InspectorError(f"{m.shape} blocks do not cover {nr}x{nc} cells in blocks of {block}")
    mask = ~np.isfinite(m)
    if masked is not None:
        mk = np.asarray(masked, dtype=bool)
        if mk.shape != m.shape:
            raise InspectorError(f"mask shape {mk.shape} does not match the matrix {m.shape}")
        mask = mask | mk
    rl = [str(i) for i in range(nr)] if row_labels is None else [str(x) for x in row_labels]
    cl = [str(i) for i in range(nc)] if col_labels is None else [str(x) for x in col_labels]
    if len(rl) != nr or len(cl) != nc:
        raise InspectorError(f"{len(rl)} row and {len(cl)} column labels for a {nr}x{nc} matrix")
    lo, hi = value_range([_finite_span(m, mask)], kind)
    lo = lo if vmin is None else float(vmin)
    hi = hi if vmax is None else float(vmax)
    if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
        raise InspectorError(f"colour range must be finite with vmin < vmax, got {lo} .. {hi}")
    dpi = float(dpi)

    w, h = fullres.usual_side(nc), fullres.usual_side(nr)
    if block > 1:
        k, values, pm = block, np.where(mask, 0.0, m), mask
    else:
        k = max(pooling.fit_block(nr, h * dpi), pooling.fit_block(nc, w * dpi))
        values, pm = pooling.pool_max(m, mask, k, k)
    if subtitle is None or subtitle == "":
        subtitle = f"{nr} × {nc}"
    if k > 1:
        subtitle += f" · {_pool_text(k)}"

    with _style():
        fig = _new_figure(2.2 + w + 1.6, 1.8 + h + 0.9)
        ax = _add_axes(fig, 2.2, 1.8, w, h)
        norm, cmap = Normalize(lo, hi), _cmap()
        _heatmap(ax, values, pm, k, (nr, nc), norm, cmap)
        numbered = row_labels is not None or col_labels is not None
        _set_ticks(ax, "y", rl, h, 7.5, numbered)
        _set_ticks(ax, "x", cl, w, 7.5, numbered)
        if row_title:
            ax.set_ylabel(row_title, fontsize=9, color=_DIM, style="italic")
        if col_title:
            ax.set_xlabel(col_title, fontsize=9, color=_DIM, style="italic")
        has_masked = bool(pm.any())
        _colorbar(fig, 2.2 + w + 0.2, 1.8 + max(0.0, h - 4.0), min(h, 4.0), norm, cmap, value_label,
                  has_masked or masked is not None)  # fmt: skip
        fig.heatmaps, fig.panel_values, fig.pool, fig.has_masked = [ax], [values], k, has_masked
        fig.row_labels, fig.col_labels = rl, cl
        _headings(fig, ax, title, subtitle)
        _fit(fig)
    return fig


def head_figure(source, layer: int, head: int, kind: str = "probs", title: str | None = None, *,
                dpi: float = DPI, full_resolution: bool = False, vector: bool = False,
                streamed: bool = False) -> HeatmapFigure:  # fmt: skip
    """One head's (T, T) matrix at one stage, tokens on both axes (rows: query, columns: key).

    By default cells are max-pooled where they would be narrower than a pixel at ``dpi``.
    ``full_resolution=True`` draws every cell as itself (see ``figures.fullres``): for a PNG written
    at ``dpi`` (and only that dpi) each cell is a whole number of pixels, the figure as large as that
    takes; with ``vector=True`` (SVG, PDF) the page keeps its usual size and embeds the T x T image
    unresampled. Past ``fullres.MAX_CELLS`` positions per side it pools, with the block size in the subtitle.
    ``streamed=True`` (with ``full_resolution``): the figure holds no cells, only what ``figures.stream``
    needs to write them into a file in row bands (the one way to write it).
    """
    check_kind(kind)
    layer = check_index(layer, source.n_layers, "layer")
    head = check_index(head, source.n_heads, "head")
    t = _positions(source)
    labels = token_labels(source, t)
    if title is None:
        title = (f"{display_model_name(source.model_name)} · layer {layer} · head {head} · {KIND_LABELS[kind]}"
                 f" · step {source.n_steps}")  # fmt: skip
    subtitle = f"{_KIND_NOTES[kind]} · {_positions_text(t)}"
    if full_resolution:
        return _full_head_figure(source, layer, head, kind, title, subtitle, labels, float(dpi), vector, streamed)
    k = pooling.fit_block(t, fullres.usual_side(t) * float(dpi))  # as matrix_figure will choose
    masking, block, lo, hi = kind in MASKING_KINDS, 1, None, None
    if k > 1 and hasattr(source, "attention_rows"):
        # block maxima from row chunks: attention(layer, head) would build the (T, T) matrix and the
        # mask of every head of the layer (3 GiB at T = 16,384 with 8 heads)
        values, masked, spans = fullres.head_blocks(source, layer, head, kind, k, masking)
        block, (lo, hi) = k, value_range(spans, kind)
        masking = masking or bool(masked.any())
    else:
        values, masked = fullres.head_matrix(source, layer, head, kind, masking)
    fig = matrix_figure(
        values, labels, labels, title, subtitle, "key", row_title="query", masked=masked if masking else None,
        vmin=lo, vmax=hi, value_label=KIND_TITLES[kind], kind=kind, dpi=dpi, block=block,
    )  # fmt: skip
    return mark_unverified(fig, getattr(source, "unverified", None))


def _full_head_figure(source, layer, head, kind, title, subtitle, labels, dpi, vector, streamed) -> HeatmapFigure:
    t = len(labels)
    block = pooling.fit_block(t, fullres.MAX_CELLS)
    cmap = _cmap()
    cells: fullres.CellImage | fullres.StreamedCells
    if streamed:
        cells = fullres.StreamedCells(source, layer, head, kind, block, cmap, kind in MASKING_KINDS)
        nb, norm, any_masked = cells.n, cells.norm, cells.any_masked
    else:
        rgba, norm, any_masked = fullres.head_cells(source, layer, head, kind, block, cmap, kind in MASKING_KINDS)
        nb, cells = rgba.shape[0], fullres.CellImage(rgba)  # (nb, nb, 4)
    if vector:
        side, p = fullres.usual_side(nb), 1
    else:
        _, _, p = fullres.png_layout(t, dpi)
        side = nb * p / dpi  # whole pixels per cell: larger than usual once T passes the usual side's pixels
    if block == 1:
        subtitle += f" · full resolution ({p}×{p} pixels per cell)" if not vector and p > 1 else " · full resolution"
    else:
        subtitle += f" · {_pool_text(block)}: full resolution stops at {fullres.MAX_CELLS:,} positions per side"
    end = nb * block - 0.5  # the last block may reach past T: the axes show it whole
    with _style():
        fig = _new_figure(2.2 + side + 1.6, 1.8 + side + 0.9)
        ax = _add_axes(fig, 2.2, 1.8, side, side)
        ax.add_artist(cells)
        ax.set_xlim(-0.5, end)
        ax.set_ylim(end, -0.5)
        # points: the frame 1.5 pixels clear of the cells, antialiasing included (vector: as at 600 dpi)
        _frame(ax, outward=0.3 + 1.5 * 72.0 / (600.0 if vector else dpi))
        _set_ticks(ax, "y", labels, side, 7.5, True)
        _set_ticks(ax, "x", labels, side, 7.5, True)
        ax.set_ylabel("query", fontsize=9, color=_DIM, style="italic")
        ax.set_xlabel("key", fontsize=9, color=_DIM, style="italic")
        bar = min(side, 4.0)
        _colorbar(fig, 2.2 + side + 0.2, 1.8 + side - bar, bar, norm, cmap, KIND_TITLES[kind],
                  any_masked or kind in MASKING_KINDS, hatch=None)  # fmt: skip
        # no value array is kept: the cells exist only as colours (the one T x T buffer)
        fig.heatmaps, fig.panel_values, fig.pool, fig.has_masked = [ax], [], block, any_masked
        fig.row_labels = fig.col_labels = labels
        fig.full_resolution, fig.layout_dpi = True, None if vector else dpi
        _headings(fig, ax, title, subtitle)
        _fit(fig)
    mark_unverified(fig, getattr(source, "unverified", None))
    if not vector:
        with _style():
            fullres.snap_to_pixels(fig, ax, dpi)
    return fig


def grid_figure(source, layer: int | None, kind: str = "probs", *, dpi: float = DPI) -> HeatmapFigure:
    """Every head of ``layer``, or with ``layer=None`` every layer x head, as labelled thumbnails."""
    check_kind(kind)
    if layer is not None:
        layer = check_index(layer, source.n_layers, "layer")
    t = _positions(source)
    L, H = int(source.n_layers), int(source.n_heads)
    layers = list(range(L)) if layer is None else [layer]
    dpi = float(dpi)
    if layer is None:
        side = min(max(9.0 / max(L, H), 0.45), 1.1)
        columns, gap_x, gap_y, font = H, 0.08, 0.08, 6.0
    else:
        side = 1.9
        columns = H if H <= 6 else -(-H // -(-H // 6))
        gap_x, gap_y, font = 0.25, 0.45, 7.0
    rows = -(-len(layers) * H // columns)
    k = pooling.fit_block(t, side * dpi)
    panels, spans, any_masked = [], [], False
    sampled = k
    if t * t * H * len(layers) > LONG_GRID_CELLS and hasattr(source, "attention_rows"):
        # long contexts: block maxima straight from row chunks of every head of a layer, over a
        # sample of each block's query rows when the exact maxima would cost too much
        sampled = pooling.rows_per_block(len(layers) * H, t, int(source.head_dim), k)
        for l in layers:
            pv, pm, sp = pooling.head_blocks(source, l, kind, k, sampled)
            spans += sp
            any_masked = any_masked or bool(pm.any())
            panels += [(l, h, pv[h], pm[h]) for h in range(H)]
    else:  # pool each head as it comes: L x H full (T, T) matrices at once could need gigabytes
        for l in layers:
            for h in range(H):
                v, m = fullres.head_matrix(source, l, h, kind, kind in MASKING_KINDS)
                spans.append(_finite_span(v, m))
                pv, pm = pooling.pool_max(v, m, k, k)
                any_masked = any_masked or bool(pm.any())
                panels.append((l, h, pv, pm))
    lo, hi = value_range(spans, kind)
    labels = token_labels(source, t)
    name = display_model_name(source.model_name)
    where = f"all {L} layers × {H} heads" if layer is None else f"layer {layer} · all {H} heads"
    title = f"{name} · {where} · {KIND_LABELS[kind]} · step {source.n_steps}"
    subtitle = f"{_KIND_NOTES[kind]} · {_positions_text(t)} · rows: query, columns: key"
    if k > 1:
        subtitle += f" · {_pool_text(k)}"
    if sampled < k:
        subtitle += f" over {sampled} of every {k} query rows (sampled)"

    left, bottom = 2.0, 1.8
    grid_w = columns * side + (columns - 1) * gap_x
    grid_h = rows * side + (rows - 1) * gap_y
    with _style():
        fig = _new_figure(left + grid_w + 1.8, bottom + grid_h + 1.2)
        norm, cmap = Normalize(lo, hi), _cmap()
        for i, (l, h, pv, pm) in enumerate(panels):
            r, c = divmod(i, columns)
            x = left + c * (side + gap_x)
            y = bottom + (rows - 1 - r) * (side + gap_y)
            ax = _add_axes(fig, x, y, side, side)
            _heatmap(ax, pv, pm, k, (t, t), norm, cmap)
            # token labels on the outer edges only: every panel shares the same positions
            if c == 0:
                _set_ticks(ax, "y", labels, side, font, True)
            else:
                ax.set_yticks([])
            if r == rows - 1 or i + columns >= len(panels):
                _set_ticks(ax, "x", labels, side, font, True)
            else:
                ax.set_xticks([])
            if layer is None:
                if c == 0:
                    ax.set_ylabel(f"L{l}", fontsize=8, weight="bold", rotation=0, ha="right", va="center",
                                  color=_TEXT)  # fmt: skip
                if r == 0:
                    ax.set_title(f"H{h}", fontsize=8, weight="bold", pad=3, color=_TEXT)
            else:
                ax.set_title(f"head {h}", fontsize=8.5, weight="bold", pad=3, color=_TEXT)
            fig.heatmaps.append(ax)
            fig.panel_values.append(pv)
        bar_h = min(grid_h, 4.0)
        _colorbar(fig, left + grid_w + 0.25, bottom + grid_h - bar_h, bar_h, norm, cmap, KIND_TITLES[kind],
                  any_masked or kind in MASKING_KINDS)  # fmt: skip
        fig.pool, fig.has_masked = k, any_masked
        fig.row_labels = fig.col_labels = labels
        _headings(fig, fig.heatmaps[0], title, subtitle)
        _fit(fig)
    return mark_unverified(fig, getattr(source, "unverified", None))
