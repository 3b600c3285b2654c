"""The next-token distribution at the current decoding settings, the chosen token marked.

Changing the temperature (or top-k / top-p) re-renders it without running the model; "Re-decide"
chooses the current token again from the same logits, and double-clicking a bar forces that
token (the generation branches from there).

The stage picker shows the distribution after each of generate's processors in order (raw logits,
each processor, the final one chosen from), with what that stage removed and which tokens it moved;
a stage the model's own generation config set is marked "model default".

Only tokens the decoding keeps are listed: top-k / top-p give the rest probability 0, and the ten
most likely of a vector whose tail is all zeros are arbitrary tokens (torch.topk breaks the tie). The
panel draws as many rows as its height holds at one label per line, and says so when that is fewer.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QComboBox, QPushButton, QWidget

from ...core.decoding import MODEL_DEFAULT
from ...core.step import TOP_N
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

GREEDY = "greedy: the top token is taken; probabilities shown at T = 1"


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
        # no probability axis: every bar is labelled with its value, and the height goes to the rows
        self.plot.hideAxis("bottom")
        self.bars = pg.BarGraphItem(x0=[], y=[], height=0.75, width=[], brushes=[])
        self.plot.addItem(self.bars)
        self.texts: list[pg.TextItem] = []
        self.decoding = info_label("")
        self.redecide = QPushButton(
            "Re-decide", toolTip="Choose the current token again from the same logits at the current settings"
        )
        self.redecide.clicked.connect(self.redecide_requested)
        self.stage = QComboBox(toolTip="The distribution after each of generate's processors, in order; "
                                       "the last is the one the token is chosen from")  # fmt: skip
        self.stage.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.stage.setMinimumContentsLength(14)
        self.stage.currentIndexChanged.connect(self._stage_picked)
        self.stage_info = info_label("", rich=True)
        self.stage_info.setWordWrap(True)
        self._stage_labels: list[str] = []
        vbox(self, hbox(None, (self.summary, 1), self.redecide), hbox(None, (self.stage, 1)), (self.glw, 1),
             self.stage_info, self.decoding, margin=2, spacing=2)  # fmt: skip
        self.top_ids: list[int] = []  # the kept candidates, best first (the rows drawn are the first ``shown``)
        self.probs: list[float] = []
        self.chosen = -1
        self.shown = 0
        self.cut = False  # top-k / top-p removed some of the ten most likely
        self._snap = None
        self.plot.getViewBox().sigResized.connect(self._resized)
        self.plot.scene().sigMouseClicked.connect(self._clicked)
        show_axes(self.plot, ("left",), False)  # no bars yet: no scale either

    def _clicked(self, ev) -> None:
        if not ev.double() or not self.top_ids:
            return
        y = self.plot.getViewBox().mapSceneToView(ev.scenePos()).y()
        i = int(round(y))
        if 0 <= i < self.shown:
            self.force_requested.emit(self.top_ids[i])

    def rows_that_fit(self) -> int:
        """Bars the plot holds with a whole label line each (all of them before it is laid out)."""
        h = self.plot.getViewBox().height()
        if h <= 0:
            return 10**6
        fm = QFontMetrics(self.axis.style.get("tickFont") or self.font())
        return max(1, int(h // (fm.height() + 1)))

    def _stage_picked(self, _index: int) -> None:
        if self._snap is not None and self._snap.step is not None:
            self.set_snapshot(self._snap)

    def _fill_stages(self, st) -> None:
        """The picker lists this step's stages; the pick stays where the stages are the same ones."""
        labels = [f"{i}. {x.label}" + (" · model default" if x.origin == MODEL_DEFAULT else "")
                  + (" (final)" if i == len(st.stages) - 1 and i else "") for i, x in enumerate(st.stages)]  # fmt: skip
        if labels == self._stage_labels:
            return
        keep = self.stage.currentIndex() if len(labels) == len(self._stage_labels) else -1
        self._stage_labels = labels
        self.stage.blockSignals(True)
        self.stage.clear()
        self.stage.addItems(labels)
        self.stage.setCurrentIndex(keep if 0 <= keep < len(labels) else len(labels) - 1)
        self.stage.blockSignals(False)

    def _stage_text(self, st, i: int) -> str:
        x = st.stages[i]
        if i == 0:
            return "raw logits (softmax at temperature 1)"
        parts = [f"<b>{html.escape(x.label)}</b> ({html.escape(x.origin)}): keeps {x.kept}"]
        if x.n_removed:
            names = ", ".join(f"“{html.escape(e.label)}” {e.prob:.3f}" for e in x.removed)
            parts.append(f"removed {x.n_removed}: {names}{' …' if x.n_removed > len(x.removed) else ''}")
        if x.moved:
            moves = ", ".join(f"“{html.escape(e.label)}” {'new' if a < 0 else a + 1}→{b + 1}" for e, a, b in x.moved)
            parts.append(f"moved: {moves}")
        return " · ".join(parts)

    def _resized(self) -> None:
        # rows that fit and room for the value labels both follow the size: draw again (ten bars)
        if self._snap is not None and self._snap.step is not None:
            self.set_snapshot(self._snap)

    def set_snapshot(self, snap) -> None:
        self._snap = snap
        st = snap.tokens.step
        self.redecide.setEnabled(st is not None and not snap.read_only)
        d = snap.tokens.decoding or {}
        t = d.get("temperature", 0.0) or 0.0
        # at T = 0 every probability would be 0 or 1: the bars show the model's own (T = 1) distribution
        parts = [GREEDY if t == 0 else f"temperature {t:g}"]
        if d.get("top_k"):
            parts.append(f"top-k {d['top_k']}")
        if d.get("top_p") not in (None, 1.0):
            parts.append(f"top-p {d['top_p']:g}")
        parts += [f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                  for k, v in d.items() if k not in ("temperature", "top_k", "top_p") and v is not None]  # fmt: skip
        self.decoding.setText(" · ".join(parts))
        if st is None:
            self._stage_labels = []
            self.stage.blockSignals(True)
            self.stage.clear()
            self.stage.blockSignals(False)
            self.stage.setEnabled(False)
            self.stage.setVisible(False)
            self.stage_info.setText("")
            self.bars.setOpts(x0=[], y=[], width=[], brushes=[])
            self.axis.set_labels([])
            for ti in self.texts:
                ti.setVisible(False)
            self.top_ids, self.probs, self.chosen, self.shown, self.cut = [], [], -1, 0, False
            self.summary.setText("no step yet")
            show_axes(self.plot, ("left",), False)
            return
        show_axes(self.plot, ("left",), True)
        stages = st.stages or ()
        self.stage.setEnabled(len(stages) > 1)
        # one stage is the distribution itself: the picker's row goes back to the bars (a laptop fits 3 more)
        self.stage.setVisible(len(stages) > 1)
        if stages:
            self._fill_stages(st)
        pick = self.stage.currentIndex() if stages else -1
        final = pick < 0 or pick == len(stages) - 1
        self.stage_info.setText("" if final and len(stages) <= 1 else self._stage_text(st, pick))
        listed = st.top if final else stages[pick].top
        kept = [e for e in listed if e.prob > 0]
        # top-k / top-p left fewer than Step.top's min(ten, V) (Step.top lists only the kept: p > 0)
        self.cut = len(kept) < min(TOP_N, snap.tokens.vocab_size or TOP_N)
        self.top_ids = [e.token_id for e in kept]
        self.probs = [e.prob for e in kept]
        self.chosen = st.token_id
        n = self.shown = min(len(kept), self.rows_that_fit())
        top = kept[:n]
        self.bars.setOpts(x0=np.zeros(n), y=np.arange(n), height=0.75, width=np.array(self.probs[:n]),
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
        xmax = max(self.probs[:n]) if n else 1.0
        # room right of the longest bar for its value: a fixed 25 % cut "0.805" off in a narrow panel
        width = self.plot.getViewBox().width()
        text = fm.horizontalAdvance("0.000") + 8
        room = 1.25 if width <= 0 else 1 / max(0.2, 1 - text / width)
        self.plot.setRange(xRange=(0, xmax * room or 1.0), yRange=(-0.6, max(n, 1) - 0.4), padding=0)
        in_top = any(e.token_id == st.token_id for e in top)
        where = "" if in_top else (" (cut by the sampler)" if st.prob == 0 else " (not among the rows shown)")
        rows = []
        if self.cut:
            rows.append(f"the sampler keeps {len(kept)} token{'s' if len(kept) != 1 else ''}")
        if n < len(kept):
            rows.append(f"{n} of {len(kept)} shown")
        forced = " · <span style='color:#ffb84f'>forced</span>" if st.forced else ""
        end = f" · <b>{st.finish_reason}</b>" if st.finish_reason else ""
        perplexity = math.exp(st.entropy) if st.entropy < 50 else float("inf")
        self.summary.setText(
            # counted from 1, as the status bar counts steps done
            f"step {st.index + 1} (position {st.position}) chose <b>“{html.escape(st.label)}”</b> p = <b>{st.prob:.4f}</b>"
            f"{where}{forced}{end}<br>"
            f"entropy <b>{st.entropy:.3f}</b> nats (perplexity {perplexity:.1f})"
            + "".join(f" · <span style='color:#8a8f99'>{r}</span>" for r in rows)
        )
