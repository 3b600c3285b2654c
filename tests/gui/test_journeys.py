"""One user journey per main workflow, driven as a user drives the window: keys, clicks, menus.

Each journey presses keys on the shown window (or clicks a widget, or triggers the QAction a
menu item is) and then reads what is on screen: the status bar, the panels' text, the snapshot
the views show. Dialogs are answered by patching the Qt call that would open them.
"""

from __future__ import annotations

from keys import click_cell, press
from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QDialog, QFileDialog, QMessageBox

from gpt_inspector.gui import autosave


def status(win) -> str:
    """The status bar's message, and why the last run stopped (a line of its own that stays)."""
    return " · ".join(t for t in (win.statusBar().currentMessage(), win.st_stopped.text()) if t)


def test_step_run_pause_and_step_back(shown, wait_idle, qtbot, dialogs):
    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    assert win.st_step.text() == "step 1" and snap.n_steps == 1
    assert win.next_token.summary.text().startswith("step 1 ")  # the panel and the status bar agree
    win.session_panel.max_steps.setValue(4)
    press(qtbot, win, Qt.Key.Key_F5)
    snap = wait_idle(win)
    assert snap.n_steps == 5 and win.st_step.text().startswith("step 5")
    assert "Run stopped" in status(win)
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
    assert wait_idle(win).n_steps == 4
    win.session_panel.max_steps.setValue(10_000)
    press(qtbot, win, Qt.Key.Key_F5)
    press(qtbot, win, Qt.Key.Key_Escape)
    snap = wait_idle(win, timeout=60000)
    assert 4 <= snap.n_steps < 4 + 10_000 and "Run stopped" in status(win)
    assert not dialogs


def test_run_to_a_breakpoint(shown, wait_idle, qtbot, dialogs):
    win = shown()
    bp = win.breakpoints_panel
    bp.prob.setValue(1.0)  # every chosen token is below probability 1: stops after one step
    assert bp.on_prob.isChecked()
    press(qtbot, win, Qt.Key.Key_F5)
    snap = wait_idle(win)
    assert snap.n_steps == 1 and "breakpoint" in status(win) and "p=" in status(win)


def test_live_temperature_and_an_edited_prompt(shown, wait_idle, qtbot, dialogs):
    win = shown(temperature=0.0)
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    t = win.session_panel.temperature
    t.selectAll()
    qtbot.keyClicks(t, "0.8")
    qtbot.waitUntil(lambda: "temperature 0.8" in win.next_token.decoding.text(), timeout=5000)
    # edit the prompt, then press Step: a new session from the new prompt, and the status bar says so
    prompt = win.session_panel.prompt
    prompt.selectAll()
    qtbot.keyClicks(prompt, "He reads")
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    assert snap.n_steps == 1 and "".join(snap.labels[: snap.prompt_len]).replace("Ġ", " ").strip() != ""
    assert "new session" in status(win) and "He reads" in status(win)
    assert snap.prompt_len < 8  # "He reads", not the longer first prompt


def test_edit_the_mask_by_clicking_cells(shown, wait_idle, qtbot, dialogs, click_tab):
    win = shown()
    win.run(2)
    wait_idle(win)
    qtbot.mouseClick(win.score_matrix.edit_button, Qt.MouseButton.LeftButton)
    assert win.score_matrix.edit_mode
    click_cell(qtbot, win, 3, 1)
    snap = wait_idle(win)
    assert len(snap.mask_edits) == 1 and (snap.mask_edits[0].query, snap.mask_edits[0].key) == (3, 1)
    assert not snap.allowed[3, 1]
    assert win.mask_editor.list.count() == 0  # its tab is behind "Next token": it waits, unseen
    click_tab(win, "Mask edits")  # the user looks at the list
    assert win.mask_editor.list.count() == 1 and "1 edit(s) in force" in win.mask_editor.summary.text() or \
        "Last edit" in win.mask_editor.summary.text()  # fmt: skip
    qtbot.mouseClick(win.mask_editor.clear, Qt.MouseButton.LeftButton)
    snap = wait_idle(win)
    assert not snap.mask_edits and win.mask_editor.list.count() == 0
    assert "in force" not in win.mask_editor.summary.text()


def test_compare_greedy_with_beams_and_inspect_a_beam(shown, wait_idle, qtbot, dialogs):
    from gpt_inspector.gui.views.compare import ComparePanel

    win = shown("llama", "She eats an apple")
    panel = win.findChildren(ComparePanel)[0]
    panel.beams.setValue(2)
    panel.returns.setValue(2)
    panel.new_tokens.setValue(3)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None, timeout=20000)
    assert panel.table.rowCount() >= 2
    panel.inspect_pick.setCurrentIndex(1)
    qtbot.mouseClick(panel.inspect_button, Qt.MouseButton.LeftButton)
    snap = wait_idle(win)
    assert snap.read_only and "read-only" in win.windowTitle() and not win.acts.step.isEnabled()


def test_export_an_image(shown, wait_idle, qtbot, dialogs, monkeypatch, tmp_path):
    from gpt_inspector.gui import export_dialog as ed

    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    target = tmp_path / "head.png"

    def accept(self):
        qtbot.addWidget(self)
        self.set_path(target)
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ed.ExportDialog, "exec", accept)
    press(qtbot, win, Qt.Key.Key_E, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(target.is_file, timeout=20000)
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert f"to {target}" in status(win) and status(win).startswith("Exported")


def test_save_and_reopen_a_trace(shown, wait_idle, qtbot, dialogs, monkeypatch, tmp_path):
    win = shown()
    win.run(3)
    live = wait_idle(win)
    path = tmp_path / "t.safetensors"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(path), ""))
    press(qtbot, win, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    assert path.is_file() and status(win).startswith(f"Saved trace to {path}")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(path), ""))
    # nothing to ask: the trace opens as a run of its own and the live session stays in the switcher
    press(qtbot, win, Qt.Key.Key_O, Qt.KeyboardModifier.ControlModifier)
    snap = wait_idle(win)
    assert snap.read_only and snap.labels == live.labels and "read-only" in win.windowTitle()
    assert not dialogs and [r.name for r in win.controller.run_infos] == ["Live session", "t.safetensors"]


def test_probe_the_cache_and_check_the_math(shown, wait_idle, qtbot, dialogs):
    win = shown()
    win.run(2)
    wait_idle(win)
    probe, math = win.probe_panel, win.mathcheck_panel
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: probe.result is not None, timeout=30000)
    qtbot.mouseClick(math.check_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: math.check is not None, timeout=30000)
    assert "no check" not in math.verdict.text()
    # a new prompt: both results were about the old session, so they go
    win.session_panel.prompt.setPlainText("He reads")
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    assert probe.result is None and math.check is None and "no check" in math.verdict.text()


def test_restore_after_a_crash(shown, wait_idle, qtbot, dialogs, monkeypatch):
    from gpt_inspector.gui.app import _offer_restore
    from gpt_inspector.gui.main_window import MainWindow

    win = shown()
    win.run(3)
    before = wait_idle(win)
    saved = autosave.read()
    assert saved is not None
    win.worker.stop()  # the crash: the next start finds the autosave
    other = MainWindow(restore_layout=False)
    qtbot.addWidget(other)
    other.show()
    busy = []
    other.controller.busy_text.connect(busy.append)
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    try:
        other.restore(_offer_restore(other))
        snap = wait_idle(other, timeout=60000)
        assert snap.labels == before.labels and snap.n_steps == 3
        assert any("operation 3/3" in b for b in busy), busy  # progress counts the replayed operations
        assert not any("None" in b for b in busy), busy  # the model is named, never "None"
    finally:
        other.worker.stop()


def test_hover_readout_follows_a_mask_edit_under_a_still_pointer(shown, wait_idle, qtbot, dialogs):
    win = shown()
    win.run(2)
    wait_idle(win)
    sm = win.score_matrix
    pos = sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(1.5, 3.5)))
    qtbot.mouseMove(sm.glw.viewport(), pos)  # the pointer comes to rest on cell (3, 1)
    qtbot.waitUntil(lambda: sm.readout.text().startswith("query 3 "), timeout=3000)
    assert "masked" not in sm.readout.text()
    qtbot.mouseClick(sm.edit_button, Qt.MouseButton.LeftButton)
    click_cell(qtbot, win, 3, 1)
    wait_idle(win)
    assert sm.readout.text().endswith(": masked")
