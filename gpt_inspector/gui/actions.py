"""The window's QActions: menus, toolbar and keyboard shortcuts, and when each may be used.

Every action calls a method without arguments: ``QAction.triggered`` carries ``checked``, and a
slot with an optional first parameter would receive it (that once made Run run 0 steps).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMenu, QToolBar

from . import help as _help
from . import settings as _settings
from . import tour as _tour
from .layout import WORKSPACES
from .viewdata import KIND_LABELS, KINDS

RECENT_TRACES = "recent/traces"


def _fill(target, *items):
    """Add ``items`` to a menu or toolbar in order: actions, submenus, and None for a separator."""
    for item in items:
        if item is None:
            target.addSeparator()
        elif isinstance(item, QMenu):
            target.addMenu(item)
        else:
            target.addAction(item)
    return target


class WindowActions(QObject):
    """Builds the menus and the toolbar of ``window`` (a MainWindow) and keeps them enabled right."""

    def __init__(self, window):
        super().__init__(window)
        self.win = w = window
        ctl = w.controller
        A = self.action
        self.step = A("Step", w.step, "F10", "Run one step: feed one token, choose the next")
        self.run = A("Run", w.run, "F5", "Run until EOS, max steps or a breakpoint")
        self.pause = A("Pause", w.pause, "Esc", "Stop a run after the current step")
        self.back = A("Step back", w.step_back, "Shift+F10", "Undo the last step exactly")
        self.restart = A(
            "Restart", w.restart, "Ctrl+Shift+F5", "Back to the prompt (a changed prompt or seed starts a new session)"
        )
        self.run_to = A("Run to step…", self.ask_run_to, "Ctrl+F10", "Step forward or back to step N")
        self.redecide = A(
            "Re-decide token", w.redecide, "Ctrl+D", "Choose the current token again at the current settings"
        )
        self.open = A(
            "Open trace…", self.open_trace_dialog, QKeySequence.StandardKey.Open, "Open a saved trace (read-only)"
        )
        self.save = A(
            "Save trace…",
            self.save_trace_dialog,
            QKeySequence.StandardKey.Save,
            "Save the run shown (the live session, a beam, a trace) as a trace file",
        )
        self.export = A("Export view…", w.export_view, "Ctrl+E", "Export the selected head's matrix")
        self.export_grid = A("Export grid…", w.export_grid, "Ctrl+Shift+E", "Export every head's pattern")
        self.load = A("Load model…", w.load_from_controls, "Ctrl+L", "Load the model chosen in the Session panel")
        self.chat = A("Chat prompt…", w.open_chat, "Ctrl+Shift+C",
                      "Build the prompt from the model's chat template: system / user / assistant turns")  # fmt: skip
        self.quit = A("Quit", w.close, QKeySequence.StandardKey.Quit)
        self.reset_layout = A(
            "Reset layout", w.reset_layout, None, "Put every panel back where it started (the Attention workspace)"
        )
        sel = lambda: ctl.selection  # noqa: E731 -- read when the key is pressed, not now
        self.prev_layer = A("Previous layer", lambda: ctl.select(layer=sel().layer - 1), "PgUp")
        self.next_layer = A("Next layer", lambda: ctl.select(layer=sel().layer + 1), "PgDown")
        self.prev_head = A("Previous head", lambda: ctl.select(head=sel().head - 1), "[")
        self.next_head = A("Next head", lambda: ctl.select(head=sel().head + 1), "]")
        self.follow = A("Follow the newest position", lambda: ctl.select_query(None), "End")
        self.kinds = [
            A(f"Stage: {KIND_LABELS[k]}", lambda k=k: ctl.select(kind=k), f"Ctrl+{i + 1}") for i, k in enumerate(KINDS)
        ]
        debug = (self.step, self.run, self.pause, self.back, self.restart, self.run_to)

        mb = w.menuBar()
        self.recent_menu = QMenu("Recent traces", w)
        self.recent_menu.aboutToShow.connect(self._fill_recent_traces)
        _fill(mb.addMenu("&File"), self.load, self.chat, None, self.open, self.recent_menu, self.save, None, self.export, self.export_grid,
              None, self.quit)  # fmt: skip
        _fill(mb.addMenu("&Debug"), *debug, None, self.redecide)
        _fill(
            mb.addMenu("&Select"),
            self.prev_layer,
            self.next_layer,
            self.prev_head,
            self.next_head,
            self.follow,
            None,
            *self.kinds,
        )
        self.tools_menu = mb.addMenu("&Tools")
        self.workspace_menu = QMenu("&Workspace", w)
        self.workspace_group = QActionGroup(self)  # exclusive: one workspace is checked
        self.workspaces = {}
        for ws in WORKSPACES.values():
            a = A(ws.name, lambda name=ws.name: w.apply_workspace(name), ws.shortcut, ws.tip)
            a.setCheckable(True)
            self.workspace_group.addAction(a)
            self.workspaces[ws.name] = a
        _fill(self.workspace_menu, *self.workspaces.values())
        self.show_workspace(w.workspace)
        rs = w.run_switcher  # read when a key is pressed: the runs change
        self.next_run = A("Next run", lambda: rs.cycle(1), "Ctrl+Tab", "Show the next run in the switcher")
        self.prev_run = A("Previous run", lambda: rs.cycle(-1), "Ctrl+Shift+Tab", "Show the previous run")
        self.live_run = A("Live session", rs.show_live, "Alt+Home", "Back to the live session, as it was left")
        self.close_run = A("Close run", rs.close_shown, "Ctrl+W",
                           "Close the run shown (the live session only after asking)")  # fmt: skip
        self.runs_menu = QMenu("&Runs", w)  # one entry per run, filled when it opens
        self.runs_menu.aboutToShow.connect(self._fill_runs)
        self.view_menu = _fill(
            mb.addMenu("&View"),
            self.workspace_menu,
            self.runs_menu,
            None,
            *(d.toggleViewAction() for d in w.docks.values()),
        )
        self.panels_end = self.view_menu.addSeparator()  # panels added later go above this line
        self.view_menu.addAction(self.reset_layout)
        self.help_page = A("What am I looking at", lambda: _help.show_page(w), "F1",
                           "The panel with the focus explained, its equation with the selection's numbers")  # fmt: skip
        self.tour = A(
            "Tour", lambda: _tour.start(w), None, "A guided tour of one step, panel by panel, with its numbers"
        )
        self.keys_help = A("Keyboard shortcuts", lambda: _help.show_keyboard(w), None, "Every key and mouse gesture")
        self.about = A("About", lambda: _help.show_about(w), None, "Version, licence, what gpt-inspector is")
        self.pages_menu = QMenu("Panels", w)  # one page per dock, the panels added later included
        self.pages_menu.aboutToShow.connect(self._fill_pages)
        _fill(mb.addMenu("&Help"), self.help_page, self.pages_menu, self.tour, None, self.keys_help, self.about)
        _help.install(w)

        tb = QToolBar("Debug")
        tb.setObjectName("toolbar_debug")
        tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        _fill(tb, *debug, None, self.redecide, None, self.open, self.save, self.export)
        w.addToolBar(Qt.ToolBarArea.TopToolBarArea, tb)
        self.toolbar = tb
        ctl.state_changed.connect(self.update)
        self.update()

    def action(self, text: str, slot: Callable[[], object], shortcut=None, tip: str = "") -> QAction:
        """A window-wide action calling ``slot()``; panels use this for their Tools-menu entries."""
        a = QAction(text, self.win)
        if shortcut is not None:
            a.setShortcut(QKeySequence(shortcut))
            a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            self.win.addAction(a)  # the shortcut works even with the menu bar hidden
        if tip:
            a.setStatusTip(tip)
            a.setToolTip(f"{tip} ({QKeySequence(shortcut).toString()})" if shortcut else tip)
        a.triggered.connect(lambda _checked=False: slot())
        return a

    def show_workspace(self, name: str) -> None:
        """Check ``name`` in View ▸ Workspace (the workspace shown, or the last one chosen)."""
        if name in self.workspaces:
            self.workspaces[name].setChecked(True)

    def update(self) -> None:
        ctl = self.win.controller
        idle_live = ctl.live and not ctl.running
        stepped = ctl.n_steps > 0
        for a in (self.restart, self.run_to):
            a.setEnabled(idle_live)
        for a in (self.back, self.redecide):  # both need a step to undo or re-decide
            a.setEnabled(idle_live and stepped)
        for a in (self.step, self.run):  # after EOS: step back, force a token or restart
            a.setEnabled(idle_live and not ctl.finished)
        self.pause.setEnabled(ctl.stoppable)
        run = ctl.current_run
        why = "nothing to save yet" if run is None else run.save_refused
        self.save.setEnabled(why is None and not ctl.running)
        self.save.setToolTip(f"Save “{run.name}” as a trace file (Ctrl+S)" if why is None else f"Cannot save: {why}")
        many = len(ctl.run_infos) > 1
        for a in (self.next_run, self.prev_run, self.close_run):
            a.setEnabled(many and not ctl.running)
        self.live_run.setEnabled(not ctl.running and any(r.live and r.id != ctl.shown_run for r in ctl.run_infos))
        self.export.setEnabled(ctl.has_source)
        self.export_grid.setEnabled(ctl.has_source)

    # ------------------------------------------------------------------ dialogs behind actions
    def ask_run_to(self) -> None:
        cur = self.win.controller.n_steps
        n, ok = QInputDialog.getInt(self.win, "Run to step", "Step or step back until this many steps are done:",
                                    cur + 10, 0, 10**6)  # fmt: skip
        if ok:
            self.win.run_to(n)

    def open_trace_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.win, "Open trace", "", "Traces (*.safetensors);;All files (*)")
        if path:
            self.win.open_trace_asking(path)

    def save_trace_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self.win, "Save trace", "trace.safetensors", "Traces (*.safetensors)")
        if path:
            self.win.save_trace(path)

    def _fill_pages(self) -> None:
        self.pages_menu.clear()
        for key, d in self.win.docks.items():
            if key in _help.PAGES:
                self.pages_menu.addAction(d.windowTitle(), lambda key=key: _help.show_page(self.win, key))

    def _fill_runs(self) -> None:
        menu, ctl = self.runs_menu, self.win.controller
        menu.clear()
        for r in ctl.run_infos:
            a = menu.addAction(r.label, lambda run_id=r.id: self.win.run_switcher.switch(run_id))
            a.setCheckable(True)
            a.setChecked(r.id == ctl.shown_run)
            a.setEnabled(not ctl.running)
            a.setToolTip(r.detail)
        if not ctl.run_infos:
            menu.addAction("(none)").setEnabled(False)
        _fill(menu, None, self.next_run, self.prev_run, self.live_run, self.close_run)

    def _fill_recent_traces(self) -> None:
        self.recent_menu.clear()
        items = _settings.recent(RECENT_TRACES)
        for p in items:
            self.recent_menu.addAction(p, lambda p=p: self.win.open_trace_asking(p))
        if not items:
            self.recent_menu.addAction("(none)").setEnabled(False)
