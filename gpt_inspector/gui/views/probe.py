"""Cache privacy panel: what an attacker reads back from the KV cache, row by row.

``ProbePanel`` only displays; ``create_panel(window)`` wires its Probe button (and a Tools-menu
entry) to run the probe on the window's worker thread and hand the ``ProbeResult`` to
``show_result``.
"""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QTableWidgetItem,
    QWidget,
)

from .common import dialog_job, hbox, table, vbox, wrapped_label

PANEL_TITLE = "Cache probe"
PANEL_AREA = "right"
COLUMNS = ("pos", "true token", "recovered", "distance", "margin", "")
_OK = QColor(46, 160, 67, 60)
_BAD = QColor(218, 54, 51, 70)

EXPLAIN = (
    "Layer-0 keys and values depend only on each token and its position, so whoever holds the cache can "
    "try every vocabulary token at every position and read the prompt back."
)


class ProbePanel(QWidget):
    """Table of cached positions: true token (if known), recovered token, distance, margin, ✓/✗.

    Above it the run controls: the layers to probe (one per model layer, from the snapshot) and
    a Probe button that emits ``probe_requested(layers)``.
    """

    probe_requested = Signal(object)  # list of layer indices

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.result = None
        self.job = None  # a PanelJob, set by create_panel; GUI thread only
        self.layers = QListWidget(
            toolTip="the layers to probe; layer 0 needs no model run past the embeddings", maximumHeight=90
        )
        self.layers.itemChanged.connect(lambda _item: self._enable())
        self.probe_button = QPushButton("Probe", clicked=lambda: self.probe_requested.emit(self.chosen_layers()))
        self._refused: str | None = "no run is shown"  # why the probe cannot run on the source shown
        self._busy = False
        self.title = QLabel("<b>Cache privacy probe</b>")
        self.layer_box = QComboBox(toolTip="probed layer")
        self.layer_box.currentIndexChanged.connect(self._show_layer)
        self.summary = wrapped_label("no probe run yet", rich=False, selectable=True)
        self.text = wrapped_label("", rich=False, selectable=True)
        explain = wrapped_label(EXPLAIN)
        explain.setStyleSheet("color: gray")

        self.table = table(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.horizontalHeader().setStretchLastSection(True)

        top = hbox(None, self.title, 1, QLabel("layer"), self.layer_box)
        run = QHBoxLayout()
        run.addWidget(self.layers, 1)
        run.addWidget(self.probe_button, 0, Qt.AlignTop)
        vbox(self, top, explain, run, self.summary, self.text, (self.table, 1))

        self._enable()

    # ------------------------------------------------------------------ public
    def set_snapshot(self, snap) -> None:
        """One checkable row per layer of the model shown; the probe runs where the source's ``live`` allows it."""
        if self.layers.count() != snap.n_layers:
            checked = set(self.chosen_layers()) or {0}
            with QSignalBlocker(self.layers):
                self.layers.clear()
                for i in range(snap.n_layers):
                    item = QListWidgetItem(f"layer {i}")
                    item.setData(Qt.UserRole, i)
                    item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
                    item.setCheckState(Qt.Checked if i in checked else Qt.Unchecked)
                    self.layers.addItem(item)
        self._refused = snap.live.why_not("probe")
        self._enable()

    def chosen_layers(self) -> list[int]:
        return [self.layers.item(r).data(Qt.UserRole) for r in range(self.layers.count())
                if self.layers.item(r).checkState() == Qt.Checked]  # fmt: skip

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._enable()

    def show_result(self, result) -> None:
        """Show a ``ProbeResult`` (None clears the panel)."""
        self.result = result
        with QSignalBlocker(self.layer_box):
            self.layer_box.clear()
            if result is not None:
                for lp in result.layers:
                    self.layer_box.addItem(f"{lp.layer} ({lp.method})", lp.layer)
        self.layer_box.setVisible(result is not None and len(result.layers) > 1)
        self._show_layer(0)

    def clear(self) -> None:
        self.show_result(None)

    def show_refusal(self, reason: str) -> None:
        """The one line saying why the probe cannot run on the source shown, instead of a result."""
        self.show_result(None)
        self.summary.setText(reason)

    # ------------------------------------------------------------------ internals
    def _enable(self) -> None:
        live = self._refused is None
        self.probe_button.setEnabled(live and not self._busy and bool(self.chosen_layers()))
        self.probe_button.setToolTip("Read the prompt back from the cached keys and values of the checked layers"
                                     if live else self._refused)  # fmt: skip

    def _show_layer(self, index: int) -> None:
        r = self.result
        if r is None or not r.layers:
            self.table.setRowCount(0)
            self.summary.setText("no probe run yet")
            self.text.setText("")
            return
        lp = r.layers[max(0, min(index, len(r.layers) - 1))]
        self.summary.setText(f"{r.model_name}: {lp.summary()} — {lp.seconds:.2f} s over a vocabulary of {r.vocab_size}")
        self.text.setText(f"read back: {r.texts.get(lp.layer, '')!r}")
        self.table.setRowCount(lp.n_positions)
        for row, p in enumerate(lp.positions):
            ok = p.recovered
            cells = (
                str(p.position),
                "" if p.true_label is None else p.true_label,
                p.label,
                f"{p.distance:.3g}",
                f"{p.margin:.3g}",
                "✓" if ok else "✗",
            )
            tips = (
                None,
                None if p.true_token_id is None else f"token id {p.true_token_id}",
                f"token id {p.token_id}; runner-up {p.runner_up_label!r} (id {p.runner_up_id})",
                "relative L2 distance between the cached K‖V and this token's K‖V "
                f"({'exact' if p.exact else 'not exact'}, tolerance {p.tolerance:g})",
                "runner-up distance minus winner distance: how sure the recovery is",
                None,
            )
            brush = QBrush(_OK if ok else _BAD)
            for col, (text, tip) in enumerate(zip(cells, tips)):
                item = QTableWidgetItem(text)
                if col in (0, 3, 4):
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if tip:
                    item.setToolTip(tip)
                item.setBackground(brush)
                self.table.setItem(row, col, item)


def create_panel(window) -> ProbePanel:
    """Dock hook for the main window: the Probe button and Tools ▸ Probe run on its worker thread."""
    panel = ProbePanel()
    run = dialog_job(window, panel, "Cache probe failed")

    def request(layers) -> None:
        layers = list(layers) or [0]
        snap = window.snapshot
        refused = "no run is shown: load a model" if snap is None else snap.live.why_not("probe")
        if refused is not None:  # not an error: the panel says why, in one line
            panel.show_refusal(refused)
            window.raise_panel(panel)
            return

        def job(src):
            from ...core.probe import probe_session

            return probe_session(src, layers=layers)  # refuses in one line where the source's live says so

        run(job, panel.show_result)

    panel.probe_requested.connect(request)
    window.snapshot_changed.connect(panel.set_snapshot)
    window.tools_menu.addAction(window.acts.action(
        "Probe the KV cache (checked layers)", lambda: request(panel.chosen_layers()), None,
        "Read the prompt back from the cached keys and values"))  # fmt: skip
    return panel
