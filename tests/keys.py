"""What a user does to a window, written once for the window tests (tests/gui, tests/remote): a key
press, a click on a score-matrix cell, the wait for the worker, and the KV lab's cache probe stopped
midway (a local window and a window on a real engine run the same journey, with their timeouts)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtWidgets import QApplication


def press(qtbot, win, key, modifier=Qt.KeyboardModifier.NoModifier) -> None:
    """A key press as the keyboard delivers it: to the widget with the focus (the window if none has it)."""
    qtbot.keyClick(QApplication.focusWidget() or win, key, modifier)


def wait(qtbot, win, timeout: int = 30000):
    """Until the window's worker has finished every command; then the snapshot the views show."""
    qtbot.waitUntil(lambda: not win.busy, timeout=timeout)
    win.controller.take_snapshot()
    return win.snapshot


def cell_pos(win, query: int, key: int) -> QPoint:
    """The centre of a score-matrix cell, in the pixels of the view's viewport."""
    sm = win.score_matrix
    return sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(key + 0.5, query + 0.5)))


def click_cell(qtbot, win, query: int, key: int) -> None:
    """A left click on the centre of a score-matrix cell."""
    qtbot.mouseClick(win.score_matrix.glw.viewport(), Qt.MouseButton.LeftButton, pos=cell_pos(win, query, key))


def stop_the_probe(qtbot, win, panel, how: str, timeout: int) -> None:
    """The KV lab panel's cache probe stopped midway: Probe clicked, "forward pass" awaited, then Stop
    clicked (``how == "Stop"``) or Esc pressed (Pause stops the lab's long jobs as it stops runs).
    Then the panel says so without a dialog, and its last progress note is from before the last pass."""
    from gpt_inspector.gui.views.kvlab import PROBE

    notes: list = []
    panel.progressed.connect(lambda *note: notes.append(note))  # every progress note, as the panel gets them
    qtbot.mouseClick(panel.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "forward pass" in panel.status.text(), timeout=timeout)
    assert panel.stop_button.isEnabled()
    if how == "Stop":
        qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    else:
        assert how == "Esc" and win.acts.pause.isEnabled()
        press(qtbot, win, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not panel.job.running, timeout=timeout)
    assert "the cache probe was stopped" in panel.status.text()
    assert panel.privacy_label.text() == ""
    what, done, total = notes[-1]
    assert what == PROBE and 1 <= done < total, notes[-1]  # it ended before its last forward pass


def run_lab(qtbot, win, policy: str, budget: int, steps: int, timeout: int = 20000):
    """The KV lab panel brought to the front, ``policy`` at ``budget`` for ``steps`` steps picked, Run
    clicked; returns the panel once it shows the run's steps."""
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    panel.policy.setCurrentText(policy)
    panel.budget.setValue(budget)
    panel.steps.setValue(steps)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == steps, timeout=timeout)
    return panel
