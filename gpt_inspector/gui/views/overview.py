"""L x H thumbnails of every head's attention pattern; click one to select that layer and head.

All thumbnails are one mosaic image (one ImageItem, one setImage per step) spread over a unit
grid: cell (head h, layer l) covers [h, h+1] x [l, l+1], whatever the thumbnail resolution.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtWidgets import QToolButton, QWidget

from .common import (
    CMAP,
    IndexAxis,
    bare,
    context_actions,
    hbox,
    info_label,
    outline,
    placeholder_text,
    show_axes,
    vbox,
)


class OverviewGrid(QWidget):
    head_clicked = Signal(int, int)  # layer, head
    export_requested = Signal(object)  # None: the whole grid; (layer, head): one head

    def __init__(self, parent=None):
        super().__init__(parent)
        self.title = info_label("Overview")
        self.title.setToolTip("Every layer (rows, L) × head (columns, H): click a thumbnail to select that head")
        exp = QToolButton(text="Export…", toolTip="Export the grid of attention patterns",
                          clicked=lambda: self.export_requested.emit(None))  # fmt: skip
        self.glw = pg.GraphicsLayoutWidget()
        vbox(self, hbox(None, (self.title, 1), exp), (self.glw, 1), margin=2, spacing=2)
        self.left = IndexAxis("left", "L")
        self.top = IndexAxis("top", "H")
        self.plot = bare(self.glw.addPlot(axisItems={"left": self.left, "top": self.top}), invert=True, still=True)
        self.plot.showAxis("top")
        self.plot.hideAxis("bottom")
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(CMAP.getLookupTable(nPts=256))
        self.plot.addItem(self.image)
        # each thumbnail is scaled by its own largest cell, under a square root (pooled.Thumbnails.image)
        self.cbar = pg.ColorBarItem(values=(0.0, 1.0), colorMap=CMAP, interactive=False, width=8)
        self.cbar.setImageItem(self.image, insert_in=self.plot)
        self.cbar.getAxis("right").setTicks([[(0.0, "0"), (0.5, ".5"), (1.0, "1")]])  # a short panel: three ticks
        self.cbar.setToolTip("Colour scale: √(attention ÷ the thumbnail's largest cell), 0 to 1, so faint "
                             "structure stays visible beside a strong sink")  # fmt: skip
        self.grid = pg.PlotCurveItem(pen=pg.mkPen("#1b1e24", width=2), connect="pairs")
        self.plot.addItem(self.grid)
        self.sel = outline(self.plot, pg.mkPen("#ffffff", width=2.5))
        self._hint = placeholder_text(self.plot, "no steps yet")
        self.sel.setVisible(False)  # no head to outline before a model is shown
        show_axes(self.plot, ("left", "top"), False)
        self.plot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
        self.L = self.H = 0
        self.layer = self.head = 0
        self.last_image: np.ndarray | None = None
        self.plot.scene().sigMouseClicked.connect(self._clicked)
        context_actions(self.glw, ("Export this grid…", lambda: self.export_requested.emit(None)),
                        ("Export the selected head…", lambda: self.export_requested.emit((self.layer, self.head))))  # fmt: skip

    def _shape(self, L: int, H: int) -> None:
        if (L, H) == (self.L, self.H):
            return
        self.L, self.H = L, H
        xs, ys = [], []
        for h in range(1, H):
            xs += [h, h]
            ys += [0, L]
        for l in range(1, L):
            xs += [0, H]
            ys += [l, l]
        self.grid.setData(np.array(xs, float), np.array(ys, float))
        self.left.set_count(L)
        self.top.set_count(H)
        self.plot.setRange(xRange=(0, H), yRange=(0, L), padding=0.01)

    def _clicked(self, ev) -> None:
        if self.L == 0 or ev.button() != Qt.MouseButton.LeftButton:
            return
        p = self.plot.getViewBox().mapSceneToView(ev.scenePos())
        h, l = int(np.floor(p.x())), int(np.floor(p.y()))
        if 0 <= l < self.L and 0 <= h < self.H:
            self.head_clicked.emit(l, h)

    def click_cell(self, layer: int, head: int) -> None:
        """What a click on the cell does (for tests and keyboard use)."""
        self.head_clicked.emit(layer, head)

    def set_snapshot(self, snap) -> None:
        self._shape(snap.n_layers, snap.n_heads)
        self.layer, self.head = snap.selection.layer, snap.selection.head
        self.sel.setRect(QRectF(self.head, self.layer, 1, 1))
        self.sel.setVisible(snap.thumbs is not None)
        self._hint.setVisible(snap.thumbs is None)
        show_axes(self.plot, ("left", "top"), True)
        if snap.thumbs is None:
            self.image.clear()
            self.last_image = None
            self._hint.setPos(self.H / 2, self.L / 2)
            self.title.setText("Overview: every layer × head")
            return
        if self.last_image is not snap.thumbs:
            self.image.setImage(snap.thumbs, autoLevels=False, levels=(0.0, 1.0))
            self.image.setRect(QRectF(0, 0, self.H, self.L))
            self.last_image = snap.thumbs
        bs = snap.thumb_bin_size
        res = f"{snap.thumb_bins}×{snap.thumb_bins} bins" + (f" of {bs} positions" if bs > 1 else "")
        partial = (
            "" if snap.thumb_rows >= snap.T else f" · {100 * snap.thumb_rows // max(1, snap.T)}% of query rows so far"
        )
        self.title.setText(f"Overview: {self.L} layers × {self.H} heads · softmax, {res}{partial}")
