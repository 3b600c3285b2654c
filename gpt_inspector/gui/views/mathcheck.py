"""Math check panel: the attention output recomputed by hand next to the model's own.

``MathCheckPanel`` only displays; ``create_panel(window)`` wires its two buttons (and the Tools
menu) to run ``check``/``check_all`` on the window's worker thread and hand the results over.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QPushButton,
    QTableWidgetItem,
    QWidget,
)

from .common import dialog_job, hbox, splitter, table, vbox, wrapped_label

PANEL_TITLE = "Math check"
PANEL_AREA = "right"
_RECOMPUTED = (66, 133, 244)
_MODEL = (244, 160, 0)
_BAD = QColor(218, 54, 51, 90)


class MathCheckPanel(QWidget):
    """Recomputed vs model vector (bars and table), max |diff|, the formula; optional all-heads grid."""

    check_requested = Signal()  # the selected head, at the selected query position
    check_all_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.check_button = QPushButton("Check selected head",
                                        toolTip="Recompute softmax(qKᵀ·s)·V by hand for the selected head and compare")  # fmt: skip
        self.check_button.clicked.connect(self.check_requested)
        self.check_all_button = QPushButton(
            "Check every head", toolTip="The same for every layer and head, at every query position"
        )
        self.check_all_button.clicked.connect(self.check_all_requested)
        self.check = None
        self.report = None
        self.job = None  # a PanelJob, set by create_panel; GUI thread only
        self.formula = wrapped_label("", rich=True)
        self.verdict = wrapped_label("no check run yet", selectable=True)

        # the plots' own dark background (pyqtgraph's config), like every other panel
        self.plot = pg.PlotWidget(labels={"bottom": "output dimension"})
        self.plot.setMinimumHeight(140)
        self.plot.showGrid(x=False, y=True, alpha=0.3)
        self.plot.addLegend(offset=(5, 5), labelTextColor="#c8ccd4", brush=pg.mkBrush(27, 30, 36, 200))
        self._bars_recomputed = pg.BarGraphItem(x=[], height=[], width=0.4, brush=_RECOMPUTED, name="recomputed")
        self._bars_model = pg.BarGraphItem(x=[], height=[], width=0.4, brush=_MODEL, name="model")
        self.plot.addItem(self._bars_recomputed)
        self.plot.addItem(self._bars_model)

        self.table = table(("dim", "recomputed", "model", "|diff|"))
        self.heads = table(("layer",))
        self.heads.setVisible(False)
        self.heads.setToolTip("max |diff| over every query position, per layer and head")

        buttons = hbox(None, self.check_button, self.check_all_button, 1)
        vbox(self, buttons, self.formula, self.verdict, (splitter(Qt.Vertical, self.plot, self.table, self.heads), 1))
        self._set_formula(None)

    # ------------------------------------------------------------------ public
    def set_busy(self, busy: bool) -> None:
        self.check_button.setEnabled(not busy)
        self.check_all_button.setEnabled(not busy)

    def show_result(self, check) -> None:
        """Show one ``MathCheck`` (None clears the vector view)."""
        self.check = check
        self._set_formula(check)
        if check is None:
            self.verdict.setText("no check run yet")
            self._bars_recomputed.setOpts(x=[], height=[])
            self._bars_model.setOpts(x=[], height=[])
            self.table.setRowCount(0)
            return
        mark = "✓ match" if check.ok else "✗ MISMATCH"
        color = "green" if check.ok else "red"
        self.verdict.setText(
            f"layer {check.layer}, head {check.head} (KV head {check.kv_head}), query position {check.position}: "
            f"max |diff| = <b>{check.max_abs_diff:.3g}</b> (tolerance {check.tolerance:.3g}) "
            f"<span style='color:{color}'><b>{mark}</b></span>; {int(check.allowed.sum())} keys allowed"
        )
        d = len(check.recomputed)
        x = np.arange(d)
        self._bars_recomputed.setOpts(x=x - 0.2, height=check.recomputed, width=0.4)
        self._bars_model.setOpts(x=x + 0.2, height=check.model, width=0.4)
        self.plot.setXRange(-0.8, d - 0.2, padding=0)
        self.plot.enableAutoRange(axis="y")
        diff = check.diff
        self.table.setRowCount(d)
        worst = check.worst_dim
        for i in range(d):
            vals = (str(i), f"{check.recomputed[i]:.7g}", f"{check.model[i]:.7g}", f"{diff[i]:.3g}")
            for col, text in enumerate(vals):
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if not diff[i] <= check.tolerance or (i == worst and not check.ok):
                    item.setBackground(QBrush(_BAD))
                self.table.setItem(i, col, item)

    def show_report(self, report) -> None:
        """Show a ``MathCheckReport``: max |diff| per layer (rows) and head (columns)."""
        self.report = report
        if report is None:
            self.heads.setVisible(False)
            self.heads.setRowCount(0)
            return
        self.heads.setVisible(True)
        self.heads.setColumnCount(report.n_heads + 1)
        self.heads.setHorizontalHeaderLabels(["layer"] + [f"h{h}" for h in range(report.n_heads)])
        self.heads.setRowCount(len(report.layers))
        for i, layer in enumerate(report.layers):
            self.heads.setItem(i, 0, QTableWidgetItem(str(layer)))
            for h in range(report.n_heads):
                d, tol = float(report.max_diff[i, h]), float(report.tolerance[i, h])
                item = QTableWidgetItem("nan" if math.isnan(d) else f"{d:.2e}")
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                item.setToolTip(f"worst at position {int(report.worst_position[i, h])}; tolerance {tol:.3g}")
                if not d <= tol:
                    item.setBackground(QBrush(_BAD))
                self.heads.setItem(i, h + 1, item)
        if self.check is None:
            self.verdict.setText(report.summary())

    def clear(self) -> None:
        self.show_result(None)
        self.show_report(None)

    # ------------------------------------------------------------------ internals
    def _set_formula(self, check) -> None:
        base = "out = softmax(q · K<sup>T</sup> × scaling + mask) · V"
        if check is None:
            self.formula.setText(f"<b>{base}</b> &nbsp; recomputed in float64 from the captured q, K, V")
            return
        cap = "" if check.softcap is None else f", logits soft-capped at {check.softcap:g}"
        self.formula.setText(
            f"<b>{base}</b> &nbsp; scaling = {check.scaling:.6g}{cap}; mask: the model's own plus mask edits; "
            f"q from head {check.head}, K and V from KV head {check.kv_head}"
        )


def create_panel(window) -> MathCheckPanel:
    """Dock hook for the main window: the buttons and Tools ▸ Check run on its worker thread."""
    panel = MathCheckPanel()
    run = dialog_job(window, panel, "Math check failed")

    def one() -> None:
        from ...core.mathcheck import check

        sel, snap = window.selection, window.snapshot
        pos = None if sel.query is None or snap is None else snap.query
        run(lambda src: check(src, sel.layer, sel.head, pos), panel.show_result)

    def every() -> None:
        from ...core.mathcheck import check_all

        run(lambda src: check_all(src), panel.show_report)

    panel.check_requested.connect(one)
    panel.check_all_requested.connect(every)
    act = window.acts.action
    window.tools_menu.addAction(act("Check the math of the selected head", one, "Ctrl+M",
                                    "Recompute softmax(qKᵀ·s)·V by hand and compare with the model"))  # fmt: skip
    window.tools_menu.addAction(act("Check the math of every head", every))
    return panel
