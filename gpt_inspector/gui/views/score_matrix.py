"""The T x T attention matrix of the selected layer and head, at any stage of the equation.

Stages: raw QKᵀ, scaled (× 1/√d), masked (−∞ where a query may not look), softmax. Masked cells
are NaN in the image, which pyqtgraph leaves transparent, so a grey rectangle behind the image
shows through exactly there: one colour of their own, whatever the colormap.

With "Edit mask" on, clicking or dragging over cells blocks (or unblocks) them; the edit is
sent to the worker, which re-runs the model from the earliest affected position.
"""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QGraphicsRectItem,
    QLabel,
    QToolButton,
    QWidget,
)

from .. import viewdata
from ..viewdata import KIND_LABELS, KINDS
from .common import (
    CMAP,
    MASKED_COLOR,
    NEWEST_PEN,
    SELECTED_PEN,
    TOGGLE_STYLE,
    FlowLayout,
    TokenAxis,
    bare,
    context_actions,
    hbox,
    info_label,
    legend_swatch,
    outline,
    placeholder_text,
    show_axes,
    unprefixed,
    vbox,
)
from .image import ColourImage, ready

SCOPES = (("head", "this head"), ("layer", "this layer"), ("all", "all layers"))


class _MatrixImage(ColourImage):
    def __init__(self, view: ScoreMatrix):
        super().__init__()
        self.view = view
        self.setAcceptHoverEvents(True)

    def hoverEvent(self, ev):
        if ev.isExit():
            self.view._hover(None)
        else:
            self.view._hover(ev.pos())

    def mouseClickEvent(self, ev):
        if ev.button() != Qt.MouseButton.LeftButton:
            ev.ignore()
            return
        ev.accept()
        self.view._click(ev.pos())

    def mouseDragEvent(self, ev):
        if not self.view.edit_mode or ev.button() != Qt.MouseButton.LeftButton:
            ev.ignore()  # the view box pans
            return
        ev.accept()
        self.view._drag(ev.pos(), ev.isStart(), ev.isFinish(), ev.buttonDownPos())


class ScoreMatrix(QWidget):
    kind_changed = Signal(str)
    query_clicked = Signal(int)
    key_hovered = Signal(int, int)  # query, key (-1, -1 when the pointer leaves)
    cells_edited = Signal(object, str)  # [(query, key)], scope
    export_requested = Signal()
    view_changed = Signal(object)  # (q0, q1, k0, k1) shown of a pooled matrix, or None: ask for exact cells there

    def __init__(self, parent=None):
        super().__init__(parent)
        self.snap = None
        self.T = 0
        self.edit_mode = False
        self._drag_cells: dict[tuple[int, int], None] = {}  # the cells dragged over, in order
        self._drag_last = None  # the pointer at the drag's previous event (view coordinates)
        self._last_matrix = None
        self._hovered: tuple[int, int] | None = None  # the cell under the pointer, read out below the plot
        bar_w = QWidget()
        bar_w.setStyleSheet(TOGGLE_STYLE)
        bar = FlowLayout(bar_w, spacing=4)  # wraps in a narrow dock instead of widening it
        bar.setContentsMargins(0, 0, 0, 0)
        self.kind_group = QButtonGroup(self)
        self.kind_buttons: dict[str, QToolButton] = {}
        for kind in KINDS:
            b = QToolButton(text=KIND_LABELS[kind], checkable=True)
            b.setToolTip({
                "raw": "q·k for every query/key pair, before scaling",
                "scores": "q·k × scaling (1/√d): the logits of attention",
                "masked_scores": "scaled scores with −∞ where the mask hides the key",
                "probs": "softmax over the allowed keys: each row sums to 1",
            }[kind])  # fmt: skip
            self.kind_group.addButton(b)
            self.kind_buttons[kind] = b
            bar.addWidget(b)
            b.clicked.connect(lambda _=False, k=kind: self.kind_changed.emit(k))
        self.kind_buttons["probs"].setChecked(True)
        self.edit_button = QToolButton(text="Edit mask", checkable=True,
                                       toolTip="Click or drag cells to block / unblock attention (cells above the diagonal are ignored)")  # fmt: skip
        self.edit_button.toggled.connect(self.set_edit_mode)
        bar.addWidget(self.edit_button)
        self.scope = QComboBox(toolTip="Which heads a mask edit applies to")
        for key, text in SCOPES:
            self.scope.addItem(text, key)
        bar.addWidget(self.scope)
        exp = QToolButton(
            text="Export…", toolTip="Save this matrix as a figure: PNG, SVG or PDF, with its tokens and colour bar"
        )
        exp.clicked.connect(self.export_requested)
        bar.addWidget(exp)
        self.title = info_label("")
        self.title.setToolTip("The layer, head, stage and query shown; F1 writes a cell's arithmetic out")
        self.glw = pg.GraphicsLayoutWidget()
        self.left = TokenAxis("left", chars=9)
        self.bottom = TokenAxis("bottom", chars=6)
        self.plot = bare(self.glw.addPlot(axisItems={"left": self.left, "bottom": self.bottom},
                                          labels={"left": "query", "bottom": "key"}), invert=True)  # fmt: skip
        context_actions(self.glw, ("Export this matrix…", self.export_requested.emit), ("Reset zoom", self._reset_zoom))
        self.vb = self.plot.getViewBox()
        self.vb.setAspectLocked(True)
        self.backdrop = outline(self.plot, pg.mkPen(None), -5)
        self.backdrop.setBrush(pg.mkBrush(MASKED_COLOR))
        self.image = _MatrixImage(self)
        self.plot.addItem(self.image)
        # past the exact limit the image holds block maxima; where the view zooms in, the worker
        # sends exact cells, drawn over it (on their own grey, so masked cells stay grey)
        self.tile_backdrop = QGraphicsRectItem(0, 0, 1, 1)
        self.tile_backdrop.setBrush(pg.mkBrush(MASKED_COLOR))
        self.tile_backdrop.setPen(pg.mkPen(None))
        self.tile = ColourImage()
        for z, item in ((1, self.tile_backdrop), (2, self.tile)):
            item.setZValue(z)
            item.setAcceptHoverEvents(False)
            item.setAcceptedMouseButtons(Qt.MouseButton.NoButton)  # hover and clicks reach the matrix below
            item.setVisible(False)
            self.plot.addItem(item)
        self.tile.setLookupTable(CMAP.getLookupTable(nPts=256))
        self._view_sent = None
        self._view_timer = QTimer(
            self, singleShot=True, interval=120
        )  # a wheel zoom sends one request when it settles, not one per notch
        self._view_timer.timeout.connect(self._send_view)
        self.cbar = pg.ColorBarItem(values=(0.0, 1.0), colorMap=CMAP, interactive=False, width=12)
        self.cbar.setImageItem(self.image, insert_in=self.plot)
        self.cbar.setToolTip("Colour scale of the stage shown (its numbers at the ends); grey cells are masked")
        self.newest = outline(self.plot, NEWEST_PEN, 10)
        self.selrow = outline(self.plot, SELECTED_PEN, 11)
        self.edits = pg.ScatterPlotItem(symbol="x", size=9, pen=pg.mkPen("#ff4040", width=2), brush=None, pxMode=True)
        self.edits.setZValue(12)
        self.plot.addItem(self.edits)
        self.preview = pg.ScatterPlotItem(
            symbol="s", size=10, pen=pg.mkPen("#ffffff"), brush=pg.mkBrush(255, 64, 64, 120)
        )
        self.preview.setZValue(13)
        self.plot.addItem(self.preview)
        self._hint = placeholder_text(self.plot, "press Step (F10) to run the prompt")
        self.readout = info_label(" ", dim=False)
        nw = QLabel("▭ newest row")
        nw.setStyleSheet("color: #ff6b6b;")
        foot = hbox(None, legend_swatch(MASKED_COLOR, "masked"), nw, (self.readout, 1))
        vbox(self, bar_w, self.title, (self.glw, 1), foot, margin=2, spacing=2)
        self._show_empty()
        self.vb.sigRangeChanged.connect(lambda *_: self._view_timer.start())
        unprefixed(self.plot)

    def _visible(self) -> tuple[int, int, int, int]:
        (x0, x1), (y0, y1) = self.vb.viewRange()
        t = self.T
        clamp = lambda v: min(max(int(v), 0), t)  # noqa: E731
        return (
            clamp(math.floor(min(y0, y1))),
            clamp(math.ceil(max(y0, y1))),
            clamp(math.floor(x0)),
            clamp(math.ceil(x1)),
        )

    def _send_view(self) -> None:
        """Ask for exact cells where a pooled matrix is zoomed in far enough to show them."""
        s = self.snap
        view = None
        if s is not None and s.scores.matrix is not None and s.scores.matrix_block > 1:
            q0, q1, k0, k1 = self._visible()
            if 0 < q1 - q0 <= viewdata.TILE_CELLS and 0 < k1 - k0 <= viewdata.TILE_CELLS:
                view = (q0, q1, k0, k1)
        if view != self._view_sent:
            self._view_sent = view
            self.view_changed.emit(view)

    def _show_tile(self, snap) -> None:
        if snap.scores.tile is not None:
            q0, k0 = snap.scores.tile_origin
            n, m = snap.scores.tile.shape
            self.tile.show(snap.scores.tile, snap.scores.levels, ready(snap, "tile"))
            self.tile.setRect(QRectF(k0, q0, m, n))
            self.tile_backdrop.setRect(QRectF(k0, q0, m, n))
        self.tile.setVisible(snap.scores.tile is not None)
        self.tile_backdrop.setVisible(snap.scores.tile is not None)

    def _show_empty(self) -> None:
        """Before the first step: the hint alone, no cell outlines or axes over it."""
        self.T = 0
        self.image.clear()
        self._last_matrix = None
        self.edits.setData([], [])
        for item in (self.newest, self.selrow, self.backdrop, self.tile, self.tile_backdrop):
            item.setVisible(False)
        show_axes(self.plot, ("left", "bottom"), False)
        self.cbar.setVisible(False)
        self._hint.setVisible(True)
        self.plot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
        self.title.setText("")
        self.left.set_labels([])
        self.bottom.set_labels([])

    # ------------------------------------------------------------------ state in
    def set_snapshot(self, snap) -> None:
        self.snap = snap
        kind = snap.selection.kind
        if not self.kind_buttons[kind].isChecked():
            self.kind_buttons[kind].setChecked(True)
        editable = not snap.read_only
        self.edit_button.setEnabled(editable)
        self.scope.setEnabled(editable)
        if not editable and self.edit_mode:
            self.edit_button.setChecked(False)
        if snap.scores.matrix is None:
            self._show_empty()
            return
        self._hint.setVisible(False)
        show_axes(self.plot, ("left", "bottom"), True)
        self.cbar.setVisible(True)
        t = snap.T
        follow = self.T == 0 or self._showing_all()
        if snap.scores.matrix is not self._last_matrix:
            self.image.show(snap.scores.matrix, snap.scores.levels, ready(snap, "matrix"))
            side = (
                snap.scores.matrix.shape[0] * snap.scores.matrix_block
            )  # a pooled cell covers block x block positions
            self.image.setRect(QRectF(0, 0, side, side))
            self.cbar.setLevels(snap.scores.levels)
            self._last_matrix = snap.scores.matrix
        self._show_tile(snap)
        if t != self.T:
            self.backdrop.setRect(QRectF(0, 0, t, t))
            self.T = t
            if follow:
                self.plot.setRange(xRange=(0, t), yRange=(0, t), padding=0.0)
        labels = snap.tokens.labels[:t]
        self.left.set_labels(labels)
        self.bottom.set_labels(labels)
        self.backdrop.setVisible(True)
        self.newest.setRect(QRectF(0, t - 1, t, 1))
        self.newest.setVisible(True)
        self.selrow.setRect(QRectF(0, snap.query, t, 1))
        self.selrow.setVisible(snap.query != t - 1)
        cells = [(e.key + 0.5, e.query + 0.5) for e in snap.edits_for(snap.selection.layer, snap.selection.head)
                 if e.query < t and e.key < t]  # fmt: skip
        self.edits.setData([c[0] for c in cells], [c[1] for c in cells])
        if self._hovered is not None:  # the pointer did not move, but the number under it did (a mask edit)
            self._readout(self._hovered)
        sel = snap.selection
        b = snap.scores.matrix_block
        pooled = "" if b == 1 else (f" · pooled {b}×{b} (block max)" + ("; exact cells where zoomed in" if snap.scores.tile is not None
                                    else f"; zoom to ≤ {viewdata.TILE_CELLS} positions for exact cells"))  # fmt: skip
        if snap.scores.matrix_rows < t:
            pooled += f" · building: {100 * snap.scores.matrix_rows // t}% of rows"
        self.title.setText(
            f"layer {sel.layer} · head {sel.head} · {KIND_LABELS[sel.kind]} · T = {t} · "
            f"query {snap.query} “{snap.tokens.labels[snap.query]}” · scaling {snap.qkv.scaling:.4g}{pooled}"
        )
        if b > 1:
            self._send_view()  # T grew past a new block size, or the matrix just became pooled

    def _reset_zoom(self) -> None:
        if self.T:
            self.plot.setRange(xRange=(0, self.T), yRange=(0, self.T), padding=0.0)

    def _showing_all(self) -> bool:
        (x0, x1), (y0, y1) = self.vb.viewRange()
        return x0 <= 0.5 and y0 <= 0.5 and x1 >= self.T - 0.5 and y1 >= self.T - 0.5

    # ------------------------------------------------------------------ interaction
    def _cell(self, pos) -> tuple[int, int] | None:
        if pos is None or self.T == 0:
            return None
        q, k = int(math.floor(pos.y())), int(math.floor(pos.x()))
        if 0 <= q < self.T and 0 <= k < self.T:
            return q, k
        return None

    def _hover(self, pos) -> None:
        self._readout(self._cell(pos))

    def hovered_cell(self) -> tuple[int, int] | None:
        """(query, key) under the pointer, or None (Help's page writes that cell's arithmetic out)."""
        return self._hovered

    def _readout(self, cell) -> None:
        self._hovered = cell
        s = self.snap
        if cell is None or s is None or s.scores.matrix is None or max(cell) >= s.T:
            self.readout.setText(" ")
            self.key_hovered.emit(-1, -1)
            return
        q, k = cell
        val = self._value_text(s, q, k)
        self.readout.setText(f"query {q} “{s.tokens.labels[q]}” → key {k} “{s.tokens.labels[k]}”: {val}")
        self.key_hovered.emit(q, k)

    @staticmethod
    def _value_text(s, q: int, k: int) -> str:
        """The number under the pointer: exact where the snapshot has it, else the block's maximum."""
        if s.scores.matrix_block == 1:
            return "masked" if not s.scores.allowed[q, k] else f"{s.scores.matrix[q, k]:.4g}"
        if s.scores.tile is not None:
            tq, tk = q - s.scores.tile_origin[0], k - s.scores.tile_origin[1]
            if 0 <= tq < s.scores.tile.shape[0] and 0 <= tk < s.scores.tile.shape[1]:
                v = s.scores.tile[tq, tk]
                return "masked" if math.isnan(v) else f"{v:.4g}"
        v = s.scores.matrix[q // s.scores.matrix_block, k // s.scores.matrix_block]
        b = s.scores.matrix_block
        return f"block {b}×{b}: all masked" if math.isnan(v) else f"block {b}×{b} max {v:.4g} (zoom in for exact cells)"

    def _click(self, pos) -> None:
        cell = self._cell(pos)
        if cell is None:
            return
        if self.edit_mode:
            self.edit_cells([cell])
        else:
            self.query_clicked.emit(cell[0])

    def _drag(self, pos, start: bool, finish: bool, origin=None) -> None:
        """One event of a drag at ``pos``; ``origin``: where the button went down (a drag starts a few pixels on)."""
        if start:
            self._drag_cells, self._drag_last = {}, origin
        # a fast drag crosses several cells between two mouse events: take every cell on the way,
        # sampled at a quarter cell along the segment since the last event
        last, self._drag_last = self._drag_last, pos
        n = 1 if last is None else max(1, math.ceil(4 * max(abs(pos.x() - last.x()), abs(pos.y() - last.y()))))
        for i in range(0 if start and last is not None else 1, n + 1):
            cell = self._cell(pos if last is None else last + (pos - last) * (i / n))
            if cell is not None and cell[1] <= cell[0]:
                self._drag_cells[cell] = None
        if self._drag_cells:
            self.preview.setData([c[1] + 0.5 for c in self._drag_cells], [c[0] + 0.5 for c in self._drag_cells])
        if finish:
            cells, self._drag_cells = list(self._drag_cells), {}
            self.preview.setData([], [])
            self.edit_cells(cells)

    def set_edit_mode(self, on: bool) -> None:
        self.edit_mode = bool(on)
        if self.edit_button.isChecked() != self.edit_mode:
            self.edit_button.setChecked(self.edit_mode)
        self.vb.setMouseEnabled(not on, not on)
        self.glw.setCursor(Qt.CursorShape.CrossCursor if on else Qt.CursorShape.ArrowCursor)

    def edit_cells(self, cells) -> None:
        """Toggle blocks on these (query, key) cells in the chosen scope; future keys are ignored."""
        cells = [(int(q), int(k)) for q, k in cells if 0 <= k <= q < max(self.T, 1)]
        if cells:
            self.cells_edited.emit(cells, self.scope.currentData())
