"""The window's docks: the workspaces (named arrangements), their fit to the screen, extra panels, saved layouts.

Qt's dock machinery has sharp edges (stray tab bars after tabifying, room handed to the outer docks
on resize); this mixin keeps those work-arounds out of the window's logic.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QByteArray, QEvent, QSize, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QDockWidget, QScrollArea, QStyle, QTabBar, QWidget

from . import settings as _settings

STATE_VERSION = 6  # bump when the default dock layout changes, so old saved layouts are ignored
# The first window takes this share of the screen's free area, never more than MAX_SIZE (on a 4K
# screen a full-size window spreads the panels too thin)
SCREEN_SHARE = 0.9
SMALL_SCREEN_HEIGHT = 900  # below this every pixel counts: the first window takes the whole free area
MAX_SIZE = (2200, 1350)
# Until the window is shown nobody knows the window manager's title bar; the first size leaves this
# much room for it, and fit_to_screen() corrects it once the real frame is known.
FRAME_GUESS = (0, 32)
# Below these a panel stops being readable; a dock never gets less (Qt keeps the window at least
# as large as the sum, so the whole set must fit a 1366x768 screen with a title bar and a taskbar).
PANEL_MIN = {
    "session": (260, 0), "breakpoints": (220, 0), "tokens": (200, 0), "scores": (300, 240),
    "overview": (200, 100), "next": (200, 135), "mask": (200, 130), "softmax": (180, 150),
    "qkv": (220, 205), "kv": (330, 195),
}  # fmt: skip
SETTINGS_KEY = "window/workspace"


def screen_share(avail_height: int) -> float:
    return 1.0 if avail_height < SMALL_SCREEN_HEIGHT else SCREEN_SHARE


AREAS = {
    "left": Qt.DockWidgetArea.LeftDockWidgetArea,
    "right": Qt.DockWidgetArea.RightDockWidgetArea,
    "top": Qt.DockWidgetArea.TopDockWidgetArea,
    "bottom": Qt.DockWidgetArea.BottomDockWidgetArea,
}
# the extra panels' docks by a short name (add_panel names a dock "panel_" + its title)
ALIASES = {"compare": "panel_compare_decoding", "probe": "panel_cache_probe", "math": "panel_math_check",
           "lens": "panel_logit_lens", "lab": "panel_kv_cache_lab", "interventions": "panel_interventions",
           "assisted": "panel_assisted"}  # fmt: skip


@dataclass(frozen=True)
class Workspace:
    """A named arrangement of the docks around one main panel.

    Session and Breakpoints always run down the left, Tokens across the top. ``main`` is the big
    slot under the tokens; ``side`` the column right of it, top down; ``bottom`` the row under both,
    left to right. Each group is tabbed, its first dock in front; a dock named nowhere joins the
    last bottom group.
    """

    # Every group's minimum height adds up down a column: on a 1366x768 screen the side column
    # holds two small groups at most, and the bottom row no dock taller than the score matrix.
    # A group's tabs must fit its width there too (a bottom group is ~300 px): whole titles, no scrolling.
    # Off the main slot the score matrix takes the widest bottom group: narrower, its buttons wrap onto
    # three or four rows and leave the matrix a strip.
    name: str
    shortcut: str
    tip: str
    main: tuple[str, ...]
    side: tuple[tuple[str, ...], ...]
    bottom: tuple[tuple[str, ...], ...]
    main_share: float = 0.57  # of the width right of the Session panel
    side_shares: tuple[float, ...] = (0.45, 0.55)
    bottom_shares: tuple[float, ...] = (0.3, 0.3, 0.4)


WORKSPACES = {w.name: w for w in (
    # what the window opens with: the score matrix in the middle (the construction in _build_docks)
    Workspace("Attention", "Alt+1", "The score matrix, the heads' overview, next token, softmax rows, Q/K/V and the KV cache",
              ("scores",), (("overview", "assisted"), ("next", "mask", "probe", "math")),
              (("softmax", "interventions"), ("qkv", "lab"), ("kv", "compare", "lens")), side_shares=(0.4, 0.6)),
    Workspace("Cache", "Alt+2", "The KV cache large, Q/K/V beside it; the cache probe and the math check a tab away",
              ("kv", "interventions", "assisted"), (("qkv", "probe", "math", "lens"),),
              (("next", "mask", "softmax"), ("overview", "lab"), ("scores", "compare")), 0.55),
    Workspace("Lens", "Alt+3", "The logit lens large, the heads' overview and next token beside it",
              ("lens", "compare", "interventions"), (("overview", "assisted"), ("next", "mask")),
              (("softmax", "math"), ("qkv", "lab"), ("scores", "probe", "kv")), 0.6),
    Workspace("Lab", "Alt+4", "The KV cache lab large, the KV cache beside it to show what the policy evicted",
              ("lab", "math", "lens", "overview"), (("kv", "probe", "interventions"),),
              (("qkv", "softmax"), ("next", "mask", "assisted"), ("scores", "compare")), 0.55),
    Workspace("Compare", "Alt+5", "Compare decoding large, next token and the heads' overview beside it",
              ("compare", "assisted"), (("next", "mask"), ("overview", "interventions")),
              (("softmax", "qkv", "lab"), ("kv", "lens", "math"), ("scores", "probe")), 0.6, (0.6, 0.4)),
)}  # fmt: skip
DEFAULT_WORKSPACE = "Attention"


def scrolled(widget: QWidget) -> QScrollArea:
    """``widget`` in a frameless scroll area: a panel taller or wider than its dock scrolls instead of
    raising the window's minimum size past the screen."""
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QScrollArea.Shape.NoFrame)
    scroll.setWidget(widget)
    return scroll


class DockLayout:
    """The docking half of ``MainWindow`` (a QMainWindow with ``docks`` and ``_auto_fit``)."""

    workspace = DEFAULT_WORKSPACE  # the arrangement shown (the last one chosen, before any hand-made change)
    _arranging = False

    def _dock(self, title: str, name: str, widget: QWidget) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(name)
        d.setWidget(widget)
        # a tab brought to the front is not a show event (see deferred.on_screen): say so
        d.visibilityChanged.connect(
            lambda shown, d=d: self.panel_revealed.emit(getattr(d, "panel", d.widget())) if shown else None
        )
        # a panel switched on from the View menu comes to the front: reopened into a tab group, it stayed behind
        d.toggleViewAction().triggered.connect(lambda on, d=d: d.raise_() if on else None)
        d.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                      | QDockWidget.DockWidgetFeature.DockWidgetClosable)  # fmt: skip
        return d

    def _build_docks(self) -> None:
        D = self._dock
        self.docks = {
            "session": D("Session", "dock_session", scrolled(self.session_panel)),
            "breakpoints": D("Breakpoints", "dock_breakpoints", self.breakpoints_panel),
            "tokens": D("Tokens", "dock_tokens", self.token_strip),
            "scores": D("Score matrix", "dock_scores", self.score_matrix),
            "overview": D("Overview (layers × heads)", "dock_overview", self.overview),
            "next": D("Next token", "dock_next", self.next_token),
            "mask": D("Mask edits", "dock_mask", scrolled(self.mask_editor)),
            "softmax": D("Softmax rows", "dock_softmax", self.softmax_rows),
            "qkv": D("Q / K / V", "dock_qkv", self.qkv),
            "kv": D("KV cache", "dock_kv", self.kv_cache),
        }
        # forms taller than a laptop's dock scroll: their full height made the window taller than the screen
        self.docks["session"].panel, self.docks["mask"].panel = self.session_panel, self.mask_editor
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
            if isinstance(w, QScrollArea):
                # never narrower than the panel inside: a sideways scroll bar would hide half a form
                bar = w.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent)
                mw = max(mw, w.widget().minimumSizeHint().width() + bar)
            # an explicit minimum replaces the layout's own hint, so keep whichever the widget had
            hint = w.minimumSizeHint()
            w.setMinimumSize(max(mw, w.minimumWidth() or hint.width()), max(mh, w.minimumHeight() or hint.height()))
        self.fit_docks()  # before panels are tabified: resizing after leaves a stray tab bar
        # the layout follows the window's size until the user moves a dock or a separator
        self._auto_fit = True

    def first_size(self) -> tuple[int, int]:
        """The size of a first window: a share of the screen's free area, capped, with room for a title bar."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return 1600, 1000
        avail = screen.availableGeometry()
        share = screen_share(avail.height())
        return (min(int(avail.width() * share), MAX_SIZE[0], avail.width() - FRAME_GUESS[0]),
                min(int(avail.height() * share), MAX_SIZE[1], avail.height() - FRAME_GUESS[1]))  # fmt: skip

    def fit_to_screen(self) -> None:
        """Move and shrink a normal (not maximised) window so that all of it, frame included, is on its
        screen's free area: the window manager's title bar is outside the size the window asked for."""
        if not self.isVisible() or self.windowState() & (
            Qt.WindowState.WindowMaximized | Qt.WindowState.WindowFullScreen
        ):
            return
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        avail, frame = screen.availableGeometry(), self.frameGeometry()
        extra_w, extra_h = frame.width() - self.width(), frame.height() - self.height()
        w, h = min(self.width(), avail.width() - extra_w), min(self.height(), avail.height() - extra_h)
        if (w, h) != (self.width(), self.height()):
            self.resize(w, h)
            w, h = self.width(), self.height()  # never below the docks' minimum (the window's own)
        x = min(max(frame.x(), avail.left()), avail.left() + avail.width() - w - extra_w)
        y = min(max(frame.y(), avail.top()), avail.top() + avail.height() - h - extra_h)
        if (x, y) != (frame.x(), frame.y()):
            self.move(max(x, avail.left()), max(y, avail.top()))

    def _fit_to_screen_soon(self) -> None:
        # X11 window managers report the frame a little after the window is mapped
        for ms in (0, 150, 600):
            QTimer.singleShot(ms, self.fit_to_screen)

    def event(self, ev) -> bool:
        if ev.type() in (QEvent.Type.ChildAdded, QEvent.Type.ChildPolished) and isinstance(ev.child(), QTabBar):
            # Qt makes a dock group's tab bar eliding after it is added here: whole titles are set when it shows.
            # ChildPolished too: at ChildAdded a bar under construction is still a plain QWidget, and was missed
            ev.child().installEventFilter(self)
        return super().event(ev)

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 (Qt)
        if ev.type() == QEvent.Type.Show and isinstance(obj, QTabBar):
            # Qt elides dock tabs ("Ne…", "Ma…") once a group is narrow; whole titles scroll instead
            obj.setElideMode(Qt.TextElideMode.ElideNone)
            obj.setUsesScrollButtons(True)
        return super().eventFilter(obj, ev)

    def _user_arranged(self, *_args) -> None:
        if not self._arranging:
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
        """Hide tab bars that belong to no dock group any more; never elide a tab's title.

        Tabifying a panel onto a dock before the window is shown leaves Qt with two tab bars
        for that group; the stale one stays where the group was and covers another panel.
        A live tab bar sits right under the dock whose tab is current.
        """
        docks = [d for d in self.docks.values() if d.isVisible() and not d.isFloating()]
        for bar in self.findChildren(QTabBar):
            if bar.parent() is not self:
                continue
            bar.setElideMode(Qt.TextElideMode.ElideNone)  # as eventFilter does for the bars shown later
            bar.setUsesScrollButtons(True)
            if not bar.isVisible() or bar.count() == 0:
                continue
            g = bar.geometry()
            title = bar.tabText(bar.currentIndex())
            if not any(d.windowTitle() == title and abs(d.geometry().bottom() + 1 - g.top()) <= 6
                       and abs(d.geometry().left() - g.left()) <= 6 for d in docks):  # fmt: skip
                bar.hide()

    def _workspace_docks(self, ws: Workspace):
        """``ws``'s groups as docks: (main, side groups, bottom groups), every dock placed once."""
        placed: set[str] = set()

        def group(keys) -> list[QDockWidget]:
            out = []
            for k in keys:
                k = ALIASES.get(k, k)
                if k in self.docks and k not in placed:
                    placed.add(k)
                    out.append(self.docks[k])
            return out

        placed.update(("session", "breakpoints", "tokens"))
        main = group(ws.main)
        side = [g for g in (group(keys) for keys in ws.side) if g]
        bottom = [g for g in (group(keys) for keys in ws.bottom) if g]
        rest = [d for k, d in self.docks.items() if k not in placed]
        if rest:
            bottom[-1].extend(rest)
        return main, side, bottom

    def fit_docks(self, size: QSize | None = None) -> None:
        """Share ``size`` (default: the window's) out among the docks in the workspace's proportions."""
        size = size or self.size()
        W, H = size.width(), size.height()
        d = self.docks
        ws = WORKSPACES[self.workspace]
        main, side, bottom = self._workspace_docks(ws)
        side_w = min(max(int(W * 0.19), d["session"].minimumWidth(), PANEL_MIN["session"][0]), 340)
        rest = W - side_w
        Hz, Vt = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        self.resizeDocks(
            [d["session"], main[0], side[0][0]],
            [side_w, int(rest * ws.main_share), int(rest * (1 - ws.main_share))],
            Hz,
        )
        shares = ws.bottom_shares[: len(bottom)]
        self.resizeDocks([g[0] for g in bottom], [int(rest * s / sum(shares)) for s in shares], Hz)
        body = H - 85  # menu, toolbar, status bar, separators
        tokens = 46  # two lines of chips; more lines scroll
        # the detail row keeps room for its plots on a laptop screen; on larger ones it has 40 %
        low = max(int((body - tokens) * 0.4), min(290, int((body - tokens) * 0.46)))
        middle = body - tokens - low
        self.resizeDocks([d["tokens"], main[0], bottom[0][0]], [tokens, middle, low], Vt)
        if len(side) > 1:
            shares = ws.side_shares[: len(side)]
            self.resizeDocks([g[0] for g in side], [int(middle * s / sum(shares)) for s in shares], Vt)
        # the whole Session form where it fits (on a laptop that is nearly all the height), Breakpoints the rest
        left = H - 85
        chrome = d["session"].minimumSizeHint().height() - d["session"].widget().minimumSizeHint().height()
        form = chrome + self.session_panel.sizeHint().height()
        session_h = min(max(int(left * 0.66), form), left - d["breakpoints"].minimumSizeHint().height())
        self.resizeDocks([d["session"], d["breakpoints"]], [session_h, left - session_h], Vt)

    def apply_workspace(self, name: str) -> None:
        """Arrange every dock as the workspace ``name`` says (closed and floating ones come back) and remember it."""
        ws = WORKSPACES[name]
        A, Hz, Vt = Qt.DockWidgetArea, Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        d = self.docks
        self._arranging = True
        try:
            main, side, bottom = self._workspace_docks(ws)
            for dock in d.values():
                dock.setFloating(False)
                self.removeDockWidget(dock)
            self.addDockWidget(A.LeftDockWidgetArea, d["session"])
            self.splitDockWidget(d["session"], d["breakpoints"], Vt)
            self.addDockWidget(A.TopDockWidgetArea, d["tokens"])
            self.addDockWidget(A.RightDockWidgetArea, main[0])
            self.splitDockWidget(main[0], side[0][0], Hz)
            for above, below in zip(side, side[1:]):
                self.splitDockWidget(above[0], below[0], Vt)
            self.addDockWidget(A.BottomDockWidgetArea, bottom[0][0])
            for left, right in zip(bottom, bottom[1:]):
                self.splitDockWidget(left[0], right[0], Hz)
            for g in [main, *side, *bottom]:
                for other in g[1:]:
                    self.tabifyDockWidget(g[0], other)
            for dock in d.values():
                dock.show()
            for g in [main, *side, *bottom]:
                g[0].raise_()
            self.workspace = name
            self._auto_fit = True
            self.fit_docks()
        finally:
            self._arranging = False
        _settings.settings().setValue(SETTINGS_KEY, name)
        if hasattr(self, "acts"):
            self.acts.show_workspace(name)
        # once Qt has laid the new arrangement out: sizes given to docks it has not placed yet are lost
        QTimer.singleShot(0, self._refit)

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
        d = self._dock(title, key, scrolled(widget))
        d.panel = widget
        self.addDockWidget(area, d)
        anchor_name = {Qt.DockWidgetArea.RightDockWidgetArea: "mask", Qt.DockWidgetArea.BottomDockWidgetArea: "kv",
                       Qt.DockWidgetArea.LeftDockWidgetArea: "breakpoints", Qt.DockWidgetArea.TopDockWidgetArea: "tokens"}[area]  # fmt: skip
        anchor = beside or self.docks[anchor_name]
        self.tabifyDockWidget(anchor, d)
        (self.docks["next"] if anchor is self.docks["mask"] else anchor).raise_()  # built-in panels stay in front
        self.docks[key] = d
        if hasattr(self, "view_menu"):
            self.view_menu.insertAction(self.acts.panels_end, d.toggleViewAction())
        if self.snapshot is not None and hasattr(widget, "set_snapshot"):
            widget.set_snapshot(self.snapshot)
        return d

    def restore_layout(self) -> None:
        """The user's last window: its geometry, and its docks as they left them (else their last workspace)."""
        st = _settings.settings()
        geo, state = st.value("window/geometry"), st.value("window/state")
        name = st.value(SETTINGS_KEY)
        name = name if name in WORKSPACES else DEFAULT_WORKSPACE
        if isinstance(geo, QByteArray) and not geo.isEmpty():
            self.restoreGeometry(geo)
        if isinstance(state, QByteArray) and not state.isEmpty() and self.restoreState(state, STATE_VERSION):
            self._auto_fit = False
            self.workspace = name
            if hasattr(self, "acts"):
                self.acts.show_workspace(name)
        elif name != DEFAULT_WORKSPACE:
            self.apply_workspace(name)

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
        self.workspace = DEFAULT_WORKSPACE
        _settings.settings().setValue(SETTINGS_KEY, DEFAULT_WORKSPACE)
        if hasattr(self, "acts"):
            self.acts.show_workspace(DEFAULT_WORKSPACE)
        self._auto_fit = True
        self.fit_docks()
        QTimer.singleShot(0, self._refit)
