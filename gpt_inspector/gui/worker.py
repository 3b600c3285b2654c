"""The thread that owns the model and the session; the GUI only talks to it through signals.

Commands (see :mod:`.commands`) arrive as one queued signal ``(serial, command)`` and run in order
on the worker thread, each by the handler its type maps to in ``HANDLERS``. After each change the
worker builds a :class:`~.viewdata.Snapshot` (owned numpy arrays) and leaves it in a one-slot
mailbox: if the GUI is slower than the worker, intermediate snapshots are dropped, not queued.

Two things bypass the queue on purpose, because a long run occupies it: ``cancel()`` (a flag
the run checks between steps) and ``set_selection()`` (read at the next snapshot).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback

from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot

from ..core.breakpoints import Breakpoints, finish, run_until
from ..core.capture import HeadEdit, MaskEdit
from ..core.decoding import Decoding
from ..core.edits import restart_starts_new_session, toggle_cells
from ..core.errors import Cancelled, InspectorError, StepFailed
from ..core.recipe_check import check_recipe
from ..core.session import Session
from . import autosave, gc_guard, paint, remote_link
from . import commands as C
from .commands import ModelSpec, SessionSpec
from .runs import Runs
from .viewdata import Selection, Snapshot, ViewModel

__all__ = ["HANDLERS", "Breakpoints", "ModelSpec", "SessionSpec", "Worker"]

PUBLISH_INTERVAL = 0.08  # seconds between snapshots during a run: the eye needs no more
REFINE_SLICE = 0.12  # seconds of streamed overview work between two looks at the command queue
ROW_GRACE = 0.1  # seconds from the GUI's taking a step's picture to its overview rows: it draws undisturbed

HANDLERS: dict[type, object] = {}  # command type -> Worker method(self, serial, command)


def handles(command_type: type):
    def register(fn):
        HANDLERS[command_type] = fn
        return fn

    return register


def _placement(lm) -> dict:
    """Where and in what precision ``lm`` runs, as the load's description and the recipe write it."""
    return {"device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch.")}


class Worker(QObject):
    snapshot_ready = Signal()  # call take() for the newest snapshot
    error = Signal(str, str, str)  # title, message, kind: "user" | "model" | "internal"
    busy = Signal(str)  # what runs now; "" when the command is over
    progress = Signal(int, int)  # steps done, steps planned
    loaded = Signal(object)  # dict describing the model
    stopped = Signal(str)  # why a run ended
    done = Signal(int)  # serial of a finished command
    called = Signal(int, object, object)  # serial, result, exception (run_in_worker)
    notice = Signal(str)  # one line for the status bar: something the user did not ask for in so many words
    session_shown = Signal(str, int, object)  # prompt, seed, chat (Chat.to_json() or None) of the live session shown
    runs_changed = Signal(object, int)  # tuple of runs.RunInfo, id of the run shown
    link = Signal(bool, str)  # a remote engine's link: up (True) or lost (False), and one line saying so
    _command = Signal(int, object)

    def __init__(self):
        super().__init__()
        self.lm = None
        self.obj = None  # the run source shown; touched only on the worker thread
        self._runs_sent: tuple = ()
        self.runs = Runs()  # every run the window holds (the live session among them): none dropped by showing another
        self.vm: ViewModel | None = None
        self.model_spec: ModelSpec | None = None
        self.thread_idents: set[int] = set()  # for tests: where commands really ran
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self._last: Snapshot | None = None  # the last published (paint.prepare keeps its unchanged parts)
        self._pending = False
        self._taken_at = 0.0  # when the GUI thread last took a snapshot
        self._selection = Selection()
        self._serial = 0
        self._dispatched = 0  # the serial of the command that ran last: a later one waits in the queue
        self._cancel_before = 0
        self._published_version = -1
        self._thread: QThread | None = None
        self.autosave = True
        self.autosave_owner = autosave.new_owner()  # this window's own file: two windows never share one
        self._autosaved = ""
        self._refining: ViewModel | None = None  # the view model a streamed overview slice is queued for
        self._streaming = False  # slices ran since the overview was last complete
        self.remote = remote_link.RemoteLink(self)  # a remote engine's link: watched, and re-made when it drops
        self._command.connect(self._dispatch)

    # ------------------------------------------------------------------ GUI-thread API
    def start(self) -> None:
        gc_guard.hold()  # before the thread exists: it must never collect
        self._thread = QThread()
        self._thread.setObjectName("gpt-inspector worker")
        self.moveToThread(self._thread)
        # on the worker thread as it ends: its timers are stopped by the thread that started them
        self._thread.finished.connect(self.remote.shutdown, Qt.ConnectionType.DirectConnection)
        self._thread.start()

    def stop(self) -> None:
        self.cancel()
        if self._thread is not None:
            self._thread.quit()
            self._thread.wait()
            self._thread = None
            gc_guard.release()
        autosave.release(self.autosave_owner)  # nothing writes the file now: a later start may offer it

    def post(self, command) -> int:
        if type(command) not in HANDLERS:
            raise TypeError(f"not a worker command: {command!r}")
        with self._lock:
            self._serial += 1
            serial = self._serial
        self._command.emit(serial, command)
        return serial

    def cancel(self) -> None:
        """Stop every run posted so far at its next step boundary."""
        with self._lock:
            self._cancel_before = self._serial + 1

    def set_selection(self, sel: Selection) -> None:
        with self._lock:
            self._selection = sel

    def take(self) -> Snapshot | None:
        with self._lock:
            snap, self._latest, self._pending = self._latest, None, False
            self._taken_at = time.perf_counter()
        return snap

    # ------------------------------------------------------------------ worker thread
    @Slot(int, object)
    def _dispatch(self, serial: int, command) -> None:
        self.thread_idents.add(threading.get_ident())
        self._dispatched = serial
        try:
            HANDLERS[type(command)](self, serial, command)
        except Exception as e:  # a bug must not kill the thread or the session
            if self.remote.lost(e):  # the link dropped: said once in the banner, the window keeps what it shows
                return
            if isinstance(e, InspectorError):
                self.error.emit("Cannot do that", str(e), "user")
            elif isinstance(e, StepFailed):
                self.error.emit("The model failed", str(e), "model")
            else:
                tb = "".join(traceback.format_exception_only(type(e), e)).strip()
                self.error.emit("Internal error", f"{tb}\n\n{traceback.format_exc(limit=-3)}", "internal")
            with contextlib.suppress(Exception):  # the error that brought us here is already reported
                self._publish()
        finally:
            self.busy.emit("")
            self.done.emit(serial)

    def _cancelled(self, serial: int) -> bool:
        with self._lock:
            return serial < self._cancel_before

    def _publish(self) -> None:
        self._autosave()
        self._runs_changed()
        if self.vm is None:
            return
        with self._lock:
            sel = self._selection
        # the shown views first: a step's new overview row at long T follows in the next idle slice
        snap = self._last = paint.prepare(self._last, self.vm.build(sel, defer=True))  # unchanged parts kept
        self._published_version = snap.state_version
        with self._lock:
            self._latest = snap
            notify = not self._pending
            self._pending = True
        if notify:
            self.snapshot_ready.emit()
        if self.vm.overview_complete:
            if self._streaming:  # the last rows may come with a step's build
                self._streaming = False
                self.notice.emit("Overview complete")
        elif self._refining is not self.vm:  # one slice of overview work, queued behind the commands already waiting
            self._refining = self.vm
            QTimer.singleShot(0, self._refine_slice)

    # -- the streamed overview: a first build or a rebuild after a mask edit at long T ------------
    @Slot()
    def _refine_slice(self) -> None:
        vm, self._refining = self._refining, None
        if vm is None or vm is not self.vm:
            return  # stale: another session, model or trace is shown now
        if self._serial > self._dispatched:  # a command posted since (a zoom's refresh, a step) goes first
            self._refining = vm
            return QTimer.singleShot(0, self._refine_slice)
        grace = ROW_GRACE if self._pending else ROW_GRACE - (time.perf_counter() - self._taken_at)
        if vm.rows_behind and grace > 0:  # a step's rows: after the GUI thread took and drew its picture
            self._refining = vm
            return QTimer.singleShot(max(1, int(1000 * grace)), self._refine_slice)
        streamed = not vm.rows_behind  # not only a step's deferred rows: a stream, said in the status bar
        try:
            done = vm.refine(deadline=time.perf_counter() + REFINE_SLICE)
        except Exception as e:  # an overview that cannot be computed must not take the session down
            self.error.emit("Internal error", f"the overview could not be computed: {e!r}", "internal")
            return
        self._streaming = self._streaming or streamed
        if not done and streamed:
            th = vm.thumbs
            self.notice.emit(f"Overview: {100 * th.rows_done // max(1, th.T)}% of the query rows so far (refining)…")
        self._publish()  # shows the refined overview and queues the next slice

    def _autosave(self) -> None:
        """Write the session recipe when it changed (every step of a run included)."""
        live = self.runs.live  # the live session, whichever run is shown
        if not self.autosave or live is None:
            return
        if live.obj.lm is None:  # a remote engine's session: the engine keeps it, the file the way back to it
            return self.remote.autosave(live.obj)
        recipe = live.obj.recipe()
        lm = live.obj.lm
        recipe["load"] = _placement(lm)
        ms = self.model_spec
        if lm.device_map and ms is not None and ms.device_map:  # a restore places the model as the load did
            recipe["load"].update(device="auto", device_map=ms.device_map, max_memory=ms.max_memory,
                                  offload_folder=ms.offload_folder)  # fmt: skip
        key = json.dumps(recipe)
        if key == self._autosaved:
            return
        try:
            autosave.write(recipe, self.autosave_owner)
            self._autosaved = key
        except InspectorError as e:  # a full disk must not stop the debugger; say so once
            if self._autosaved != "failed":
                self._autosaved = "failed"
                self.error.emit("Autosave failed", str(e), "user")

    def _session(self):
        if self.obj is None:
            raise InspectorError("no model loaded: choose a model and press Load")
        self.obj.live.require("step")  # a trace or a beam says why not, in one line
        return self.obj

    def _show(self, obj) -> None:
        """``obj`` becomes the live session (it replaces the old one; the other runs stay) and is shown."""
        old = self.runs.live
        self._switch(self.runs.set_live(obj))
        if old is not None and old.obj is not obj:  # a remote engine's session replaced: its link is closed
            self.remote.detach(old.obj)

    def _switch(self, run) -> None:
        self.runs.shown, self.obj = run, run.obj
        if run.vm is None:
            run.vm = ViewModel(run.obj)
        self.vm = run.vm
        self._streaming = False
        lm = run.obj.lm  # a beam or a policy run may be of another model than the one loaded last
        if lm is not None and lm is not self.lm:
            self.lm = lm
            self.loaded.emit(self._describe())
        elif run.obj.engine is not None:
            self.remote.attach(run.obj)
        if run.live:
            chat = run.obj.chat
            self.session_shown.emit(run.obj.prompt, int(run.obj.seed), None if chat is None else chat.to_json())
        self._publish()

    def _runs_changed(self) -> None:
        """Tell the GUI thread about the runs when anything it shows of them changed (steps, what saves)."""
        shown = self.runs.shown
        state = (self.runs.infos(), -1 if shown is None else shown.id)
        if state != self._runs_sent:
            self._runs_sent = state
            self.runs_changed.emit(*state)

    def _session_for(self, wanted: SessionSpec | None):
        """The session to step: a new one when the controls' prompt or seed changed since it began."""
        s = self._session()
        if wanted is None or not restart_starts_new_session(s, wanted):
            return s
        what = "chat" if wanted.chat is not None else "prompt" if wanted.prompt != s.prompt else "seed"
        self._do_new_session(0, C.NewSession(wanted))
        text = self.obj.prompt if len(self.obj.prompt) <= 40 else self.obj.prompt[:39] + "…"
        self.notice.emit(f"The {what} changed: started a new session from “{text}” (seed {wanted.seed})")
        return self.obj

    def _describe(self) -> dict:
        lm = self.lm
        return {
            "name": lm.name,
            "describe": lm.describe(),
            **_placement(lm),
            "n_layers": lm.n_layers,
            "n_heads": lm.n_heads,
            "context_length": lm.context_length,
        }

    # -- commands ----------------------------------------------------------------------------
    @handles(C.Load)
    def _do_load(self, serial, cmd: C.Load) -> None:
        model, session = cmd.model, cmd.session
        self.busy.emit(f"Loading {model.model or 'the demo model'}…")
        lm = model.load()
        sess = Session(lm, **session.session_kwargs())
        self.lm, self.model_spec = lm, model
        self.loaded.emit(self._describe())
        self._show(sess)

    @handles(C.Restore)
    def _do_restore(self, serial, cmd: C.Restore) -> None:
        """Load the recipe's model and replay it; pickle and remote code stay off on restore."""
        recipe = cmd.recipe
        if "remote" in recipe:  # a session on a remote engine: back to it there
            return self.remote.restore(recipe)
        try:
            check_recipe(recipe)  # whole, before a model loads
        except InspectorError as e:
            self._refuse_restore(e)
        spec = ModelSpec.of_recipe(recipe)
        name = spec.model or "the demo model"
        self.busy.emit(f"Restoring the last session: loading {name}…")
        if self.lm is None or self.lm.name != spec.model:
            try:
                lm = spec.load()
            except (InspectorError, StepFailed) as e:
                self._refuse_restore(e)
            self.lm, self.model_spec = lm, spec
            self.loaded.emit(self._describe())
        name = self.lm.name or name

        def progress(done: int, total: int) -> None:
            self.busy.emit(f"Restoring {name}: operation {done}/{total}")
            self.progress.emit(done, total)

        try:
            sess = Session.replay(self.lm, recipe, progress, lambda: self._cancelled(serial))
        except Cancelled:
            # the user chose to start fresh: the recipe's prompt, seed and decoding, no step; the saved
            # session is moved aside, not overwritten by the fresh one's autosave
            d = recipe["initial_decoding"]
            kept = self._set_aside_autosave()
            start = dict(recipe["chat"]) if "chat" in recipe else {"prompt": recipe["prompt"],
                                                                   "prompt_ids": list(recipe["prompt_ids"])}  # fmt: skip
            self._show(Session(self.lm, seed=recipe["seed"], decoding=Decoding.from_json(d), **start))
            where = f"; the saved session is kept as {kept}" if kept else ""
            self.notice.emit(f"Restore cancelled: started fresh{where}")
            return
        except (InspectorError, StepFailed) as e:
            self._refuse_restore(e)
        self._show(sess)

    def _refuse_restore(self, e: Exception):
        kept = self._set_aside_autosave()  # the next start is clean; the file is kept for the user
        where = f"; the saved session is kept as {kept}" if kept else ""
        raise InspectorError(f"cannot restore this session recipe: {e}{where}") from None

    def _set_aside_autosave(self):
        """Move this window's autosave file aside (a restore failed or was cancelled); where it went, or None."""
        p = autosave.path(self.autosave_owner)
        if not self.autosave or not p.is_file():
            return None
        try:
            return autosave.move_aside(p)
        except OSError:
            return None

    @handles(C.NewSession)
    def _do_new_session(self, serial, cmd: C.NewSession) -> None:
        live = self.runs.live
        if live is not None and live.obj.engine is not None:  # a remote engine: the session is opened there
            return self._show(self.remote.new_session(live.obj, cmd.session, cmd.keep_edits))
        if self.lm is None:
            raise InspectorError("no model loaded: choose a model and press Load")
        session = cmd.session
        old = None if self.runs.live is None else self.runs.live.obj
        sess = Session(self.lm, **session.session_kwargs())
        if cmd.keep_edits and old is not None and old.mask_edits:
            sess.set_mask_edits(old.mask_edits)
        self._show(sess)

    @handles(C.Restart)
    def _do_restart(self, serial, cmd: C.Restart) -> None:
        s = self._session()
        if restart_starts_new_session(s, cmd.session):
            return self._do_new_session(serial, C.NewSession(cmd.session))
        s.restart()
        if cmd.session is not None:
            d = cmd.session
            s.set_decoding(d.temperature, d.top_k, d.top_p, **(d.settings or {}))
        self._publish()

    @handles(C.Step)
    def _do_step(self, serial, cmd: C.Step) -> None:
        s = self._session_for(cmd.session)
        self.busy.emit("Stepping…")
        s.step()
        self._publish()

    @handles(C.StepBack)
    def _do_step_back(self, serial, cmd: C.StepBack) -> None:
        self._session().step_back()
        self._publish()

    @handles(C.Run)
    def _do_run(self, serial, cmd: C.Run) -> None:
        s = self._session_for(cmd.session)
        run = run_until(s, max_steps=cmd.max_steps, target=cmd.target, breakpoints=cmd.breakpoints,
                        cancelled=lambda: self._cancelled(serial))  # fmt: skip
        last = [time.perf_counter(), 0]

        def each(p) -> None:
            last[1] = p.done
            self.progress.emit(p.done, p.planned)
            if time.perf_counter() - last[0] >= PUBLISH_INTERVAL and p.done < p.planned:
                self._publish()
                last[0] = time.perf_counter()

        self.busy.emit("Running…")
        reason = None
        try:
            reason = finish(run, each).reason
        finally:
            if reason is None:  # the error itself is reported by _dispatch
                reason = f"stopped by an error after {last[1]} steps"
            self._publish()
            self.stopped.emit(reason)

    @handles(C.SetDecoding)
    def _do_set_decoding(self, serial, cmd: C.SetDecoding) -> None:
        s = self._session()
        s.set_decoding(temperature=cmd.temperature, top_k=cmd.top_k, top_p=cmd.top_p, redecide=cmd.redecide,
                       **(cmd.settings or {}))  # fmt: skip
        self._publish()

    @handles(C.ForceToken)
    def _do_force_token(self, serial, cmd: C.ForceToken) -> None:
        self._session().force_token(cmd.token_id)
        self._publish()

    @handles(C.EditCells)
    def _do_edit_cells(self, serial, cmd: C.EditCells) -> None:
        s = self._session()
        old = list(s.mask_edits)
        edits = toggle_cells(old, cmd.cells, cmd.layer, cmd.head, cmd.scope, cmd.block)
        if edits == old:
            return
        self._recompute_mask(serial, s, edits)

    @handles(C.SetMaskEdits)
    def _do_set_mask_edits(self, serial, cmd: C.SetMaskEdits) -> None:
        self._recompute_mask(serial, self._session(), list(cmd.edits))

    def _recompute_mask(self, serial, s, edits) -> None:
        self._recompute(serial, s.set_mask_edits, edits, "the edited mask")

    def _recompute(self, serial, put, edits, what: str, done: str | None = None) -> None:
        """``put(edits)`` with the recompute's progress shown; Stop (cancel) leaves the session as it was."""
        self.busy.emit(f"Recomputing with {what}…")

        def progress(n: int, total: int) -> None:
            self.busy.emit(f"Recomputing with {what}: position {n}/{total}")
            self.progress.emit(n, total)

        try:
            put(edits, progress=progress, cancelled=lambda: self._cancelled(serial))
        except Cancelled as e:
            self.notice.emit(str(e))
        else:
            if done:
                self.notice.emit(done)
        self._publish()

    def _add_head_edit(self, serial, s, new: HeadEdit, what: str) -> None:
        """Put one more knock-out or patch in force, unless its head already has one (nothing stacks)."""
        for e in s.head_edits:
            if e.layer == new.layer and (e.head is None or new.head is None or e.head == new.head):
                where = f"layer {e.layer}'s attention" if e.head is None else f"head {e.layer}.{e.head}"
                has = "is knocked out" if e.patch_from is None else "is patched"
                self.notice.emit(f"Not applied: {where} {has} already (undo it in the Interventions panel first)")
                return
        self._recompute(serial, s.set_head_edits, [*s.head_edits, new], what,
                        f"{what[0].upper()}{what[1:]}; the run was recomputed with the chosen tokens kept")  # fmt: skip

    @handles(C.KnockOut)
    def _do_knock_out(self, serial, cmd: C.KnockOut) -> None:
        what = f"layer {cmd.layer}'s attention" if cmd.head is None else f"head {cmd.layer}.{cmd.head}"
        self._add_head_edit(serial, self._session(), HeadEdit(cmd.layer, cmd.head), f"{what} knocked out")

    @handles(C.PatchHead)
    def _do_patch_head(self, serial, cmd: C.PatchHead) -> None:
        s = self._session()
        self.busy.emit(f"Running “{cmd.prompt}” to patch head {cmd.layer}.{cmd.head} from it…")
        if s.engine is not None:  # the engine runs the patch source beside its session
            edit = s.patch_edit_from(cmd.layer, cmd.head, cmd.prompt)
        else:
            src = Session(s.lm, cmd.prompt)
            while src.cache_length < s.cache_length and not src.finished:
                src.step()
            edit = s.patch_edit(cmd.layer, cmd.head, src)
        text = cmd.prompt if len(cmd.prompt) <= 40 else cmd.prompt[:39] + "…"
        self._add_head_edit(serial, s, edit, f"head {cmd.layer}.{cmd.head} patched from “{text}”")

    @handles(C.UndoEdit)
    def _do_undo_edit(self, serial, cmd: C.UndoEdit) -> None:
        s, e = self._session(), cmd.edit
        mask = isinstance(e, MaskEdit)
        edits = s.mask_edits if mask else s.head_edits
        if e not in edits:  # undone already (a second click before the panel showed the first)
            return
        rest = [x for x in edits if x != e]
        if mask:
            self._recompute(serial, s.set_mask_edits, rest, "the edited mask", "Mask edit undone")
        else:
            kind = "knock-out" if e.patch_from is None else "patch"
            where = f"layer {e.layer}'s attention" if e.head is None else f"head {e.layer}.{e.head}"
            self._recompute(
                serial, s.set_head_edits, rest, "the knock-outs and patches", f"Undid the {kind} of {where}"
            )

    @handles(C.SetHeadEdits)
    def _do_set_head_edits(self, serial, cmd: C.SetHeadEdits) -> None:
        s = self._session()
        if list(cmd.edits) != s.head_edits:
            self._recompute(serial, s.set_head_edits, list(cmd.edits), "the knock-outs and patches")

    @handles(C.Refresh)
    def _do_refresh(self, serial, cmd: C.Refresh) -> None:
        self._publish()

    @handles(C.SaveTrace)
    def _do_save_trace(self, serial, cmd: C.SaveTrace) -> None:
        if self.obj is None:
            raise InspectorError("nothing to save: load a model first")
        self.busy.emit("Saving trace…")
        self.obj.save_trace(cmd.path)  # a beam and a trace too; a policy run says why not

    @handles(C.SwitchRun)
    def _do_switch_run(self, serial, cmd: C.SwitchRun) -> None:
        run = self.runs.get(cmd.run_id)
        if run is None:
            raise InspectorError("that run is closed already")
        if run is not self.runs.shown:
            self._switch(run)

    @handles(C.CloseRun)
    def _do_close_run(self, serial, cmd: C.CloseRun) -> None:
        run = self.runs.get(cmd.run_id)
        if run is None:
            return  # closed already (a second click before the switcher showed the first)
        if len(self.runs.items) == 1:
            raise InspectorError("the window always shows one run: open or load another before closing this one")
        after = self.runs.remove(run)
        if after is not None:
            self._switch(after)
        else:
            self._runs_changed()

    @handles(C.OpenTrace)
    def _do_open_trace(self, serial, cmd: C.OpenTrace) -> None:
        from pathlib import Path

        from ..core import load_trace

        self.busy.emit("Opening trace…")
        self._switch(self.runs.add(load_trace(cmd.path), Path(cmd.path).name))

    @handles(C.Show)
    def _do_show(self, serial, cmd: C.Show) -> None:
        obj = cmd.obj
        if cmd.name is None and obj.live.can("step"):
            self._show(obj)
        else:
            self._switch(self.runs.add(obj, cmd.name or obj.source_name))

    @handles(C.Call)
    def _do_call(self, serial, cmd: C.Call) -> None:
        def waiting() -> bool:  # a command posted after this one is in the queue (they run in order)
            with self._lock:
                return self._serial > serial

        try:
            if not cmd.idle:
                result, exc = cmd.fn(self.obj), None
            elif waiting():
                result, exc = None, Cancelled("gave way to a newer command")
            else:
                result, exc = cmd.fn(self.obj, waiting), None
        except Exception as e:  # handed back to the caller's callback
            result, exc = None, e
        self.called.emit(serial, result, exc)
        if self.vm is not None and self.vm.version != self._published_version:
            self._publish()  # the call changed the session (stepped, edited): show it
