"""The debugger window: docks and their layout, the status bar, and the views fed from one controller.

What the debugger does lives in :class:`~.controller.Controller` (``window.controller``): the
selection, the snapshot shown, the commands posted to the worker thread. Menus, toolbar and
shortcuts are :class:`~.actions.WindowActions` (``window.acts``). This window only lays the
views out, turns their signals into controller calls and shows each new snapshot.
Exports build their figures on the worker thread too (``run_in_worker``).

Extension points for other panels (comparison, probes, math checks):
- ``add_panel(title, widget, area)`` docks a widget (its layout is saved like the others);
- ``snapshot_changed(Snapshot)`` after every update, ``selection_changed(layer, head, query)``;
- ``run_in_worker(fn, callback)`` runs ``fn(session_or_trace)`` on the worker thread and calls
  ``callback(result, error)`` back on the GUI thread;
- ``acts.tools_menu`` and ``acts.action(text, slot, shortcut, tip)`` for a panel's menu entries.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import shiboken6
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QProgressDialog,
    QSizePolicy,
    QToolBar,
    QWidget,
)

from . import remote_link
from . import settings as _settings
from .actions import RECENT_TRACES, WindowActions
from .commands import (
    CloseRun,
    ForceToken,
    Load,
    NewSession,
    OpenTrace,
    Restart,
    Restore,
    Run,
    Show,
    Step,
    StepBack,
    SwitchRun,
)
from .controller import Controller
from .controls import BreakpointsPanel, SessionPanel
from .deferred import DeferredViews
from .layout import MAX_SIZE, PANEL_MIN, STATE_VERSION, WORKSPACES, DockLayout, screen_share  # noqa: F401 (re-exported)
from .runs import RunSwitcher
from .viewdata import Snapshot
from .views import assisted, compare, interventions, kvlab, lens, mathcheck, probe
from .views.common import ElidedLabel
from .views.kv_cache import KVCacheView, human_bytes
from .views.mask_editor import MaskEditor
from .views.next_token import NextTokenView
from .views.overview import OverviewGrid
from .views.qkv import QKVView
from .views.score_matrix import ScoreMatrix
from .views.softmax_rows import SoftmaxRows
from .views.token_strip import TokenStrip
from .worker import ModelSpec, SessionSpec


def _controller_state(name: str) -> property:
    """A window attribute that reads the controller's (which owns the state)."""
    return property(lambda self: getattr(self.controller, name))


def _controller_call(name: str):
    """A window method that is the controller's; a plain function, so a test may replace it on the window."""

    def call(self, *args, **kwargs):
        return getattr(self.controller, name)(*args, **kwargs)

    call.__name__, call.__doc__ = name, getattr(Controller, name).__doc__
    return call


class MainWindow(DockLayout, QMainWindow):
    snapshot_changed = Signal(object)  # Snapshot, after every view showed it
    panel_revealed = Signal(object)  # a dock's widget, when its dock comes to the front (tab chosen, shown)
    selection_changed = Signal(int, int, int)  # layer, head, query (-1: follow the newest)
    loaded_message = ""  # the status bar's last "Loaded …" line

    def __init__(self, restore_layout: bool = True):
        super().__init__()
        self._auto_fit = False  # the docks do not exist yet
        self.setWindowTitle("gpt-inspector")
        self._first_size = self.first_size()
        self.resize(*self._first_size)
        self.setDockNestingEnabled(True)
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowTabbedDocks
                            | QMainWindow.DockOption.AllowNestedDocks)  # fmt: skip
        self.errors: list[tuple[str, str]] = []  # every error shown, newest last
        self.headless_errors = False  # print errors instead of dialogs (screenshot mode)
        self.persist_layout = True  # save the dock layout on close (not for screenshots)
        self.apply_log: list[tuple[float, float, float]] = []  # (model done, built, applied) per snapshot
        self._read_only_shown = False
        self._load_spec: ModelSpec | None = None
        self._focus_set = False
        self._shown_prompt: str | None = None
        self._shown_text = ""
        self._source_id = 0
        self._new_session = True  # the next source shown is a new session, not a run a panel put on show
        self.restore_dialog: QProgressDialog | None = None
        self._restore_serial: int | None = None

        self.controller = ctl = Controller(self)
        ctl.snapshot_changed.connect(self._apply)
        ctl.selection_changed.connect(self.selection_changed)
        ctl.error.connect(self.show_error)
        ctl.busy_text.connect(self._busy)
        ctl.progress.connect(self._progress)
        ctl.stopped.connect(self._run_stopped)
        ctl.posted.connect(self._posted)
        ctl.loaded.connect(self._loaded)
        ctl.done.connect(self._command_done)
        ctl.notice.connect(lambda text: self.statusBar().showMessage(text, 15000))
        ctl.session_shown.connect(self._session_shown)
        self._confirm: dict[int, tuple[str, int]] = {}  # serial -> (status line once it worked, errors before)

        self._build_views()
        self._build_docks()
        self.run_switcher = RunSwitcher(self)
        self.acts = WindowActions(self)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, self.run_switcher)  # beside the Debug toolbar
        self.tools_menu = self.acts.tools_menu
        self.view_menu = self.acts.view_menu
        self._build_status()
        remote_link.install_banner(self)  # says when the link to a remote engine is down
        # each panel module names its dock and builds its panel against this window, in this order
        self.compare_panel, self.probe_panel, self.mathcheck_panel, self.lens_panel, self.kvlab_panel = (
            self.add_panel(m.PANEL_TITLE, m.create_panel(self), m.PANEL_AREA).panel
            for m in (compare, probe, mathcheck, lens, kvlab)
        )
        self.interventions_panel = self.add_panel(interventions.PANEL_TITLE, interventions.create_panel(self),
                                                  interventions.PANEL_AREA).panel  # fmt: skip
        self.assisted_panel = self.add_panel(
            assisted.PANEL_TITLE, assisted.create_panel(self), assisted.PANEL_AREA
        ).panel
        self._default_state = self.saveState(STATE_VERSION)
        for d in self.docks.values():
            d.dockLocationChanged.connect(self._user_arranged)
            d.topLevelChanged.connect(self._user_arranged)
        if restore_layout:
            self.restore_layout()

    # ================================================================== construction
    def _build_views(self) -> None:
        self.session_panel = SessionPanel()
        self.breakpoints_panel = BreakpointsPanel()
        self.token_strip = TokenStrip()
        self.overview = OverviewGrid()
        self.score_matrix = ScoreMatrix()
        self.softmax_rows = SoftmaxRows()
        self.qkv = QKVView()
        self.kv_cache = KVCacheView()
        self.next_token = NextTokenView()
        self.mask_editor = MaskEditor()
        self.views = [self.token_strip, self.overview, self.score_matrix, self.softmax_rows, self.qkv,
                      self.kv_cache, self.next_token, self.mask_editor]  # fmt: skip

        sp, ctl = self.session_panel, self.controller
        sp.load_requested.connect(self.load_from_controls)
        sp.start_requested.connect(self.start_session)
        sp.chat_requested.connect(self.open_chat)
        sp.decoding_changed.connect(self._decoding_changed)
        sp.bad_input.connect(lambda text: self.show_error("Decoding", text, "user"))
        self.token_strip.position_clicked.connect(ctl.select_query)
        self.score_matrix.query_clicked.connect(ctl.select_query)
        self.score_matrix.kind_changed.connect(lambda k: ctl.select(kind=k))
        self.score_matrix.key_hovered.connect(lambda q, k: self.qkv.set_key(k) if k >= 0 else None)
        self.score_matrix.cells_edited.connect(ctl.edit_cells)
        self.score_matrix.view_changed.connect(ctl.select_view)
        self._deferred = DeferredViews(self, self.views)
        self.panel_revealed.connect(self._deferred.reveal)
        self.score_matrix.export_requested.connect(lambda: self.export_view())
        self.overview.head_clicked.connect(lambda l, h: ctl.select(layer=l, head=h))
        self.overview.export_requested.connect(
            lambda which: self.export_grid() if which is None else self.export_view(*which)
        )
        self.softmax_rows.head_clicked.connect(lambda h: ctl.select(head=h))
        self.kv_cache.layer_clicked.connect(lambda l: ctl.select(layer=l))
        self.kv_cache.export_requested.connect(self.export_kv)
        self.next_token.redecide_requested.connect(self.redecide)
        self.next_token.force_requested.connect(ctl.force_token)
        self.mask_editor.edits_replaced.connect(ctl.set_mask_edits)
        # single-key shortcuts ([, ], End, PgUp/PgDown) reach the window only while no text
        # field has the focus: the views take it when clicked, and the score matrix starts with it
        for v in (self.score_matrix, self.overview, self.token_strip):
            v.setFocusPolicy(Qt.FocusPolicy.StrongFocus)

    def _build_status(self) -> None:
        sb = self.statusBar()
        self.st_busy = ElidedLabel("")
        self.st_progress = QProgressBar(maximumWidth=180, maximumHeight=14, textVisible=False, visible=False)
        self.st_run = ElidedLabel("", objectName="run_name", toolTip="The run shown (View ▸ Runs switches)")
        self.st_step = QLabel("no model")
        self.st_device = QLabel("")
        self.st_positions = QLabel("")
        self.st_kv = QLabel("")
        self.st_time = QLabel("")
        # why the last run stopped stays until the next step or run (a toast was gone before it was read);
        # permanent, so that other messages do not hide it, and elided, so that it never widens the window
        self.st_stopped = ElidedLabel("", objectName="run_stopped", styleSheet="color: #ffb84f;")
        # the run's name and why it stopped (empty: none) take their text's width, up to a cap, never the rest: at
        # 1366 px two expanding labels left a message ("Loaded …") 296 px, cut in the middle of a word
        for lab, cap in ((self.st_run, 380), (self.st_stopped, 420)):  # 380: "Live session · llama on engine HOST:PORT"
            lab.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
            lab.setMaximumWidth(cap)
        sb.addWidget(self.st_busy)
        sb.addWidget(self.st_progress)
        for w in (
            self.st_stopped,
            self.st_run,
            self.st_step,
            self.st_positions,
            self.st_kv,
            self.st_time,
            self.st_device,
        ):
            sb.addPermanentWidget(w)
        # a model loaded with --unverified: a red band across the window above every panel
        self.unverified_bar = QToolBar("Unverified", self, objectName="unverified_bar", movable=False)
        self.unverified_bar.toggleViewAction().setVisible(False)  # not something to switch off by accident
        # elided, not wrapped or widened: a long reason once made the window 1398 px wide on a 1366 px screen
        self.unverified_label = ElidedLabel("", objectName="unverified_banner",
                                            styleSheet="background: #b00020; color: white; font-weight: bold; padding: 3px 8px;")  # fmt: skip
        self.unverified_bar.addWidget(self.unverified_label)
        self.addToolBarBreak(Qt.ToolBarArea.TopToolBarArea)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, self.unverified_bar)
        self.unverified_bar.hide()

    # ================================================================== state (the controller's, read here)
    worker = _controller_state("worker")
    snapshot = _controller_state("snapshot")  # Snapshot | None
    selection = _controller_state("selection")  # Selection
    busy = _controller_state("busy")
    running = _controller_state("running")
    read_only = _controller_state("read_only")
    has_source = _controller_state("has_source")
    last_stop_reason = _controller_state("last_stop_reason")  # str | None

    # ================================================================== extension API
    def raise_panel(self, widget: QWidget) -> None:
        """Bring the dock holding ``widget`` (from ``add_panel``) to the front, showing it if closed."""
        for d in self.docks.values():
            if getattr(d, "panel", None) is widget:
                d.show()
                d.raise_()

    def show_source(self, obj, name: str | None = None) -> None:
        """Show a run source (or a trace file path); ``name``: as a run of its own beside the live session.

        Without a name a Session becomes the live session; a source that cannot step (a trace, a beam)
        is always a run of its own. A Session passed here belongs to the worker afterwards.
        """
        if isinstance(obj, (str, Path)):
            self.open_trace(str(obj))
        else:
            self.controller.show(obj, name)

    run_in_worker = _controller_call("run_in_worker")
    when_idle = _controller_call("when_idle")
    post = _controller_call("post")  # a typed command (see :mod:`.commands`)

    # ================================================================== requests with the controls' values
    def load_model(self, spec: ModelSpec | None = None, session: SessionSpec | None = None) -> int | None:
        spec = spec or ModelSpec()
        session = session or self.session_panel.session_spec()
        if not remote_link.may_leave_engine(self):  # the user keeps the remote session
            return None
        self._load_spec = spec
        self.st_busy.setText(f"Loading {spec.model or 'the demo model'}…")
        return self.controller.load(spec, session)

    def load_from_controls(self) -> int | None:
        return self.load_model(self.session_panel.model_spec(), self.session_panel.session_spec())

    def restore(self, recipe: dict) -> int | None:
        """Replay an autosaved session recipe in the worker; the controls show its settings.

        The recipe is checked whole before any control changes. A dialog shows the replay's progress;
        its Cancel stops the replay and starts fresh from the recipe's prompt.
        """
        from ..core.errors import InspectorError
        from ..core.recipe_check import check_recipe

        try:
            check_recipe(recipe)
        except InspectorError as e:
            self.show_error("Cannot restore", f"cannot restore this session recipe: {e}", "user")
            return None
        if "remote" not in recipe:  # the Model field names the restored model (a remote one is the engine's)
            self._load_spec = ModelSpec.of_recipe(recipe)
            self.session_panel.set_model_spec(self._load_spec)
        dec = recipe.get("decoding") or recipe["initial_decoding"]
        self.session_panel.prompt.setPlainText(recipe["prompt"])
        self.session_panel.seed.setValue(min(recipe["seed"], self.session_panel.seed.maximum()))
        self.session_panel.set_decoding(float(dec.get("temperature", 0.0)), dec.get("top_k"), dec.get("top_p"))
        self.session_panel.set_sampler_settings(dec)
        self.st_busy.setText("Restoring the last session…")
        serial = self.controller.restore(recipe)
        self._restore_progress(serial)
        return serial

    def _restore_progress(self, serial: int | None) -> None:
        if serial is None:  # refused before it started: nothing to show progress for
            return
        # One dialog per window, hidden between restores and never deleted from a slot: a window-modal
        # QProgressDialog.setValue runs a nested event loop, and a dialog deleted inside it (the restore
        # ending there) is used after free when setValue returns.
        dialog = self.findChild(QProgressDialog, "restore_progress")
        if dialog is None:
            dialog = QProgressDialog("Restoring the last session…", "Cancel and start fresh", 0, 0, self)
            dialog.setObjectName("restore_progress")
            dialog.setWindowTitle("Restoring")
            dialog.setWindowModality(Qt.WindowModality.WindowModal)
            dialog.setMinimumDuration(400)  # a quick restore flashes nothing
            dialog.setAutoClose(False)
            dialog.setAutoReset(False)
            dialog.canceled.connect(self.controller.pause)  # the worker checks between operations
            # bound methods of this window: Qt drops the connections when the window goes, so a
            # controller that outlives it never reaches a deleted dialog
            self.controller.progress.connect(self._on_restore_progress)
            self.controller.done.connect(self._on_restore_done)
        dialog.reset()
        dialog.setRange(0, 0)
        dialog.setValue(0)  # starts the minimum-duration timer
        self.restore_dialog = dialog
        self._restore_serial = serial

    def _on_restore_progress(self, done_ops: int, total: int) -> None:
        dialog = self.restore_dialog
        if self._restore_serial is None or dialog is None or not shiboken6.isValid(dialog):
            return
        dialog.setMaximum(max(total, 1))
        dialog.setValue(done_ops)

    def _on_restore_done(self, serial: int) -> None:
        if serial != self._restore_serial or serial is None:
            return
        self._restore_serial = None
        dialog = self.restore_dialog
        if dialog is not None and shiboken6.isValid(dialog):
            dialog.reset()
            dialog.hide()

    def start_session(self) -> int | None:
        return self.controller.new_session(self.session_panel.session_spec())

    def _wanted(self):
        """The controls' session settings; the prompt counts as changed only if the user edited it.

        The text box may normalise what it shows (line breaks, control characters in a decoded
        prompt), so an unedited box stands for the shown session's own prompt.
        """
        spec = self.session_panel.session_spec()
        if self._shown_prompt is not None and spec.prompt == self._shown_text:
            spec = replace(spec, prompt=self._shown_prompt)
        return spec

    def step(self) -> int | None:
        return self.controller.step(self._wanted())

    def run(self, max_steps: int | None = None) -> int | None:
        """Run ``max_steps`` steps (default: the Session panel's max steps) or to a breakpoint."""
        n = max_steps if max_steps is not None else self.session_panel.max_steps.value()
        return self.controller.run(n, self.breakpoints_panel.breakpoints(), self._wanted())

    def run_to(self, n: int) -> int | None:
        return self.controller.run_to(n, self.breakpoints_panel.breakpoints())

    def pause(self) -> None:
        if self.controller.pause():
            self.st_busy.setText("Pausing after this step…")

    def restart(self) -> int | None:
        return self.controller.restart(self._wanted())

    def redecide(self) -> int | None:
        t, k, p = self.session_panel.decoding()
        return self.controller.set_decoding(t, k, p, redecide=True, settings=self.session_panel.sampler_settings())

    def set_decoding(self, temperature: float, top_k: int | None = None, top_p: float | None = None) -> int | None:
        self.session_panel.set_decoding(temperature, top_k, top_p)
        return self.controller.set_decoding(temperature, top_k, top_p)

    def _decoding_changed(self) -> None:
        if self.controller.live:
            self.controller.set_decoding(*self.session_panel.decoding(), settings=self.session_panel.sampler_settings())

    step_back = _controller_call("step_back")
    force_token = _controller_call("force_token")
    edit_cells = _controller_call("edit_cells")
    set_mask_edits = _controller_call("set_mask_edits")
    select = _controller_call("select")
    select_query = _controller_call("select_query")

    def open_trace_asking(self, path: str) -> int | None:
        """Open a trace the user picked, as a run of its own: the live session stays in the run switcher."""
        return self.open_trace(path)

    def open_trace(self, path: str) -> int | None:
        _settings.remember(RECENT_TRACES, str(path))
        return self._confirm_when_done(self.controller.open_trace(str(path)), f"Opened trace {path} (read-only)")

    def save_trace(self, path: str) -> int | None:
        path = str(path)
        if not path.endswith(".safetensors"):
            path += ".safetensors"
        _settings.remember(RECENT_TRACES, path)
        return self._confirm_when_done(self.controller.save_trace(path), f"Saved trace to {path}")

    def _confirm_when_done(self, serial: int | None, text: str) -> int | None:
        """Show ``text`` once the command ``serial`` is done, if no error came with it; returns ``serial``."""
        if serial is not None:
            self._confirm[serial] = (text, len(self.errors))
        return serial

    def open_chat(self) -> None:
        """The turns editor (Chat…); its OK starts a session on the chat template's prompt."""
        from .chat_dialog import ChatDialog

        self.chat_dialog = d = ChatDialog(self, self.session_panel.chat)
        d.accepted.connect(lambda: (self.session_panel.set_chat(d.chat()), self.start_session()))
        d.open()

    def _session_shown(self, prompt: str, seed: int, chat: dict | None = None) -> None:
        # the controls show what runs, so that a later difference means the user edited them
        sp = self.session_panel
        sp.set_chat(chat)
        if sp.prompt.toPlainText() != prompt:
            sp.prompt.setPlainText(prompt)
        self._shown_prompt = prompt
        self._shown_text = sp.prompt.toPlainText()  # as the box shows it: a difference is the user's edit
        if sp.seed.value() != seed:
            sp.seed.setValue(seed)

    # ================================================================== showing what the controller says
    def _apply(self, snap: Snapshot) -> None:
        if snap.source_id != self._source_id:
            # another prompt, model or trace: a probe or math check of the old one would mislead
            self._source_id = snap.source_id
            for panel in (self.probe_panel, self.mathcheck_panel):
                panel.clear()
            if self._new_session:  # not a beam or policy run those panels themselves put on show
                why = "the window shows another session now: run it again on this one"
                self.lens_panel.clear(why), self.kvlab_panel.clear(why), self.compare_panel.forget(why)
                self.assisted_panel.clear(why)
        if snap.read_only != self._read_only_shown:
            self._read_only_shown = snap.read_only
            self.session_panel.set_read_only(snap.read_only)
        for v in self.views:
            try:
                self._deferred.apply(v, snap)  # a view nobody can see waits until it is shown
            except Exception as e:  # one broken view must not blank the others
                print(f"gpt-inspector: {type(v).__name__} failed to update: {e!r}", file=sys.stderr)
        self._update_status(snap)
        self.apply_log.append((snap.t_model_done, snap.t_built, time.perf_counter()))
        del self.apply_log[:-200]
        self.snapshot_changed.emit(snap)

    def _update_status(self, s: Snapshot) -> None:
        self.st_device.setText(f"{s.device} · {s.dtype}")
        title, run = self.run_switcher.names(s)
        self.setWindowTitle(title)
        self.st_run.setText(run)
        if s.unverified:
            self.unverified_label.setText(f"UNVERIFIED: these numbers may not be the model's own ({s.unverified})")
            self.setWindowTitle(self.windowTitle() + " — UNVERIFIED")
        self.unverified_bar.setVisible(bool(s.unverified))
        self.st_positions.setText(f"positions {s.T} / {s.context_length}")
        # the model's own cache; what the inspector keeps beside it where that is more (every position
        # of a sliding-window layer)
        cached, kept = sum(s.kv_bytes), sum(s.kv_kept)
        more = kept > cached
        self.st_kv.setText(f"KV cache {human_bytes(cached)}" + (f" · kept {human_bytes(kept)}" if more else ""))
        tip = "bytes the model's own KV cache would hold now (sliding-window layers: their window)"
        more_tip = f"; the inspector keeps {kept:,}, every position, so all stay inspectable"
        self.st_kv.setToolTip(tip + (more_tip if more else ""))
        st = s.step
        self.st_time.setText(f"last step {st.time_s * 1000:.0f} ms" if st is not None and st.time_s else "")
        fin = f" · finished ({s.finished})" if s.finished else ""
        self.st_step.setText(f"step {s.n_steps}{fin}")

    def _run_stopped(self, reason: str) -> None:
        self.st_stopped.setText(f"Run stopped: {reason}")

    def _posted(self, command) -> None:
        if isinstance(command, (Show, SwitchRun, CloseRun, Load, Restore, NewSession, OpenTrace, Step, Run, Restart)):
            # another run, switched to: the panels' results (a comparison, a lab) still hold for it
            self._new_session = not isinstance(
                command, (Show, SwitchRun, CloseRun, OpenTrace)
            )  # a Step may start one from an edited prompt
        if isinstance(
            command, (Step, StepBack, Run, Restart, NewSession, Load, Restore, ForceToken, OpenTrace, Show, SwitchRun)
        ):
            self.st_stopped.setText("")

    def _busy(self, text: str) -> None:
        if text:
            self.st_busy.setText(text)
            if not self.running:
                self.st_progress.setRange(0, 0)  # indeterminate: loading, recomputing
                self.st_progress.show()
        elif not self.running:
            self.st_busy.setText("")
            self.st_progress.hide()

    def _progress(self, done: int, total: int) -> None:
        self.st_progress.setRange(0, max(total, 1))
        self.st_progress.setValue(done)
        self.st_progress.show()
        self.st_busy.setText(f"running: {done} / {total} steps")

    def _loaded(self, info: dict) -> None:
        spec = self._load_spec
        if spec is not None:
            self.session_panel.set_model_spec(spec)
            self.session_panel.remember_model(spec.model)
        name, _, rest = info["describe"].partition(": ")
        if os.sep in name and os.path.isabs(name):  # a local folder: its name, not the whole path
            name = os.path.basename(name.rstrip(os.sep)) or name
        self.loaded_message = f"Loaded {name}: {rest}"
        self.statusBar().showMessage(self.loaded_message, 8000)

    def _command_done(self, serial: int) -> None:
        confirm = self._confirm.pop(serial, None)
        if confirm is not None and len(self.errors) == confirm[1]:  # no error came with it
            self.statusBar().showMessage(confirm[0], 15000)
        self._busy("")  # unless a run goes on: no busy line, no progress bar

    def show_error(self, title: str, message: str, kind: str = "user") -> None:
        first = not self.errors
        self.errors.append((title, message))
        if self.headless_errors:
            if first:  # what follows is usually a consequence (no model -> cannot step)
                print(f"gpt-inspector: error: {message}", file=sys.stderr)
            return
        if kind == "user":
            QMessageBox.warning(self, title, message)
        else:
            QMessageBox.critical(self, title, message)

    # ================================================================== export
    def _export(self, fn_name: str, *args) -> None:
        """Hand the export to the dialog module, which builds the figure on the worker thread."""
        # imported here: matplotlib loads on the first export, not at start-up
        from . import export_dialog as mod

        if not self.has_source:
            QMessageBox.information(self, "Export", "Nothing to export yet: load a model or open a trace.")
            return
        # queued behind any running steps: the figure shows the session as they leave it
        getattr(mod, fn_name)(self, *args)

    def export_view(self, layer: int | None = None, head: int | None = None, kind: str | None = None) -> None:
        s = self.selection
        self._export(
            "export_view", s.layer if layer is None else layer, s.head if head is None else head, kind or s.kind
        )

    def export_grid(self, layer: int | None = None, kind: str | None = None) -> None:
        self._export("export_grid", layer, kind or self.selection.kind)

    def export_kv(self, which: str = "k") -> None:
        """The selected layer's K or V cache as an image, from the snapshot (safe on this thread)."""
        from . import export_dialog

        export_dialog.export_kv(self, which)

    def showEvent(self, ev) -> None:
        super().showEvent(ev)
        QTimer.singleShot(0, self._hide_stale_tab_bars)
        if not self._focus_set:  # else Qt gives the focus to the first text field, the Model box
            self._focus_set = True
            if self.size().toTuple() == self._first_size:  # a size someone chose (a restored one, a test's) stays
                self._fit_to_screen_soon()
            self.score_matrix.setFocus(Qt.FocusReason.OtherFocusReason)

    def closeEvent(self, ev) -> None:
        if self.persist_layout:
            self.save_layout()
        self.controller.stop()
        if self.worker.autosave:  # a clean quit: nothing to restore next time (a crash never gets here)
            from . import autosave

            autosave.clear(self.worker.autosave_owner)
        super().closeEvent(ev)
