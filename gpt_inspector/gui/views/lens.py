"""Logit lens panel: where the chosen token's probability forms, layer by layer, and which heads push it.

``LensPanel`` only displays a ``core.lens.LensResult``; ``create_panel(window)`` computes one on
the worker thread after each step while the panel is shown (or on its button), so the GUI
thread never runs the model.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidgetItem,
    QWidget,
)

from ...core.errors import Cancelled
from ..deferred import on_screen
from .common import (
    PanelJob,
    column,
    hbox,
    splitter,
    symmetric_levels,
    table,
    vbox,
)

PANEL_TITLE = "Logit lens"
PANEL_AREA = "bottom"
TOP_K = 5
WIDE = 640  # px: from this width the table and the plots sit side by side; narrower, the plots go under it


class LensPanel(QWidget):
    """A layer × top-k table, the chosen token's probability per layer, and the L × H attribution map."""

    compute_requested = Signal()
    head_clicked = Signal(int, int)  # layer, head

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.result = None
        self.job: PanelJob | None = None  # set by create_panel; GUI thread only
        self.computed_for: tuple | None = None  # (state version, steps) the shown or running lens is of
        self.compute_button = QPushButton("Compute", toolTip="The logit lens and head attribution of the current step")
        self.compute_button.clicked.connect(self.compute_requested)
        self.export_button = QPushButton(
            "Export…", toolTip="Save the lens and the head map as PNG, SVG or PDF", enabled=False
        )
        self.follow = QCheckBox("after every step", checked=True,
                                toolTip="Recompute after each step while this panel is shown (one extra unembedding per layer)")  # fmt: skip
        self.status = QLabel("run a step, then the lens shows where the prediction formed")
        self.status.setWordWrap(True)

        self.table = table(["layer", "p(chosen)"] + [f"#{i + 1}" for i in range(TOP_K)])
        self.table.setMinimumHeight(100)

        self.curve_plot = pg.PlotWidget(labels={"bottom": "layer", "left": "p(chosen)"})
        self.curve_plot.setMinimumHeight(90)
        self.curve_plot.setYRange(0, 1)
        self.curve = self.curve_plot.plot([], [], pen=pg.mkPen((66, 133, 244), width=2), symbol="o", symbolSize=6)

        self.map_plot = pg.PlotWidget(labels={"bottom": "head", "left": "layer"})
        self.map_plot.setMinimumHeight(90)
        self.map_plot.invertY(True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setColorMap(pg.colormap.get("CET-D1"))  # diverging: pushes for vs against
        self.map_plot.addItem(self.image)
        self.map_plot.scene().sigMouseClicked.connect(self._clicked)
        self.map_note = QLabel("")
        self.map_note.setWordWrap(True)

        top = hbox(None, self.compute_button, self.follow, self.export_button, 1)
        self.plots = splitter(Qt.Vertical, self.curve_plot, self.map_plot)
        self.split = splitter(Qt.Horizontal, self.table, column((self.plots, 1), self.map_note))
        self.split.setStretchFactor(0, 3)  # the table's words need the width more than the plots do
        self.split.setStretchFactor(1, 2)
        vbox(self, top, self.status, (self.split, 1))
        self._status_text = self.status.text()
        self.hidden_ranks = 0  # top-k columns left out because the table is too narrow for them whole
        self.table.installEventFilter(self)

    def resizeEvent(self, ev) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(ev)
        want = Qt.Orientation.Horizontal if self.width() >= WIDE else Qt.Orientation.Vertical
        if self.split.orientation() != want:
            self.split.setOrientation(want)
            # under the table the two plots sit side by side: stacked, they would scroll out of a short dock
            self.plots.setOrientation(
                Qt.Orientation.Vertical if want == Qt.Orientation.Horizontal else Qt.Orientation.Horizontal
            )
        QTimer.singleShot(0, self._share)

    def _share(self) -> None:
        """Side by side: 60 % of the width to the table. Stacked: the table as tall as its rows, the plots the rest."""
        total = sum(self.split.sizes())
        if total <= 0:
            return
        if self.split.orientation() == Qt.Orientation.Horizontal:
            first = int(total * 0.6)
        else:
            t = self.table
            rows = (
                t.horizontalHeader().height()
                + sum(t.rowHeight(r) for r in range(t.rowCount()))
                + 2 * t.frameWidth()
                + 4
            )
            if t.horizontalScrollBar().isVisible():
                rows += t.horizontalScrollBar().height()
            first = max(t.minimumHeight(), min(rows, int(total * 0.6)))
        self.split.setSizes([first, total - first])

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 (Qt)
        if obj is self.table and ev.type() == QEvent.Type.Resize:
            QTimer.singleShot(0, self._fit_columns)
        return False

    def _fit_columns(self) -> None:
        """Show the top-k columns that fit whole, the best first; a column cut at the table's edge
        showed half a token (the lens's words were clipped even at 1920 px)."""
        header = self.table.horizontalHeader()
        room = self.table.viewport().width()
        used, hidden = 0, 0
        for col in range(self.table.columnCount()):
            self.table.setColumnHidden(col, False)
            width = max(header.sectionSize(col), header.sectionSizeHint(col))
            used += width
            if col > 2 and used > room:  # layer, p(chosen) and the top token always stay
                self.table.setColumnHidden(col, True)
                hidden += 1
        if hidden != self.hidden_ranks:
            self.hidden_ranks = hidden
            self._show_status()

    def _show_status(self) -> None:
        shown = TOP_K - self.hidden_ranks
        more = (
            f" · top {shown} of {TOP_K} shown: widen the panel for more"
            if self.hidden_ranks and self.result is not None
            else ""
        )
        self.status.setText(self._status_text + more)

    def clear(self, text: str) -> None:
        self.result = None
        self.export_button.setEnabled(False)
        self.table.setRowCount(0)
        self.curve.setData([], [])
        self.image.clear()
        self.map_note.setText("")
        self._status_text = text
        self._show_status()

    def set_busy(self, busy: bool) -> None:
        self.compute_button.setEnabled(not busy)
        if busy:
            self._status_text = "computing the lens…"
            self._show_status()

    def show_result(self, r) -> None:
        self.result = r
        self.export_button.setEnabled(True)
        # counted from 1, as the status bar and the next-token panel count steps (r.step is the index)
        self._status_text = f"step {r.step + 1} (position {r.position}) chose “{r.label}”, logit {r.logit:.3f}"
        header = self.table.horizontalHeader()
        # sized to contents once, after the fill: per cell, the columns were measured again for each
        # item (20 ms of the GUI thread for a 12-layer model, on every step the lens follows)
        header.setSectionResizeMode(QHeaderView.Fixed)
        self.table.setUpdatesEnabled(False)
        try:
            self.table.setRowCount(len(r.layers))
            for i, x in enumerate(r.layers):
                cells = [str(x.layer), f"{x.prob:.4f}"] + [f"{e.label} {e.prob:.3f}" for e in x.top[:TOP_K]]
                for j, text in enumerate(cells):
                    item = QTableWidgetItem(text)
                    if j >= 2 and x.top[j - 2].token_id == r.token_id:
                        item.setBackground(pg.mkColor(66, 133, 244, 70))  # the chosen token, where it ranks
                    self.table.setItem(i, j, item)
        finally:
            header.setSectionResizeMode(QHeaderView.ResizeToContents)
            self.table.setUpdatesEnabled(True)
        self._fit_columns()
        self._show_status()
        self._share()
        self.curve.setData(np.arange(len(r.layers)), np.array([x.prob for x in r.layers]))
        if r.attribution is None:
            self.image.clear()
            self.map_note.setText(r.note)
            return
        a = np.asarray(r.attribution, dtype=np.float32)  # (L, H)
        _, m = symmetric_levels(a)
        self.image.setImage(a, autoLevels=False, levels=(-m, m))
        self.map_plot.setRange(xRange=(0, a.shape[1]), yRange=(0, a.shape[0]), padding=0.02)
        self.map_note.setText(
            f"each head's direct push on “{r.label}” (logit units, ±{m:.2f}); everything else "
            f"{r.remainder:+.3f}; {r.note}; click a cell to select that head"
        )

    def _clicked(self, ev) -> None:
        if self.result is None or self.result.attribution is None or ev.button() != Qt.MouseButton.LeftButton:
            return
        p = self.image.mapFromScene(ev.scenePos())
        if p.x() < 0 or p.y() < 0:
            return
        layer, head = int(p.y()), int(p.x())
        L, H = self.result.attribution.shape
        if 0 <= layer < L and 0 <= head < H:
            self.head_clicked.emit(layer, head)


def create_panel(window) -> LensPanel:
    """Dock hook: compute on the worker after each step while shown, or on the button."""
    panel = LensPanel()

    def failed(error) -> None:
        if isinstance(error, Cancelled):  # gave way to a step: compute for wherever the user stops
            panel.computed_for = None
            window.when_idle(lambda: on_snapshot(window.snapshot))
            return
        from ..remote_link import dropped_note  # here: a window that never met an engine imports no client

        note = dropped_note(error)
        if note is not None:  # the band says so: the lens shown stays, computed again after the reconnect
            panel.computed_for = None
            window.statusBar().showMessage(f"Logit lens: {note}", 15000)
            return
        panel.clear(str(error))

    panel.job = PanelJob(window, lambda busy, _text: panel.set_busy(busy), failed)

    def compute(idle: bool = False) -> None:
        from ...core.lens import lens

        def job(src, waiting=None):
            src.live.require("lens")
            return lens(src, stop=waiting)

        # one at a time: snapshots published during a run must not queue a backlog; after a step the
        # lens is idle work: it costs about a step, so it never holds the next one up
        panel.job.submit(job, panel.show_result, idle=idle)

    def on_snapshot(snap, revealed: bool = False) -> None:
        if snap is None:
            return
        refused = snap.live.why_not("lens")
        if refused is not None or snap.tokens.n_steps == 0:
            panel.clear(refused or "run a step, then the lens shows where the prediction formed")
            panel.computed_for = None
            return
        key = (snap.state_version, snap.tokens.n_steps)
        # on screen: a tab behind another is "visible" to Qt, and the lens costs about a step
        if panel.follow.isChecked() and (revealed or on_screen(panel)) and key != panel.computed_for:
            panel.computed_for = key
            compute(idle=True)

    def export() -> None:
        from ..export_dialog import export_lens

        snap = window.snapshot
        if panel.result is not None:
            export_lens(window, panel.result, snap.model_name if snap is not None else "",
                        snap.unverified if snap is not None else None)  # fmt: skip

    panel.export_button.clicked.connect(export)
    panel.compute_requested.connect(lambda: compute())
    panel.head_clicked.connect(lambda layer, head: window.select(layer=layer, head=head))
    window.snapshot_changed.connect(on_snapshot)
    window.panel_revealed.connect(lambda w: on_snapshot(window.snapshot, True) if w is panel else None)
    window.tools_menu.addAction(window.acts.action("Logit lens of the current step", lambda: compute(), "Ctrl+Shift+L",
                                                   "Where the prediction formed, and which heads pushed it"))  # fmt: skip
    return panel
