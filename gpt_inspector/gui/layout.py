"""The window's docks: the default arrangement, its fit to the screen, extra panels, saved layouts.

Qt's dock machinery has sharp edges (stray tab bars after tabifying, room handed to the outer docks
on resize); this mixin keeps those work-arounds out of the window's logic.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSize, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QDockWidget, QScrollArea, QTabBar, QWidget

from . import settings as _settings

STATE_VERSION = 4  # bump when the default dock layout changes, so old saved layouts are ignored
# The first window takes this share of the screen's free area (a laptop's 1366x768 included),
# never more than MAX_SIZE (on a 4K screen a full-size window spreads the panels too thin)
SCREEN_SHARE = 0.9
SMALL_SCREEN_HEIGHT = 900  # below this every pixel counts: the first window takes the whole free area
MAX_SIZE = (2200, 1350)
# Below these a panel stops being readable; a dock never gets less (Qt keeps the window
# at least as large as the sum, so the whole set still fits a 1366x768 screen).
PANEL_MIN = {
    "session": (260, 0), "breakpoints": (220, 0), "tokens": (200, 0), "scores": (300, 240),
    "overview": (200, 120), "next": (200, 130), "mask": (200, 130), "softmax": (180, 110),
    "qkv": (180, 110), "kv": (180, 110),
}  # fmt: skip


def screen_share(avail_height: int) -> float:
    return 1.0 if avail_height < SMALL_SCREEN_HEIGHT else SCREEN_SHARE


AREAS = {
    "left": Qt.DockWidgetArea.LeftDockWidgetArea,
    "right": Qt.DockWidgetArea.RightDockWidgetArea,
    "top": Qt.DockWidgetArea.TopDockWidgetArea,
    "bottom": Qt.DockWidgetArea.BottomDockWidgetArea,
}


class DockLayout:
    """The docking half of ``MainWindow`` (a QMainWindow with ``docks`` and ``_auto_fit``)."""

    def _dock(self, title: str, name: str, widget: QWidget) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(name)
        d.setWidget(widget)
        # a tab brought to the front is not a show event (see deferred.on_screen): say so
        d.visibilityChanged.connect(lambda shown, d=d: self.panel_revealed.emit(getattr(d, "panel", d.widget())) if shown else None)
        d.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                      | QDockWidget.DockWidgetFeature.DockWidgetClosable)  # fmt: skip
        return d

    def _build_docks(self) -> None:
        D = self._dock
        self.docks = {
            "session": D("Session", "dock_session", self.session_panel),
            "breakpoints": D("Breakpoints", "dock_breakpoints", self.breakpoints_panel),
            "tokens": D("Tokens", "dock_tokens", self.token_strip),
            "scores": D("Score matrix", "dock_scores", self.score_matrix),
            "overview": D("Overview (layers × heads)", "dock_overview", self.overview),
            "next": D("Next token", "dock_next", self.next_token),
            "mask": D("Mask edits", "dock_mask", self.mask_editor),
            "softmax": D("Softmax rows", "dock_softmax", self.softmax_rows),
            "qkv": D("Q / K / V", "dock_qkv", self.qkv),
            "kv": D("KV cache", "dock_kv", self.kv_cache),
        }
        # The docks fill the window; a hidden central widget lets them take all the space.
        central = QWidget()
        central.setMaximumSize(0, 0)
        self.setCentralWidget(central)
        central.hide()
        d = self.docks
        A = Qt.DockWidgetArea
        # Session runs the full height on the left; tokens (top) and the detail row (bottom)
        # span everything to its right; score matrix and overview share the middle.
        self.setCorner(Qt.Corner.TopLeftCorner, A.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomLeftCorner, A.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.TopRightCorner, A.TopDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, A.BottomDockWidgetArea)
        self.addDockWidget(A.LeftDockWidgetArea, d["session"])
        self.splitDockWidget(d["session"], d["breakpoints"], Qt.Orientation.Vertical)
        self.addDockWidget(A.TopDockWidgetArea, d["tokens"])
        self.addDockWidget(A.RightDockWidgetArea, d["scores"])
        self.splitDockWidget(d["scores"], d["overview"], Qt.Orientation.Horizontal)
        self.splitDockWidget(d["overview"], d["next"], Qt.Orientation.Vertical)
        self.tabifyDockWidget(d["next"], d["mask"])
        d["next"].raise_()
        self.addDockWidget(A.BottomDockWidgetArea, d["softmax"])
        self.splitDockWidget(d["softmax"], d["qkv"], Qt.Orientation.Horizontal)
        self.splitDockWidget(d["qkv"], d["kv"], Qt.Orientation.Horizontal)
        for key, (mw, mh) in PANEL_MIN.items():
            w = d[key].widget()
            # an explicit minimum replaces the layout's own hint, so keep whichever the widget had
            hint = w.minimumSizeHint()
            w.setMinimumSize(max(mw, w.minimumWidth() or hint.width()), max(mh, w.minimumHeight() or hint.height()))
        self.fit_docks()  # before panels are tabified: resizing after leaves a stray tab bar
        # the layout follows the window's size until the user moves a dock or a separator
        self._auto_fit = True

    def first_size(self) -> tuple[int, int]:
        """The size of a first window: a share of the screen's free area, capped."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return 1600, 1000
        avail = screen.availableGeometry()
        share = screen_share(avail.height())
        return (min(int(avail.width() * share), MAX_SIZE[0]),
                min(int(avail.height() * share), MAX_SIZE[1]))  # fmt: skip

    def _user_arranged(self, *_args) -> None:
        self._auto_fit = False

    def mousePressEvent(self, ev) -> None:
        # presses that reach the window itself land on the separators between docks: a resize by hand
        self._auto_fit = False
        super().mousePressEvent(ev)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        if self._auto_fit:
            # else Qt hands the new room to the outer docks: a wide Session panel, a tall token strip.
            # After this event, not in it: resizing docks inside it leaves a tab bar where it was.
            QTimer.singleShot(0, self._refit)

    def _refit(self) -> None:
        if self._auto_fit:
            self.fit_docks()
        QTimer.singleShot(0, self._hide_stale_tab_bars)

    def _hide_stale_tab_bars(self) -> None:
        """Hide tab bars that belong to no dock group any more.

        Tabifying a panel onto a dock before the window is shown leaves Qt with two tab bars
        for that group; the stale one stays where the group was and covers another panel.
        A live tab bar sits right under the dock whose tab is current.
        """
        docks = [d for d in self.docks.values() if d.isVisible() and not d.isFloating()]
        for bar in self.findChildren(QTabBar):
            if bar.parent() is not self or not bar.isVisible() or bar.count() == 0:
                continue
            g = bar.geometry()
            title = bar.tabText(bar.currentIndex())
            if not any(d.windowTitle() == title and abs(d.geometry().bottom() + 1 - g.top()) <= 6
                       and abs(d.geometry().left() - g.left()) <= 6 for d in docks):  # fmt: skip
                bar.hide()

    def fit_docks(self, size: QSize | None = None) -> None:
        """Share ``size`` (default: the window's) out among the docks in the default proportions."""
        size = size or self.size()
        W, H = size.width(), size.height()
        d = self.docks
        side = min(max(int(W * 0.19), PANEL_MIN["session"][0]), 340)
        rest = W - side
        Hz, Vt = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        self.resizeDocks([d["session"], d["scores"], d["overview"]], [side, int(rest * 0.57), int(rest * 0.43)], Hz)
        self.resizeDocks([d["softmax"], d["qkv"], d["kv"]], [int(rest * 0.3), int(rest * 0.3), int(rest * 0.4)], Hz)
        body = H - 110  # menu, toolbar, status bar, separators
        tokens = 46  # two lines of chips; more lines scroll
        middle = int((body - tokens) * 0.6)
        self.resizeDocks([d["tokens"], d["scores"], d["softmax"]], [tokens, middle, body - tokens - middle], Vt)
        self.resizeDocks([d["overview"], d["next"]], [int(middle * 0.45), int(middle * 0.55)], Vt)
        self.resizeDocks([d["session"], d["breakpoints"]], [int(H * 0.62), int(H * 0.3)], Vt)

    def add_panel(self, title: str, widget: QWidget, area=Qt.DockWidgetArea.RightDockWidgetArea) -> QDockWidget:
        """Dock another panel, tabbed with the built-in panels of ``area``; its layout persists.

        ``area`` may also name a built-in dock ("qkv", ...) to tab the panel with that one.
        The widget sits in a scroll area, so a wide toolbar scrolls instead of widening the window.
        """
        beside = self.docks.get(area) if isinstance(area, str) else None
        if beside is not None:
            area = self.dockWidgetArea(beside)
        elif isinstance(area, str):
            area = AREAS.get(area, Qt.DockWidgetArea.RightDockWidgetArea)
        key = "panel_" + "".join(c if c.isalnum() else "_" for c in title.lower())
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setWidget(widget)
        d = self._dock(title, key, scroll)
        d.panel = widget
        self.addDockWidget(area, d)
        anchor_name = {Qt.DockWidgetArea.RightDockWidgetArea: "mask", Qt.DockWidgetArea.BottomDockWidgetArea: "kv",
                       Qt.DockWidgetArea.LeftDockWidgetArea: "breakpoints", Qt.DockWidgetArea.TopDockWidgetArea: "tokens"}[area]  # fmt: skip
        anchor = beside or self.docks[anchor_name]
        self.tabifyDockWidget(anchor, d)
        (self.docks["next"] if anchor is self.docks["mask"] else anchor).raise_()  # built-in panels stay in front
        self.docks[key] = d
        if hasattr(self, "view_menu"):
            self.view_menu.insertAction(self.acts.reset_layout, d.toggleViewAction())
        if self.snapshot is not None and hasattr(widget, "set_snapshot"):
            widget.set_snapshot(self.snapshot)
        return d

    def restore_layout(self) -> None:
        st = _settings.settings()
        geo, state = st.value("window/geometry"), st.value("window/state")
        if isinstance(geo, QByteArray) and not geo.isEmpty():
            self.restoreGeometry(geo)
        if isinstance(state, QByteArray) and not state.isEmpty():
            if self.restoreState(state, STATE_VERSION):
                self._auto_fit = False

    def save_layout(self) -> None:
        st = _settings.settings()
        st.setValue("window/geometry", self.saveGeometry())
        st.setValue("window/state", self.saveState(STATE_VERSION))
        st.sync()

    def reset_layout(self) -> None:
        for d in self.docks.values():
            d.setFloating(False)
            d.show()
        self.restoreState(self._default_state, STATE_VERSION)
        self._auto_fit = True
        self.fit_docks()
