"""Decoding comparison panel: greedy, beam search and a seeded sample side by side, and the beam tree.

Display only. The comparison (``gpt_inspector.core.compare.compare``) runs on the worker thread;
``create_panel`` wires the Compare button to ``window.run_in_worker`` and hands the ``Comparison``
to ``ComparePanel.show_result``; "Inspect beam" shows the chosen beam in the main window, read-only.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QGraphicsItem,
    QGraphicsPathItem,
    QGraphicsScene,
    QGraphicsSimpleTextItem,
    QGraphicsView,
    QHeaderView,
    QLabel,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from .common import FlowLayout, PanelJob, column, elide, group, splitter, vbox, wrapped_label

if TYPE_CHECKING:
    from ...core.compare import Comparison

PANEL_TITLE = "Compare decoding"
PANEL_AREA = "bottom"

# cell and node states, stored on the items (Qt.UserRole) so tests and tooltips can read them
SAME, PARTS, AFTER = "same", "parts", "after"

_PARTS_BG = QColor(255, 140, 40, 190)  # the first token that differs from greedy
_AFTER_BG = QColor(255, 140, 40, 70)  # later tokens that differ from greedy at that position
_PROB_BG = (79, 143, 223)  # per-token probability, as alpha
_ALIVE = QColor("#4fa3ff")
_FINISHED = QColor("#3fb950")
_RETURNED = QColor("#ffb84f")
_PRUNED = QColor("#6e7381")
_PRUNED_FILL = QColor(110, 115, 129, 40)
_TEXT = QColor("#c8ccd4")
_BACKGROUND = QColor("#1b1e24")

_DX, _DY = 96.0, 30.0  # tree spacing: per step, per leaf
_NODE_W, _NODE_H = 78.0, 22.0
_MIN_SCALE = 0.75  # below this node labels drop under ~9 px: scroll instead of shrinking further


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


class BeamTreeView(QGraphicsView):
    """The search as a tree: nodes are tokens, edges carry the cumulative score.

    Pruned branches are grey and dashed, finished hypotheses green, the returned sequences' paths
    outlined in amber. Wheel zooms. A new tree is fitted to the view (never below a legible
    scale) and refitted as the view resizes, until the user zooms or drags.
    """

    node_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        self._scene = QGraphicsScene()
        super().__init__(self._scene, parent, dragMode=QGraphicsView.DragMode.ScrollHandDrag,
                         transformationAnchor=QGraphicsView.ViewportAnchor.AnchorUnderMouse,
                         backgroundBrush=QBrush(_BACKGROUND))  # the plots' dark background, in any Qt theme  # fmt: skip
        self.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        self.node_items: dict[int, QGraphicsPathItem] = {}
        self.edge_items: dict[int, QGraphicsPathItem] = {}  # keyed by the child node
        self._focus: tuple[float, float] | None = None  # scene point to keep in view when it cannot all fit
        self._auto_fit = False

    def wheelEvent(self, ev):  # noqa: N802 (Qt)
        self._auto_fit = False
        f = 1.15 if ev.angleDelta().y() > 0 else 1 / 1.15
        self.scale(f, f)

    def resizeEvent(self, ev):  # noqa: N802 (Qt)
        super().resizeEvent(ev)
        # the panel is laid out (splitter, dock, tab) after the tree is drawn: fit to the final size
        if self._auto_fit:
            self.fit()

    def showEvent(self, ev):  # noqa: N802 (Qt)
        super().showEvent(ev)
        if self._auto_fit:
            self.fit()

    def fit(self) -> None:
        """Scale the tree to the view, between a legible minimum and 1:1; centre on the best path if it overflows."""
        rect = self._scene.sceneRect()
        vp = self.viewport().rect()
        if not self.node_items or rect.isEmpty() or vp.width() < 2 or vp.height() < 2:
            return
        f = min(vp.width() / rect.width(), vp.height() / rect.height())
        f = max(_MIN_SCALE, min(1.0, f))
        self.resetTransform()
        self.scale(f, f)
        fits = rect.width() * f <= vp.width() and rect.height() * f <= vp.height()
        if fits or self._focus is None:
            self.centerOn(rect.center())
        else:
            self.centerOn(*self._focus)

    @property
    def zoom(self) -> float:
        return self.transform().m11()

    def clear(self) -> None:
        self._focus = None
        self._auto_fit = False
        self._scene.clear()
        self.node_items.clear()
        self.edge_items.clear()

    @staticmethod
    def layout(nodes: list[dict]) -> dict[int, tuple[float, float]]:
        """(x, y) per node id: x by step, leaves stacked in rank order, parents centred on children."""
        children: dict[int, list[dict]] = {}
        for n in nodes:
            if n["parent"] is not None:
                children.setdefault(n["parent"], []).append(n)
        for kids in children.values():
            kids.sort(key=lambda n: (n["rank"], n["id"]))
        pos: dict[int, tuple[float, float]] = {}
        next_leaf = 0.0
        roots = [n for n in nodes if n["parent"] is None]
        # iterative post-order: trees can be deeper than Python's recursion limit
        for root in roots:
            stack: list[tuple[dict, bool]] = [(root, False)]
            while stack:
                n, expanded = stack.pop()
                kids = children.get(n["id"], [])
                if not kids:
                    pos[n["id"]] = ((n["step"] + 1) * _DX, next_leaf * _DY)
                    next_leaf += 1
                elif expanded:
                    ys = [pos[k["id"]][1] for k in kids]
                    pos[n["id"]] = ((n["step"] + 1) * _DX, (min(ys) + max(ys)) / 2)
                else:
                    stack.append((n, True))
                    stack.extend((k, False) for k in reversed(kids))
        return pos

    def show_tree(self, nodes: list[dict]) -> None:
        self.clear()
        if not nodes:
            return
        pos = self.layout(nodes)
        small = QFont()
        small.setPointSizeF(max(6.0, small.pointSizeF() * 0.8))
        # edges first, so nodes paint over them
        for n in nodes:
            if n["parent"] is None:
                continue
            (x0, y0), (x1, y1) = pos[n["parent"]], pos[n["id"]]
            path = QPainterPath()
            path.moveTo(x0 + _NODE_W / 2, y0)
            mid = (x0 + _NODE_W / 2 + x1 - _NODE_W / 2) / 2
            path.cubicTo(mid, y0, mid, y1, x1 - _NODE_W / 2, y1)
            pruned = n["status"] == "pruned"
            color = _RETURNED if n.get("returned") is not None else (_PRUNED if pruned else _ALIVE)
            pen = QPen(color, 2.2 if n.get("returned") is not None else 1.2)
            if pruned:
                pen.setStyle(Qt.PenStyle.DashLine)
            edge = QGraphicsPathItem(path)
            edge.setPen(pen)
            edge.setZValue(0)
            edge.setData(0, n["status"])
            self._scene.addItem(edge)
            self.edge_items[n["id"]] = edge
            label = QGraphicsSimpleTextItem(_fmt(n["score"]))
            label.setFont(small)
            label.setBrush(QBrush(_PRUNED if pruned else _TEXT))
            br = label.boundingRect()
            # next to the child: siblings sit _DY apart, so labels never pile up at the fork
            label.setPos(x1 - _NODE_W / 2 - br.width() - 3, y1 - br.height())
            label.setZValue(1)
            self._scene.addItem(label)
        for n in nodes:
            x, y = pos[n["id"]]
            self._add_node(n, x, y)
        self._scene.setSceneRect(self._scene.itemsBoundingRect().adjusted(-20, -20, 20, 20))
        best = [n for n in nodes if n.get("returned") == 0]
        best = best or [n for n in nodes if n["status"] != "pruned"] or nodes
        best.sort(key=lambda n: n["step"])
        self._focus = pos[best[len(best) // 2]["id"]]
        self._auto_fit = True
        self.fit()

    def _add_node(self, n: dict, x: float, y: float) -> None:
        status = n["status"]
        path = QPainterPath()
        if n["parent"] is not None:
            w, left = _NODE_W, x - _NODE_W / 2
        else:  # the prompt grows leftwards so its edges still leave from the usual place
            w = max(_NODE_W, 7.0 * min(len(n["text"]), 24) + 12)
            left = x + _NODE_W / 2 - w
        path.addRoundedRect(QRectF(left, y - _NODE_H / 2, w, _NODE_H), 6, 6)
        item = QGraphicsPathItem(path)
        if status == "pruned":
            pen, fill = QPen(_PRUNED, 1.0, Qt.PenStyle.DashLine), QBrush(_PRUNED_FILL)
        elif status == "finished":
            pen, fill = QPen(_FINISHED, 2.0), QBrush(QColor(63, 185, 80, 70))
        else:
            pen, fill = QPen(_ALIVE, 1.5), QBrush(QColor(79, 163, 255, 50))
        if n.get("returned") is not None:
            pen = QPen(_RETURNED, 2.5)
        item.setPen(pen)
        item.setBrush(fill)
        item.setZValue(2)
        item.setData(0, status)
        item.setData(1, n["id"])
        item.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIsSelectable, True)
        item.setToolTip(self._tooltip(n))
        self._scene.addItem(item)
        text = n["text"] if n["parent"] is not None else elide(n["text"], 24)
        if n.get("stopped"):
            text += " ■"
        label = QGraphicsSimpleTextItem(elide(text, 11) if n["parent"] is not None else text, item)
        label.setBrush(QBrush(_PRUNED if status == "pruned" else _TEXT))
        br = label.boundingRect()
        rect = path.boundingRect()
        label.setPos(rect.center().x() - br.width() / 2, rect.center().y() - br.height() / 2)
        self.node_items[n["id"]] = item

    @staticmethod
    def _tooltip(n: dict) -> str:
        if n["parent"] is None:
            return f"prompt: {n['text']}"
        lines = [
            f"step {n['step']}: {n['text']!r} (id {n['token_id']})",
            f"from beam {None if n['parent_beam'] is None else n['parent_beam'] + 1}, rank {n['rank'] + 1}",
            f"log p = {_fmt(n['logprob'])}" + ("" if n["logprob"] is None else f"  (p = {math.exp(n['logprob']):.3f})"),
            f"cumulative score = {_fmt(n['score'])}",
        ]
        if n.get("stopped"):
            lines.append(f"stopped; length-normalised score = {_fmt(n.get('normalized'))}")
        fate = {"beam": f"kept as beam {(n.get('beam') or 0) + 1}", "finished": "entered the finished hypotheses",
                "dropped": "stopped but not kept", "pruned": "not kept"}.get(n.get("fate"), n.get("fate"))  # fmt: skip
        lines.append(f"at its step: {fate}; now: {n['status']}")
        if n.get("returned") is not None:
            lines.append(f"on the path of returned sequence {n['returned'] + 1}")
        return "\n".join(lines)

    def mousePressEvent(self, ev):  # noqa: N802 (Qt)
        self._auto_fit = False  # a click may start a drag: leave the view where the user puts it
        item = self.itemAt(ev.position().toPoint())
        while item is not None and item.data(1) is None:
            item = item.parentItem()
        if item is not None:
            self.node_clicked.emit(int(item.data(1)))
        super().mousePressEvent(ev)


class ComparePanel(QWidget):
    """Greedy, beams 1..R and the seeded sample side by side; where they part from greedy highlighted.

    ``show_result(result)`` takes the ``Comparison`` that ``gpt_inspector.core.compare.compare``
    returns. ``compare_requested(settings)`` asks the owner to run a comparison with the settings in
    the controls; ``inspect_requested(r)`` asks it to show returned beam ``r``. This panel never
    runs the model.
    """

    compare_requested = Signal(dict)
    inspect_requested = Signal(int)  # returned sequence r: show it in the main window, read-only

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
        self.sample = QCheckBox("sample", toolTip="also draw one seeded sample")
        self.temperature = QDoubleSpinBox(
            minimum=0.05, maximum=10.0, value=1.0, singleStep=0.1, decimals=2, toolTip="sampling temperature"
        )
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1, value=0, toolTip="sampling seed")
        self.run_button = QPushButton(
            "Compare",
            toolTip="Run greedy, beam search and sampling on this prompt side by side",
            clicked=lambda: self.compare_requested.emit(self.settings()),
        )
        self.beams.valueChanged.connect(lambda v: self.returns.setMaximum(v))
        self.sample.toggled.connect(self.temperature.setEnabled)
        self.sample.toggled.connect(self.seed.setEnabled)
        self.temperature.setEnabled(False)
        self.seed.setEnabled(False)

        # one long row would need ~1,400 px and the panel often docks at ~430: let the controls wrap
        controls = FlowLayout(spacing=8)
        for label, w in (("beams", self.beams), ("return", self.returns), ("new tokens", self.new_tokens),
                         ("length penalty", self.length_penalty), ("early stopping", self.early)):  # fmt: skip
            controls.addWidget(group(QLabel(label), w))
        controls.addWidget(group(self.sample, QLabel("T"), self.temperature, QLabel("seed"), self.seed))
        controls.addWidget(self.run_button)

        self.summary = wrapped_label("Compare greedy decoding, beam search and a seeded sample on the session's prompt.",
                                     rich=True, selectable=True)  # fmt: skip

        self.table = QTableWidget(0, 0, editTriggers=QAbstractItemView.EditTrigger.NoEditTriggers,
                                  selectionMode=QAbstractItemView.SelectionMode.SingleSelection, wordWrap=False)  # fmt: skip
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.tree = BeamTreeView()

        legend = wrapped_label(  # wrapped: one line of it is ~700 px, wider than the dock
            "beam tree — edges: cumulative log-prob · <span style='color:#ffb84f'>amber</span>: returned · "
            "<span style='color:#3fb950'>green</span>: finished · <span style='color:#4fa3ff'>blue</span>: alive · "
            "<span style='color:#6e7381'>grey dashed</span>: pruned · ■ stopped (EOS or max length)", rich=True,
        )  # fmt: skip
        self.split = split = splitter(
            Qt.Orientation.Vertical, column((self.table, 1), self.summary), column(legend, (self.tree, 1), spacing=1)
        )
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
            "sample": self.sample.isChecked(),
            "temperature": self.temperature.value(),
            "seed": self.seed.value(),
        }

    refused: str | None = None  # why Compare cannot run on the session shown (a remote engine's), or None

    def refuse(self, why: str | None) -> None:
        """Disable Compare, its tooltip saying ``why`` (None: enable it again)."""
        if why == self.refused:
            return
        if self.refused is None:
            self._tip = self.run_button.toolTip()
        self.refused = why
        self.run_button.setToolTip(self._tip if why is None else why)
        self.run_button.setEnabled(why is None)

    def set_busy(self, busy: bool, text: str = "") -> None:
        self.run_button.setEnabled(not busy and self.refused is None)
        if text:
            self.summary.setText(text)

    def show_error(self, message: str) -> None:
        self.set_busy(False)
        self.summary.setText(f"<span style='color:#ff6b6b'>{_html(message)}</span>")

    def forget(self, text: str) -> None:
        """Drop the comparison shown: it was made on a session the window no longer shows."""
        self.result = None
        self.table.clear()
        self.table.setRowCount(0)
        self.tree.clear()
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
        can = bool(result.beams)
        self.inspect_pick.setEnabled(can)
        self.inspect_button.setEnabled(can)
        p = int(result.prompt_length)
        rows: list[tuple[str, dict]] = [("greedy", dict(result.greedy))]
        rows += [(f"beam {i + 1}", dict(b)) for i, b in enumerate(result.beams)]
        if result.sampled is not None:
            rows.append(("sample", dict(result.sampled)))
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
        # the table needs only its rows; give the rest to the tree
        t.resizeRowsToContents()
        want = t.horizontalHeader().height() + sum(t.rowHeight(r) for r in range(t.rowCount())) + 6
        want += self.summary.sizeHint().height() + t.horizontalScrollBar().sizeHint().height()
        total = sum(self.split.sizes()) or self.height()
        if total > want:
            self.split.setSizes([want, total - want])
        self.tree.fit()  # the splitter just gave the tree its size

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


def _compare_job(settings: dict):
    """What the worker runs: a comparison on the shown source's prompt (never on the GUI thread)."""

    def job(source):
        from ...core.compare import compare
        from ...core.errors import InspectorError

        lm = getattr(source, "lm", None)
        if lm is None and getattr(source, "engine", None) is not None:
            raise InspectorError("compare and beams run where the model is: not served over the link to the engine yet")
        if lm is None:
            raise InspectorError("load a model first: comparing decodings needs a live model, not a trace")
        return compare(lm, prompt_ids=list(source.prompt_ids), **settings)

    return job


def create_panel(window) -> ComparePanel:
    """Dock hook for the main window: Compare runs through ``window.run_in_worker``, Inspect beam
    hands the beam to ``window.show_source``."""
    panel = ComparePanel()

    def failed(error) -> None:
        panel.show_error(str(error).splitlines()[0] if str(error) else type(error).__name__)

    panel.job = PanelJob(window, panel.set_busy, failed)

    def request(settings: dict) -> None:
        panel.job.submit(_compare_job(settings), panel.show_result, "Comparing…")

    def inspect(r: int) -> None:
        result = panel.result
        if result is None or not 0 <= r < len(result.beams):
            return
        # the search is finished and nothing changes it any more, so a view of it can be made
        # here and handed to the worker, which owns whatever the window shows
        window.show_source(result.beam_view(r), name=f"Beam {r + 1}")  # a run of its own: the live session stays

    panel.compare_requested.connect(request)
    panel.inspect_requested.connect(inspect)
    return panel
