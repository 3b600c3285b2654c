"""The next-token distribution at the current decoding settings, the chosen token marked.

Changing the temperature (or top-k / top-p) re-renders it without running the model; "Re-decide"
chooses the current token again from the same logits, and double-clicking a bar forces that
token (the generation branches from there).
"""

from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QPushButton, QWidget

from .common import (
    BAR_BRUSH,
    CHOSEN_BRUSH,
    TokenAxis,
    bare,
    elide,
    hbox,
    info_label,
    show_axes,
    vbox,
    wrapped_label,
)


class _LabelAxis(TokenAxis):
    """Every label, on the bars' rows (not thinned, not at pixel centres)."""

    def tickValues(self, minVal, maxVal, size):
        return [(1, [float(i) for i in range(len(self.labels))])]


class NextTokenView(QWidget):
    redecide_requested = Signal()
    force_requested = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.summary = wrapped_label("no step yet", rich=True)
        self.glw = pg.GraphicsLayoutWidget()
        self.axis = _LabelAxis("left", chars=12)
        self.axis.setWidth(90)
        self.plot = bare(self.glw.addPlot(axisItems={"left": self.axis}), invert=True, still=True)
        self.plot.setLabel("bottom", "probability")
        self.plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.bars = pg.BarGraphItem(x0=[], y=[], height=0.75, width=[], brushes=[])
        self.plot.addItem(self.bars)
        self.texts: list[pg.TextItem] = []
        self.decoding = info_label("")
        self.redecide = QPushButton("Re-decide", toolTip="Choose the current token again from the same logits at the current settings")
        self.redecide.clicked.connect(self.redecide_requested)
        vbox(self, self.summary, (self.glw, 1), hbox(None, (self.decoding, 1), self.redecide), margin=2, spacing=2)
        self.top_ids: list[int] = []
        self.probs: list[float] = []
        self.chosen = -1
        self.plot.scene().sigMouseClicked.connect(self._clicked)
        show_axes(self.plot, ("left", "bottom"), False)  # no bars yet: no scale either

    def _clicked(self, ev) -> None:
        if not ev.double() or not self.top_ids:
            return
        y = self.plot.getViewBox().mapSceneToView(ev.scenePos()).y()
        i = int(round(y))
        if 0 <= i < len(self.top_ids):
            self.force_requested.emit(self.top_ids[i])

    def set_snapshot(self, snap) -> None:
        st = snap.step
        self.redecide.setEnabled(st is not None and not snap.read_only)
        d = snap.decoding or {}
        t = d.get("temperature", 0.0) or 0.0
        parts = ["greedy (T = 0: shown at T = 1)" if t == 0 else f"temperature {t:g}"]
        if d.get("top_k"):
            parts.append(f"top-k {d['top_k']}")
        if d.get("top_p") not in (None, 1.0):
            parts.append(f"top-p {d['top_p']:g}")
        self.decoding.setText(" · ".join(parts))
        if st is None:
            self.bars.setOpts(x0=[], y=[], width=[], brushes=[])
            self.axis.set_labels([])
            for ti in self.texts:
                ti.setVisible(False)
            self.top_ids, self.probs, self.chosen = [], [], -1
            self.summary.setText("no step yet")
            show_axes(self.plot, ("left", "bottom"), False)
            return
        show_axes(self.plot, ("left", "bottom"), True)
        top = list(st.top)
        self.top_ids = [e.token_id for e in top]
        self.probs = [e.prob for e in top]
        self.chosen = st.token_id
        n = len(top)
        self.bars.setOpts(x0=np.zeros(n), y=np.arange(n), height=0.75, width=np.array(self.probs),
                          brushes=[CHOSEN_BRUSH if e.token_id == st.token_id else BAR_BRUSH for e in top])  # fmt: skip
        labels = [e.label for e in top]
        # wide enough for the longest label: pyqtgraph drops a tick label that does not fit
        fm = QFontMetrics(self.axis.style.get("tickFont") or self.font())
        need = max((fm.horizontalAdvance(elide(s, 12)) for s in labels), default=0) + 14
        self.axis.setWidth(max(60, min(need, 160)))
        self.axis.set_labels(labels)
        while len(self.texts) < n:
            ti = pg.TextItem("", color="#c8ccd4", anchor=(0, 0.5))
            self.plot.addItem(ti)
            self.texts.append(ti)
        for i, ti in enumerate(self.texts):
            ti.setVisible(i < n)
            if i < n:
                ti.setText(f"{top[i].prob:.3f}")
                ti.setPos(top[i].prob, i)
        xmax = max(self.probs) if self.probs else 1.0
        self.plot.setRange(xRange=(0, min(1.0, xmax * 1.25) or 1.0), yRange=(-0.6, n - 0.4), padding=0)
        in_top = any(e.token_id == st.token_id for e in top)
        forced = " · <span style='color:#ffb84f'>forced</span>" if st.forced else ""
        end = f" · <b>{st.finish_reason}</b>" if st.finish_reason else ""
        perplexity = math.exp(st.entropy) if st.entropy < 50 else float("inf")
        self.summary.setText(
            # counted from 1, as the status bar counts steps done
            f"step {st.index + 1} (position {st.position}) chose <b>“{html.escape(st.label)}”</b> p = <b>{st.prob:.4f}</b>"
            f"{'' if in_top else ' (outside the top 10)'}{forced}{end}<br>"
            f"entropy <b>{st.entropy:.3f}</b> nats (perplexity {perplexity:.1f})"
        )
