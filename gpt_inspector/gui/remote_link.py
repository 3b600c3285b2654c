"""The window driving a remote engine (``gpt-inspector --connect URL``): its link, watched and re-made.

``RemoteLink`` lives on the worker thread beside the session it watches: a timer looks at the link
every ``WATCH_MS`` (the client's pings close a stalled one within seconds), a command that meets a
dropped link is not an error dialog but the same "link lost", and while it is down the timer tries
to reconnect; once back, the session is the engine's (it kept it) and the views are rebuilt from it.
Until then the window keeps showing what it showed. ``install_banner`` is the window's half: a band
across the top and a status-bar field that say so.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QToolBar

from ..remote.client import LinkLost, RemoteRefused

WATCH_MS = 500  # how often the worker looks at the link, and tries again while it is down
RETRY_S = 0.5  # how long one reconnect attempt may retry a refused connection
OPEN_S = 2.0  # and wait for a handshake (the worker waits meanwhile: commands queue behind it)


class RemoteLink:
    """The worker's side (see the module docstring); every method runs on the worker thread."""

    def __init__(self, worker):
        self.w = worker
        self.obj = None  # the RemoteSession of the live run, when it is one
        self.down = False
        self._timer: QTimer | None = None

    def attach(self, obj) -> None:
        """``obj`` (a RemoteSession) is shown: watch its link."""
        if obj is self.obj:
            return
        self.obj, self.down = obj, False
        if self._timer is None:  # made here, on the worker thread, so that it fires there
            self._timer = QTimer()
            self._timer.setInterval(WATCH_MS)
            self._timer.timeout.connect(self._tick)
            self._timer.start()
        self.w.link.emit(True, f"connected to the engine at {obj.where}")

    def shutdown(self) -> None:
        """The worker thread ends: stop watching (a timer must be stopped on the thread it runs on)."""
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def lost(self, error: BaseException) -> bool:
        """True (and the window told, once) when ``error`` is the link dropping."""
        if not isinstance(error, LinkLost):
            return False
        self._down(str(error))
        return True

    def _down(self, why: str) -> None:
        if not self.down:
            self.down = True
            self.w.link.emit(False, why)

    def _tick(self) -> None:
        obj, live = self.obj, self.w.runs.live
        if obj is None or live is None or live.obj is not obj:
            return
        if not self.down:
            if not obj.link_alive:  # dropped while idle: say so now, not at the next key press
                self._down(f"lost the link to the engine at {obj.where}")
            return
        try:
            obj.reconnect(timeout=RETRY_S, open_timeout=OPEN_S)
        except (LinkLost, RemoteRefused):  # not back yet, or its old link not yet given up by the engine
            return
        self.down = False
        live.vm = None  # the engine's session may be a step further than what was shown: build anew
        if self.w.runs.shown is live:
            self.w._switch(live)
        self.w.link.emit(True, f"reconnected to the engine at {obj.where}: the session is as the engine kept it")

    def new_session(self, obj, spec, keep_edits: bool):
        """Open a new session from the controls' ``spec`` on the engine; ``obj`` stays the live source."""
        if getattr(spec, "chat", None) is not None:  # before anything changes on the engine
            from ..core.errors import InspectorError

            raise InspectorError("chat prompts are not sent to a remote engine yet: give the engine a plain prompt")
        edits = list(obj.mask_edits) if keep_edits else []
        obj.open(spec.prompt, spec.temperature, spec.top_k, spec.top_p, spec.seed, **(spec.settings or {}))
        if edits:
            obj.set_mask_edits(edits)
        return obj


def install_banner(win) -> None:
    """The window's half: a band across the top while the link is down, and a status-bar field
    naming the engine and whether the link is up."""
    from PySide6.QtCore import Qt

    from .views.common import ElidedLabel

    bar = QToolBar("Engine link", win, objectName="link_bar", movable=False)
    bar.toggleViewAction().setVisible(False)
    label = ElidedLabel("", objectName="link_banner",
                        styleSheet="background: #9a6700; color: white; font-weight: bold; padding: 3px 8px;")  # fmt: skip
    bar.addWidget(label)
    win.addToolBarBreak(Qt.ToolBarArea.TopToolBarArea)
    win.addToolBar(Qt.ToolBarArea.TopToolBarArea, bar)
    bar.hide()
    field = QLabel("", objectName="link_status", visible=False)
    win.statusBar().addPermanentWidget(field)

    def changed(up: bool, text: str) -> None:
        field.setVisible(True)
        if up:
            bar.hide()
            field.setText("engine: connected")
            field.setStyleSheet("")
            win.statusBar().showMessage(text[0].upper() + text[1:], 15000)
        else:
            label.setText(f"LINK LOST: {text}. Reconnecting…; the window keeps what it showed")
            label.setToolTip(text)
            bar.show()
            field.setText("engine: LINK LOST")
            field.setStyleSheet("color: #ff7b72; font-weight: bold;")
            win.statusBar().showMessage(f"Link lost: {text}", 15000)

    win.controller.link_changed.connect(changed)
    win.link_bar, win.link_label, win.st_link = bar, label, field

    def shown(snap) -> None:
        if snap.engine is None:
            field.setVisible(False)

    win.snapshot_changed.connect(shown)
