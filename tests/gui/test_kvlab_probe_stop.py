"""The KV lab panel's Stop (or Esc) during the cache probe, in a local window: the probe ends between two
forward passes, the panel says so without a dialog, and the lab is as it was (its next step is the
reference lab's)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

# long enough that the probe runs for seconds (~90 forward passes on the tiny model): Stop lands in it
PROMPT = " ".join(["She eats an apple. He reads"] * 3)


@pytest.mark.parametrize("how", ["Stop", "Esc"])
def test_stop_ends_the_cache_probe_and_the_lab_stays(make_window, wait_idle, qtbot, tiny_lm, no_dialogs, how):
    from gpt_inspector.core.kvlab import KVLab, make
    from gpt_inspector.gui.views import kvlab

    win = make_window(prompt=PROMPT)
    panel = kvlab.create_panel(win)
    win.add_panel(kvlab.PANEL_TITLE, panel, kvlab.PANEL_AREA)
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    panel.policy.setCurrentText("h2o")
    panel.budget.setValue(4)
    panel.steps.setValue(2)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == 2, timeout=20000)
    wait_idle(win)

    notes: list = []
    panel.progressed.connect(lambda *note: notes.append(note))  # every progress note, as the panel gets them
    qtbot.mouseClick(panel.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "forward pass" in panel.status.text(), timeout=20000)
    assert panel.stop_button.isEnabled()
    if how == "Stop":
        qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    else:  # Esc (Pause) stops the lab's long jobs as it stops the window's runs
        assert win.acts.pause.isEnabled()
        qtbot.keyClick(QApplication.focusWidget() or win, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not panel.job.running, timeout=20000)
    assert "the cache probe was stopped" in panel.status.text()
    assert panel.privacy_label.text() == "" and not no_dialogs
    what, done, total = notes[-1]
    assert what == kvlab.PROBE and 1 <= done < total  # it ended before its last forward pass

    ref = KVLab(tiny_lm("gpt2"), PROMPT, make("h2o", 4, **panel.options()))
    ref.run_steps(2)
    qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)  # the lab goes on as if no probe had run
    qtbot.waitUntil(lambda: len(panel.view.steps) == 3 and not panel.job.running, timeout=20000)
    ref.step()
    assert [s.to_json() for s in panel.view.steps] == [s.to_json() for s in ref.history]
