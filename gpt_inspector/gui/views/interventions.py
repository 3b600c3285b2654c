"""Every intervention in force: mask edits, knock-outs and patches, one row each with its own undo.

A knock-out or a patch used to show for a few seconds in the status bar and then nothing said it
was still changing the numbers. Here each stays listed until it is undone (its row's Undo button,
or Delete on the row); the undo is a typed command the worker carries out against what is in force
when it runs, so two quick undos never bring an edit back. The same module puts knock-out and
patching on the Tools menu and on the overview's and the score matrix's right-click menus.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QPushButton, QTableWidgetItem, QToolButton, QWidget

from ...core.capture import MaskEdit
from .common import context_actions, hbox, info_label, table, vbox
from .mask_editor import describe_edit

PANEL_TITLE = "Interventions"
# a tab beside the softmax rows, under the overview whose marks it lists (the right-hand groups have
# no room left for a fifth whole tab title at 1366 px)
PANEL_AREA = "softmax"


def describe(edit, labels, source_text: str = "") -> tuple[str, str, str]:
    """(kind, where, what) of one intervention, as its row shows them."""
    if isinstance(edit, MaskEdit):
        where, _, what = describe_edit(edit, labels).partition(": ")
        return "mask edit", where, what
    where = f"L{edit.layer}" + (" all heads" if edit.head is None else f" H{edit.head}")
    if edit.patch_from is None:
        return "knock-out", where, "attention output zeroed" if edit.head is not None else "every head's output zeroed"
    return "patch", where, f"output from the run of “{source_text}”"


class InterventionsPanel(QWidget):
    undo_requested = Signal(object)  # a MaskEdit or HeadEdit to take out of force
    clear_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.summary = info_label("no intervention in force")
        self.table = table(["kind", "where", "what", ""], QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setWordWrap(False)
        self.clear = QPushButton("Undo all", clicked=lambda: self.clear_requested.emit(),
                                 toolTip="Take every mask edit, knock-out and patch out of force")  # fmt: skip
        hint = info_label("Ctrl+K knocks out the selected head; right-click a head in the overview for more")
        vbox(self, hbox(None, (self.summary, 1), self.clear), (self.table, 1), hint, margin=2, spacing=2)
        # Delete on the list, not the window: elsewhere Delete is a text field's
        for key in (QKeySequence.StandardKey.Delete, QKeySequence(Qt.Key.Key_Backspace)):
            QShortcut(key, self.table, self._undo_current, context=Qt.ShortcutContext.WidgetShortcut)
        self.rows: list = []  # the edits listed, top down
        self._shown: list = []
        self.editable = False

    def _undo_current(self) -> None:
        row = self.table.currentRow()
        if self.editable and 0 <= row < len(self.rows):
            self.undo_requested.emit(self.rows[row])

    def undo_button(self, row: int) -> QToolButton:
        return self.table.cellWidget(row, 3)

    def row_texts(self) -> list[tuple[str, str, str]]:
        """What each row shows (kind, where, what), top down."""
        return [tuple(self.table.item(r, c).text() for c in range(3)) for r in range(self.table.rowCount())]

    def set_snapshot(self, snap) -> None:
        self.editable = not snap.read_only
        self.clear.setEnabled(self.editable and bool(snap.mask.mask_edits or snap.mask.head_edits))
        rows = [*snap.mask.mask_edits, *(e for e, _ in snap.mask.head_edits)]
        texts = [describe(e, snap.tokens.labels) for e in snap.mask.mask_edits]
        texts += [describe(e, snap.tokens.labels, src) for e, src in snap.mask.head_edits]
        n = len(rows)
        self.summary.setText(f"{n} intervention{'s' * (n != 1)} in force" if n else "no intervention in force")
        shown = [rows, texts, self.editable]
        if shown == self._shown:
            return
        self._shown, self.rows = shown, rows
        current = self.table.currentRow()
        self.table.setRowCount(n)
        for r, (edit, cells) in enumerate(zip(rows, texts)):
            for c, text in enumerate(cells):
                it = QTableWidgetItem(text)
                it.setToolTip(text)
                self.table.setItem(r, c, it)
            undo = QToolButton(text="Undo", objectName=f"undo_{r}", enabled=self.editable,
                               toolTip=f"Take this {cells[0]} out of force and recompute (Delete on the row)")  # fmt: skip
            undo.clicked.connect(lambda _=False, e=edit: self.undo_requested.emit(e))
            self.table.setCellWidget(r, 3, undo)
        if n:
            self.table.setCurrentCell(min(max(current, 0), n - 1), 0)


def create_panel(window) -> InterventionsPanel:
    from PySide6.QtWidgets import QInputDialog

    panel = InterventionsPanel()
    ctl = window.controller

    def clear() -> None:
        snap = window.snapshot
        if snap is not None and snap.mask.mask_edits:
            ctl.set_mask_edits(())
        if snap is not None and snap.mask.head_edits:
            ctl.set_head_edits(())

    window.snapshot_changed.connect(panel.set_snapshot)
    panel.undo_requested.connect(ctl.undo_edit)
    panel.clear_requested.connect(clear)

    def knock(whole_layer: bool) -> None:
        sel = window.selection
        ctl.knock_out(sel.layer, None if whole_layer else sel.head)

    def patch() -> None:
        layer, head = window.selection.layer, window.selection.head
        text, ok = QInputDialog.getText(window, "Patch a head from another prompt",
                                        f"Write head {layer}.{head}'s output from a run of this prompt:")  # fmt: skip
        if ok and text:
            ctl.patch_head(layer, head, text)

    items = [("Knock out the selected head", lambda: knock(False), "Ctrl+K"),
             ("Knock out the selected layer's attention", lambda: knock(True), None),
             ("Patch the selected head from another prompt…", patch, None),
             ("Clear knock-outs and patches", lambda: ctl.set_head_edits(()), None)]  # fmt: skip
    window.tools_menu.addSeparator()
    for text, slot, key in items:
        window.tools_menu.addAction(
            window.acts.action(text, slot, key, "Recompute the run with this change, tokens kept")
        )
    # the overview selects the head under the pointer before its menu opens, so these act on that head
    for view in (window.overview, window.score_matrix):
        context_actions(view.glw, *((text, slot) for text, slot, _ in items))
    return panel
