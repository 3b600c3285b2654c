"""Colour-mapped images drawn from ready pixels: the score matrix, its tile, q / K / V and the KV cache.

pyqtgraph's ``ImageItem`` maps a float image to colours at paint time, on the GUI thread. With NaN
(masked) cells it first locates every one of them (``isnan().nonzero()``, about half of a causal
matrix) and applies the colour table cell by cell: 22 ms for a 1,024² matrix on this machine,
against 1 ms for the same matrix without NaN. ``argb`` does the same mapping in a few vector passes
(about 4 ms), and the worker runs it off the GUI thread (``gui.paint``). ``ColourImage`` keeps the
float values as its ``image`` (the hover readout, the colour bar and the tests read them) and draws
those pixels: the same colours, cell for cell, as ``ImageItem`` with the same levels and lookup
table (masked cells transparent, so the grey behind shows through). They reach Qt as
``Format_ARGB32``, which Qt scales onto the same screen pixels as pyqtgraph's RGBA8888 (some cells
masked) and Indexed8 (none) images; the premultiplied format, drawn a little faster, rounds some
cell edges a pixel differently.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QImage

# pyqtgraph refuses images past this many rows or columns without downsampling them per view
_QIMAGE_SIDE = 2**15 - 1


def lut32(lut: np.ndarray) -> np.ndarray:
    """(N,) uint32 opaque 0xAARRGGBB from an (N, 3) uint8 lookup table."""
    lut = np.asarray(lut, dtype=np.uint8)
    r, g, b = (lut[:, i].astype(np.uint32) for i in range(3))
    return np.uint32(0xFF000000) | (r << 16) | (g << 8) | b


def argb(values: np.ndarray, levels, lut: np.ndarray) -> np.ndarray:
    """(h, w) uint32 0xAARRGGBB of a 2-D float image: each cell's colour as ``ImageItem`` picks it
    (levels scaled to the table's N entries in float32, clipped, truncated), 0 (transparent) where NaN.
    """
    lo, hi = float(levels[0]), float(levels[1])
    span = hi - lo or 1.0
    n = len(lut)
    work = np.float32 if np.can_cast(values.dtype, np.float32) else np.float64
    x = np.subtract(values, work(lo), dtype=work)  # (h, w)
    x *= work(n / span)
    np.clip(x, 0, n - 1, out=x)  # NaN stays NaN
    x[np.isnan(x)] = n  # the table's extra entry: transparent
    table = np.append(lut32(lut), np.uint32(0))
    return np.take(table, x.astype(np.uint16 if n < 2**16 - 1 else np.intp))  # (h, w) uint32


class Pixels(NamedTuple):
    """What ``ColourImage.show`` draws ``values`` with: its levels and, made beforehand, its ``argb``
    under ``lut`` (None where Qt could not draw it whole: pyqtgraph downsamples those per view)."""

    values: np.ndarray
    levels: tuple[float, float]
    lut: np.ndarray
    argb: np.ndarray | None


def drawable(values: np.ndarray, lut) -> bool:
    """Whether ``argb`` draws ``values`` as ``ImageItem`` would: a float image Qt takes whole, an RGB table."""
    return (
        values.ndim == 2
        and values.dtype.kind == "f"
        and 0 < values.size
        and max(values.shape) <= _QIMAGE_SIDE
        and isinstance(lut, np.ndarray)
        and lut.ndim == 2
        and lut.shape[1] == 3
    )


def pixels(values: np.ndarray, levels, lut: np.ndarray, made: bool = True) -> Pixels:
    """``values``' Pixels under ``levels``; ``made=False``: the levels alone (an image with no masked
    cell draws as quickly through pyqtgraph's own 8-bit path)."""
    levels = (float(levels[0]), float(levels[1]))
    return Pixels(values, levels, lut, argb(values, levels, lut) if made and drawable(values, lut) else None)


def ready(snap, name: str) -> Pixels | None:
    """The worker's ``Pixels`` of one of a snapshot's images (``snap.painted``, see gui.paint), or None."""
    return None if getattr(snap, "painted", None) is None else getattr(snap.painted, name)


class ColourImage(pg.ImageItem):
    """An ``ImageItem`` that draws an image with masked cells from ``argb``'s pixels, made beforehand
    where the worker did it; any other image the way ``ImageItem`` does.

    ``show(values, levels, ready)``: ``values`` the float image (``self.image``); ``ready`` the
    worker's ``Pixels`` of them, used where they are of these values under these levels and this
    item's lookup table, else the pixels are made at the first paint.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("axisOrder", "row-major")
        super().__init__(*args, **kwargs)
        self.ready: Pixels | None = None

    def show(self, values: np.ndarray, levels, ready: Pixels | None = None) -> None:
        self.ready = ready if ready is not None and ready.values is values else None
        self.setImage(values, autoLevels=False, levels=(float(levels[0]), float(levels[1])))

    def render(self) -> None:
        img, lut = self.image, self.lut
        if (
            img is None
            or not drawable(img, lut)
            or self.levels is None
            or np.ndim(self.levels) != 1
            or self.autoDownsample
        ):
            super().render()  # anything else (and images Qt cannot draw whole): pyqtgraph's own way
            return
        levels = (float(self.levels[0]), float(self.levels[1]))
        r = self.ready
        # pyqtgraph keeps a view of the array it was given
        if (r is not None and r.argb is not None and (img is r.values or img.base is r.values) and r.levels == levels
                and (r.lut is lut or np.array_equal(r.lut, lut))):  # fmt: skip
            out = r.argb
        elif np.isnan(img.min()):
            out = argb(img, levels, lut)
        else:  # no masked cell: pyqtgraph's own 8-bit path is as quick (Qt colours it at the paint)
            self._imageHasNans = False  # just looked: pyqtgraph need not look again
            super().render()
            return
        self.qimage = pg.functions.ndarray_to_qimage(out, QImage.Format.Format_ARGB32)
        self._renderRequired = False
        self._unrenderable = False
