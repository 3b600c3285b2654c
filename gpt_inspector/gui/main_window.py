"""The debugger window: docks, actions, status bar, and the wiring between views and the worker.

Threading rule: the session lives in the worker thread. This window only posts commands and
applies Snapshots; exports build their figures on the worker too (``run_in_worker``).

Extension points for other panels (comparison, probes, math checks):
- ``add_panel(title, widget, area)`` docks a widget (its layout is saved like the others);
- ``snapshot_changed(Snapshot)`` after every update, ``selection_changed(layer, head, query)``;
- ``run_in_worker(fn, callback)`` runs ``fn(session_or_trace)`` on the worker thread and calls
  ``callback(result, error)`` back on the GUI thread;
- modules ``gpt_inspector.gui.views.{compare,probe,mathcheck}`` that define
  ``create_panel(window) -> QWidget`` (and optionally ``PANEL_TITLE``, ``PANEL_AREA``) are docked
  automatically.
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QScrollArea,
    QToolBar,
    QWidget,
)

from . import settings as _settings
from .controls import BreakpointsPanel, SessionPanel
from .viewdata import KINDS, Selection, Snapshot
from .views.kv_cache import KVCacheView, human_bytes
from .views.mask_editor import MaskEditor
from .views.next_token import NextTokenView
from .views.overview import OverviewGrid
from .views.qkv import QKVView
from .views.score_matrix import ScoreMatrix
from .views.softmax_rows import SoftmaxRows
from .views.token_strip import TokenStrip
from .worker import ModelSpec, SessionSpec, Worker

STATE_VERSION = 3  # bump when the default dock layout changes, so old saved layouts are ignored
RECENT_TRACES = "recent/traces"
PLUGIN_MODULES = ("compare", "probe", "mathcheck")
AREAS = {
    "left": Qt.DockWidgetArea.LeftDockWidgetArea,
    "right": Qt.DockWidgetArea.RightDockWidgetArea,
    "top": Qt.DockWidgetArea.TopDockWidgetArea,
    "bottom": Qt.DockWidgetArea.BottomDockWidgetArea,
}


class MainWindow(QMainWindow):
    snapshot_changed = Signal(object)  # Snapshot
    selection_changed = Signal(int, int, int)  # layer, head, query (-1: follow the newest)

    def __init__(self, restore_layout: bool = True):
        super().__init__()
        self.setWindowTitle("gpt-inspector")
        self.resize(1600, 1000)
        self.setDockNestingEnabled(True)
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowTabbedDocks
                            | QMainWindow.DockOption.AllowNestedDocks)  # fmt: skip
        self.selection = Selection()
        self.snapshot: Snapshot | None = None
        self.read_only = False
        self.has_source = False
        self.errors: list[tuple[str, str]] = []  # every error shown, newest last
        self.headless_errors = False  # print errors instead of dialogs (screenshot mode)
        self.persist_layout = True  # save the dock layout on close (not for screenshots)
        self.apply_log: list[tuple[float, float, float]] = []  # (model done, built, applied) per snapshot
        self._pending: set[int] = set()
        self._runs: set[int] = set()
        self._refresh_serial: int | None = None
        self._refresh_sel: Selection | None = None
        self._callbacks: dict[int, object] = {}
        self._idle_waiters: list = []
        self._last_spec: SessionSpec | None = None
        self._load_spec: ModelSpec | None = None

        self.worker = Worker()
        self.worker.start()
        w = self.worker
        w.snapshot_ready.connect(self._take_snapshot)
        w.error.connect(self.show_error)
        w.busy.connect(self._busy)
        w.progress.connect(self._progress)
        w.loaded.connect(self._loaded)
        w.stopped.connect(self._stopped)
        w.done.connect(self._done)
        w.called.connect(self._called)

        self._build_views()
        self._build_docks()
        self._build_actions()
        self._build_status()
        self._discover_panels()
        self._default_state = self.saveState(STATE_VERSION)
        if restore_layout:
            self.restore_layout()
        self._update_actions()

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

        sp = self.session_panel
        sp.load_requested.connect(lambda: self.load_model(sp.model_spec(), sp.session_spec()))
        sp.start_requested.connect(self.start_session)
        sp.decoding_changed.connect(self._decoding_changed)
        self.token_strip.position_clicked.connect(self.select_query)
        self.score_matrix.query_clicked.connect(self.select_query)
        self.score_matrix.kind_changed.connect(lambda k: self.select(kind=k))
        self.score_matrix.key_hovered.connect(lambda q, k: self.qkv.set_key(k) if k >= 0 else None)
        self.score_matrix.cells_edited.connect(self.edit_cells)
        self.score_matrix.export_requested.connect(lambda: self.export_view())
        self.overview.head_clicked.connect(lambda l, h: self.select(layer=l, head=h))
        self.overview.export_requested.connect(self._export_from_overview)
        self.softmax_rows.head_clicked.connect(lambda h: self.select(head=h))
        self.kv_cache.layer_clicked.connect(lambda l: self.select(layer=l))
        self.kv_cache.export_requested.connect(self.export_kv)
        self.next_token.redecide_requested.connect(self.redecide)
        self.next_token.force_requested.connect(self.force_token)
        self.mask_editor.edits_replaced.connect(self.set_mask_edits)

    def _dock(self, title: str, name: str, widget: QWidget) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(name)
        d.setWidget(widget)
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
        self.resizeDocks([d["session"], d["scores"], d["overview"]], [290, 760, 540], Qt.Orientation.Horizontal)
        self.resizeDocks([d["softmax"], d["qkv"], d["kv"]], [430, 430, 450], Qt.Orientation.Horizontal)
        self.resizeDocks([d["tokens"], d["scores"], d["softmax"]], [50, 560, 290], Qt.Orientation.Vertical)
        self.resizeDocks([d["overview"], d["next"]], [250, 310], Qt.Orientation.Vertical)
        self.resizeDocks([d["session"], d["breakpoints"]], [560, 300], Qt.Orientation.Vertical)

    def _action(self, text: str, slot, shortcut=None, tip: str = "") -> QAction:
        a = QAction(text, self)
        if shortcut is not None:
            a.setShortcut(QKeySequence(shortcut))
            a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        if tip:
            a.setStatusTip(tip)
            a.setToolTip(f"{tip} ({QKeySequence(shortcut).toString()})" if shortcut else tip)
        a.triggered.connect(slot)
        return a

    def _build_actions(self) -> None:
        A = self._action
        self.act_step = A("Step", self.step, "F10", "Run one step: feed one token, choose the next")
        self.act_run = A("Run", self.run, "F5", "Run until EOS, max steps or a breakpoint")
        self.act_pause = A("Pause", self.pause, "Esc", "Stop a run after the current step")
        self.act_back = A("Step back", self.step_back, "Shift+F10", "Undo the last step exactly")
        self.act_restart = A("Restart", self.restart, "Ctrl+Shift+F5", "Back to the prompt (a changed prompt or seed starts a new session)")
        self.act_run_to = A("Run to step…", self.ask_run_to, "Ctrl+F10", "Step forward or back to step N")
        self.act_redecide = A("Re-decide token", self.redecide, "Ctrl+D", "Choose the current token again at the current settings")
        self.act_open = A("Open trace…", self.open_trace_dialog, QKeySequence.StandardKey.Open, "Open a saved trace (read-only)")
        self.act_save = A("Save trace…", self.save_trace_dialog, QKeySequence.StandardKey.Save, "Save the session as a trace file")
        self.act_export = A("Export view…", lambda: self.export_view(), "Ctrl+E", "Export the selected head's matrix")
        self.act_export_grid = A("Export grid…", lambda: self.export_grid(), "Ctrl+Shift+E", "Export every head's pattern")
        self.act_load = A("Load model…", lambda: self.load_model(self.session_panel.model_spec(), self.session_panel.session_spec()),
                          "Ctrl+L", "Load the model chosen in the Session panel")  # fmt: skip
        self.act_quit = A("Quit", self.close, QKeySequence.StandardKey.Quit)
        self.act_reset_layout = A("Reset layout", self.reset_layout, None, "Put every panel back where it started")

        m = self.menuBar().addMenu("&File")
        m.addAction(self.act_load)
        m.addSeparator()
        m.addAction(self.act_open)
        self.recent_menu = m.addMenu("Recent traces")
        self.recent_menu.aboutToShow.connect(self._fill_recent_traces)
        m.addAction(self.act_save)
        m.addSeparator()
        m.addAction(self.act_export)
        m.addAction(self.act_export_grid)
        m.addSeparator()
        m.addAction(self.act_quit)
        m = self.menuBar().addMenu("&Debug")
        for a in (self.act_step, self.act_run, self.act_pause, self.act_back, self.act_restart, self.act_run_to):
            m.addAction(a)
        m.addSeparator()
        m.addAction(self.act_redecide)
        m = self.menuBar().addMenu("&Select")
        m.addAction(self._action("Previous layer", lambda: self.select(layer=self.selection.layer - 1), "PgUp"))
        m.addAction(self._action("Next layer", lambda: self.select(layer=self.selection.layer + 1), "PgDown"))
        m.addAction(self._action("Previous head", lambda: self.select(head=self.selection.head - 1), "["))
        m.addAction(self._action("Next head", lambda: self.select(head=self.selection.head + 1), "]"))
        m.addAction(self._action("Follow the newest position", lambda: self.select_query(None), "End"))
        m.addSeparator()
        for i, kind in enumerate(KINDS):
            m.addAction(self._action(f"Stage: {kind}", lambda _=False, k=kind: self.select(kind=k), f"Ctrl+{i + 1}"))
        self.tools_menu = self.menuBar().addMenu("&Tools")
        self.view_menu = self.menuBar().addMenu("&View")
        for d in self.docks.values():
            self.view_menu.addAction(d.toggleViewAction())
        self.view_menu.addSeparator()
        self.view_menu.addAction(self.act_reset_layout)

        tb = QToolBar("Debug")
        tb.setObjectName("toolbar_debug")
        tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        for a in (self.act_step, self.act_run, self.act_pause, self.act_back, self.act_restart, self.act_run_to):
            tb.addAction(a)
        tb.addSeparator()
        tb.addAction(self.act_redecide)
        tb.addSeparator()
        tb.addAction(self.act_open)
        tb.addAction(self.act_save)
        tb.addAction(self.act_export)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, tb)
        self.toolbar = tb

    def _build_status(self) -> None:
        sb = self.statusBar()
        self.st_busy = QLabel("")
        self.st_progress = QProgressBar()
        self.st_progress.setMaximumWidth(180)
        self.st_progress.setMaximumHeight(14)
        self.st_progress.setTextVisible(False)
        self.st_progress.hide()
        self.st_step = QLabel("no model")
        self.st_device = QLabel("")
        self.st_positions = QLabel("")
        self.st_kv = QLabel("")
        self.st_time = QLabel("")
        sb.addWidget(self.st_busy)
        sb.addWidget(self.st_progress)
        for w in (self.st_step, self.st_positions, self.st_kv, self.st_time, self.st_device):
            sb.addPermanentWidget(w)

    def _discover_panels(self) -> None:
        for name in PLUGIN_MODULES:
            mod_name = f"{__package__}.views.{name}"
            try:
                mod = importlib.import_module(mod_name)
            except ModuleNotFoundError as e:
                if e.name != mod_name:
                    print(f"gpt-inspector: panel {name} unavailable: {e}", file=sys.stderr)
                continue
            except Exception as e:  # another panel's bug must not stop the window
                print(f"gpt-inspector: panel {name} failed to import: {e}", file=sys.stderr)
                continue
            factory = getattr(mod, "create_panel", None) or self._fallback_panels.get(name)
            if factory is None:
                continue
            try:
                widget = factory(self)
            except Exception as e:
                print(f"gpt-inspector: panel {name} failed to start: {e}", file=sys.stderr)
                continue
            if widget is not None:
                title = getattr(mod, "PANEL_TITLE", {"probe": "Cache probe", "mathcheck": "Math check"}.get(name, name.title()))
                self.add_panel(title, widget, getattr(mod, "PANEL_AREA", "right"))

    @property
    def _fallback_panels(self) -> dict:
        # display-only panels without a create_panel hook: this window runs their jobs
        return {"probe": self._probe_panel, "mathcheck": self._mathcheck_panel}

    def _probe_panel(self, _window=None):
        from .views.probe import ProbePanel

        panel = ProbePanel()
        self.probe_panel = panel

        def job(src):
            from ..core.errors import InspectorError
            from ..core.probe import probe_session

            if not hasattr(src, "lm"):
                raise InspectorError("the cache probe needs a live session: load a model (a trace has no model)")
            return probe_session(src, layers=(0,))

        def run():
            self.run_in_worker(job, lambda r, e: self._panel_result(panel, "Cache probe", panel.show_result, r, e))

        self.tools_menu.addAction(self._action("Probe the KV cache (layer 0)", run, None,
                                               "Read the prompt back from the cached keys and values"))  # fmt: skip
        return panel

    def _mathcheck_panel(self, _window=None):
        from .views.mathcheck import MathCheckPanel

        panel = MathCheckPanel()
        self.mathcheck_panel = panel

        def one():
            from ..core.mathcheck import check

            sel, snap = self.selection, self.snapshot
            pos = None if sel.query is None or snap is None else snap.query
            self.run_in_worker(lambda src: check(src, sel.layer, sel.head, pos),
                               lambda r, e: self._panel_result(panel, "Math check", panel.show_result, r, e))  # fmt: skip

        def every():
            from ..core.mathcheck import check_all

            self.run_in_worker(lambda src: check_all(src),
                               lambda r, e: self._panel_result(panel, "Math check", panel.show_report, r, e))  # fmt: skip

        self.tools_menu.addAction(self._action("Check the math of the selected head", one, "Ctrl+M",
                                               "Recompute softmax(qKᵀ·s)·V by hand and compare with the model"))  # fmt: skip
        self.tools_menu.addAction(self._action("Check the math of every head", every, None))
        return panel

    def _panel_result(self, panel, title: str, show, result, error) -> None:
        if error is not None:
            from ..core.errors import InspectorError

            self.show_error(f"{title} failed", str(error), "user" if isinstance(error, InspectorError) else "internal")
            return
        show(result)
        for d in self.docks.values():
            if getattr(d, "panel", None) is panel:
                d.show()
                d.raise_()

    # ================================================================== extension API
    def add_panel(self, title: str, widget: QWidget, area=Qt.DockWidgetArea.RightDockWidgetArea) -> QDockWidget:
        """Dock another panel, tabbed with the built-in panels of ``area``; its layout persists.

        The widget sits in a scroll area, so a wide toolbar scrolls instead of widening the window.
        """
        if isinstance(area, str):
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
        anchor = self.docks[anchor_name]
        self.tabifyDockWidget(anchor, d)
        (self.docks["next"] if anchor_name == "mask" else anchor).raise_()  # built-in panels stay in front
        self.docks[key] = d
        if hasattr(self, "view_menu"):
            self.view_menu.insertAction(self.act_reset_layout, d.toggleViewAction())
        if self.snapshot is not None and hasattr(widget, "set_snapshot"):
            widget.set_snapshot(self.snapshot)
        return d

    def run_in_worker(self, fn, callback=None) -> int | None:
        """Run ``fn(session_or_trace)`` on the worker thread; ``callback(result, error)`` on this one."""
        serial = self.post("call", fn=fn)
        if serial is not None and callback is not None:
            self._callbacks[serial] = callback
        return serial

    def show_source(self, obj) -> None:
        """Show a Trace (or a trace file path) read-only, or hand a Session over to the worker.

        A Session passed here belongs to the worker afterwards: do not touch it from this thread.
        """
        if isinstance(obj, (str, Path)):
            self.open_trace(str(obj))
        else:
            self.post("show", obj=obj)

    def current_snapshot(self) -> Snapshot | None:
        return self.snapshot

    # ================================================================== commands to the worker
    @property
    def busy(self) -> bool:
        return bool(self._pending)

    @property
    def running(self) -> bool:
        return bool(self._runs)

    def post(self, name: str, **kwargs) -> int | None:
        serial = self.worker.post(name, **kwargs)
        self._pending.add(serial)
        if name == "run":
            self._runs.add(serial)
        self._update_actions()
        return serial

    def load_model(self, spec: ModelSpec | None = None, session: SessionSpec | None = None) -> int | None:
        spec = spec or ModelSpec()
        session = session or self.session_panel.session_spec()
        self._load_spec = spec
        self._last_spec = session
        self.st_busy.setText(f"Loading {spec.model or 'the demo model'}…")
        return self.post("load", model=spec, session=session)

    def restore(self, recipe: dict) -> int | None:
        """Replay an autosaved session recipe in the worker; the controls show its settings."""
        dec = recipe.get("decoding") or {}
        self.session_panel.prompt.setPlainText(str(recipe.get("prompt", "")))
        try:
            self.session_panel.seed.setValue(int(recipe.get("seed", 0)))
            self.session_panel.set_decoding(float(dec.get("temperature", 0.0)), dec.get("top_k"), dec.get("top_p"))
        except (TypeError, ValueError):
            pass  # the worker validates the recipe and reports what is wrong
        self.st_busy.setText("Restoring the last session…")
        return self.post("restore", recipe=recipe)

    def start_session(self) -> int | None:
        spec = self.session_panel.session_spec()
        self._last_spec = spec
        return self.post("new_session", session=spec)

    def step(self) -> int | None:
        return self.post("step")

    def run(self, max_steps: int | None = None) -> int | None:
        n = max_steps if max_steps is not None else self.session_panel.max_steps.value()
        return self.post("run", max_steps=n, breakpoints=self.breakpoints_panel.breakpoints())

    def run_to(self, n: int) -> int | None:
        return self.post("run", target=int(n), breakpoints=self.breakpoints_panel.breakpoints())

    def ask_run_to(self) -> None:
        cur = self.snapshot.n_steps if self.snapshot else 0
        n, ok = QInputDialog.getInt(self, "Run to step", "Step or step back until this many steps are done:", cur + 10, 0, 10**6)
        if ok:
            self.run_to(n)

    def pause(self) -> None:
        self.worker.cancel()
        if self.running:
            self.st_busy.setText("Pausing after this step…")

    def step_back(self) -> int | None:
        return self.post("step_back")

    def restart(self) -> int | None:
        spec = self.session_panel.session_spec()
        self._last_spec = spec
        return self.post("restart", session=spec)

    def redecide(self) -> int | None:
        t, k, p = self.session_panel.decoding()
        return self.post("set_decoding", temperature=t, top_k=k, top_p=p, redecide=True)

    def force_token(self, token_id: int) -> int | None:
        return self.post("force_token", token_id=int(token_id))

    def set_decoding(self, temperature: float, top_k: int | None = None, top_p: float | None = None) -> int | None:
        self.session_panel.set_decoding(temperature, top_k, top_p)
        return self.post("set_decoding", temperature=temperature, top_k=top_k, top_p=top_p)

    def _decoding_changed(self) -> None:
        if self.has_source and not self.read_only:
            t, k, p = self.session_panel.decoding()
            self.post("set_decoding", temperature=t, top_k=k, top_p=p)

    def edit_cells(self, cells, scope: str = "head", block: bool | None = None) -> int | None:
        sel = self.selection
        return self.post("edit_cells", cells=list(cells), layer=sel.layer, head=sel.head, scope=scope, block=block)

    def set_mask_edits(self, edits) -> int | None:
        return self.post("set_mask_edits", edits=list(edits))

    def open_trace(self, path: str) -> int | None:
        _settings.remember(RECENT_TRACES, str(path))
        return self.post("open_trace", path=str(path))

    def save_trace(self, path: str) -> int | None:
        path = str(path)
        if not path.endswith(".safetensors"):
            path += ".safetensors"
        _settings.remember(RECENT_TRACES, path)
        return self.post("save_trace", path=path)

    def open_trace_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open trace", "", "Traces (*.safetensors);;All files (*)")
        if path:
            self.open_trace(path)

    def save_trace_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save trace", "trace.safetensors", "Traces (*.safetensors)")
        if path:
            self.save_trace(path)

    def _fill_recent_traces(self) -> None:
        self.recent_menu.clear()
        items = _settings.recent(RECENT_TRACES)
        for p in items:
            self.recent_menu.addAction(p, lambda p=p: self.open_trace(p))
        if not items:
            self.recent_menu.addAction("(none)").setEnabled(False)

    # ================================================================== selection
    def select(self, layer: int | None = None, head: int | None = None, kind: str | None = None) -> None:
        s = self.selection
        snap = self.snapshot
        L = snap.n_layers if snap else 1 << 30
        H = snap.n_heads if snap else 1 << 30
        new = replace(
            s,
            layer=s.layer if layer is None else min(max(layer, 0), L - 1),
            head=s.head if head is None else min(max(head, 0), H - 1),
            kind=s.kind if kind is None else kind,
        )
        self._set_selection(new)

    def select_query(self, pos: int | None) -> None:
        snap = self.snapshot
        if pos is not None and snap is not None and pos >= snap.T - 1:
            pos = None  # the newest position: follow the run from now on
        self._set_selection(replace(self.selection, query=pos))

    def _set_selection(self, sel: Selection) -> None:
        if sel == self.selection:
            return
        self.selection = sel
        self.worker.set_selection(sel)
        self.selection_changed.emit(sel.layer, sel.head, -1 if sel.query is None else sel.query)
        if self._refresh_serial is None and self.has_source:
            self._refresh_sel = sel
            self._refresh_serial = self.post("refresh")

    # ================================================================== from the worker
    def _take_snapshot(self) -> None:
        snap = self.worker.take()
        if snap is not None:
            self._apply(snap)

    def _apply(self, snap: Snapshot) -> None:
        t_recv = time.perf_counter()
        self.snapshot = snap
        self.has_source = True
        if snap.read_only != self.read_only:
            self.read_only = snap.read_only
            self.session_panel.set_read_only(snap.read_only)
        for v in self.views:
            try:
                v.set_snapshot(snap)
            except Exception as e:  # one broken view must not blank the others
                print(f"gpt-inspector: {type(v).__name__} failed to update: {e!r}", file=sys.stderr)
        self._update_status(snap)
        self._update_actions()
        self.apply_log.append((snap.t_model_done, snap.t_built, time.perf_counter()))
        del self.apply_log[:-200]
        _ = t_recv
        self.snapshot_changed.emit(snap)

    def _update_status(self, s: Snapshot) -> None:
        if s.read_only:
            self.st_device.setText(f"trace · {s.dtype}")
            self.setWindowTitle(f"gpt-inspector — {Path(s.source_name).name} (read-only trace)")
        else:
            self.st_device.setText(f"{s.device} · {s.dtype}")
            self.setWindowTitle(f"gpt-inspector — {Path(s.model_name).name}")
        self.st_positions.setText(f"positions {s.T} / {s.context_length}")
        self.st_kv.setText(f"KV cache {human_bytes(sum(s.kv_bytes))}")
        st = s.step
        self.st_time.setText(f"last step {st.time_s * 1000:.0f} ms" if st is not None and st.time_s else "")
        fin = f" · finished ({s.finished})" if s.finished else ""
        self.st_step.setText(f"step {s.n_steps}{fin}")

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

    def _stopped(self, reason: str) -> None:
        self.statusBar().showMessage(f"Run stopped: {reason}", 8000)
        self.last_stop_reason = reason

    def _loaded(self, info: dict) -> None:
        spec = self._load_spec
        if spec is not None:
            self.session_panel.set_model_spec(spec)
            self.session_panel.remember_model(spec.model)
        self.statusBar().showMessage(f"Loaded {info['describe']}", 8000)
        if self.selection.layer >= info["n_layers"] or self.selection.head >= info["n_heads"]:
            self._set_selection(Selection(kind=self.selection.kind))

    def _done(self, serial: int) -> None:
        self._pending.discard(serial)
        self._runs.discard(serial)
        if serial == self._refresh_serial:
            self._refresh_serial = None
            if self._refresh_sel != self.selection:  # changed while that refresh ran
                self._refresh_sel = self.selection
                self._refresh_serial = self.post("refresh")
        if not self.running:
            self.st_progress.hide()
            self.st_busy.setText("")
        self._update_actions()
        if not self._pending:
            self._take_snapshot()
            waiters, self._idle_waiters = self._idle_waiters, []
            for cb in waiters:
                cb()

    def _called(self, serial: int, result, error) -> None:
        cb = self._callbacks.pop(serial, None)
        if cb is not None:
            cb(result, error)
        elif error is not None:
            self.show_error("Panel error", str(error), "internal")

    def when_idle(self, callback) -> None:
        """Call ``callback()`` once every posted command has finished and its snapshot is shown."""
        if not self._pending:
            self._take_snapshot()
            QTimer.singleShot(0, callback)
        else:
            self._idle_waiters.append(callback)

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

    def _update_actions(self) -> None:
        live = self.has_source and not self.read_only
        running = self.running
        finished = bool(self.snapshot is not None and self.snapshot.finished)
        for a in (self.act_back, self.act_restart, self.act_run_to, self.act_redecide):
            a.setEnabled(live and not running)
        for a in (self.act_step, self.act_run):  # after EOS: step back, force a token or restart
            a.setEnabled(live and not running and not finished)
        self.act_pause.setEnabled(running)
        self.act_save.setEnabled(live)
        self.act_export.setEnabled(self.has_source)
        self.act_export_grid.setEnabled(self.has_source)

    # ================================================================== export
    def _export(self, fn_name: str, *args) -> None:
        """Hand the export to the dialog module, which builds the figure on the worker thread."""
        try:
            mod = importlib.import_module(f"{__package__}.export_dialog")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.export_dialog":
                raise
            QMessageBox.information(self, "Export", "Export is not available in this build yet.")
            return
        if not self.has_source:
            QMessageBox.information(self, "Export", "Nothing to export yet: load a model or open a trace.")
            return
        # queued behind any running steps: the figure shows the session as they leave it
        getattr(mod, fn_name)(self, *args)

    def export_view(self, layer: int | None = None, head: int | None = None, kind: str | None = None) -> None:
        s = self.selection
        self._export("export_view", s.layer if layer is None else layer, s.head if head is None else head, kind or s.kind)

    def export_grid(self, layer: int | None = None, kind: str | None = None) -> None:
        self._export("export_grid", layer, kind or self.selection.kind)

    def export_kv(self, which: str = "k") -> None:
        """The selected layer's K or V cache as an image, from the snapshot (safe on this thread)."""
        snap = self.snapshot
        m = None if snap is None else (snap.kv_k if which == "k" else snap.kv_v)
        if m is None:
            QMessageBox.information(self, "Export", "Nothing cached yet: run a step first.")
            return
        mod = importlib.import_module(f"{__package__}.export_dialog")
        layer, name = snap.selection.layer, which.upper()
        mod.export_matrix(
            self, m, list(snap.labels[: snap.T]),
            f"{snap.model_name} · layer {layer} · {name} cache · step {snap.n_steps}",
            f"kv-L{layer}-{which}.png",
            subtitle=f"{snap.T} positions × {snap.n_kv_heads} KV heads × {snap.head_dim} dims ({snap.dtype})",
            col_title="KV head × dimension",
        )  # fmt: skip

    def _export_from_overview(self, which) -> None:
        if which is None:
            self.export_grid()
        else:
            self.export_view(which[0], which[1])

    # ================================================================== layout
    def restore_layout(self) -> None:
        st = _settings.settings()
        geo, state = st.value("window/geometry"), st.value("window/state")
        if isinstance(geo, QByteArray) and not geo.isEmpty():
            self.restoreGeometry(geo)
        if isinstance(state, QByteArray) and not state.isEmpty():
            self.restoreState(state, STATE_VERSION)

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

    def closeEvent(self, ev) -> None:
        if self.persist_layout:
            self.save_layout()
        self.worker.stop()
        super().closeEvent(ev)
