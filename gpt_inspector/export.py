"""Attention heatmaps written to files: thin wrappers over ``gpt_inspector.figures``.

    >>> from gpt_inspector.export import render_heatmap, render_grid
    >>> render_heatmap(session, 0, 3, "probs", "l0h3.png", scale=2)   # 200 dpi
    >>> render_grid(trace, None, "probs", "model.pdf")                 # every layer x every head

``scale`` is PNG pixels per unit: 1.0 is 100 dpi. SVG and PDF are vector files and ignore it.
``render_heatmap(..., full_resolution=True)`` writes every cell of the head unpooled, at any T.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import figures
from .figures import FORMATS, KIND_TITLES, KINDS, MASKED_RGB, check_format, check_scale, clean_label, pool_max


def _write(build, path, scale: float) -> Path:
    check_format(path)  # before any work: a bad name is the user's to fix, not a rendering error
    dpi = figures.scale_to_dpi(scale)
    fig = build(dpi)
    try:
        return figures.save(fig, path, dpi)
    finally:
        figures.close(fig)


def render_heatmap(source, layer: int, head: int, kind: str, path, scale: float = 2.0, title: str | None = None,
                   *, full_resolution: bool = False) -> Path:  # fmt: skip
    """Write one head's attention heatmap to ``path`` (.png at ``scale``, .svg or .pdf).

    ``full_resolution=True`` draws every one of the T x T cells unpooled: a PNG gets whole pixels
    per cell (so it grows with T: about T pixels a side past ~700 x ``scale`` positions), an SVG or
    PDF embeds the T x T image at the usual page size. Past ``figures.fullres.MAX_CELLS`` positions it
    pools, saying the block size in the subtitle. The cells are computed and written in row bands
    (``figures.stream``): the T x T image is never held whole.
    """
    check_format(path)
    if full_resolution:
        return figures.stream.write_head(source, layer, head, kind, path, scale, title)
    return _write(lambda dpi: figures.head_figure(source, layer, head, kind, title, dpi=dpi), path, scale)


def render_grid(source, layer: int | None, kind: str, path, scale: float = 1.0) -> Path:
    """Write every head of ``layer`` (or, with ``layer=None``, of the whole model) as one image."""
    return _write(lambda dpi: figures.grid_figure(source, layer, kind, dpi=dpi), path, scale)


def render_matrix(
    matrix,
    row_labels: Sequence[str] | None,
    col_labels: Sequence[str] | None,
    masked,
    title: str,
    path,
    *,
    scale: float = 2.0,
    subtitle: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    row_title: str = "row",
    col_title: str = "column",
    value_label: str = "",
) -> Path:
    """Write any 2-D matrix as a heatmap; ``masked`` (bool, same shape, or None) cells are drawn as masked.

    Labels may be None for plain indices. The colour range defaults to the unmasked finite values.
    """
    return _write(lambda dpi: figures.matrix_figure(
        matrix, row_labels, col_labels, title, subtitle or "", col_title, row_title=row_title,
        masked=masked, vmin=vmin, vmax=vmax, value_label=value_label, dpi=dpi,
    ), path, scale)  # fmt: skip


__all__ = [
    "FORMATS", "KIND_TITLES", "KINDS", "MASKED_RGB", "check_format", "check_scale", "clean_label", "pool_max",
    "render_grid", "render_heatmap", "render_matrix",
]  # fmt: skip
