"""Decoding comparison panel: greedy, beam search and seeded samples side by side, and two trees.

Display only. The comparison (``gpt_inspector.core.compare.compare``) runs on the worker thread;
``create_panel`` wires the Compare button to ``window.run_in_worker`` (on a remote engine's session
the engine compares: ``RemoteSession.remote_compare``) and hands the ``Comparison`` to
``ComparePanel.show_result``; Stop ends it between two tokens; "Inspect beam" shows the chosen beam
in the main window, read-only (a local comparison's: a remote one's beams stay on the engine).
The table has one row per ``Comparison.rows`` entry, whatever its kind; the trees are in ``compare_tree``.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QToolButton,
    QWidget,
)

from .common import FlowLayout, PanelJob, column, group, splitter, vbox, wrapped_label
from .compare_tree import _AFTER_BG, _PARTS_BG, _PROB_BG, BeamTreeView, FanoutTreeView

if TYPE_CHECKING:
    from ...core.compare import Comparison

PANEL_TITLE = "Compare decoding"
PANEL_AREA = "bottom"

# cell and node states, stored on the items (Qt.UserRole) so tests and tooltips can read them
SAME, PARTS, AFTER = "same", "parts", "after"


class ComparePanel(QWidget):
    """Greedy, beams 1..R and the seeded sample side by side; where they part from greedy highlighted.

    ``show_result(result)`` takes the ``Comparison`` that ``gpt_inspector.core.compare.compare``
    returns. ``compare_requested(settings)`` asks the owner to run a comparison with the settings in
    the controls; ``inspect_requested(r)`` asks it to show returned beam ``r``. This panel never
    runs the model.
    """

    compare_requested = Signal(dict)
    inspect_requested = Signal(int)  # returned sequence r: show it in the main window, read-only
    result_shown = Signal()  # a comparison came back and is on screen (or its error)
    progressed = Signal(str, int)  # what runs, its token: emitted on the worker, shown here

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.result: Comparison | None = None
        self.job: PanelJob | None = None  # set by create_panel; GUI thread only
        self.row_names: list[str] = []

        self.beams = QSpinBox(minimum=1, maximum=32, value=2, toolTip="num_beams")
        self.returns = QSpinBox(minimum=1, maximum=32, value=2, toolTip="num_return_sequences (≤ beams)")
        self.new_tokens = QSpinBox(minimum=1, maximum=1024, value=8, toolTip="max_new_tokens")
        self.length_penalty = QDoubleSpinBox(minimum=-10.0, maximum=10.0, value=1.0, singleStep=0.5, decimals=2,
                                             toolTip="hypothesis score = sum log p / generated_length ** length_penalty")  # fmt: skip
        self.early = QComboBox(toolTip="early_stopping")
        self.early.addItems(["False", "True", "never"])
        self.samples = QSpinBox(minimum=0, maximum=64, value=0, specialValueText="off",
                                toolTip="seeded samples at each temperature (seeds: seed, seed + 1, ...)")  # fmt: skip
        self.temperatures = QLineEdit("1.0", toolTip="sampling temperatures, comma-separated (0.7, 1.0, 1.5)")
        self.temperatures.setMaximumWidth(110)
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1, value=0, toolTip="the first sample's seed")
        self.lookup = QSpinBox(minimum=0, maximum=64, value=0, specialValueText="off",
                               toolTip="assisted decoding by prompt lookup: tokens proposed per round "
                                       "(generate's prompt_lookup_num_tokens); its row's tokens are greedy's")  # fmt: skip
        self.run_button = QPushButton(
            "Compare",
            toolTip="Run greedy, beam search and sampling on this prompt side by side",
            clicked=lambda: self.compare_requested.emit(self.settings()),
        )
        self.stop = threading.Event()  # read by the job on the worker between two tokens (sent to a remote engine)
        self.stop_button = QPushButton("Stop", enabled=False, toolTip="Stop the comparison", clicked=self.stop.set)
        self.beams.valueChanged.connect(lambda v: self.returns.setMaximum(v))
        for w in (self.temperatures, self.seed):
            self.samples.valueChanged.connect(lambda n, w=w: w.setEnabled(n > 0))
            w.setEnabled(False)

        # one long row would need ~1,400 px and the panel often docks at ~430: let the controls wrap
        controls = FlowLayout(spacing=8)
        for label, w in (("beams", self.beams), ("return", self.returns), ("new tokens", self.new_tokens),
                         ("length penalty", self.length_penalty), ("early stopping", self.early)):  # fmt: skip
            controls.addWidget(group(QLabel(label), w))
        controls.addWidget(
            group(QLabel("samples"), self.samples, QLabel("T"), self.temperatures, QLabel("seed"), self.seed)
        )
        controls.addWidget(group(QLabel("assisted"), self.lookup))
        controls.addWidget(self.run_button)
        controls.addWidget(self.stop_button)

        self.summary = wrapped_label("Compare greedy decoding, beam search and a seeded sample on the session's prompt.",
                                     rich=True, selectable=True)  # fmt: skip

        self.table = QTableWidget(0, 0, editTriggers=QAbstractItemView.EditTrigger.NoEditTriggers,
                                  selectionMode=QAbstractItemView.SelectionMode.SingleSelection, wordWrap=False)  # fmt: skip
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.tree = BeamTreeView()
        self.fanout = FanoutTreeView()
        fan_legend = wrapped_label(
            "every output as one tree, sharing a node while their tokens agree — <span style='color:#4fa3ff'>blue</span>: "
            "greedy · <span style='color:#ffb84f'>amber</span>: beams · <span style='color:#c586f7'>violet</span>: samples · "
            "<span style='background:#ff8c28'>orange</span>: where an output first leaves greedy", rich=True,
        )  # fmt: skip
        legend = wrapped_label(  # wrapped: one line of it is ~700 px, wider than the dock
            "beam tree — edges: cumulative log-prob · <span style='color:#ffb84f'>amber</span>: returned · "
            "<span style='color:#3fb950'>green</span>: finished · <span style='color:#4fa3ff'>blue</span>: alive · "
            "<span style='color:#6e7381'>grey dashed</span>: pruned · ■ stopped (EOS or max length)", rich=True,
        )  # fmt: skip
        self.trees = QTabWidget(documentMode=True)
        self.trees.addTab(column(fan_legend, (self.fanout, 1), spacing=1), "All outputs")
        self.trees.addTab(column(legend, (self.tree, 1), spacing=1), "Beam search")
        self.trees.setTabToolTip(0, "Greedy, the beams and every sample as one fan-out tree")
        self.trees.setTabToolTip(1, "The beam search as it ran: every candidate, pruned ones too")
        self.trees.setCurrentIndex(1)  # until a comparison with samples comes
        for b in self.trees.tabBar().findChildren(QToolButton):  # the bar's scroll arrows, when the dock is narrow
            b.setToolTip("Scroll the tabs")
        self.split = split = splitter(Qt.Orientation.Vertical, column((self.table, 1), self.summary), self.trees)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 2)

        self.inspect_pick = QComboBox(toolTip="a returned beam", enabled=False)
        self.inspect_button = QPushButton("Inspect beam", enabled=False, toolTip=(
            "Show this beam's attention, Q/K/V and KV cache in the main window, read-only "
            "as a run of its own: the live session stays in the run switcher above the panels"))  # fmt: skip
        self.inspect_button.clicked.connect(lambda: self.inspect_requested.emit(self.inspect_pick.currentIndex()))
        controls.addWidget(group(self.inspect_pick, self.inspect_button))

        vbox(self, controls, (split, 1), margin=2)

    # ------------------------------------------------------------------ requests
    def settings(self) -> dict:
        """The controls as ``compare()`` keyword arguments."""
        early = {"False": False, "True": True}.get(self.early.currentText(), "never")
        return {
            "num_beams": self.beams.value(),
            "num_return_sequences": min(self.returns.value(), self.beams.value()),
            "max_new_tokens": self.new_tokens.value(),
            "length_penalty": self.length_penalty.value(),
            "early_stopping": early,
            "samples": self.samples.value(),
            "temperatures": self.temperature_list(),
            "seed": self.seed.value(),
            "prompt_lookup_num_tokens": self.lookup.value() or None,
        }

    def temperature_list(self) -> list[float]:
        """The temperatures typed; what is not a number > 0 is refused by compare() in words."""
        out = []
        for part in self.temperatures.text().replace(";", ",").split(","):
            if part.strip():
                try:
                    out.append(float(part))
                except ValueError:
                    out.append(float("nan"))  # compare() says which
        return out

    def set_busy(self, busy: bool, text: str = "") -> None:
        self.run_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        if text:
            self.summary.setText(text)

    def show_progress(self, what: str, step: int) -> None:
        if self.job is not None and self.job.running:
            self.summary.setText(f"Comparing… {what}: token {step}")

    def show_error(self, message: str) -> None:
        self.set_busy(False)
        self.summary.setText(f"<span style='color:#ff6b6b'>{_html(message)}</span>")
        self.result_shown.emit()

    def link_dropped(self, text: str) -> None:
        """The link to the engine dropped during a job: the comparison shown stays, its summary back
        (the job's progress wrote over it), with ``text`` saying what happened."""
        self.set_busy(False)
        note = f"<span style='color:#ffb84f'>{_html(text)}</span>"
        r = self.result
        self.summary.setText(note if r is None else self._summary_html(r, [(x["name"], dict(x)) for x in r.rows])
                             + "<br>" + note)  # fmt: skip
        self.result_shown.emit()

    def forget(self, text: str) -> None:
        """Drop the comparison shown: it was made on a session the window no longer shows."""
        self.result = None
        self.table.clear()
        self.table.setRowCount(0)
        self.tree.clear()
        self.fanout.clear()
        self.inspect_pick.clear()
        self.inspect_pick.setEnabled(False)
        self.inspect_button.setEnabled(False)
        self.summary.setText(text)

    # ------------------------------------------------------------------ results
    def show_result(self, result: Comparison) -> None:
        self.set_busy(False)
        self.result = result
        self.inspect_pick.clear()
        self.inspect_pick.addItems([f"beam {r + 1}  ({b['score']:.3f})" for r, b in enumerate(result.beams)])
        can = bool(result.beams) and result.search is not None  # a remote one's search stays there, and reads it
        self.inspect_pick.setEnabled(can)
        self.inspect_button.setEnabled(can)
        p = int(result.prompt_length)
        rows: list[tuple[str, dict]] = [(r["name"], dict(r)) for r in result.rows]
        self.row_names = [name for name, _ in rows]
        n_cols = max((len(r.get("tokens", [])) for _, r in rows), default=0)
        greedy_ids = result.greedy["token_ids"]
        t = self.table
        t.clear()
        t.setRowCount(len(rows))
        t.setColumnCount(n_cols)
        t.setHorizontalHeaderLabels([str(p + i) for i in range(n_cols)])
        headers = []
        for r, (name, out) in enumerate(rows):
            score = out.get("score")
            headers.append(name if score is None else f"{name}  {score:.3f}")
            if "seed" in out:
                name = f"{name} (seed {out['seed']})"
            div = out.get("diverges_at")
            for i, (label, prob) in enumerate(zip(out.get("tokens", []), out.get("probs", []))):
                pos = p + i
                tok = out["token_ids"][pos] if pos < len(out["token_ids"]) else None
                item = QTableWidgetItem(f"{label}\n{prob:.2f}")
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                state = SAME
                if div is not None and pos == div:
                    state = PARTS
                elif div is not None and pos > div and (pos >= len(greedy_ids) or greedy_ids[pos] != tok):
                    state = AFTER
                item.setData(Qt.ItemDataRole.UserRole, state)
                if state == PARTS:
                    item.setBackground(QBrush(_PARTS_BG))
                    f = item.font()
                    f.setBold(True)
                    item.setFont(f)
                elif state == AFTER:
                    item.setBackground(QBrush(_AFTER_BG))
                else:
                    item.setBackground(QBrush(QColor(*_PROB_BG, int(25 + 120 * max(0.0, min(1.0, prob))))))
                item.setToolTip(
                    f"{name}, position {pos}: {label!r} (id {tok})\np = {prob:.4f}"
                    + ("\nfirst token that differs from greedy" if state == PARTS else "")
                )
                t.setItem(r, i, item)
        t.setVerticalHeaderLabels(headers)
        self.summary.setText(self._summary_html(result, rows))
        self.tree.show_tree(result.beam_tree)
        self.fanout.show_tree(result.fanout_tree, [dict(r) for r in result.rows])
        self.trees.setCurrentIndex(0 if result.samples else 1)
        # the table needs only its rows; give the rest to the tree
        t.resizeRowsToContents()
        want = t.horizontalHeader().height() + sum(t.rowHeight(r) for r in range(t.rowCount())) + 6
        want += self.summary.sizeHint().height() + t.horizontalScrollBar().sizeHint().height()
        total = sum(self.split.sizes()) or self.height()
        if total > want:
            self.split.setSizes([want, total - want])
        self.tree.fit()  # the splitter just gave the tree its size
        self.fanout.fit()
        self.result_shown.emit()

    def cell_state(self, row: int, col: int) -> str | None:
        item = self.table.item(row, col)
        return None if item is None else item.data(Qt.ItemDataRole.UserRole)

    @staticmethod
    def _summary_html(result: Comparison, rows) -> str:
        s = result.settings
        head = (
            f"<b>{_html(result.prompt)!s}</b> — {s['num_beams']} beams, "
            f"length_penalty {s['length_penalty']}, early_stopping {s['early_stopping']}"
        )
        lines = [head]
        for name, out in rows:
            div = out.get("diverges_at")
            note = ""
            if name != "greedy":
                note = " (same as greedy)" if div is None else f" (parts from greedy at token {div})"
            score = "" if out.get("score") is None else f" score {out['score']:.3f}"
            lines.append(f"<b>{name}</b>{score}{note}: {_html(out.get('text', ''))}")
        for w in result.warnings:
            lines.append(f"<span style='color:#ffb84f'>{_html(w)}</span>")
        return "<br>".join(lines)


def _html(s: str) -> str:
    return html.escape(str(s), quote=False).replace("\n", "↵")


def _compare_job(settings: dict, panel: ComparePanel):
    """What the worker runs: a comparison on the shown source's prompt (never on the GUI thread)."""

    def job(source):
        from ...core.compare import compare
        from ...core.errors import Cancelled

        source.live.require("compare")  # a trace says why not, in one line
        if getattr(source, "engine", None) is not None:  # the engine compares; its rows and trees come back
            return source.remote_compare(**settings, progress=lambda what, i, _n: panel.progressed.emit(what, i),
                                         cancelled=panel.stop.is_set)  # fmt: skip

        def progress(what: str, step: int) -> None:
            panel.progressed.emit(what, step + 1)
            if panel.stop.is_set():
                raise Cancelled("the comparison was stopped")

        assert source.lm is not None  # a local source whose live allows "compare" has its model
        return compare(source.lm, prompt_ids=list(source.prompt_ids), progress=progress, **settings)

    return job


def create_panel(window) -> ComparePanel:
    """Dock hook for the main window: Compare runs through ``window.run_in_worker``, Inspect beam
    hands the beam to ``window.show_source``."""
    panel = ComparePanel()

    def failed(error) -> None:
        from ..remote_link import dropped_note  # here: a panel that never met an engine imports no client

        note = dropped_note(error)
        if note is not None:  # the window's band says so and reconnects: the comparison shown stays, no dialog
            panel.link_dropped(note)
            return
        panel.show_error(str(error).splitlines()[0] if str(error) else type(error).__name__)

    panel.job = PanelJob(window, panel.set_busy, failed)

    def request(settings: dict) -> None:
        panel.stop.clear()
        panel.job.submit(_compare_job(settings, panel), panel.show_result, "Comparing…")

    def inspect(r: int) -> None:
        result = panel.result
        if result is None or not 0 <= r < len(result.beams):
            return
        name = f"Beam {r + 1}"  # a run of its own: the live session stays
        if getattr(result.search, "remote", False):  # the engine holds the search: its beam is fetched by the worker
            panel.job.submit(lambda _source: result.beam_view(r), lambda beam: window.show_source(beam, name=name),
                             f"Fetching beam {r + 1} from the engine…")  # fmt: skip
            return
        # the search is finished and nothing changes it any more, so a view of it can be made
        # here and handed to the worker, which owns whatever the window shows
        window.show_source(result.beam_view(r), name=name)

    panel.progressed.connect(panel.show_progress)  # a bound method: queued to this thread (a lambda would not be)
    panel.compare_requested.connect(request)
    panel.inspect_requested.connect(inspect)
    return panel
