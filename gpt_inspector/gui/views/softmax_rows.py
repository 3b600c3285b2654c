"""The softmax row of the selected query position for every head of the layer, as bar charts.

Bars are drawn as one filled step curve per head (not one rectangle per key), so a thousand
keys cost the same as ten. Past two keys per pixel of the plot, each bar is the maximum of a block
of keys (the peaks the pixels can show): a fill path through every key of a 32k row cost more than
the rest of the window's repaint (pyqtgraph's own peak downsampling does not apply to a step curve).
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QCheckBox, QWidget

from .common import TEXT, TokenAxis, bare, hbox, info_label, unprefixed, vbox

_BRUSH = pg.mkBrush(79, 143, 223, 200)
_SEL_BRUSH = pg.mkBrush(255, 184, 79, 220)
BARS_PER_PIXEL = 2  # past this many keys per pixel, blocks of keys share a bar (their maximum)
MIN_BARS = 64


def block_max(rows: np.ndarray, bars: int) -> tuple[np.ndarray, np.ndarray]:
    """(edges (n + 1,), heights (H, n)): ``rows`` (H, T) as at most ``bars`` bars, each the maximum of its block of keys."""
    t = rows.shape[1]
    b = max(1, -(-t // max(1, bars)))
    if b == 1:
        return np.arange(t + 1, dtype=np.float64), rows
    n = -(-t // b)
    padded = np.zeros((rows.shape[0], n * b), dtype=rows.dtype)  # probabilities: 0 never raises a maximum
    padded[:, :t] = rows
    edges = np.minimum(np.arange(n + 1, dtype=np.float64) * b, t)
    return edges, padded.reshape(rows.shape[0], n, b).max(axis=2)


class SoftmaxRows(QWidget):
    head_clicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.title = info_label("")
        self.only_selected = QCheckBox("selected head only", toolTip="Show only the selected head's row, larger")
        self.only_selected.toggled.connect(self._relayout)
        self.glw = pg.GraphicsLayoutWidget()
        vbox(self, hbox(None, (self.title, 1), self.only_selected), (self.glw, 1), margin=2, spacing=2)
        self.plots: list[pg.PlotItem] = []
        self.curves: list[pg.PlotDataItem] = []
        self.axes: list[TokenAxis] = []
        self.labels: list[pg.TextItem] = []
        self.sums: list[float] = []
        self.H = 0
        self.head = 0
        self.snap = None
        self._drawn: tuple = (None, None, None)
        self.glw.scene().sigMouseClicked.connect(self._clicked)

    def _build(self, H: int) -> None:
        self.glw.clear()
        self.plots, self.curves, self.axes, self.labels = [], [], [], []
        for _ in range(H):
            ax = TokenAxis("bottom", chars=5)
            p = bare(pg.PlotItem(axisItems={"bottom": ax}), still=True)
            p.setYRange(0, 1, padding=0.02)
            p.getAxis("left").setWidth(28)
            p.getAxis("left").setTicks([[(0, "0"), (0.5, ".5"), (1, "1")]])
            p.getAxis("left").setToolTip("p, the attention weight on each key (0 to 1; a head's bars sum to 1)")
            unprefixed(p)
            c = pg.PlotDataItem(stepMode="center", fillLevel=0, fillOutline=False, brush=_BRUSH, pen=None)
            # thousands of keys in a panel a few hundred pixels wide: draw the peaks the pixels can show
            c.setDownsampling(auto=True, method="peak")
            c.setClipToView(True)
            p.addItem(c)
            # a plain-text label, not setTitle(): rich-text titles cost ~0.5 ms each, per step
            ti = pg.TextItem("", color=TEXT, anchor=(0, 0), fill=pg.mkBrush(27, 30, 36, 170))
            ti.setZValue(10)
            p.addItem(ti, ignoreBounds=True)
            self.labels.append(ti)
            self.plots.append(p)
            self.curves.append(c)
            self.axes.append(ax)
        self.H = H
        self._drawn = (None, None, None)  # new plots: nothing drawn in them yet
        self._relayout()

    def _relayout(self) -> None:
        for p in self.plots:
            if p.scene() is not None:
                self.glw.removeItem(p)
        only = self.only_selected.isChecked()
        heads = [self.head] if only and self.plots else range(len(self.plots))
        cols = 1 if only else max(1, math.ceil(math.sqrt(len(self.plots))))
        for i, h in enumerate(heads):
            self.glw.addItem(self.plots[h], row=i // cols, col=i % cols)

    def set_snapshot(self, snap) -> None:
        self.snap = snap
        if snap.n_heads != self.H:
            self._build(snap.n_heads)
        head = snap.selection.head
        if head != self.head:
            self.head = head
            if self.only_selected.isChecked():
                self._relayout()
        rows = snap.query_row.head_rows
        width = max((p.getViewBox().width() for p in self.plots), default=0.0)
        # the parts by identity (the worker keeps an unchanged one: gui.paint), the rest by value
        drawn = (snap.query_row, snap.tokens, (head, snap.selection.layer, snap.query, width))
        if (
            rows is not None
            and drawn[0] is self._drawn[0]
            and drawn[1] is self._drawn[1]
            and drawn[2] == self._drawn[2]
        ):
            return  # nothing this view draws changed
        self._drawn = drawn
        if rows is None:
            for c, lab in zip(self.curves, self.labels):
                c.setData([], [])
                lab.setText("")
            self.title.setText("softmax rows: no steps yet")
            return
        t = rows.shape[1]
        x, bars = block_max(rows, max(MIN_BARS, int(BARS_PER_PIXEL * width)))  # (n + 1,), (H, n)
        labels = snap.tokens.labels[:t]
        self.sums = rows.sum(axis=1).tolist()
        tops = rows.argmax(axis=1).tolist()
        new_t = t != getattr(self, "_t", -1)
        self._t = t
        # per step only the data changes; ranges, colours and label text only when they do (each
        # of those calls costs a re-layout of its plot, times H plots)
        for h, (p, c, ax) in enumerate(zip(self.plots, self.curves, self.axes)):
            brush = _SEL_BRUSH if h == head else _BRUSH
            if c.opts["fillBrush"] != brush:
                c.setData(x, bars[h], brush=brush)
            else:
                c.setData(x, bars[h], skipFiniteCheck=True)
            ax.set_labels(labels)
            if new_t:
                p.setXRange(0, t, padding=0)
            top = tops[h]
            lab = self.labels[h]
            # short lines: a small plot clips a long one ("H0 Σ = 1.")
            text = f"H{h} Σ={self.sums[h]:.3f}\nmax {rows[h, top]:.2f} {labels[top]}"
            if lab.toPlainText() != text:
                lab.setText(text)
            color = "#ffb84f" if h == head else TEXT
            if getattr(lab, "_shown_color", None) != color:
                lab.setColor(color)
                lab._shown_color = color
                lab.setPos(0, 1.0)
        self.title.setText(
            f"softmax of query {snap.query} “{snap.tokens.labels[snap.query]}” · layer {snap.selection.layer}, every head"
        )

    def _clicked(self, ev) -> None:
        if ev.button() != Qt.MouseButton.LeftButton:
            return
        for h, p in enumerate(self.plots):
            if p.scene() is not None and p.sceneBoundingRect().contains(ev.scenePos()):
                self.head_clicked.emit(h)
                return
