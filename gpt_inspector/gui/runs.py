"""The runs a window holds: the live session, inspected beams, the KV lab's policy run, opened traces.

The worker owns a :class:`Runs` (the run sources and a view model each, touched only on its thread)
and hands the GUI thread an immutable :class:`RunInfo` per run. Showing another run never drops
one: the live session stays, with its steps and edits, until the user closes it. What each run can
do is read off its ``live`` capability (core.source.Live), never off its class.

:class:`RunSwitcher` is the window's side: a tab per run above the panels (closable, the live
session only after asking), the title and status-bar names, and the View ▸ Runs menu's targets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from PySide6.QtCore import QSignalBlocker, Qt
from PySide6.QtWidgets import QLabel, QMessageBox, QTabBar, QToolBar

from ..core.trace import save_refusal

LIVE_NAME = "Live session"


@dataclass(frozen=True)
class RunInfo:
    """One run as the switcher, the title bar and the actions see it (GUI thread)."""

    id: int
    name: str
    live: bool  # the session Load, New session and Restore replace (and autosave writes)
    read_only: bool  # it cannot be stepped: a beam, a trace
    save_refused: str | None  # why Save trace cannot write it, or None
    detail: str  # a tooltip: what the run is
    engine: str | None = None  # the remote engine it runs on (ws://HOST:PORT), or None
    work: bool = False  # it has steps or edits (asked before a Load replaces a remote one)

    @property
    def label(self) -> str:
        return f"{self.name} · read-only" if self.read_only else self.name


class Run:
    """A run source with the view model that shows it (kept, so switching back costs nothing)."""

    _ids = itertools.count(1)

    def __init__(self, obj, name: str, live: bool):
        self.id = next(Run._ids)
        self.obj = obj
        self.name = name
        self.live = live
        self.vm = None  # made on first show

    def info(self) -> RunInfo:
        o = self.obj
        read_only = not o.live.can("step")
        refused = save_refusal(o)  # a live session, a beam, a policy run, a trace: core says which it cannot
        prompt = o.prompt if len(o.prompt) <= 40 else o.prompt[:39] + "…"
        detail = f"{self.name}: {o.source_name}, “{prompt}”, {o.n_steps} steps" + (" (read-only)" if read_only else "")
        work = bool(o.n_steps or getattr(o, "mask_edits", None) or getattr(o, "head_edits", None))
        return RunInfo(self.id, self.name, self.live, read_only, refused, detail, o.engine, work)


class Runs:
    """The runs in the order they were opened; the live session, when there is one, comes first."""

    def __init__(self):
        self.items: list[Run] = []
        self.shown: Run | None = None

    @property
    def live(self) -> Run | None:
        return next((r for r in self.items if r.live), None)

    def get(self, run_id: int) -> Run | None:
        return next((r for r in self.items if r.id == run_id), None)

    def set_live(self, obj) -> Run:
        """``obj`` becomes the live session (a new load, prompt or restore: the old one is replaced)."""
        old = self.live
        run = Run(obj, LIVE_NAME, live=True)
        if old is None:
            self.items.insert(0, run)
        else:
            self.items[self.items.index(old)] = run
        return run

    def add(self, obj, name: str) -> Run:
        """A run beside the others; the same source shown again is the run it already is."""
        for r in self.items:
            if r.obj is obj:
                return r
        taken = {r.name for r in self.items}
        base, n = name, 2
        while name in taken:  # two beams of the same number from two comparisons stay apart
            name, n = f"{base} ({n})", n + 1
        run = Run(obj, name, live=False)
        self.items.append(run)
        return run

    def remove(self, run: Run) -> Run | None:
        """Drop ``run``; the run to show instead when it was the one shown (its neighbour), else None."""
        i = self.items.index(run)
        self.items.pop(i)
        if run is not self.shown or not self.items:
            return None
        return self.items[min(i, len(self.items) - 1)]

    def infos(self) -> tuple[RunInfo, ...]:
        return tuple(r.info() for r in self.items)


class RunSwitcher(QToolBar):
    """A tab per run (the window's ``run_switcher``); choosing one shows it, its close button drops it."""

    def __init__(self, window):
        super().__init__("Runs", window, objectName="toolbar_runs", movable=False)
        self.win = window
        self.ctl = ctl = window.controller
        self.bar = QTabBar(objectName="run_tabs", tabsClosable=True, documentMode=True, expanding=False,
                           drawBase=False, toolTip="The runs this window holds: choose one to show it "
                           "(Ctrl+Tab / Ctrl+Shift+Tab; Ctrl+W closes the one shown)")  # fmt: skip
        self.bar.setElideMode(Qt.TextElideMode.ElideMiddle)  # a long trace name never widens the window
        # no taller than the Debug toolbar's buttons beside it: a default tab (32 px) made the row 11 px
        # taller, and a maximised window at 1366x768 one pixel taller than the screen
        self.bar.setStyleSheet("QTabBar::tab { padding: 1px 8px; }")
        self.bar.setMaximumHeight(22)
        self.addWidget(QLabel(" Runs ", toolTip=self.bar.toolTip()))
        self.addWidget(self.bar)
        self.bar.currentChanged.connect(self._chosen)
        self.bar.tabCloseRequested.connect(lambda i: self.close_run(self.bar.tabData(i)))
        ctl.runs_changed.connect(self.refresh)
        ctl.state_changed.connect(lambda: self.bar.setEnabled(not ctl.running))  # a switch would wait for the run

    def refresh(self) -> None:
        infos, bar = self.ctl.run_infos, self.bar
        with QSignalBlocker(bar):  # the worker's list, shown: not a choice of the user's
            while bar.count() > len(infos):
                bar.removeTab(bar.count() - 1)
            for i, r in enumerate(infos):
                if i >= bar.count():
                    bar.addTab("")
                bar.setTabText(i, r.label)
                bar.setTabData(i, r.id)
                bar.setTabToolTip(i, r.detail)
                if r.id == self.ctl.shown_run:
                    bar.setCurrentIndex(i)

    def _chosen(self, i: int) -> None:
        run_id = self.bar.tabData(i)
        if run_id is not None and run_id != self.ctl.shown_run:
            self.ctl.switch_run(run_id)

    # ------------------------------------------------------------------ what the menu and keys do
    def switch(self, run_id: int) -> int | None:
        return None if run_id == self.ctl.shown_run else self.ctl.switch_run(run_id)

    def cycle(self, by: int) -> int | None:
        """Show the next (+1) or previous (-1) run, round the end."""
        ids = [r.id for r in self.ctl.run_infos]
        if len(ids) < 2 or self.ctl.shown_run not in ids:
            return None
        return self.switch(ids[(ids.index(self.ctl.shown_run) + by) % len(ids)])

    def show_live(self) -> int | None:
        live = next((r for r in self.ctl.run_infos if r.live), None)
        if live is None:
            self.win.statusBar().showMessage("No live session: load a model or start a session", 8000)
            return None
        return self.switch(live.id)

    def close_shown(self) -> int | None:
        return self.close_run(self.ctl.shown_run)

    def close_run(self, run_id) -> int | None:
        """Close a run; the live session only if the user says so (its steps and edits go with it)."""
        info = next((r for r in self.ctl.run_infos if r.id == run_id), None)
        if info is None:
            return None
        if info.live:
            answer = QMessageBox.question(
                self.win, "Close the live session?",
                "Closing the live session drops its steps, mask edits and interventions for good.\n"
                "Save it first with File ▸ Save trace to keep it.\n\nClose it?",
                QMessageBox.StandardButton.Close | QMessageBox.StandardButton.Cancel, QMessageBox.StandardButton.Cancel,
            )  # fmt: skip
            if answer != QMessageBox.StandardButton.Close:
                self.win.statusBar().showMessage("Kept the live session", 8000)
                return None
        return self.ctl.close_run(run_id)

    def names(self, snap) -> tuple[str, str]:
        """The window title and the status bar's run name for ``snap`` (the run shown)."""
        run = self.ctl.current_run
        name = run.name if run is not None else snap.source_name
        model = snap.model_name.rstrip("/").rsplit("/", 1)[-1]
        ro = " (read-only)" if snap.read_only or (run is not None and run.read_only) else ""
        if snap.engine is not None:  # a remote engine: which one, always in sight
            host = snap.engine.split("://", 1)[-1]
            return f"gpt-inspector — {name} — {model} on engine {host}{ro}", f"{name}{ro} · {model} on engine {host}"
        return f"gpt-inspector — {name} — {model}{ro}", f"{name}{ro}"
