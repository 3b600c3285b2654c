"""The one place that knows what the debugger is doing: the selection, the snapshot shown, what runs.

Menus, shortcuts, buttons and panels all go through a :class:`Controller`; it turns their
requests into typed commands (:mod:`.commands`) for the worker thread and turns the worker's
signals back into state the views read. It owns the only copy of the selection.

Threading rule: the session lives in the worker thread. The controller only posts commands and
takes Snapshots; exports build their figures on the worker too (``run_in_worker``), so the GUI
thread never reads the live session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, QTimer, Signal

from ..core.breakpoints import Breakpoints
from .commands import (  # re-exported: callers build commands from here
    COMMANDS,
    Call,
    CloseRun,
    EditCells,
    ForceToken,
    KnockOut,
    Load,
    ModelSpec,
    NewSession,
    OpenTrace,
    PatchHead,
    Refresh,
    Restart,
    Restore,
    Run,
    SaveTrace,
    SessionSpec,
    SetDecoding,
    SetHeadEdits,
    SetMaskEdits,
    Show,
    Step,
    StepBack,
    SwitchRun,
    UndoEdit,
)
from .runs import RunInfo
from .viewdata import Selection, Snapshot
from .worker import Worker

__all__ = ["COMMANDS", "Controller", "ModelSpec", "SessionSpec", *(c.__name__ for c in COMMANDS)]


class Controller(QObject):
    snapshot_changed = Signal(object)  # Snapshot, after it became ``self.snapshot``
    selection_changed = Signal(int, int, int)  # layer, head, query (-1: follow the newest)
    state_changed = Signal()  # busy, running, source or step changed: what may be done now
    busy_text = Signal(str)  # what the worker does now; "" when a command is over
    progress = Signal(int, int)  # steps done, planned
    stopped = Signal(str)  # why a run ended
    done = Signal(int)  # serial of a finished command
    loaded = Signal(object)  # dict describing the model
    error = Signal(str, str, str)  # title, message, kind: "user" | "model" | "internal"
    notice = Signal(str)  # a line for the status bar from the worker
    posted = Signal(object)  # a command, as it is queued for the worker
    session_shown = Signal(str, int, object)  # prompt, seed, chat (or None) of the live session now shown
    runs_changed = Signal()  # ``run_infos`` or ``shown_run`` changed
    link_changed = Signal(bool, str)  # a remote engine's link is up (True) or lost, and one line saying so

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.selection = Selection()
        self.snapshot: Snapshot | None = None
        self.read_only = False
        self.has_source = False
        self.last_stop_reason: str | None = None
        self.pending: set[int] = set()
        self.runs: set[int] = set()
        self._stops: dict[int, Callable[[], None]] = {}  # panel jobs Pause stops: serial -> how
        self._refresh_serial: int | None = None
        self._refresh_sel: Selection | None = None
        self._callbacks: dict[int, object] = {}
        self._idle_waiters: list = []
        self.run_infos: tuple[RunInfo, ...] = ()  # every run the worker holds, in the switcher's order
        self.shown_run = -1  # the id of the run shown

        self.worker = w = Worker()
        w.start()
        # bound methods, not lambdas: PySide calls a lambda on the emitting (worker) thread
        w.snapshot_ready.connect(self._snapshot_ready)
        w.error.connect(self.error)
        w.busy.connect(self.busy_text)
        w.progress.connect(self.progress)
        w.loaded.connect(self._loaded)
        w.stopped.connect(self._stopped)
        w.done.connect(self._done)
        w.called.connect(self._called)
        w.notice.connect(self.notice)
        w.session_shown.connect(self.session_shown)
        w.runs_changed.connect(self._runs_changed)
        w.link.connect(self.link_changed)

    # ------------------------------------------------------------------ state
    @property
    def busy(self) -> bool:
        return bool(self.pending)

    @property
    def running(self) -> bool:
        return bool(self.runs)

    @property
    def live(self) -> bool:
        """The run shown can be stepped (a session, not a trace or a beam)."""
        return self.snapshot is not None and self.snapshot.live.can("step")

    @property
    def current_run(self) -> RunInfo | None:
        return next((r for r in self.run_infos if r.id == self.shown_run), None)

    @property
    def finished(self) -> bool:
        return bool(self.snapshot is not None and self.snapshot.finished)

    @property
    def n_steps(self) -> int:
        return self.snapshot.n_steps if self.snapshot is not None else 0

    # ------------------------------------------------------------------ posting
    def post(self, command) -> int:
        """Queue a command for the worker; returns its serial."""
        serial = self.worker.post(command)
        self.pending.add(serial)
        if isinstance(
            command, (Run, EditCells, SetMaskEdits, KnockOut, PatchHead, SetHeadEdits, UndoEdit)
        ):  # long work that Pause (Esc) may stop
            self.runs.add(serial)
        self.posted.emit(command)
        self.state_changed.emit()
        return serial

    def run_in_worker(self, fn, callback=None, idle: bool = False, stop=None) -> int:
        """Run ``fn(session_or_trace)`` on the worker thread; ``callback(result, error)`` on this one.
        ``idle``: give way to later commands (see ``commands.Call``). ``stop``: how Pause (Esc) ends
        it, as it ends a run (a panel's long job: its Stop), called here; Pause stays on while it runs."""
        serial = self.post(Call(fn, idle))
        if callback is not None:
            self._callbacks[serial] = callback
        if stop is not None:
            self._stops[serial] = stop
            self.state_changed.emit()
        return serial

    def when_idle(self, callback) -> None:
        """Call ``callback()`` once every posted command has finished and its snapshot is shown."""
        if not self.pending:
            self.take_snapshot()
            QTimer.singleShot(0, callback)
        else:
            self._idle_waiters.append(callback)

    # ------------------------------------------------------------------ commands
    def load(self, model: ModelSpec, session: SessionSpec) -> int:
        return self.post(Load(model, session))

    def restore(self, recipe: dict) -> int:
        return self.post(Restore(recipe))

    def new_session(self, session: SessionSpec) -> int:
        return self.post(NewSession(session))

    def restart(self, session: SessionSpec | None = None) -> int:
        return self.post(Restart(session))

    def step(self, session: SessionSpec | None = None) -> int:
        return self.post(Step(session))

    def step_back(self) -> int:
        return self.post(StepBack())

    def run(self, max_steps: int | None, breakpoints: Breakpoints | None = None,
            session: SessionSpec | None = None) -> int:  # fmt: skip
        return self.post(Run(max_steps=max_steps, breakpoints=breakpoints, session=session))

    def run_to(self, target: int, breakpoints: Breakpoints | None = None) -> int:
        return self.post(Run(target=int(target), breakpoints=breakpoints))

    def pause(self) -> bool:
        """Stop every run (and panel job that says how) posted so far after its current step; True if one was running."""
        self.worker.cancel()
        for stop in list(self._stops.values()):
            stop()
        return self.stoppable

    @property
    def stoppable(self) -> bool:
        """Something Pause (Esc) stops is running."""
        return bool(self.runs or self._stops)

    def set_decoding(self, temperature: float, top_k: int | None, top_p: float | None, redecide: bool = False,
                     settings: dict | None = None):  # fmt: skip
        return self.post(SetDecoding(temperature, top_k, top_p, redecide, settings))

    def force_token(self, token_id: int) -> int:
        return self.post(ForceToken(int(token_id)))

    def edit_cells(self, cells, scope: str = "head", block: bool | None = None) -> int:
        """Toggle blocks on (query, key) cells of the selected head, its layer or every layer."""
        sel = self.selection
        cells = tuple((int(q), int(k)) for q, k in cells)
        return self.post(EditCells(cells, sel.layer, sel.head, scope, block))

    def set_mask_edits(self, edits) -> int:
        return self.post(SetMaskEdits(tuple(edits)))

    def knock_out(self, layer: int, head: int | None) -> int | None:
        """Knock out a head (None: the layer's whole attention); the worker refuses one already in force."""
        return self.post(KnockOut(int(layer), None if head is None else int(head)))

    def patch_head(self, layer: int, head: int, prompt: str) -> int | None:
        return self.post(PatchHead(int(layer), int(head), str(prompt)))

    def set_head_edits(self, edits) -> int | None:
        return self.post(SetHeadEdits(tuple(edits)))

    def undo_edit(self, edit) -> int | None:
        """Take one mask edit, knock-out or patch out of force (the others stay)."""
        return self.post(UndoEdit(edit))

    def open_trace(self, path: str) -> int:
        return self.post(OpenTrace(str(path)))

    def save_trace(self, path: str) -> int:
        return self.post(SaveTrace(str(path)))

    def show(self, obj, name: str | None = None) -> int:
        return self.post(Show(obj, name))

    def switch_run(self, run_id: int) -> int:
        return self.post(SwitchRun(int(run_id)))

    def close_run(self, run_id: int) -> int:
        """Drop a run for good (the window asks first for the live session)."""
        return self.post(CloseRun(int(run_id)))

    # ------------------------------------------------------------------ selection
    def select(self, layer: int | None = None, head: int | None = None, kind: str | None = None) -> None:
        """Change the selection; layer and head are clamped to the model's."""
        s = self.selection
        snap = self.snapshot
        L = snap.n_layers if snap else 1 << 30
        H = snap.n_heads if snap else 1 << 30
        self.set_selection(replace(
            s,
            layer=s.layer if layer is None else min(max(layer, 0), L - 1),
            head=s.head if head is None else min(max(head, 0), H - 1),
            kind=s.kind if kind is None else kind,
        ))  # fmt: skip

    def select_query(self, pos: int | None) -> None:
        snap = self.snapshot
        if pos is not None and snap is not None and pos >= snap.T - 1:
            pos = None  # the newest position: follow the run from now on
        self.set_selection(replace(self.selection, query=pos))

    def select_view(self, view) -> None:
        """The part (q0, q1, k0, k1) of a pooled score matrix on screen, for its exact cells; None: all of it."""
        view = None if view is None else tuple(int(x) for x in view)
        self.set_selection(replace(self.selection, view=view))

    def set_selection(self, sel: Selection) -> None:
        if sel == self.selection:
            return
        self.selection = sel
        self.worker.set_selection(sel)
        self.selection_changed.emit(sel.layer, sel.head, -1 if sel.query is None else sel.query)
        if self._refresh_serial is None and self.has_source:
            self._refresh_sel = sel
            self._refresh_serial = self.post(Refresh())

    # ------------------------------------------------------------------ from the worker
    def _snapshot_ready(self) -> None:
        self.take_snapshot()  # looked up at call time, so a benchmark can wrap it

    def take_snapshot(self) -> None:
        snap = self.worker.take()
        if snap is None:
            return
        self.snapshot = snap
        self.has_source = True
        self.read_only = snap.read_only
        self.snapshot_changed.emit(snap)
        self.state_changed.emit()

    def _runs_changed(self, infos: tuple, shown: int) -> None:
        self.run_infos, self.shown_run = infos, shown
        self.runs_changed.emit()
        self.state_changed.emit()

    def _stopped(self, reason: str) -> None:
        self.last_stop_reason = reason
        self.stopped.emit(reason)

    def _loaded(self, info: dict) -> None:
        if self.selection.layer >= info["n_layers"] or self.selection.head >= info["n_heads"]:
            self.set_selection(Selection(kind=self.selection.kind))
        self.loaded.emit(info)

    def _done(self, serial: int) -> None:
        self.pending.discard(serial)
        self.runs.discard(serial)
        self._stops.pop(serial, None)
        if serial == self._refresh_serial:
            self._refresh_serial = None
            if self._refresh_sel != self.selection:  # changed while that refresh ran
                self._refresh_sel = self.selection
                self._refresh_serial = self.post(Refresh())
        self.done.emit(serial)
        self.state_changed.emit()
        if not self.pending:
            self.take_snapshot()
            waiters, self._idle_waiters = self._idle_waiters, []
            for cb in waiters:
                cb()

    def _called(self, serial: int, result, error) -> None:
        cb = self._callbacks.pop(serial, None)
        if cb is not None:
            cb(result, error)
        elif error is not None:
            self.error.emit("Panel error", str(error), "internal")

    def stop(self) -> None:
        self.worker.stop()
