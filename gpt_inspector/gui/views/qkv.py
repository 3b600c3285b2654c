"""Q, K and V of the selected head, and one attention score taken apart.

For the selected query position and the hovered key j (hover the score matrix or the K map;
by default the key the head attends to most) it shows q ⊙ k_j element by element, their sum
(the raw score) and × scaling (the score the softmax sees).
"""

from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtWidgets import QGraphicsRectItem, QWidget

from .common import (
    DIVERGING,
    NEWEST_PEN,
    SELECTED_PEN,
    TokenAxis,
    bare,
    info_label,
    outline,
    placeholder_text,
    show_axes,
    symmetric_levels,
    under,
    unprefixed,
    vbox,
    wrapped_label,
)
from .image import ColourImage, ready

COMPACT_HEIGHT = 300  # px: below this K and V show no dimension ticks (d is in the title)
_POS = pg.mkBrush("#4f8fdf")
_NEG = pg.mkBrush("#df6f4f")


class _KImage(ColourImage):
    def __init__(self, view):
        super().__init__()
        self.view = view
        self.setAcceptHoverEvents(True)

    def hoverEvent(self, ev):
        if not ev.isExit():
            self.view.set_key(int(math.floor(ev.pos().y())))


class QKVView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.title = info_label("")
        self.glw = pg.GraphicsLayoutWidget()
        self.readout = wrapped_label(" ", rich=True)
        vbox(self, self.title, (self.glw, 1), self.readout, margin=2, spacing=2)

        # On a laptop the dock is ~220 px tall: K and V get the height, q is a thin strip over K's
        # columns and the q⊙k bars are capped, and the names sit in the left axes, not in titles.
        self.qplot = bare(self.glw.addPlot(row=0, col=0, colspan=2), still=True)
        self.qplot.setLabel("left", "q")
        self.qplot.getAxis("left").setTicks([[]])
        self.qplot.hideAxis("bottom")  # K's axis below counts the same dimensions
        self.qimg = pg.ImageItem(axisOrder="row-major")
        self.qimg.setLookupTable(DIVERGING.getLookupTable(nPts=256))
        self.qplot.addItem(self.qimg)
        self.qplot.setMaximumHeight(20)
        self.qplot.setMinimumHeight(14)
        self.kaxis = TokenAxis("left", chars=8)
        self.kplot = self.glw.addPlot(row=1, col=0, axisItems={"left": self.kaxis})
        self.vplot = self.glw.addPlot(row=1, col=1)
        self.kimg = _KImage(self)
        self.vimg = ColourImage()
        self.rows: list[tuple[QGraphicsRectItem, QGraphicsRectItem]] = []
        for p, img in ((self.kplot, self.kimg), (self.vplot, self.vimg)):
            img.setLookupTable(DIVERGING.getLookupTable(nPts=256))
            p.addItem(img)
            bare(p, invert=True)
            p.setMinimumHeight(80)  # with its axis: rows a reader can still point at
            self.rows.append((outline(p, NEWEST_PEN), outline(p, SELECTED_PEN)))
        # q and K share one diverging scale (q·k multiplies them); V has its own. Under the images, not
        # beside them: on a laptop the panel is ~300 px wide, and two upright bars left K and V 35 px each
        self.kbar, self.vbar = (
            under(p, imgs) for p, imgs in ((self.kplot, [self.qimg, self.kimg]), (self.vplot, self.vimg))
        )
        self.kbar.setToolTip("Colour scale of q and K: blue negative, red positive, centred on 0")
        self.vbar.setToolTip("Colour scale of V: blue negative, red positive, centred on 0")
        self.vplot.setYLink(self.kplot)
        self.vplot.getAxis("left").setTicks([[]])
        # set once, before _set_empty: pyqtgraph's setLabel shows the axis it labels
        self.kplot.setLabel("left", "K")
        self.vplot.setLabel("left", "V")
        for plot, tip in ((self.qplot, "q: the selected position's query vector, one column per dimension"),
                          (self.kplot, "K: one row per cached position (the kv head this head reads); hover a row"),
                          (self.vplot, "V: one row per cached position; the head's output is their p-weighted sum")):  # fmt: skip
            plot.getAxis("left").setToolTip(tip)
        self.title.setToolTip("The layer, head and query shown; F1 writes the selected score out with its numbers")
        self.bplot = bare(self.glw.addPlot(row=2, col=0, colspan=2))
        self.bplot.setLabel("left", "q⊙k")
        self.bplot.hideAxis("bottom")
        self.bplot.setMaximumHeight(52)
        self.bplot.setMinimumHeight(32)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brushes=[])
        self.bplot.addItem(self.bars)
        self.bplot.addLine(y=0, pen=pg.mkPen("#555"))
        self.glw.ci.layout.setRowStretchFactor(0, 0)
        self.glw.ci.layout.setRowStretchFactor(1, 4)
        self.glw.ci.layout.setRowStretchFactor(2, 1)
        self._hint = placeholder_text(self.kplot, "no steps yet")
        self._empty = True
        self.compact = False  # short (a laptop's dock): K and V drop their dimension axes for image rows
        self.snap = None
        self.key = -1
        self._last = None
        self._drawn: tuple = ()
        unprefixed(self.qplot, self.kplot, self.vplot, self.bplot)
        self._set_empty(True)

    def resizeEvent(self, ev) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(ev)
        compact = self.height() < COMPACT_HEIGHT
        if compact != self.compact:
            self.compact = compact
            self._set_empty(self._empty)

    def _set_empty(self, empty: bool) -> None:
        self._empty = empty
        # an empty plot would show pyqtgraph's default axes: "(x0.001)" and −0.4…0.4 for no data
        for plot, names in (
            (self.qplot, ("left",)),
            (self.kplot, ("left",)),
            (self.vplot, ("left",)),
            (self.bplot, ("left",)),
        ):
            show_axes(plot, names, not empty)
        for plot in (self.kplot, self.vplot):
            show_axes(plot, ("bottom",), not empty and not self.compact)
        for r in (r for pair in self.rows for r in pair):
            r.setVisible(not empty)
        for bar in (self.kbar, self.vbar):  # no scale for no data
            bar.setVisible(not empty)
        self._hint.setVisible(empty)
        if empty:
            self.kplot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)

    def set_snapshot(self, snap) -> None:
        # the parts by identity (the worker keeps an unchanged one: gui.paint), the rest by value
        drawn = (snap.qkv, snap.query_row, snap.tokens, (snap.selection.layer, snap.selection.head, snap.query))
        same = len(self._drawn) == len(drawn) and all(a is b for a, b in zip(drawn[:3], self._drawn[:3]))
        self.snap = snap
        if same and drawn[3] == self._drawn[3]:
            return  # nothing this view draws changed
        self._drawn = drawn
        if snap.qkv.q is None:
            for img in (self.qimg, self.kimg, self.vimg):
                img.clear()
            self.bars.setOpts(x=[], height=[], brushes=[])
            self._set_empty(True)
            self._last = None
            self.kaxis.set_labels([])  # the old prompt's tokens must not label a new, empty cache
            self.title.setText("")
            self.readout.setText(" ")
            self.key = -1
            return
        if self._empty:
            self._set_empty(False)
        t, d = snap.qkv.k.shape
        if self._last is not snap.qkv.k:
            # the worker's levels and pixels where it made them (gui.paint), else made here
            rk, rv = ready(snap, "qkv_k"), ready(snap, "qkv_v")
            rk = rk if rk is not None and rk.values is snap.qkv.k else None
            rv = rv if rv is not None and rv.values is snap.qkv.v else None
            qk = rk.levels if rk is not None else symmetric_levels(np.concatenate([snap.qkv.q, snap.qkv.k.ravel()]))
            vl = rv.levels if rv is not None else symmetric_levels(snap.qkv.v)
            self.qimg.setImage(snap.qkv.q[None, :], autoLevels=False, levels=qk)
            self.qimg.setRect(QRectF(0, 0, d, 1))
            self.kimg.show(snap.qkv.k, qk, rk)
            self.vimg.show(snap.qkv.v, vl, rv)
            self.kbar.setLevels(qk)
            self.vbar.setLevels(vl)
            self._last = snap.qkv.k
            self.kaxis.set_labels(snap.tokens.labels[:t])
            self.kplot.setRange(xRange=(0, d), yRange=(0, t), padding=0)
            self.vplot.setXRange(0, d, padding=0)
            self.qplot.setRange(xRange=(0, d), yRange=(0, 1), padding=0)
        for newest, _ in self.rows:
            newest.setRect(QRectF(0, t - 1, d, 1))
        sel = snap.selection
        kv = f" (kv head {snap.qkv.kv_head})"
        self.title.setText(
            f"layer {sel.layer} · head {sel.head}{kv} · query {snap.query} “{snap.tokens.labels[snap.query]}” · d = {d}"
        )
        key = self.key
        if not 0 <= key < t or snap.query_row.query_allowed is None or not snap.query_row.query_allowed[key]:
            key = int(np.argmax(snap.query_row.head_rows[sel.head])) if snap.query_row.head_rows is not None else t - 1
        self.key = -1
        self.set_key(key)

    def set_key(self, key: int) -> None:
        """Break q·k_key down for the selected query (also called when the score matrix is hovered)."""
        s = self.snap
        if s is None or s.qkv.k is None or key == self.key or not 0 <= key < s.qkv.k.shape[0]:
            return
        self.key = key
        t, d = s.qkv.k.shape
        for _, hov in self.rows:
            hov.setRect(QRectF(0, key, d, 1))
        prod = s.qkv.q * s.qkv.k[key]  # (d,)
        self.bars.setOpts(x=np.arange(d), height=prod, width=0.8, brushes=[_POS if v >= 0 else _NEG for v in prod])
        raw = float(prod.sum())
        score = raw * s.qkv.scaling
        bias = (
            None if s.query_row.query_bias is None else float(s.query_row.query_bias[key])
        )  # ALiBi / a learned bias: part of the score
        if bias is not None:
            score += bias
        if s.qkv.softcap is not None:
            score = math.tanh(score / s.qkv.softcap) * s.qkv.softcap
        allowed = bool(s.query_row.query_allowed[key]) if s.query_row.query_allowed is not None else True
        p = float(s.query_row.head_rows[s.selection.head, key]) if s.query_row.head_rows is not None else float("nan")
        tail = (
            f"softmax p = <b>{p:.4f}</b>"
            if allowed
            else "<span style='color:#ff6b6b'>masked: the softmax never sees it</span>"
        )
        self.readout.setText(
            f"q<sub>{s.query}</sub> · k<sub>{key}</sub> “{html.escape(s.tokens.labels[key])}”: Σ<sub>i</sub> q<sub>i</sub>k<sub>i</sub> = "
            f"<b>{raw:.4f}</b> × scaling {s.qkv.scaling:.4g}"
            + ("" if bias is None else f" + bias {bias:+.4g}")
            + f" = score <b>{score:.4f}</b> → {tail}"
        )
