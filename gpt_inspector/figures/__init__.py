"""Attention heatmaps as matplotlib figures, headless: PNG, SVG or PDF, no Qt.

Only matplotlib's object API is used (``Figure`` + ``FigureCanvasAgg``), never pyplot: pyplot keeps
every figure in a global registry until closed, which is how long export runs leak, and it may
pick an interactive backend. So this module runs anywhere, including the window's worker thread.

    >>> from gpt_inspector import figures
    >>> fig = figures.head_figure(session, 0, 3, "probs")
    >>> figures.save(fig, "l0h3.png", dpi=200)
    >>> figures.save(figures.grid_figure(trace, None, "probs"), "model.svg")   # every layer x head

A *source* (Session, Trace, a beam view) offers ``attention(layer, head, kind)``,
``allowed(layer, head)``, ``token_labels()``, ``model_name``, ``n_layers``, ``n_heads``,
``cache_length`` and ``n_steps``.

The package: ``labels`` (token labels, ticks, pooling: no matplotlib), ``drawing`` (the figure's
look and the head, grid and matrix figures), ``fullres`` (one head's every cell, unpooled, built in
row chunks: ``head_figure(..., full_resolution=True)``), ``stream`` (that head written to a file in
row bands, never whole: ``stream.write_head``) and ``output`` (format checks, bytes, files).
"""

from __future__ import annotations

from ..core.attention import KIND_TITLES, KINDS
from ..core.pooling import pool_max
from . import fullres as fullres
from .drawing import (
    HATCH_COLOR,
    MASKED_COLOR,
    MASKED_RGB,
    HeatmapFigure,
    grid_figure,
    head_figure,
    mark_unverified,
    matrix_figure,
)
from .kvlab import frontier_figure, lab_figure
from .labels import clean_label
from .lens import lens_figure
from .output import FORMATS, cell_center, check_format, check_scale, close, pixel_size, save, scale_to_dpi, to_bytes

from . import stream as stream  # isort: skip  (after output: it writes through it)

# public too, though not in __all__ (as before the split): re-exported explicitly
from .drawing import CMAP_NAME as CMAP_NAME, DPI as DPI, HATCH as HATCH, MASKING_KINDS as MASKING_KINDS  # isort: skip
from .drawing import MAX_HATCH_RUNS as MAX_HATCH_RUNS  # isort: skip
from .labels import display_model_name as display_model_name, ticks as ticks, token_labels as token_labels  # isort: skip
from .labels import value_range as value_range  # isort: skip
from .output import MAX_PIXELS as MAX_PIXELS, MAX_SCALE as MAX_SCALE, MAX_SIDE as MAX_SIDE  # isort: skip
from .output import MAX_FULL_PIXELS as MAX_FULL_PIXELS, MIN_SCALE as MIN_SCALE  # isort: skip

__all__ = [
    "FORMATS", "HATCH_COLOR", "HeatmapFigure", "KINDS", "MASKED_COLOR", "MASKED_RGB", "KIND_TITLES", "cell_center",
    "check_format", "check_scale", "clean_label", "close", "frontier_figure", "grid_figure", "head_figure",
    "lab_figure", "lens_figure", "mark_unverified", "matrix_figure",
    "pixel_size", "pool_max", "save", "scale_to_dpi", "to_bytes",
]  # fmt: skip
