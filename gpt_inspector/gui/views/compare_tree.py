"""The trees of the Compare decoding panel: the beam search as it ran, and every output as one fan-out tree.

``BeamTreeView`` draws ``Comparison.beam_tree`` (every node the search made, pruned ones too);
``FanoutTreeView`` draws ``Comparison.fanout_tree`` (greedy, the returned beams and each sample,
sharing a node while their tokens agree), each output's first token off greedy's path highlighted.
Display only.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
    QGraphicsItem,
    QGraphicsPathItem,
    QGraphicsScene,
    QGraphicsSimpleTextItem,
    QGraphicsView,
    QWidget,
)

from .common import elide

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


def _edge(a: tuple[float, float], b: tuple[float, float]) -> QPainterPath:
    """A curve from the right side of the node at ``a`` to the left side of the node at ``b`` (centres)."""
    (x0, y0), (x1, y1) = a, b
    path = QPainterPath()
    path.moveTo(x0 + _NODE_W / 2, y0)
    mid = (x0 + _NODE_W / 2 + x1 - _NODE_W / 2) / 2
    path.cubicTo(mid, y0, mid, y1, x1 - _NODE_W / 2, y1)
    return path


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
            x1, y1 = pos[n["id"]]
            path = _edge(pos[n["parent"]], (x1, y1))
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


# the fan-out tree's colours per row kind (a kind added later gets the last)
_KIND_COLORS = {"greedy": _ALIVE, "beam": _RETURNED, "sample": QColor("#c586f7"), "": QColor("#5fd18b")}


class FanoutTreeView(BeamTreeView):
    """Every output as one prefix tree: greedy's path along the top in blue, each beam and sample
    branching off where its tokens first differ (that node filled orange and outlined), the branch in
    its kind's colour. Node tooltips name the outputs passing through and each one's probability."""

    def show_tree(self, nodes: list[dict], rows: list[dict] | None = None) -> None:  # type: ignore[override]
        self.clear()
        if not nodes:
            return
        rows = rows or []
        pos = self.layout(nodes)
        for n in nodes:
            if n["parent"] is None:
                continue
            x1, y1 = pos[n["id"]]
            path = _edge(pos[n["parent"]], (x1, y1))
            edge = QGraphicsPathItem(path)
            edge.setPen(QPen(self._color(n, rows), 2.2 if n["greedy"] else 1.4))
            edge.setZValue(0)
            self._scene.addItem(edge)
            self.edge_items[n["id"]] = edge
        for n in nodes:
            self._add_fan_node(n, *pos[n["id"]], rows)
        self._scene.setSceneRect(self._scene.itemsBoundingRect().adjusted(-20, -20, 20, 20))
        parts = [n for n in nodes if n["parts"]]
        focus = min(parts, key=lambda n: n["step"]) if parts else nodes[len(nodes) // 2]
        self._focus = pos[focus["id"]]
        self._auto_fit = True
        self.fit()

    @staticmethod
    def _color(n: dict, rows: list[dict]) -> QColor:
        if n["greedy"]:
            return _ALIVE
        kinds = {rows[i]["kind"] for i in n["rows"] if i < len(rows)}
        kind = next(iter(kinds)) if len(kinds) == 1 else ""
        return _KIND_COLORS.get(kind, _KIND_COLORS[""])

    def _add_fan_node(self, n: dict, x: float, y: float, rows: list[dict]) -> None:
        path = QPainterPath()
        if n["parent"] is not None:
            w, left = _NODE_W, x - _NODE_W / 2
        else:
            w = max(_NODE_W, 7.0 * min(len(n["text"]), 24) + 12)
            left = x + _NODE_W / 2 - w
        path.addRoundedRect(QRectF(left, y - _NODE_H / 2, w, _NODE_H), 6, 6)
        item = QGraphicsPathItem(path)
        color = self._color(n, rows)
        if n["parts"]:  # where an output first leaves greedy's path
            item.setPen(QPen(QColor(255, 140, 40), 2.5))
            item.setBrush(QBrush(_PARTS_BG))
        else:
            item.setPen(QPen(color, 1.5))
            item.setBrush(QBrush(QColor(color.red(), color.green(), color.blue(), 50)))
        item.setZValue(2)
        item.setData(0, "parts" if n["parts"] else "greedy" if n["greedy"] else "other")
        item.setData(1, n["id"])
        item.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIsSelectable, True)
        item.setToolTip(self._fan_tooltip(n, rows))
        self._scene.addItem(item)
        text = elide(n["text"], 11) if n["parent"] is not None else elide(n["text"], 24)
        label = QGraphicsSimpleTextItem(text, item)
        label.setBrush(QBrush(_TEXT))
        br, rect = label.boundingRect(), path.boundingRect()
        label.setPos(rect.center().x() - br.width() / 2, rect.center().y() - br.height() / 2)
        self.node_items[n["id"]] = item

    @staticmethod
    def _fan_tooltip(n: dict, rows: list[dict]) -> str:
        if n["parent"] is None:
            return f"prompt: {n['text']}"
        name = lambda i: rows[i]["name"] if i < len(rows) else f"row {i}"  # noqa: E731
        lines = [f"token {n['step'] + 1}: {n['text']!r} (id {n['token_id']})"]
        lines += [f"{name(i)}: p = {p:.4f}" for i, p in zip(n["rows"], n["probs"])]
        if n["parts"]:
            lines.append("first token off greedy's path for " + ", ".join(name(i) for i in n["parts"]))
        return "\n".join(lines)
