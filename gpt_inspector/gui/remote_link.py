"""The window driving a remote engine (``gpt-inspector --connect URL``): its link, watched and re-made.

``RemoteLink`` lives on the worker thread beside the session it watches: a timer looks at the link
every ``WATCH_MS`` (the client's pings close a stalled one within seconds), a command that meets a
dropped link is not an error dialog but the same "link lost", and while it is down the timer tries
to reconnect; once back, the session is the engine's (it kept it) and the views are rebuilt from it.
Until then the window keeps showing what it showed. One link is watched whatever is shown over it (the
live session, or a beam of the engine's comparison read over its link), and a panel's job that meets
the drop (a KV lab Run, a comparison) says so on the panel in words (``dropped_note``), not in a dialog:
the band says the rest. ``install_banner`` is the window's half: a band across the top and a
status-bar field that say so.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QToolBar

from ..remote.client import LinkLost, RemoteRefused
from ..remote.wire import BAD_TOKEN

WATCH_MS = 500  # how often the worker looks at the link, and tries again while it is down
RETRY_S = 0.5  # how long one reconnect attempt may retry a refused connection
OPEN_S = 2.0  # and wait for a handshake (the worker waits meanwhile: commands queue behind it)
# a restarted engine holds a fresh token (and none of the old session): the window's URL can never get in
# again, so the band says what to do instead of "Reconnecting…" for ever
RESTARTED = "no longer takes this window's token"
AUTOSAVE_MS = 1000  # a remote session's autosave waits this long after a change (its recipe is a request)


def same_session(obj, recipe: dict) -> bool:
    """Whether the engine's session (``obj``) is the one ``recipe`` makes, or that one stepped further."""
    if obj.n_steps == 0 and not obj.tokens:
        return False
    have = obj.recipe()
    ops = recipe["ops"]
    return (have["prompt_ids"], have["seed"], have.get("chat")) == (recipe["prompt_ids"], recipe["seed"],
                                                                   recipe.get("chat")) and have["ops"][: len(ops)] == ops  # fmt: skip


class RemoteLink:
    """The worker's side (see the module docstring); every method runs on the worker thread."""

    def __init__(self, worker):
        self.w = worker
        self.obj = None  # the RemoteSession of the live run, when it is one
        self.down = False
        self.gave_up = False  # the engine was restarted: its new token is not the window's
        self._timer: QTimer | None = None
        self._saved: object = None  # what the autosave file holds: (url, the session's change count)
        self._saving = False

    def attach(self, obj) -> None:
        """``obj`` (a RemoteSession, or a beam read over one) is shown: watch its link."""
        obj = obj.link  # a beam inspected over the link shares its session's: one link, watched once
        if obj is self.obj:
            return
        self.obj, self.down, self.gave_up = obj, False, False
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
            # dropped while idle (the live session or a beam read over its link shown): say so now, not at
            # the next read; a panel's job that met the drop (KV lab, Compare) closed the link, and is said here
            if not obj.link_alive:
                self._down(f"lost the link to the engine at {obj.where}")
            return
        if self.gave_up:
            return
        was = (list(obj.prompt_ids), obj.seed)
        try:
            obj.reconnect(timeout=RETRY_S, open_timeout=OPEN_S)
        except LinkLost:  # not back yet
            return
        except RemoteRefused as e:  # its old link not yet given up by the engine, or another engine there now
            if BAD_TOKEN in str(e):
                self.gave_up = True
                self.w.link.emit(False, f"the engine at {obj.where} was restarted: connect to the line it printed "
                                        f"(gpt-inspector --connect URL); it {RESTARTED}, and the session it held "
                                        "is gone (serve saved its recipe when it stopped)")  # fmt: skip
            return
        self.down = False
        # the engine's session may be a step further than what was shown: its views are built anew; the
        # same session (its prompt and seed) keeps its source id, so the panels keep their lab and comparison
        same = was == (list(obj.prompt_ids), obj.seed)
        shown = self.w.runs.shown
        for run in self.w.runs.items:
            if run.obj.engine is not None and run.obj.link is obj:
                self._rebuild(run, keep_id=same or run is not live)  # a beam is as the search made it
        if shown is not None and shown.obj.engine is not None and shown.obj.link is obj:
            self.w._switch(shown)
        self.w.link.emit(True, f"reconnected to the engine at {obj.where}: the session is as the engine kept it")

    @staticmethod
    def _rebuild(run, keep_id: bool) -> None:
        """A fresh view model of ``run`` (the reconnect dropped what watched the old one); with ``keep_id``
        it is the same source as far as the window's panels are concerned."""
        from .viewdata import ViewModel

        old, run.vm = run.vm, ViewModel(run.obj)
        if keep_id and old is not None:
            run.vm.source_id = old.source_id

    def detach(self, old) -> None:
        """``old`` (a live session that another replaced: Load, a restore) is gone: close its engine's link,
        if it had one; the engine keeps its session for a later ``--connect``."""
        if old.engine is None:
            return
        old.close()
        if self.obj is old:  # nothing else on an engine is shown: the banner and the status bar stop naming one
            self.obj, self.down = None, False
            self.w.link.emit(True, "")

    # -- autosave: the engine keeps the session; this window's file keeps the way back to it --------------
    def autosave(self, obj) -> None:
        """Write (soon, once the worker is idle) the engine's URL and the session's recipe, when it changed."""
        key = (obj.url, obj.changes)
        if key != self._saved and not self._saving:
            self._saving = True
            QTimer.singleShot(AUTOSAVE_MS, self._write)  # on the worker thread: after a run, not at each step

    def _write(self) -> None:
        from ..core.errors import InspectorError
        from . import autosave

        self._saving = False
        live = self.w.runs.live
        obj = None if live is None else live.obj
        if not self.w.autosave or obj is None or obj.engine is None or self.down or obj.n_steps == 0:
            return
        key = (obj.url, obj.changes)
        try:
            recipe = obj.recipe()
        except (LinkLost, InspectorError):  # tried again at the next change
            return
        # the whole URL, token included, so a restart can reconnect: the file is the user's alone (0600);
        # every message names the engine by ``where``, never by the URL
        recipe["remote"] = {"url": obj.url, "engine": obj.where, "model": obj.model_name}
        try:
            autosave.write(recipe, self.w.autosave_owner)
            self._saved = key
        except InspectorError as e:
            if self._saved != "failed":
                self._saved = "failed"
                self.w.error.emit("Autosave failed", str(e), "user")

    def restore(self, recipe: dict) -> None:
        """Back to an autosaved remote session: reconnect to its engine and take the session it kept, or
        rebuild it there from the recipe (the engine restarted, or holds another session)."""
        from ..core.errors import InspectorError
        from ..remote.client import RemoteSession
        from . import autosave

        info = recipe["remote"]
        live = self.w.runs.live
        obj = None if live is None or live.obj.engine is None or live.obj.url != info["url"] else live.obj
        if obj is None:
            self.w.busy.emit(f"Reconnecting to the engine at {info['engine']}…")
            try:
                obj = RemoteSession(info["url"])
            except (LinkLost, RemoteRefused) as e:
                # the file stays for a start with the engine's new URL, which offers to rebuild it there
                autosave.release(self.w.autosave_owner)
                self.w.autosave_owner = autosave.new_owner()
                raise InspectorError(f"{e}. If the engine was restarted, open gpt-inspector --connect with the URL it "
                                     "printed: the window then offers to rebuild this session there") from None  # fmt: skip
        mine = {k: v for k, v in recipe.items() if k != "remote"}
        if not same_session(obj, mine):
            self.w.busy.emit(f"Rebuilding the session on the engine at {obj.where} from the autosaved recipe…")
            obj.replay(mine)
            self.w.notice.emit(f"Rebuilt the last session on the engine at {obj.where} from its autosaved recipe")
        self.w._show(obj)

    def new_session(self, obj, spec, keep_edits: bool):
        """Open a new session from the controls' ``spec`` on the engine; ``obj`` stays the live source."""
        edits = list(obj.mask_edits) if keep_edits else []
        chat = spec.chat or {}  # a chat's turns: the engine applies its tokenizer's template
        obj.open("" if chat else spec.prompt, spec.temperature, spec.top_k, spec.top_p, spec.seed, **chat,
                 **(spec.settings or {}))  # fmt: skip
        if edits:
            obj.set_mask_edits(edits)
        return obj


def dropped_note(error: BaseException) -> str | None:
    """What a panel whose job met a dropped link says (the band across the window says the rest, and
    the window reconnects by itself): None when ``error`` is anything else, which the panel reports."""
    if not isinstance(error, LinkLost):
        return None
    return ("the link to the engine dropped before this came back: what is shown is kept; once the window has "
            "reconnected (the band above goes), run it again")  # fmt: skip


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
        if not text:  # the link was closed (a local model loaded): nothing names the engine any more
            bar.hide()
            field.setVisible(False)
            return
        field.setVisible(True)
        if up:
            bar.hide()
            field.setText("engine: connected")
            field.setStyleSheet("")
            win.statusBar().showMessage(text[0].upper() + text[1:], 15000)
        else:
            then = (
                "the window keeps what it showed"
                if RESTARTED in text
                else "Reconnecting…; the window keeps what it showed"
            )
            label.setText(f"LINK LOST: {text}. {then}")
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
            bar.hide()

    win.snapshot_changed.connect(shown)


def may_leave_engine(win) -> bool:
    """Before a local model replaces a remote engine's live session (Load): ask, if it holds work (steps or
    edits), as closing a live session asks; True to go on. The engine keeps its session either way."""
    from PySide6.QtWidgets import QMessageBox

    live = next((r for r in win.controller.run_infos if r.live), None)
    if live is None or live.engine is None or not live.work:
        return True
    answer = QMessageBox.question(
        win, "Leave the remote session?",
        f"Loading a model here closes the link to the engine at {live.engine}; this window then shows the "
        "local model's session instead of the remote one (its steps, mask edits and interventions).\n"
        "The engine keeps that session until it stops or another client opens one: gpt-inspector --connect "
        "takes it back. Save it first with File ▸ Save trace to keep a copy here.\n\nLoad and close the link?",
        QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, QMessageBox.StandardButton.Cancel,
    )  # fmt: skip
    if answer != QMessageBox.StandardButton.Yes:
        win.statusBar().showMessage("Kept the remote session", 8000)
        return False
    return True


def offer_rebuild(win, remote) -> dict | None:
    """``--connect URL`` with an autosaved session of a remote engine that this engine does not hold (it was
    restarted): ask whether to rebuild it there; the recipe to restore, or None."""
    from PySide6.QtWidgets import QMessageBox

    from . import autosave

    found = autosave.read_with_owner(None, remote=True)
    if found is None:
        return None
    recipe, owner = found
    mine = {k: v for k, v in recipe.items() if k != "remote"}
    if recipe.get("model") != remote.model_name:  # another model's session: not this engine's to rebuild
        autosave.release(owner)
        return None
    autosave.release(win.worker.autosave_owner)  # this window carries on in that file
    win.worker.autosave_owner = owner
    if same_session(remote, mine):  # the engine kept it (or went on from it): nothing to ask
        return None
    answer = QMessageBox.question(
        win, "Rebuild the last session on the engine?",
        f"The engine at {remote.where} does not hold your last session on it:\n\n{autosave.summary(recipe)}\n\n"
        "Rebuild it there from the autosaved recipe (it replaces the engine's current session)?",
        QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes,
    )  # fmt: skip
    if answer != QMessageBox.StandardButton.Yes:
        autosave.clear(owner)
        win.worker.autosave_owner = autosave.new_owner()
        return None
    return {**mine, "remote": {"url": remote.url, "engine": remote.where, "model": remote.model_name}}
