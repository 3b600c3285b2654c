"""Shared look and helpers of the panels: colours, token axes, the dark theme."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QAction, QColor, QFont, QFontInfo, QFontMetrics, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QGraphicsRectItem,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLayout,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

from ...core.errors import InspectorError
from ...figures.labels import nice_step

# row-major: a (T, T) array displays with rows as rows, like the matrix it is
pg.setConfigOptions(imageAxisOrder="row-major", background="#1b1e24", foreground="#c8ccd4", antialias=False)

CMAP = pg.colormap.get("viridis")
DIVERGING = pg.colormap.get("CET-D1")
MASKED_COLOR = QColor("#8c8f96")  # masked cells: neutral grey, outside every colormap used
NEWEST_PEN = pg.mkPen("#ff6b6b", width=2)  # the row/position this step added
SELECTED_PEN = pg.mkPen("#ffffff", width=1.5)
CHOSEN_BRUSH = pg.mkBrush("#ffb84f")
BAR_BRUSH = pg.mkBrush("#4f8fdf")
TEXT = "#c8ccd4"
DIM = "#8a8f99"
# Fusion draws a checked tool button almost like an unchecked one on a dark palette, so a
# stage or "Edit mask" that is on could not be told from one that is off.
TOGGLE_STYLE = (
    "QToolButton { padding: 2px 6px; border: 1px solid #3a3f4b; border-radius: 3px; background: #2d313a; }"
    "QToolButton:hover { border-color: #5a6070; }"
    "QToolButton:checked { background: #3d6fb3; color: #ffffff; border-color: #8cc0ff; font-weight: bold; }"
    "QToolButton:disabled { color: #6b707a; }"
)


def elide(label: str, n: int = 8) -> str:
    return label if len(label) <= n else label[: n - 1] + "…"


def symmetric_levels(a: np.ndarray) -> tuple[float, float]:
    """(-m, m) for a diverging colour map centred on 0, m the largest finite |value|.

    NaN or inf cells (an overflowed half-precision cache) would make the levels NaN or inf and blank
    or flatten the whole image; they are left out of the scale instead (the fast path reads the
    extremes once and only looks further when they are not finite).
    """
    if not a.size:
        return -1.0, 1.0
    hi, lo = float(a.max()), float(a.min())
    if not (math.isfinite(hi) and math.isfinite(lo)):
        finite = a[np.isfinite(a)]
        hi, lo = (float(finite.max()), float(finite.min())) if finite.size else (0.0, 0.0)
    m = max(hi, -lo)
    return (-m, m) if m > 0 else (-1.0, 1.0)


class TokenAxis(pg.AxisItem):
    """An axis labelled with tokens at pixel centres, thinned so labels never overlap, at any zoom."""

    def __init__(self, orientation: str, chars: int = 7, **kw):
        super().__init__(orientation, **kw)
        self.labels: list[str] = []
        self.longest = 1  # the longest label's length: read at every paint, so not counted there (T labels)
        self.chars = chars
        self.enableAutoSIPrefix(False)

    # the labels object last given to any token axis, as the list they keep, and its longest label:
    # a snapshot's labels go to a dozen axes (each softmax row has one), and at 32k tokens copying
    # and comparing them once per axis cost 2 ms of the GUI thread's step
    _last: tuple = (None, [], 1)

    def set_labels(self, labels) -> None:
        given, as_list, longest = TokenAxis._last
        if labels is given:  # a tuple (a list could have changed since)
            if self.labels is as_list:
                return
            self.labels, self.longest = as_list, longest
        else:
            new, old = list(labels), self.labels
            if new == old:
                if isinstance(labels, tuple):
                    TokenAxis._last = (labels, old, self.longest)
                return
            n = len(old)
            if 0 < n < len(new) and new[:n] == old:  # a step appended: measure only the new labels
                self.longest = max(self.longest, *map(len, new[n:]))
            else:
                self.longest = max(map(len, new), default=1)
            self.labels = new
            if isinstance(labels, tuple):
                TokenAxis._last = (labels, new, self.longest)
        self.picture = None
        self.update()

    def tickValues(self, minVal, maxVal, size):
        minVal, maxVal = min(minVal, maxVal), max(minVal, maxVal)  # inverted view boxes pass them swapped
        n = len(self.labels)
        if n == 0 or size <= 0 or maxVal <= minVal:
            return []
        px_per = size / (maxVal - minVal)
        vertical = self.orientation in ("left", "right")
        need = 13.0 if vertical else 7.0 * min(self.chars, self.longest) + 8
        stride = int(nice_step(max(1.0, need / px_per)))
        lo = max(0, int(math.floor(minVal)))
        hi = min(n - 1, int(math.ceil(maxVal)))
        start = (lo // stride) * stride
        return [(stride, [i + 0.5 for i in range(start, hi + 1, stride)])]

    def tickStrings(self, values, scale, spacing):
        out = []
        for v in values:
            i = int(math.floor(v))
            out.append(elide(self.labels[i], self.chars) if 0 <= i < len(self.labels) else "")
        return out


class WholeAxis(pg.AxisItem):
    """Ticks on whole numbers only (steps, counts): pyqtgraph's own levels, less those finer than 1."""

    def __init__(self, orientation: str, **kw):
        super().__init__(orientation, **kw)
        self.enableAutoSIPrefix(False)

    def tickValues(self, minVal, maxVal, size):
        levels = [(sp, vals) for sp, vals in super().tickValues(minVal, maxVal, size) if sp >= 1]
        if levels:
            return levels
        lo, hi = math.ceil(min(minVal, maxVal)), math.floor(max(minVal, maxVal))
        return [(1, list(range(lo, hi + 1)))]


class IndexAxis(pg.AxisItem):
    """Integer ticks at cell centres with a prefix: L0, L1, ... / H0, H1, ...

    Rows shorter than a label's height (down the side) or columns narrower than its width (along the
    bottom) get a smaller font (to ``MIN_PX``) before any goes unlabelled: on a laptop the overview's
    four layers are 12 px rows, and the KV cache panel's bytes per layer 20 px columns; L1, L3 were dropped.
    """

    MIN_PX = 8  # the smallest label font, in pixels: the colour bars' ticks are 9

    def __init__(self, orientation: str, prefix: str, **kw):
        super().__init__(orientation, **kw)
        self.prefix = prefix
        self.n = 0
        self._label_px = 14.0  # the height a label takes down the side (the font's line height)

    def set_count(self, n: int) -> None:
        if n != self.n:
            self.n = n
            self.picture = None
            self.update()

    GAP = 6  # pixels between two labels along the bottom

    def generateDrawSpecs(self, p):  # noqa: N802 (pyqtgraph)
        if self.n and self.range[1] != self.range[0]:
            side = self.orientation in ("left", "right")
            extent = self.size().height() if side else self.size().width()
            font = self._font_for(extent / abs(self.range[1] - self.range[0]))
            if font != self.style["tickFont"]:
                self.style["tickFont"] = font  # drawPicture sets it too, from here
            p.setFont(font if font is not None else self.font())
        return super().generateDrawSpecs(p)

    def _extent(self, font: QFont) -> float:
        """Pixels one label needs: its line height down the side, the widest label and a gap along the bottom."""
        m = QFontMetrics(font)
        if self.orientation in ("left", "right"):
            return m.height()
        return m.horizontalAdvance(f"{self.prefix}{max(0, self.n - 1)}") + self.GAP

    def _font_for(self, cell_px: float) -> QFont | None:
        """The widget's font if a label fits a cell, else the largest smaller one that does (``MIN_PX`` at least)."""
        base = self.font()
        self._label_px = self._extent(base)
        if self._label_px <= cell_px:
            return None
        font = QFont(base)
        for px in range(QFontInfo(base).pixelSize() - 1, self.MIN_PX - 1, -1):
            font.setPixelSize(px)
            self._label_px = self._extent(font)
            if self._label_px <= cell_px:
                break
        return font

    def tickValues(self, minVal, maxVal, size):
        minVal, maxVal = min(minVal, maxVal), max(minVal, maxVal)
        if self.n == 0 or size <= 0 or maxVal <= minVal:
            return []
        px_per = size / (maxVal - minVal)
        stride = int(nice_step(max(1.0, self._label_px / px_per)))
        return [(stride, [i + 0.5 for i in range(0, self.n, stride)])]

    def tickStrings(self, values, scale, spacing):
        return [f"{self.prefix}{int(math.floor(v))}" for v in values]


def info_label(text: str = "", dim: bool = True, rich: bool = False) -> QLabel:
    """A one-line label that never widens its panel: long text is clipped, not a minimum width."""
    lab = QLabel(text)
    lab.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
    lab.setTextFormat(Qt.TextFormat.RichText if rich else Qt.TextFormat.PlainText)
    if dim:
        lab.setStyleSheet(f"color: {DIM};")
    return lab


class ElidedLabel(QLabel):
    """One line that never widens its window: it asks for its text's width, takes what it is given, and
    ends in "…" when that is less; ``full_text()`` and the tooltip have all of it."""

    def __init__(self, text: str = "", **kw):
        super().__init__(**kw)
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt)
        self._full = text
        self.setToolTip(text if text else "")
        self.updateGeometry()
        # lay the parent out now: a label that takes its text's width (the status bar's) would otherwise
        # show the new text elided to the old width, "" after an empty one, until the next layout pass
        lay = self.parentWidget().layout() if self.parentWidget() is not None else None
        if lay is not None and self.isVisible():
            lay.activate()
        self._elide()

    def full_text(self) -> str:
        return self._full

    def _elide(self) -> None:
        width = self.contentsRect().width()
        super().setText(
            self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, width) if width > 0 else self._full
        )

    def resizeEvent(self, ev) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(ev)
        self._elide()

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt)
        m = self.contentsMargins()
        return QSize(
            self.fontMetrics().horizontalAdvance(self._full) + m.left() + m.right() + 2, super().sizeHint().height()
        )

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt)
        return QSize(0, super().minimumSizeHint().height())


def wrapped_label(text: str = "", rich: bool | None = None, selectable: bool = False) -> QLabel:
    """A label that wraps its text; ``rich``: force rich or plain text (else Qt guesses)."""
    lab = QLabel(text)
    lab.setWordWrap(True)
    if rich is not None:
        lab.setTextFormat(Qt.TextFormat.RichText if rich else Qt.TextFormat.PlainText)
    if selectable:
        lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return lab


def vbox(parent: QWidget | None, *items, margin: int | None = None, spacing: int | None = None) -> QVBoxLayout:
    """``parent``'s column of widgets and layouts, top down: ``(item, stretch)`` for one that
    stretches, an int for empty stretch; ``margin`` and ``spacing`` in pixels, else Qt's."""
    return _fill(QVBoxLayout(parent), items, margin, spacing)


def hbox(parent: QWidget | None, *items, margin: int | None = None, spacing: int | None = None) -> QHBoxLayout:
    """A row, left to right, as ``vbox`` makes a column."""
    return _fill(QHBoxLayout(parent), items, margin, spacing)


def _fill(lay, items, margin: int | None, spacing: int | None):
    if margin is not None:
        lay.setContentsMargins(margin, margin, margin, margin)
    if spacing is not None:
        lay.setSpacing(spacing)
    for item in items:
        if isinstance(item, int):
            lay.addStretch(item)
            continue
        item, stretch = item if isinstance(item, tuple) else (item, 0)
        (lay.addLayout if isinstance(item, QLayout) else lay.addWidget)(item, stretch)
    return lay


def column(*items, spacing: int | None = None) -> QWidget:
    """A borderless widget holding ``items`` top down (one pane of a splitter)."""
    w = QWidget()
    vbox(w, *items, margin=0, spacing=spacing)
    return w


def splitter(orientation: Qt.Orientation, *widgets: QWidget) -> QSplitter:
    """A splitter of ``widgets`` in order (top down, or left to right)."""
    split = QSplitter(orientation)
    for w in widgets:
        split.addWidget(w)
    return split


def table(columns, resize=QHeaderView.ResizeMode.ResizeToContents) -> QTableWidget:
    """A read-only table with these column headers and no row numbers."""
    t = QTableWidget(0, len(columns))
    t.setHorizontalHeaderLabels(list(columns))
    t.verticalHeader().setVisible(False)
    t.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    t.horizontalHeader().setSectionResizeMode(resize)
    return t


def bare(plot, invert: bool = False, still: bool = False):
    """No pyqtgraph context menu or auto-range button; ``invert``: rows top down; ``still``: no pan or zoom."""
    plot.setMenuEnabled(False)
    plot.hideButtons()
    if invert:
        plot.getViewBox().invertY(True)
    if still:
        plot.setMouseEnabled(False, False)
    return plot


def unprefixed(*plots) -> None:
    """Turn pyqtgraph's SI prefixes off on the axes with no label, which can never show one: it
    typesets their (empty) label again at every range change, 0.3 ms each, hidden top and right axes
    included, on every plot whose range follows T."""
    for plot in plots:
        for name in ("left", "bottom", "top", "right"):
            axis = plot.getAxis(name)
            if not axis.labelText and not axis.labelUnits:
                axis.enableAutoSIPrefix(False)


def outline(plot, pen, z: float = 10) -> QGraphicsRectItem:
    """A rectangle on ``plot``, placed later with setRect (the newest row, a selected cell)."""
    r = QGraphicsRectItem(0, 0, 1, 1)
    r.setPen(pen)
    r.setZValue(z)
    plot.addItem(r)
    return r


def under(plot, images, cmap=DIVERGING) -> pg.ColorBarItem:
    """A thin horizontal colour bar under ``plot`` giving ``images``' scale (levels set with setLevels)."""
    bar = pg.ColorBarItem(values=(-1.0, 1.0), colorMap=cmap, interactive=False, width=5, orientation="horizontal")
    bar.setImageItem(images, insert_in=plot)
    plot.layout.setRowFixedHeight(4, 0)  # pyqtgraph leaves 10 px between plot and bar
    # small numbers in a short strip: on a laptop the heatmap above keeps its rows (~70 px)
    axis = bar.getAxis("bottom")
    font = QFont(axis.font())
    font.setPixelSize(9)
    axis.setStyle(tickFont=font, tickTextOffset=0, tickLength=2, hideOverlappingLabels=False)
    axis.setHeight(13)
    return bar


def context_actions(widget: QWidget, *items) -> None:
    """Right-click menu entries ``(text, slot)`` on ``widget`` (one that builds its own menu keeps it)."""
    if widget.contextMenuPolicy() != Qt.ContextMenuPolicy.CustomContextMenu:
        widget.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
    for text, slot in items:
        act = QAction(text, widget)
        act.triggered.connect(slot)
        widget.addAction(act)


def report_error(window, title: str, error: BaseException) -> None:
    """A worker job's error in the window: the user's to fix (InspectorError) or an internal one. A job
    that met a dropped link to the engine is neither: the window's band says so and reconnects by itself,
    so the status bar says what became of the job, and no dialog stands in the way."""
    from ..remote_link import dropped_note  # here: a window that never met an engine imports no client

    note = dropped_note(error)
    if note is not None:
        window.statusBar().showMessage(f"{title}: {note}", 15000)
        return
    window.show_error(title, str(error), "user" if isinstance(error, InspectorError) else "internal")


class PanelJob:
    """A feature panel's worker job, one at a time: ``submit`` marks the panel busy and posts the job;
    the result or the error comes back on the GUI thread, where the panel is made idle again before
    ``done`` or ``failed`` sees it. Only the GUI thread touches it."""

    def __init__(self, window, busy: Callable[[bool, str], None], failed: Callable[[BaseException], None]):
        self._window, self._busy, self._failed = window, busy, failed
        self.running = False

    def submit(self, job, done, text: str = "", idle: bool = False, stop=None) -> bool:
        """Run ``job(source)`` on the worker, then ``done(result)`` here; False, nothing posted, while
        the panel's last job still runs (``idle``: it gives way to later commands, see ``commands.Call``;
        ``stop``: what Pause (Esc) calls to end it, as the panel's Stop does)."""
        if self.running:
            return False
        self.running = True
        self._busy(True, text)

        def finish(result, error) -> None:
            self.running = False
            self._busy(False, "")
            if error is None:
                done(result)
            else:
                self._failed(error)

        # idle only where asked: the window's run_in_worker takes (fn, callback) and idle as a third
        self._window.run_in_worker(
            *((job, finish, True) if idle else (job, finish)), **({"stop": stop} if stop else {})
        )
        return True


def dialog_job(window, panel, title: str) -> Callable:
    """``run(job, show)`` for a panel whose errors are dialogs under ``title``: ``show(result)`` and the
    panel brought to the front; while its last job runs, the status bar says so (its Tools menu entry
    stays enabled while its button is not)."""

    def failed(error) -> None:
        report_error(window, title, error)

    panel.job = PanelJob(window, lambda busy, _text: panel.set_busy(busy), failed)

    def run(job, show) -> None:
        def done(result) -> None:
            show(result)
            window.raise_panel(panel)

        if not panel.job.submit(job, done):
            window.statusBar().showMessage(f"{title.removesuffix(' failed')} is still running", 5000)

    return run


def legend_swatch(color: QColor, text: str) -> QWidget:
    w = QWidget()
    sw = QLabel()
    sw.setFixedSize(12, 12)
    sw.setStyleSheet(f"background: {color.name()}; border: 1px solid #555;")
    hbox(w, sw, QLabel(text), margin=0, spacing=4)
    return w


def placeholder_text(plot, text: str) -> pg.TextItem:
    """A grey hint centred on (0.5, 0.5) of an empty plot, over everything in it."""
    item = pg.TextItem(text, color=DIM, anchor=(0.5, 0.5))
    item.setZValue(100)
    item.setPos(0.5, 0.5)
    plot.addItem(item, ignoreBounds=True)
    return item


def show_axes(plot, names, on: bool) -> None:
    """Show or hide these axes: an empty plot shows none, rather than ticks for data it does not have."""
    for name in names:
        plot.showAxis(name, on)


def prob_color(p: float | None) -> QColor:
    """Tint for a chosen token: viridis of its probability (prompt tokens: neutral)."""
    if p is None:
        return QColor("#3a3f4b")
    return CMAP.map(float(min(max(p, 0.0), 1.0)) * 0.85 + 0.1, mode="qcolor")


def apply_theme(app: QApplication) -> None:
    """Fusion with a dark palette: heatmaps read better on dark, and panels match pyqtgraph's."""
    app.setStyle("Fusion")
    p = QPalette()
    base, window, text = QColor("#1b1e24"), QColor("#252830"), QColor("#d7dae0")
    p.setColor(QPalette.ColorRole.Window, window)
    p.setColor(QPalette.ColorRole.WindowText, text)
    p.setColor(QPalette.ColorRole.Base, base)
    p.setColor(QPalette.ColorRole.AlternateBase, window)
    p.setColor(QPalette.ColorRole.ToolTipBase, QColor("#31343d"))
    p.setColor(QPalette.ColorRole.ToolTipText, text)
    p.setColor(QPalette.ColorRole.Text, text)
    p.setColor(QPalette.ColorRole.Button, QColor("#2d313a"))
    p.setColor(QPalette.ColorRole.ButtonText, text)
    p.setColor(QPalette.ColorRole.BrightText, Qt.GlobalColor.red)
    p.setColor(QPalette.ColorRole.Highlight, QColor("#3d6fb3"))
    p.setColor(QPalette.ColorRole.HighlightedText, Qt.GlobalColor.white)
    p.setColor(QPalette.ColorRole.PlaceholderText, QColor(DIM))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b707a"))
    app.setPalette(p)


def group(*widgets: QWidget) -> QWidget:
    """Widgets that wrap as one in a FlowLayout (a label with its field)."""
    box = QWidget()
    hbox(box, *widgets, margin=0, spacing=3)
    return box


class FlowLayout(QLayout):
    """Items left to right, wrapping onto a new line when the width runs out (Qt's flow layout
    example), so a row of controls fits a narrow dock without hiding its last buttons."""

    def __init__(self, parent: QWidget | None = None, spacing: int = 6):
        super().__init__(parent)
        self._items = []
        self._gap = spacing

    def addItem(self, item) -> None:  # noqa: N802 (Qt)
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, i: int):  # noqa: N802 (Qt)
        return self._items[i] if 0 <= i < len(self._items) else None

    def takeAt(self, i: int):  # noqa: N802 (Qt)
        return self._items.pop(i) if 0 <= i < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802 (Qt)
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802 (Qt)
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802 (Qt)
        return self._arrange(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802 (Qt)
        super().setGeometry(rect)
        self._arrange(rect, move=True)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt)
        return self.minimumSize()

    def minimumSize(self) -> QSize:  # noqa: N802 (Qt)
        size = QSize()
        for item in self._items:  # the widest item alone on a line
            size = size.expandedTo(item.minimumSize())
        m = self.contentsMargins()
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    def _arrange(self, rect: QRect, move: bool) -> int:
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        x, y, line = area.x(), area.y(), 0
        for item in self._items:
            if item.isEmpty():  # a hidden widget takes no room
                continue
            hint = item.sizeHint()
            if x + hint.width() > area.right() + 1 and line > 0:
                x, y, line = area.x(), y + line + self._gap, 0
            if move:
                item.setGeometry(QRect(QPoint(x, y), hint))
            x += hint.width() + self._gap
            line = max(line, hint.height())
        return y + line - rect.y() + m.bottom()
