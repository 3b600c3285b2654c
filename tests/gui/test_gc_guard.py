"""The cyclic garbage collector never runs on the worker thread while a window lives.

A collection on the worker that frees Qt objects deadlocked the window in CI (worker collecting
inside matplotlib while the GUI thread waited for the GIL). These tests watch every collection
with ``gc.callbacks`` while the user steps and exports, and fail if one ran anywhere but the GUI
thread; then they check that automatic collection comes back once the last worker stops.
"""

from __future__ import annotations

import gc
import threading

from keys import press
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog

from gpt_inspector.gui import gc_guard


def test_collections_run_only_on_the_gui_thread(shown, wait_idle, qtbot, dialogs, monkeypatch, tmp_path):
    from gpt_inspector.gui import export_dialog as ed

    win = shown()
    assert not gc.isenabled() and gc_guard.holding()
    where: list[int] = []

    def watch(phase, info):
        if phase == "start":
            where.append(threading.get_ident())

    gc.callbacks.append(watch)
    try:
        targets = []

        def accept(self):
            qtbot.addWidget(self)
            targets.append(tmp_path / f"head{len(targets)}.png")
            self.set_path(targets[-1])
            return QDialog.DialogCode.Accepted

        monkeypatch.setattr(ed.ExportDialog, "exec", accept)
        for _ in range(3):  # steps and figure builds allocate enough on the worker to pass gc's threshold
            press(qtbot, win, Qt.Key.Key_F10)
            wait_idle(win)
            press(qtbot, win, Qt.Key.Key_E, Qt.KeyboardModifier.ControlModifier)
            qtbot.waitUntil(lambda: bool(targets) and targets[-1].is_file(), timeout=20000)
        qtbot.waitUntil(lambda: bool(where), timeout=5000)  # the GUI thread's collector ticks about every second
    finally:
        gc.callbacks.remove(watch)
    gui = threading.get_ident()
    assert win.worker.thread_idents and gui not in win.worker.thread_idents  # the work did run elsewhere
    assert where, "the GUI thread's collector never ran"
    assert set(where) == {gui}


def test_automatic_collection_comes_back_when_the_last_worker_stops(qtbot):
    from gpt_inspector.gui.worker import Worker

    assert gc.isenabled() or gc_guard.holding()
    before = gc_guard.holding()
    a, b = Worker(), Worker()
    a.start()
    b.start()
    assert not gc.isenabled()
    a.stop()
    assert not gc.isenabled()  # one worker still runs
    b.stop()
    assert gc.isenabled() == (not before)
