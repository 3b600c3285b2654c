"""The prompt and the generated tokens as chips; generated ones tinted by their probability.

One custom-painted widget (not a widget per token): a thousand tokens lay out in a millisecond
and only the visible chips are painted.
"""

from __future__ import annotations

import bisect
import html

from PySide6.QtCore import QRect, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QScrollArea, QToolTip, QWidget

from ..chat_dialog import ROLE_COLORS, ROLE_TIP
from .common import prob_color

_PAD, _GAP, _H = 5, 3, 20
# what the label glyphs stand for (core/tokens.py writes them): (glyph, meaning), the legend of tooltips and Help
GLYPHS = (
    ("␣", "a space (GPT-2's pieces carry the space before a word: “␣eats” is one token)"),
    ("↵", "a newline"),
    ("⇥", "a tab"),
    ("␍", "a carriage return"),
    (
        "<0x",
        "<0xNN>: one byte of a character split over several tokens (an emoji, an accented letter), "
        "not valid UTF-8 on its own",
    ),
    ("∅", "a token with no text"),
)
STRIP_TIP = ("The prompt and the generated tokens, one chip per token; click one to select that query position. "
             "Generated chips are tinted by the probability they were chosen with.<br>"
             + "<br>".join(f"{html.escape(g if g != '<0x' else '<0xNN>')} {html.escape(m.removeprefix('<0xNN>: '))}"
                           for g, m in GLYPHS))  # fmt: skip


class _Canvas(QWidget):
    clicked = Signal(int)

    def __init__(self, strip: TokenStrip):
        super().__init__()
        self.strip = strip
        self.rects: list[QRect] = []
        self.tops: list[int] = []  # each chip's top, in order (chips fill row after row): the painted rows by bisection
        self.setMouseTracking(True)
        f = QFont(self.font())
        f.setPointSizeF(max(8.0, f.pointSizeF() - 0.5))
        self.setFont(f)
        self._fm = QFontMetrics(f)
        self._width_cache: dict[str, int] = {}

    def relayout(self, start: int = 0) -> None:
        """Place chips from index ``start`` on (earlier ones keep their places: a step appends)."""
        width = max(self.width(), 100)
        start = min(start, len(self.rects), len(self.strip.labels))
        rects = self.rects[:start]
        tops = self.tops[:start]
        if rects:
            x, y = rects[-1].right() + 1 + _GAP, rects[-1].top()
        else:
            x = y = _GAP
        for lab in self.strip.labels[start:]:
            w = self._width_cache.get(lab)
            if w is None:
                w = self._width_cache[lab] = self._fm.horizontalAdvance(lab) + 2 * _PAD
            if x + w > width - _GAP and x > _GAP:
                x = _GAP
                y += _H + _GAP
            rects.append(QRect(x, y, w, _H))
            tops.append(y)
            x += w + _GAP
        self.rects, self.tops = rects, tops
        h = (rects[-1].bottom() + _GAP + 1) if rects else _H
        if h != self.minimumHeight():
            self.setMinimumHeight(h)
        self.update()

    def resizeEvent(self, ev):
        super().resizeEvent(ev)
        if ev.size().width() != ev.oldSize().width():
            self.relayout()

    def sizeHint(self) -> QSize:
        return QSize(600, 2 * (_H + _GAP))

    def index_at(self, pos) -> int:
        return next((i for i, r in enumerate(self.rects) if r.contains(pos)), -1)

    def mousePressEvent(self, ev):
        i = self.index_at(ev.position().toPoint())
        if i >= 0 and ev.button() == Qt.MouseButton.LeftButton:
            self.clicked.emit(i)

    def mouseMoveEvent(self, ev):
        i = self.index_at(ev.position().toPoint())
        if i >= 0:
            QToolTip.showText(ev.globalPosition().toPoint(), self.strip.tooltip(i), self)
        else:
            QToolTip.hideText()

    def paintEvent(self, ev):
        s = self.strip
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        clip = ev.rect()
        # only the rows the clip crosses: at 16k tokens a loop over every chip cost 37 ms a paint
        first = bisect.bisect_left(self.tops, clip.top() - _H + 1)
        last = bisect.bisect_right(self.tops, clip.bottom())
        for i in range(first, last):
            r = self.rects[i]
            if not r.intersects(clip):
                continue
            pending = i >= s.T  # chosen, not yet fed: no K/V for it yet
            bg = prob_color(s.probs[i] if i < len(s.probs) else None)
            if pending:
                bg = QColor(bg)
                bg.setAlpha(110)
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(bg)
            p.drawRoundedRect(r, 4, 4)
            if i == s.query:
                p.setPen(QPen(QColor("#ffffff"), 2))
                p.setBrush(Qt.BrushStyle.NoBrush)
                p.drawRoundedRect(r.adjusted(1, 1, -1, -1), 4, 4)
            elif pending:
                p.setPen(QPen(QColor("#d7dae0"), 1, Qt.PenStyle.DashLine))
                p.setBrush(Qt.BrushStyle.NoBrush)
                p.drawRoundedRect(r.adjusted(0, 0, -1, -1), 4, 4)
            lum = bg.redF() * 0.3 + bg.greenF() * 0.59 + bg.blueF() * 0.11
            p.setPen(QColor("#111111") if lum > 0.55 and not pending else QColor("#eef0f3"))
            p.drawText(r, Qt.AlignmentFlag.AlignCenter, s.labels[i])
            if i < len(s.roles):  # a chat prompt: the turn it came from, as a bar under the chip
                p.fillRect(
                    r.left() + 2, r.bottom() - 2, r.width() - 4, 3, QColor(ROLE_COLORS.get(s.roles[i], "#d7dae0"))
                )
        p.end()


class TokenStrip(QScrollArea):
    """Click a token to select that query position (clicking the newest one follows the run)."""

    position_clicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.labels: list[str] = []
        self.ids: list[int] = []
        self.probs: list[float | None] = []
        self.T = 0
        self.query = -1
        self.prompt_len = 0
        self.roles: list[str] = []  # per prompt token of a chat prompt: system, user, assistant or template
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.canvas = _Canvas(self)
        self.canvas.clicked.connect(self.position_clicked)
        self.setWidget(self.canvas)
        self.setMinimumHeight(_H + 2 * _GAP + 4)
        self.setToolTip(STRIP_TIP)  # between chips; a chip's own tip names its glyphs

    def count(self) -> int:
        return len(self.labels)

    def tooltip(self, i: int) -> str:
        kind = "prompt" if i < self.prompt_len else "generated"
        if i < len(self.roles):
            kind = f"prompt · <span style='color:{ROLE_COLORS.get(self.roles[i], '#d7dae0')}'>{self.roles[i]}</span>"
            kind += " (chat template markup)" if self.roles[i] == "template" else " turn"
        lines = [f"<b>{html.escape(self.labels[i])}</b>", f"position {i} · id {self.ids[i]} · {kind}"]
        p = self.probs[i] if i < len(self.probs) else None
        if p is not None:
            lines.append(f"chosen with p = {p:.4f}")
        if i >= self.T:
            lines.append("<i>chosen, not in the KV cache yet (the next step feeds it)</i>")
        lines += [f"<span style='color:#8a8f99'>{html.escape(m)}</span>" if g == "<0x" else
                  f"<span style='color:#8a8f99'>{g} = {html.escape(m)}</span>"
                  for g, m in GLYPHS if g in self.labels[i]]  # fmt: skip
        return "<br>".join(lines)

    def set_snapshot(self, snap) -> None:
        new = list(snap.tokens.labels)
        old = self.labels
        grew = len(new) > len(old)
        n = min(len(old), len(new))
        # a step appends: one list comparison (in C) instead of a Python loop over T labels
        same = new[:n] == old[:n]
        first = n if same else next(i for i in range(n) if old[i] != new[i])  # first chip whose label changed
        changed = first < max(len(old), len(new))
        self.labels = new
        self.ids = list(snap.tokens.token_ids)
        self.probs = list(snap.tokens.token_probs)
        self.T, self.query, self.prompt_len = snap.T, snap.query, snap.tokens.prompt_len
        roles = list(snap.tokens.roles)
        if roles != self.roles:
            self.roles = roles
            self.setToolTip(STRIP_TIP + ("<br>" + ROLE_TIP if roles else ""))
            self.canvas.update()
        if changed:
            self.canvas.relayout(first)
        else:
            self.canvas.update()
        if grew and self.canvas.rects:
            self.ensureVisible(self.canvas.rects[-1].center().x(), self.canvas.rects[-1].center().y(), 0, _H)
