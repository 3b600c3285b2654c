"""The window driven the way a user drives it: keys, toolbar buttons, menu actions, panel buttons.

Every test presses keys on the shown, active window (or clicks a widget) and then reads what is
on screen: the status bar, the panels, the snapshot the views show.
"""

from __future__ import annotations

import threading
import time

import pytest
from keys import press
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractSpinBox, QApplication, QInputDialog, QLineEdit, QPlainTextEdit, QTextEdit

from gpt_inspector.gui import commands
from gpt_inspector.gui.worker import HANDLERS


def _step_text(win) -> str:
    return win.st_step.text()


def _stopped(win) -> str:
    """Why the last run stopped, as the status bar shows it (a line that stays, not a timed message)."""
    return win.st_stopped.text() if win.st_stopped.isVisible() else ""


def test_f10_steps_and_shift_f10_steps_back(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    assert _step_text(win) == "step 0"
    assert not win.acts.back.isEnabled()  # nothing to undo at step 0
    for n in (1, 2):
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
        assert _step_text(win) == f"step {n}"
    assert win.acts.back.isEnabled()
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
    snap = wait_idle(win)
    assert _step_text(win) == "step 1" and snap.n_steps == 1
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
    wait_idle(win)
    assert _step_text(win) == "step 0" and not win.acts.back.isEnabled()
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)  # disabled: nothing happens
    assert wait_idle(win).n_steps == 0 and not no_dialogs and not win.errors


def test_f5_toolbar_run_and_debug_run_each_run_the_max_steps_count(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    win.session_panel.max_steps.setValue(3)
    press(qtbot, win, Qt.Key.Key_F5)
    wait_idle(win)
    assert _step_text(win) == "step 3"
    assert _stopped(win) == "Run stopped: ran 3 steps"
    button = win.acts.toolbar.widgetForAction(win.acts.run)
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    wait_idle(win)
    assert _step_text(win) == "step 6"
    debug_menu = next(a.menu() for a in win.menuBar().actions() if a.text() == "&Debug")
    assert win.acts.run in debug_menu.actions()
    win.acts.run.trigger()  # Debug ▸ Run
    wait_idle(win)
    assert _step_text(win) == "step 9" and not no_dialogs


def _slow_steps(session, release=None):
    """Steps of at least 50 ms; with ``release`` (a threading.Event), the 4th and later wait for it, so a
    run is certainly still going when the test's key lands, however slowly a loaded machine paints."""
    orig = session.step

    def step():
        time.sleep(0.05)
        if release is not None and session.n_steps >= 3:
            release.wait(20)
        st = orig()
        if st.finish_reason == "eos":  # keep going: the run must still be going when Esc comes
            st = session.force_token(5)
        return st

    session.step = step


def test_esc_pauses_a_run(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    release = threading.Event()
    win.run_in_worker(lambda s: _slow_steps(s, release))
    wait_idle(win)
    win.session_panel.max_steps.setValue(40)
    press(qtbot, win, Qt.Key.Key_F5)
    qtbot.waitUntil(lambda: win.st_progress.value() >= 3, timeout=10000)
    assert win.st_busy.text().startswith("running:") and win.acts.pause.isEnabled()
    assert not win.acts.step.isEnabled()
    press(qtbot, win, Qt.Key.Key_Escape)
    release.set()
    snap = wait_idle(win)
    assert _stopped(win) == "Run stopped: paused"
    assert 3 <= snap.n_steps < 40 and _step_text(win) == f"step {snap.n_steps}"
    assert not win.acts.pause.isEnabled() and win.acts.step.isEnabled() and not no_dialogs


def test_head_and_layer_keys_work_right_after_start(shown, wait_idle, qtbot):
    win = shown()
    focus = QApplication.focusWidget()
    assert focus is not None and not isinstance(focus, (QLineEdit, QAbstractSpinBox, QPlainTextEdit, QTextEdit))
    model_text = win.session_panel.model.currentText()
    press(qtbot, win, Qt.Key.Key_BracketRight)
    snap = wait_idle(win)
    assert snap.selection.head == 1 and win.overview.isVisible()
    assert win.session_panel.model.currentText() == model_text  # nothing typed into the Model box
    press(qtbot, win, Qt.Key.Key_PageDown)
    assert wait_idle(win).selection.layer == 1
    press(qtbot, win, Qt.Key.Key_BracketLeft)
    press(qtbot, win, Qt.Key.Key_PageUp)
    snap = wait_idle(win)
    assert (snap.selection.layer, snap.selection.head) == (0, 0)
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    assert "layer 0 · head 0" in win.score_matrix.title.text()


def test_a_breakpoint_stops_a_run(shown, wait_idle, qtbot):
    win = shown()
    bp = win.breakpoints_panel
    qtbot.mouseClick(bp.on_prob, Qt.MouseButton.LeftButton)
    assert bp.on_prob.isChecked()
    bp.prob.setValue(1.0)  # every token is below p = 1: stop after the first step
    press(qtbot, win, Qt.Key.Key_F5)
    wait_idle(win)
    assert _step_text(win) == "step 1"
    assert _stopped(win).startswith("Run stopped: breakpoint at step 1: p=")


def test_run_to_step_goes_forward_and_back(shown, wait_idle, qtbot, monkeypatch):
    win = shown()
    answers = iter([(5, True), (2, True), (9, False)])
    asked = []

    def get_int(parent, title, label, value, *a, **k):  # the dialog Ctrl+F10 opens, answered
        asked.append(value)
        return next(answers)

    monkeypatch.setattr(QInputDialog, "getInt", get_int)
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    assert _step_text(win) == "step 5" and _stopped(win) == "Run stopped: reached step 5"
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    assert _step_text(win) == "step 2"
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ControlModifier)  # cancelled: stays
    assert wait_idle(win).n_steps == 2
    assert asked == [10, 15, 12]  # the dialog proposes ten steps past the current one


def test_probe_and_math_check_panels_run_from_their_own_buttons(shown, wait_idle, qtbot, tiny_lm, no_dialogs):
    win = shown()
    probe = win.probe_panel
    n_layers = tiny_lm("gpt2").n_layers
    assert probe.layers.count() == n_layers and probe.chosen_layers() == [0]
    assert probe.probe_button.isEnabled()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    probe.layers.item(n_layers - 1).setCheckState(Qt.CheckState.Checked)
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    wait_idle(win)
    assert probe.result is not None and [lp.layer for lp in probe.result.layers] == [0, n_layers - 1]
    assert probe.table.rowCount() == win.snapshot.T and "recovered" in probe.summary.text()

    math = win.mathcheck_panel
    press(qtbot, win, Qt.Key.Key_BracketRight)
    wait_idle(win)
    qtbot.mouseClick(math.check_button, Qt.MouseButton.LeftButton)
    wait_idle(win)
    assert "layer 0, head 1" in math.verdict.text() and "✓ match" in math.verdict.text()
    qtbot.mouseClick(math.check_all_button, Qt.MouseButton.LeftButton)
    wait_idle(win)
    assert not math.heads.isHidden() and math.heads.rowCount() == n_layers
    assert not no_dialogs and not win.errors


def test_every_command_has_a_handler_and_anything_else_is_refused_when_posted(make_window, no_dialogs):
    assert set(HANDLERS) == set(commands.COMMANDS)
    win = make_window()
    with pytest.raises(TypeError, match="not a worker command"):
        win.controller.post(("step", {}))  # the old string protocol
    with pytest.raises(TypeError, match="max_steps"):
        commands.Run(max_steps=False)  # QAction's checked flag must never become a step count
    assert not win.busy and not no_dialogs


@pytest.mark.parametrize(("entry", "busy_text"), [("Probe the KV cache", "Cache probe is still running"),
                                                  ("Check the math of the selected head", "Math check is still running")])  # fmt: skip
def test_a_tools_entry_chosen_twice_runs_once(shown, wait_idle, qtbot, no_dialogs, entry, busy_text):
    """The panel's button is disabled while its job runs; its Tools menu entry is not, so a second
    choice must not queue a second job (the first result would clear the busy state under it)."""
    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    tools = next(a.menu() for a in win.menuBar().actions() if a.text() == "&Tools")
    act = next(a for a in tools.actions() if a.text().startswith(entry))
    posted = []
    orig = win.controller.run_in_worker
    win.controller.run_in_worker = lambda *a, **kw: posted.append(1) or orig(*a, **kw)
    act.trigger()
    act.trigger()  # before the first job can come back: its callback runs on this thread's event loop
    assert win.statusBar().currentMessage() == busy_text
    wait_idle(win)
    assert len(posted) == 1 and not no_dialogs and not win.errors
    act.trigger()  # once it is back, the entry runs again
    wait_idle(win)
    assert len(posted) == 2


def test_why_a_run_stopped_stays_in_the_status_bar_until_the_next_step(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    win.session_panel.max_steps.setValue(2)
    press(qtbot, win, Qt.Key.Key_F5)
    wait_idle(win)
    assert _stopped(win) == "Run stopped: ran 2 steps"
    # it is no timed message: another line coming and going (the old one vanished with its timeout) leaves it
    assert win.statusBar().currentMessage() != "Run stopped: ran 2 steps"
    win.statusBar().showMessage("Saved trace to t.safetensors", 50)
    qtbot.waitUntil(lambda: win.statusBar().currentMessage() == "", timeout=3000)
    assert _stopped(win) == "Run stopped: ran 2 steps"
    press(qtbot, win, Qt.Key.Key_F10)  # the next step: the reason is stale
    wait_idle(win)
    assert _stopped(win) == "" and _step_text(win) == "step 3"
    press(qtbot, win, Qt.Key.Key_F5)
    wait_idle(win)
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)  # a step back clears it too
    wait_idle(win)
    assert _stopped(win) == "" and not no_dialogs


def _type_into(qtbot, box, text: str) -> None:
    """Select what a spin box shows and type over it, as a user does."""
    qtbot.mouseDClick(box.lineEdit(), Qt.MouseButton.LeftButton)
    box.lineEdit().selectAll()
    qtbot.keyClicks(box.lineEdit(), text)
    qtbot.keyClick(box.lineEdit(), Qt.Key.Key_Tab)


def test_top_k_lists_only_the_tokens_it_keeps(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    sp, nt = win.session_panel, win.next_token
    _type_into(qtbot, sp.temperature, "1")
    _type_into(qtbot, sp.top_k, "3")
    qtbot.waitUntil(lambda: (win.snapshot.decoding or {}).get("top_k") == 3, timeout=5000)
    win.score_matrix.setFocus()  # the user clicks back into a view, so F10 reaches the window
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    top = snap.step.top
    # the engine lists the three kept, best first (the seven zero-probability rows torch.topk's tie once added are gone)
    by_logit = snap.step.logits.argsort(descending=True)[:3].tolist()
    assert [e.token_id for e in top] == by_logit and all(e.prob > 0 for e in top)
    assert nt.top_ids == by_logit
    assert all(p > 0 for p in nt.probs) and sum(nt.probs) == pytest.approx(1.0, abs=1e-5)
    assert nt.shown == 3 and nt.axis.labels == [e.label for e in top if e.prob > 0]
    assert len(nt.bars.opts["width"]) == 3 and nt.chosen in nt.top_ids
    assert "the sampler keeps 3 tokens" in nt.summary.text() and "top-k 3" in nt.decoding.text()
    assert not no_dialogs and not win.errors
