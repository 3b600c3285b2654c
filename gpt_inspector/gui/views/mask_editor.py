"""The mask edits in force and what the last one did to the next-token distribution.

Edits are made on the score matrix ("Edit mask", then click or drag cells); this panel lists
them, removes them, and shows the distribution before and after with its total variation.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QTableWidgetItem,
    QWidget,
)

from .common import DIM, column, hbox, splitter, table, vbox, wrapped_label


def describe_edit(e, labels) -> str:
    where = "all layers" if e.layer is None else f"L{e.layer}" + (" all heads" if e.head is None else f" H{e.head}")
    lab = lambda i: f"“{labels[i]}”" if 0 <= i < len(labels) else ""  # noqa: E731
    verb = "blocked" if e.blocked else "allowed"
    return f"{where}: {e.query} {lab(e.query)} ↛ {e.key} {lab(e.key)} ({verb})"


class MaskEditor(QWidget):
    edits_replaced = Signal(object)  # the full list of MaskEdit to put in force

    def __init__(self, parent=None):
        super().__init__(parent)
        self.edits: list = []
        hint = wrapped_label("Turn on <b>Edit mask</b> above the score matrix, then click or drag cells.")
        hint.setStyleSheet(f"color: {DIM};")
        self.list = QListWidget(
            selectionMode=QAbstractItemView.SelectionMode.ExtendedSelection,
            toolTip="The mask edits in force: layer, head, query ↛ key; select some to remove them",
        )
        self.remove = QPushButton(
            "Remove selected", clicked=self._remove, toolTip="Undo the selected edits (the model re-runs)"
        )
        self.clear = QPushButton(
            "Clear all", clicked=lambda: self.edits_replaced.emit([]), toolTip="Undo every mask edit"
        )
        self.summary = wrapped_label("no edit yet", rich=True)
        self.table = table(["token", "before", "after", "Δ"], QHeaderView.ResizeMode.Stretch)
        self.table.setToolTip("The next-token probabilities before and after the last edit")
        split = splitter(
            Qt.Orientation.Vertical,
            column(self.list, hbox(None, self.remove, self.clear, 1)),
            column(self.summary, self.table),
        )
        vbox(self, hint, (split, 1), margin=2)
        self.report = None

    def _remove(self) -> None:
        rows = {i.row() for i in self.list.selectedIndexes()}
        if rows:
            self.edits_replaced.emit([e for i, e in enumerate(self.edits) if i not in rows])

    def set_snapshot(self, snap) -> None:
        editable = not snap.read_only
        self.remove.setEnabled(editable)
        self.clear.setEnabled(editable and bool(snap.mask.mask_edits))
        texts = [describe_edit(e, snap.tokens.labels) for e in snap.mask.mask_edits]
        # compared by text too: a new prompt keeps the edits but renames the tokens they name
        if list(snap.mask.mask_edits) != self.edits or texts != [
            self.list.item(i).text() for i in range(self.list.count())
        ]:
            self.edits = list(snap.mask.mask_edits)
            self.list.clear()
            for t in texts:
                QListWidgetItem(t, self.list)
            self.report = False  # the summary names the count: write it again
        r = snap.mask.mask_report
        if r is self.report:
            return
        self.report = r
        if r is None:
            self.summary.setText(f"{len(self.edits)} edit(s) in force" if self.edits else "no edit yet")
            self.table.setRowCount(0)
            return
        where = "nothing processed was affected" if r.earliest_position is None else (
            f"recomputed {r.recomputed} position(s) from {r.earliest_position}")  # fmt: skip
        self.summary.setText(
            f"Last edit: {where}.<br>Next-token distribution moved by total variation <b>{r.total_variation:.4f}</b>."
        )
        self.table.setRowCount(len(r.rows))
        for i, (lab, b, a) in enumerate(r.rows):
            delta = a - b
            cells = [lab, f"{b:.4f}", f"{a:.4f}", f"{delta:+.4f}"]
            for j, text in enumerate(cells):
                it = QTableWidgetItem(text)
                if j == 3 and abs(delta) > 1e-4:
                    it.setForeground(QColor("#6fdf8f") if delta > 0 else QColor("#ff7b7b"))
                self.table.setItem(i, j, it)
