"""L x H thumbnails of every head's attention pattern; click one to select that layer and head.

Heads with an intervention in force carry a mark in their cell's corner (✕ knocked out, ● patched,
■ a mask edit); a right-click selects the head under the pointer first, so its menu acts on that head.

All thumbnails are one mosaic image (one ImageItem, one setImage per step) spread over a unit
grid: cell (head h, layer l) covers [h, h+1] x [l, l+1], whatever the thumbnail resolution.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtWidgets import QMenu, QToolButton, QWidget

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
        self.marks = pg.ScatterPlotItem(pxMode=True, size=9)
        self.plot.addItem(self.marks)
        self.marked: dict[tuple[int, int], str] = {}  # (layer, head) -> kinds in force, e.g. "kp"
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
        self.glw.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.glw.customContextMenuRequested.connect(self._menu)
        self.menu: QMenu | None = None

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

    def cell_at(self, pos) -> tuple[int, int] | None:
        """(layer, head) under ``pos`` (the graphics view's coordinates), or None."""
        p = self.plot.getViewBox().mapSceneToView(self.glw.mapToScene(pos))
        h, l = int(np.floor(p.x())), int(np.floor(p.y()))
        return (l, h) if 0 <= l < self.L and 0 <= h < self.H else None

    def _menu(self, pos) -> None:
        # the entries act on the selected head: select the one under the pointer first (the
        # controller takes a selection at once), else they acted on the head selected before
        cell = self.cell_at(pos)
        if cell is not None:
            self.layer, self.head = cell
            self.head_clicked.emit(*cell)
        if self.menu is None:  # one menu, filled afresh: panels add entries after this view is built
            self.menu = QMenu(self.glw)
        self.menu.clear()
        self.menu.addActions(self.glw.actions())
        self.menu.popup(self.glw.mapToGlobal(pos))

    def click_cell(self, layer: int, head: int) -> None:
        """What a click on the cell does (for tests and keyboard use)."""
        self.head_clicked.emit(layer, head)

    def _mark(self, snap) -> None:
        marked: dict[tuple[int, int], str] = {}
        L, H = range(self.L), range(self.H)

        def put(layer, head, kind) -> None:
            for l in L if layer is None else [layer]:
                for h in H if head is None else [head]:
                    if kind not in marked.get((l, h), ""):
                        marked[(l, h)] = marked.get((l, h), "") + kind

        for e in snap.mask.mask_edits:
            put(e.layer, e.head, "m")
        for e, _ in snap.mask.head_edits:
            put(e.layer, e.head, "k" if e.patch_from is None else "p")
        if marked == self.marked:
            return
        self.marked = marked
        # the strongest change shows: a knock-out over a patch over a mask edit
        style = {"k": ("x", "#ff5c5c"), "p": ("o", "#5cc8ff"), "m": ("s", "#ffb84f")}
        spots = []
        for (l, h), kinds in marked.items():
            symbol, colour = style[next(k for k in "kpm" if k in kinds)]
            spots.append({"pos": (h + 0.8, l + 0.2), "symbol": symbol, "brush": colour, "pen": pg.mkPen("#1b1e24")})
        self.marks.setData(spots)

    def set_snapshot(self, snap) -> None:
        self._shape(snap.n_layers, snap.n_heads)
        self._mark(snap)
        self.layer, self.head = snap.selection.layer, snap.selection.head
        self.sel.setRect(QRectF(self.head, self.layer, 1, 1))
        self.sel.setVisible(snap.overview.thumbs is not None)
        self._hint.setVisible(snap.overview.thumbs is None)
        show_axes(self.plot, ("left", "top"), True)
        if snap.overview.thumbs is None:
            self.image.clear()
            self.last_image = None
            self._hint.setPos(self.H / 2, self.L / 2)
            self.title.setText("Overview: every layer × head")
            return
        if self.last_image is not snap.overview.thumbs:
            self.image.setImage(snap.overview.thumbs, autoLevels=False, levels=(0.0, 1.0))
            self.image.setRect(QRectF(0, 0, self.H, self.L))
            self.last_image = snap.overview.thumbs
        bs = snap.overview.thumb_bin_size
        res = f"{snap.overview.thumb_bins}×{snap.overview.thumb_bins} bins" + (f" of {bs} positions" if bs > 1 else "")
        ov, behind = snap.overview, snap.T - snap.overview.thumb_rows
        if behind <= 0:
            partial = ""
        elif ov.rows_behind:  # a step's picture came first: its overview rows are the worker's next slice
            partial = f" · the newest {behind} query row{'s' if behind > 1 else ''} next"
        else:
            partial = f" · {100 * ov.thumb_rows // max(1, snap.T)}% of query rows so far"
        marked = (
            f" · {len(self.marked)} head(s) with interventions (✕ knock-out, ● patch, ■ mask edit)"
            if self.marked
            else ""
        )
        self.title.setText(f"Overview: {self.L} layers × {self.H} heads · softmax, {res}{partial}{marked}")
