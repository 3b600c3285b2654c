"""A bad autosave never locks the window out; a restore can be cancelled to start fresh."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QMessageBox, QProgressDialog

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit
from gpt_inspector.gui import autosave

GOOD = {"format": "gpt-inspector-recipe/1", "model": None, "prompt": "She eats", "prompt_ids": [1, 2], "seed": 0,
        "initial_decoding": {"temperature": 0.0, "top_k": None, "top_p": None}, "ops": [{"op": "step"}]}  # fmt: skip
HOSTILE = {  # each crashed the old window: before the restore question, or after "Yes"
    "mask_edits_not_a_list": '{**GOOD, "mask_edits": 5}',
    "seed_overflow": '{**GOOD, "seed": 1e400}',
    "decoding_a_list": '{**GOOD, "decoding": [1, 2]}',
}


def test_hostile_autosaves_are_set_aside_and_the_window_starts_fresh(qtbot, monkeypatch, capsys, wait_idle):
    from gpt_inspector.gui import app
    from gpt_inspector.gui.main_window import MainWindow

    for n, (name, expr) in enumerate(HOSTILE.items()):
        text = json.dumps(eval(expr, {"GOOD": GOOD})).replace('"seed": Infinity', '"seed": 1e400')
        autosave.path(f"old-{name}").write_text(text)
        os.utime(autosave.path(f"old-{name}"), (1000 + n, 1000 + n))
    asked = []
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: asked.append(a) or QMessageBox.StandardButton.Yes)
    monkeypatch.setattr(QApplication, "exec", lambda *a: 0)  # the start only: the test drives the loop itself
    args = SimpleNamespace(model=None, prompt=None, steps=None, screenshot=None)
    assert app.run(args) == 0
    win = next(w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible())
    qtbot.addWidget(win)
    try:
        snap = wait_idle(win, timeout=120000)
        assert not asked  # nothing restorable: no question
        assert snap is not None and snap.n_steps == 0 and not win.errors  # a fresh session on the demo model
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 3 and all("cannot be restored" in line and "kept as" in line for line in lines)
        folder = autosave.path().parent
        assert not list(folder.glob("autosave-old-*.json"))  # the next start is clean
        assert len(list(folder.glob("autosave-old-*.json.rejected-*"))) == 3  # and every file kept
    finally:
        win.worker.stop()
        win.close()


def test_escape_on_the_restore_progress_cancels_and_starts_fresh(make_window, wait_idle, qtbot, tiny_lm, monkeypatch):
    from gpt_inspector.core import session as session_mod

    # a long restore: every op replayed (compacting would fold these cycles into two recomputes)
    monkeypatch.setattr(session_mod, "compact_ops", lambda ops, shape=None: list(ops))
    win = make_window("gpt2")
    s = gi.Session(tiny_lm("gpt2"), "She eats an apple. He reads")
    s.run(40)
    s.set_mask_edits([MaskEdit(5, 1, layer=0)])
    recipe = s.recipe()
    block, clear = recipe["ops"][-1], {"op": "mask", "edits": []}
    recipe["ops"] += [clear, block] * 900  # each a recompute of every position: a long restore
    autosave.write(recipe, win.worker.autosave_owner)
    win.restore(recipe)
    dialog = win.findChild(QProgressDialog, "restore_progress")
    qtbot.waitUntil(dialog.isVisible, timeout=20000)
    qtbot.keyClick(dialog, Qt.Key.Key_Escape)
    snap = wait_idle(win, timeout=60000)
    assert snap.n_steps == 0 and not win.errors  # started fresh, long before the replay would have ended
    assert "Restore cancelled" in win.statusBar().currentMessage()
    kept = list(autosave.path().parent.glob("autosave-*.json.rejected-*"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["ops"] == recipe["ops"]  # the session is kept


def test_a_killed_saves_temporaries_are_removed_at_the_next_start(qtbot, monkeypatch, tmp_path, wait_idle):
    import subprocess
    import sys

    from gpt_inspector.core import outfile
    from gpt_inspector.gui import app, settings
    from gpt_inspector.gui.actions import RECENT_TRACES
    from gpt_inspector.gui.main_window import MainWindow

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a writer that is gone, as after a kill -9 in the middle of a save
    traces = tmp_path / "traces"
    traces.mkdir()
    settings.remember(RECENT_TRACES, str(traces / "t.safetensors"))
    left = [traces / f".t.safetensors{outfile.MARK}{dead.pid}-0123abcd.tmp",
            autosave.path().parent / f".autosave-x.json{outfile.MARK}{dead.pid}-4567abcd.tmp"]  # fmt: skip
    alive = traces / f".u.safetensors{outfile.MARK}{os.getpid()}-89abcdef.tmp"  # a save in progress: kept
    for p in (*left, alive):
        p.write_bytes(b"half" * 1000)
    monkeypatch.setattr(QApplication, "exec", lambda *a: 0)  # the start only
    assert app.run(SimpleNamespace(model=None, prompt=None, steps=None, screenshot=None)) == 0
    win = next(w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible())
    qtbot.addWidget(win)
    try:
        wait_idle(win, timeout=120000)
        assert not any(p.exists() for p in left) and alive.exists()
    finally:
        win.worker.stop()
        win.close()
