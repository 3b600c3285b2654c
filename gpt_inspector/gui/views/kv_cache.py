"""The KV cache: the selected layer's K and V growing one row per step, and what it costs.

Rows are positions (newest outlined), columns are KV heads side by side (thin separators): K and V
as the attention function received them. Right: the bytes the model's own cache would hold per layer
(selected one highlighted) and in all after each step: on a sliding-window or chunked layer only
its window, as the cache ``generate`` builds. The inspector keeps every position so all stay
inspectable; where that is more, its bytes are drawn beside (outlined bars, a grey curve) and the
title says both. Where the cache holds something else (a compressed latent, untiled heads, another
layer's cache) the title says what, next to its bytes.

Under a KV cache policy (a KV cache lab's policy run), each KV head's evicted rows are greyed and
crossed in both images, the rows the selected head's KV head evicted are marked ✗ in the token
labels, and a quantizing policy's per-row error (keys and values, the selected KV head) is drawn in
a column beside V.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtWidgets import QCheckBox, QPushButton, QWidget

from ...core.kv_layout import human_bytes
from ...core.pooling import pool_rows
from ...figures.labels import nice_step
from .common import (
    BAR_BRUSH,
    CHOSEN_BRUSH,
    DIVERGING,
    NEWEST_PEN,
    IndexAxis,
    TokenAxis,
    WholeAxis,
    bare,
    hbox,
    info_label,
    outline,
    placeholder_text,
    show_axes,
    symmetric_levels,
    under,
    unprefixed,
    vbox,
)
from .image import ColourImage, ready

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
EVICTED_GREY = (140, 143, 150)  # MASKED_COLOR's grey: an evicted entry reads like a masked one
EVICTED_MARK = "#2b2e35"
EVICTED_ALPHA = 200  # the veil over a row every position of which is evicted (pooled rows: in proportion)
EVICTED_LABEL = "✗ "  # prefixed to the token label of a row the selected head's KV head evicted


def cache_note(cached: float, per_head: float) -> str:
    """Where the model's cache is not the per-head K/V shown: what it holds instead (bytes of this layer)."""
    if cached == per_head:
        return ""
    if cached == 0:
        return " · this layer keeps no cache: it reads an earlier layer's K and V (KV sharing)"
    return (f" · shown: K and V as attention receives them ({human_bytes(per_head)}); "
            f"the model's cache holds {human_bytes(cached)} for this layer (a compressed latent or fewer heads)")  # fmt: skip


KEPT_PEN = "#8a8f99"  # what the inspector keeps beyond the model's cache: grey, behind the model's own


def cache_bytes_text(snap, layer: int) -> str:
    """The model's cache in bytes, this layer (its window where it keeps one) and all, then what the
    inspector keeps where that is more: short, so the one-line title keeps it at 1366 px."""
    cached, kept = snap.kv.kv_bytes, snap.kv.kv_kept
    n = snap.kv.kv_positions[layer] if layer < len(snap.kv.kv_positions) else snap.T
    window = f" (last {n} positions)" if n < snap.T and cached[layer] else ""
    whose = "model's" if snap.kv.kv_evicted is None else "policy's"  # a KV cache lab's policy run: its cache
    text = f"{whose} cache {human_bytes(cached[layer])}{window}, {human_bytes(sum(cached))} all layers"
    if len(kept) == len(cached) and sum(kept) > sum(cached):
        text += f" · kept for inspection {human_bytes(kept[layer])}, {human_bytes(sum(kept))} all"
    return text


class HeadAxis(pg.AxisItem):
    """ "kv head n" over the middle of each head's columns (heads side by side, d columns each), thinned to fit."""

    def __init__(self, orientation: str = "top", **kw):
        super().__init__(orientation, **kw)
        self.heads, self.d = 0, 1
        self.short = False  # labels "kv n" where "kv head n" does not fit
        self.setStyle(tickLength=0, hideOverlappingLabels=False)  # "kv 0" sits at the left edge: keep it
        self.setToolTip("The kv heads side by side: each takes head_dim columns (kv n: kv head n)")

    def set_heads(self, heads: int, d: int) -> None:
        if (heads, d) != (self.heads, self.d):
            self.heads, self.d = heads, max(1, d)
            self.picture = None
            self.update()

    def tickValues(self, minVal, maxVal, size):  # noqa: N802, N803 (pyqtgraph)
        minVal, maxVal = min(minVal, maxVal), max(minVal, maxVal)
        if self.heads == 0 or size <= 0 or maxVal <= minVal:
            return []
        per_head = size / (maxVal - minVal) * self.d  # pixels
        # "kv head 10" needs ~60 px; narrower heads get "kv 10" (the tooltip says what it means), then fewer
        self.short = per_head < 66
        stride = int(nice_step(max(1.0, (30.0 if self.short else 66.0) / per_head)))
        return [(stride * self.d, [(h + 0.5) * self.d for h in range(0, self.heads, stride)])]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph)
        return [f"kv {int(v // self.d)}" if self.short else f"kv head {int(v // self.d)}" for v in values]


def _pool_share(evicted: np.ndarray, block: int) -> np.ndarray:
    """(Hkv, T) bool -> (ceil(T / block), Hkv): the share of each row block's positions evicted."""
    return pool_rows(evicted.T.astype(np.float32), block, np.float64)  # the veil's alpha rounds the float64 share


class KVCacheView(QWidget):
    layer_clicked = Signal(int)
    export_requested = Signal(str)  # "k" or "v": the selected layer's cache as an image

    def __init__(self, parent=None):
        super().__init__(parent)
        self.title = info_label("")
        # where the model caches something else than per-head K/V (MLA's latent): show that instead
        self.as_cached = QCheckBox("as cached", visible=False, toolTip="Show the rows the model's cache really stores "
                                   "(a compressed latent) instead of the per-head K and V attention receives")  # fmt: skip
        self.as_cached.toggled.connect(self._refresh)
        head = hbox(None, (self.title, 1), self.as_cached)
        for which in ("k", "v"):
            head.addWidget(QPushButton(f"Export {which.upper()}…", toolTip=f"Save this layer's {which.upper()} cache as PNG or SVG",
                                       clicked=lambda _=False, w=which: self.export_requested.emit(w)))  # fmt: skip
        self.glw = pg.GraphicsLayoutWidget()
        vbox(self, head, (self.glw, 1), margin=2, spacing=2)
        self.axis = TokenAxis("left", chars=8)
        self.heads_axes = (HeadAxis("top"), HeadAxis("top"))
        self.kplot = self.glw.addPlot(row=0, col=0, rowspan=2, title=None,
                                      axisItems={"left": self.axis, "top": self.heads_axes[0]})  # fmt: skip
        self.vplot = self.glw.addPlot(row=0, col=1, rowspan=2, title=None, axisItems={"top": self.heads_axes[1]})
        self.kimg = ColourImage()
        self.vimg = ColourImage()
        self.newest = []
        self.seps = []
        # a KV cache policy's evicted rows: a grey veil per (row, KV head) and an X through each
        self.evicted_veils, self.evicted_marks = [], []
        for p, img in ((self.kplot, self.kimg), (self.vplot, self.vimg)):
            img.setLookupTable(DIVERGING.getLookupTable(nPts=256))
            p.addItem(img)
            bare(p, invert=True)
            p.hideAxis("bottom")
            self.newest.append(outline(p, NEWEST_PEN))
            sep = pg.PlotCurveItem(pen=pg.mkPen("#1b1e24", width=1), connect="pairs")
            sep.setZValue(5)
            p.addItem(sep)
            self.seps.append(sep)
            veil = pg.ImageItem(axisOrder="row-major")
            veil.setZValue(6)
            p.addItem(veil)
            self.evicted_veils.append(veil)
            mark = pg.PlotCurveItem(pen=pg.mkPen(EVICTED_MARK, width=1), connect="pairs")
            mark.setZValue(7)
            p.addItem(mark)
            self.evicted_marks.append(mark)
        self.bars_kv = []  # each image its colour scale
        for p, img, name in ((self.kplot, self.kimg, "K"), (self.vplot, self.vimg, "V")):
            p.showAxis("top")
            bar = under(p, img)  # under the image: beside it, two bars squeezed K and V to ~50 px
            bar.setToolTip(f"Colour scale of this layer's {name} cache: blue negative, red positive, centred on 0")
            self.bars_kv.append(bar)
        self.vplot.setYLink(self.kplot)
        self.vplot.hideAxis("left")
        # a quantizing policy's error per row of the selected KV head (hidden otherwise)
        self.eplot = bare(self.glw.addPlot(row=0, col=2, rowspan=2, title=None))
        self.eplot.setYLink(self.kplot)
        self.eplot.hideAxis("left")
        self.eplot.setLabel("bottom", "rel. error")
        self.ek_curve = self.eplot.plot([], [], pen=pg.mkPen("#4fa3ff", width=1.5), name="K")
        self.ev_curve = self.eplot.plot([], [], pen=pg.mkPen("#ffb84f", width=1.5), name="V")
        self.eplot.setTitle("quant. error (K blue, V orange)", size="8pt")
        self._show_error_column(False)
        self.laxis = IndexAxis("bottom", "L")
        self.bplot = bare(self.glw.addPlot(row=0, col=3, title=None, axisItems={"bottom": self.laxis}), still=True)
        # behind the model's bars: what the inspector keeps, where more (every position of a windowed layer)
        self.kept_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=None, pen=pg.mkPen(KEPT_PEN, width=1))
        self.bplot.addItem(self.kept_bars)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7, brushes=[])
        self.bplot.addItem(self.bars)
        self.hplot = bare(
            self.glw.addPlot(row=1, col=3, title=None, axisItems={"bottom": WholeAxis("bottom")})
        )  # whole steps
        self.hplot.setLabel("bottom", "step")
        self.kept_curve = self.hplot.plot([], [], pen=pg.mkPen(KEPT_PEN, width=1, style=Qt.PenStyle.DashLine))
        self.hcurve = self.hplot.plot([], [], pen=pg.mkPen("#4fa3ff", width=2), symbol="o", symbolSize=4,
                                      symbolBrush="#4fa3ff", symbolPen=None)  # fmt: skip
        for p in (self.bplot, self.hplot):
            p.getAxis("left").setWidth(58)
            p.getAxis("left").enableAutoSIPrefix(True)
            p.getAxis("left").setLabel(units="B")
        # small titles: pyqtgraph's default size takes a third of a short panel's height, and clips
        for p, text in ((self.kplot, "K cache"), (self.vplot, "V cache"), (self.bplot, "bytes per layer"),
                        (self.hplot, "size per step")):  # fmt: skip
            p.setTitle(text, size="8pt")
        for col, share in ((0, 3), (1, 3), (3, 2)):
            self.glw.ci.layout.setColumnStretchFactor(col, share)
        self._hint = placeholder_text(self.kplot, "empty")
        self._last = None
        self.snap = None
        self._drawn: tuple = ()
        unprefixed(self.kplot, self.vplot, self.bplot, self.hplot)
        self._hist_range = None  # the size-per-step plot's (steps, bytes) bounds now
        self._more = False  # whether the plots show what the inspector keeps beside the model's cache
        self.shape = (0, 0, 0)
        self.bplot.scene().sigMouseClicked.connect(self._clicked)
        self._set_empty(True)
        self.title.setText("KV cache: empty (no model yet)")

    def _set_empty(self, empty: bool) -> None:
        # no bytes to scale: pyqtgraph would label an empty axis "(mB)" and run it from −400 to 400
        show_axes(self.kplot, ("left",), not empty)
        for p in (self.kplot, self.vplot):
            show_axes(p, ("top",), not empty)
        for bar in self.bars_kv:
            bar.setVisible(not empty)
        for p in (self.bplot, self.hplot):
            show_axes(p, ("left", "bottom"), not empty)
        for r in self.newest:
            r.setVisible(not empty)
        self._hint.setVisible(empty)
        if empty:
            self.kplot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)

    def _clicked(self, ev) -> None:
        if not self.bplot.sceneBoundingRect().contains(ev.scenePos()):
            return
        x = self.bplot.getViewBox().mapSceneToView(ev.scenePos()).x()
        i = int(round(x - 0.5))
        if 0 <= i < self.laxis.n:
            self.layer_clicked.emit(i)

    def _refresh(self, *_args) -> None:
        if self.snap is not None:
            self._last = None
            self._drawn = ()
            self.set_snapshot(self.snap)

    def set_snapshot(self, snap) -> None:
        # the parts by identity (the worker keeps an unchanged one: gui.paint), the rest by value
        drawn = (snap.kv, snap.tokens, (snap.qkv.kv_head, snap.selection.layer, snap.T, snap.dtype, snap.n_kv_heads))
        same = len(self._drawn) == len(drawn) and all(a is b for a, b in zip(drawn[:2], self._drawn[:2]))
        self.snap = snap
        if same and drawn[2] == self._drawn[2]:
            return  # nothing this view draws changed
        self._drawn = drawn
        self.as_cached.setVisible(snap.kv.kv_cached is not None)
        L = snap.n_layers
        self.laxis.set_count(L)
        layer = snap.selection.layer
        kvb = np.asarray(snap.kv.kv_bytes, dtype=float)
        self.bars.setOpts(x=np.arange(L) + 0.5, height=kvb, width=0.7,
                          brushes=[CHOSEN_BRUSH if i == layer else BAR_BRUSH for i in range(L)])  # fmt: skip
        hist = np.asarray(snap.kv.kv_history, dtype=float)
        self.hcurve.setData(np.arange(len(hist)), hist)
        kept = np.asarray(snap.kv.kv_kept, dtype=float)
        more = len(kept) == L and bool((kept > kvb).any())  # the inspector keeps more than the model's cache
        self.kept_bars.setOpts(x=np.arange(L) + 0.5 if more else [], height=kept if more else [], width=0.7)
        kept_hist = np.asarray(snap.kv.kv_kept_history if more else (), dtype=float)
        self.kept_curve.setData(np.arange(len(kept_hist)), kept_hist)
        if more != self._more:  # a title change costs a relayout: only when it says something else
            self._more = more
            self.bplot.setTitle("bytes per layer" + (" (outline: kept)" if more else ""), size="8pt")
            self.hplot.setTitle("size per step" + (" (dashed: kept)" if more else ""), size="8pt")
        top = max(float(hist.max()) if len(hist) else 1.0, float(kept_hist.max()) if len(kept_hist) else 0.0)
        # steps and bytes from 0 (auto-ranging a lone first point spanned ±0.2 "(x0.001)" steps), to the
        # next 1-2-5 bound: the axes change now and then, not on every step (each change costs a relayout)
        ranges = (int(nice_step(max(1.0, len(hist) - 1))), int(nice_step(max(1.0, top))))
        if ranges != self._hist_range:
            self._hist_range = ranges
            self.hplot.setRange(xRange=(0, ranges[0]), yRange=(0, ranges[1]), padding=0.05)
        if snap.kv.kv_k is None:
            self.kimg.clear()
            self.vimg.clear()
            self._last = None
            self.shape = (0, 0, 0)
            self._set_empty(True)
            self.axis.set_labels([])
            self._show_policy(None, 0, 0, 0)
            self.title.setText("KV cache: empty (no step yet)")
            return
        self._set_empty(False)
        if snap.kv.kv_cached is not None and self.as_cached.isChecked():
            self._show_policy(None, 0, 0, 0)
            self._show_cached(snap)
            return
        if (
            self.kplot.titleLabel.text != "K cache"
        ):  # a title set again costs a relayout: only after the cache as stored
            self.kplot.setTitle("K cache", size="8pt")
            self.vplot.show()
        rows, w = snap.kv.kv_k.shape
        t = snap.T  # past the exact limit a row of the image is the mean of kv_block positions
        wv = snap.kv.kv_v.shape[1]  # V's head size may differ from K's (multi-head latent attention)
        if self._last is not snap.kv.kv_k:
            for img, bar, a, width, r in (
                (self.kimg, self.bars_kv[0], snap.kv.kv_k, w, ready(snap, "kv_k")),
                (self.vimg, self.bars_kv[1], snap.kv.kv_v, wv, ready(snap, "kv_v")),
            ):
                # the worker's levels and pixels where it made them (gui.paint), else made here
                r = r if r is not None and r.values is a else None
                levels = r.levels if r is not None else symmetric_levels(a)
                img.show(a, levels, r)
                img.setRect(QRectF(0, 0, width, rows * snap.kv.kv_block))
                bar.setLevels(levels)
            self._last = snap.kv.kv_k
        heads = max(1, snap.n_kv_heads)
        for ax, width in zip(self.heads_axes, (w, wv)):
            ax.set_heads(heads, width // heads)
        if (t, w, wv) != self.shape:
            for sep, width in zip(self.seps, (w, wv)):
                d = width // heads
                xs = np.repeat(np.arange(1, heads) * d, 2).astype(float)
                ys = np.tile([0.0, float(t)], heads - 1)
                sep.setData(xs, ys)
            self.kplot.setRange(xRange=(0, w), yRange=(0, t), padding=0)
            self.vplot.setXRange(0, wv, padding=0)
            self.shape = (t, w, wv)
        for r, width in zip(self.newest, (w, wv)):
            r.setRect(QRectF(0, t - 1, width, 1))
        labels = snap.tokens.labels[:t]
        policy_note = self._show_policy(snap, w, wv, heads)
        if snap.kv.kv_evicted is not None:
            gone = snap.kv.kv_evicted[snap.qkv.kv_head]  # (T,) the selected head's KV head
            labels = tuple(EVICTED_LABEL + lab if g else lab for lab, g in zip(labels, gone))
        self.axis.set_labels(labels)
        dims = f"{w // heads} dims" if w == wv else f"{w // heads} dims in K, {wv // heads} in V"
        # the bytes first: at 1366 px the panel shows only the title's first forty characters (all on hover)
        self._set_title(
            f"layer {layer}: "
            + cache_bytes_text(snap, layer)
            + f" · {t} positions × {heads} KV heads × {dims}, K and V ({snap.dtype})"
            # K and V of every position, as attention receives them: against what is kept of every position
            + cache_note(kept[layer] if more else kvb[layer], t * (w + wv) * _ITEMSIZE.get(snap.dtype, 4))
            + (f" · rows: means of {snap.kv.kv_block} positions" if snap.kv.kv_block > 1 else "")
            + policy_note
        )

    def _set_title(self, text: str) -> None:
        self.title.setText(text)
        self.title.setToolTip(text)  # the one-line title clips on a narrow panel: all of it on hover

    def _show_error_column(self, on: bool) -> None:
        if self.eplot.isVisible() == on:
            return
        # a hidden item still takes its column's width: squeeze it to nothing
        self.eplot.setVisible(on)
        self.eplot.setMaximumWidth(160 if on else 0)
        self.eplot.setMinimumWidth(110 if on else 0)
        self.glw.ci.layout.setColumnStretchFactor(2, 1 if on else 0)

    def _show_policy(self, snap, w: int, wv: int, heads: int) -> str:
        """Grey and cross each KV head's evicted rows; the error column; returns the title's note."""
        ev = None if snap is None else snap.kv.kv_evicted  # (Hkv, T) bool
        err = None if snap is None else snap.kv.kv_error  # (2, Hkv, T)
        if ev is None:
            for veil, mark in zip(self.evicted_veils, self.evicted_marks):
                veil.clear()
                veil.setVisible(False)
                mark.setData([], [])
            self.ek_curve.setData([], [])
            self.ev_curve.setData([], [])
            self._show_error_column(False)
            return ""
        block, t = snap.kv.kv_block, snap.T
        share = _pool_share(ev, block)  # (rows, Hkv) in [0, 1]
        rgba = np.zeros((*share.shape, 4), dtype=np.uint8)
        rgba[..., :3] = EVICTED_GREY
        rgba[..., 3] = np.round(share * EVICTED_ALPHA).astype(np.uint8)
        rows_r, heads_r = np.nonzero(share >= 1.0) if block == 1 else (np.array([], int), np.array([], int))
        for veil, mark, width in zip(self.evicted_veils, self.evicted_marks, (w, wv)):
            veil.setImage(rgba, levels=(0, 255), autoLevels=False)
            veil.setRect(QRectF(0, 0, width, share.shape[0] * block))
            veil.setVisible(True)
            d = width / heads
            x0, y0 = heads_r * d, rows_r.astype(float)
            # two diagonals per evicted (row, KV head) cell: an X
            xs = np.stack([x0, x0 + d, x0, x0 + d], 1).ravel()
            ys = np.stack([y0, y0 + 1, y0 + 1, y0], 1).ravel()
            mark.setData(xs, ys)
        n_gone = int(ev[snap.qkv.kv_head].sum())
        note = f" · KV head {snap.qkv.kv_head}: {n_gone} of {t} rows evicted (greyed, ✗)"
        if err is None:
            self._show_error_column(False)
            return note
        self._show_error_column(True)
        ys = np.arange(t) + 0.5
        self.ek_curve.setData(err[0, snap.qkv.kv_head], ys)
        self.ev_curve.setData(err[1, snap.qkv.kv_head], ys)
        self.eplot.setXRange(0, float(max(err[:, snap.qkv.kv_head].max(), 1e-6)), padding=0.05)
        return (f" · KV head {snap.qkv.kv_head} quantization error: keys max {float(err[0, snap.qkv.kv_head].max()):.3g}, "
                f"values max {float(err[1, snap.qkv.kv_head].max()):.3g}")  # fmt: skip

    def _show_cached(self, snap) -> None:
        """The selected layer's cache rows as the model stores them (one image; V's plot hidden)."""
        a = snap.kv.kv_cached  # (rows, n)
        rows, n = a.shape
        t = snap.T
        self.kimg.setImage(a, autoLevels=False, levels=symmetric_levels(a))
        self.kimg.setRect(QRectF(0, 0, n, rows * snap.kv.kv_block))
        self.bars_kv[0].setLevels(symmetric_levels(a))
        self.heads_axes[0].set_heads(0, 1)  # a latent's columns are no heads
        self._last, self.shape = None, (0, 0, 0)
        for sep in self.seps:
            sep.setData([], [])
        self.vplot.hide()
        self.kplot.setTitle("the cache as stored", size="8pt")
        self.kplot.setRange(xRange=(0, n), yRange=(0, t), padding=0)
        self.newest[0].setRect(QRectF(0, t - 1, n, 1))
        self.axis.set_labels(snap.tokens.labels[:t])
        self._set_title(
            f"layer {snap.selection.layer}: the model's cache as stored, {t} positions × {n} numbers "
            f"(a compressed latent, not per-head K and V, {snap.dtype}) · "
            + cache_bytes_text(snap, snap.selection.layer)
            + (f" · rows: means of {snap.kv.kv_block} positions" if snap.kv.kv_block > 1 else "")
        )
