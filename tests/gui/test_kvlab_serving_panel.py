"""The KV cache lab panel's serving controls (when to evict, page size, AdaKV), set with keys and clicks
as a user does; the lab they start is the one the API builds with the same options."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt

PROMPT = "She eats an apple. He reads"


def test_schedule_page_and_adakv_controls_run_that_policy(make_window, wait_idle, qtbot, tiny_lm, no_dialogs):
    from gpt_inspector.core.kvlab import KVLab, make

    lm = tiny_lm("llama")
    win = make_window("llama", prompt=PROMPT)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    panel.policy.setCurrentText("tova")
    panel.budget.setValue(8)
    panel.steps.setValue(6)
    # "every 2 steps": two items down from "every step"
    panel.schedule.setFocus()
    qtbot.keyClick(panel.schedule, Qt.Key.Key_Down)
    qtbot.keyClick(panel.schedule, Qt.Key.Key_Down)
    assert panel.schedule.currentText() == "every 2 steps"
    # pages of 2 positions: one step up from "entries"
    qtbot.keyClick(panel.page, Qt.Key.Key_Up)
    assert panel.page.value() == 2
    qtbot.mouseClick(panel.shared, Qt.MouseButton.LeftButton)
    assert panel.shared.isChecked()
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == 6 and not win.busy, timeout=20000)
    wait_idle(win)
    ref = KVLab(lm, PROMPT, make("tova", 8, schedule=2, page=2, share="layer"))
    want = ref.run_steps(6)
    np.testing.assert_allclose(panel.kl_curve.getData()[1], [s.kl for s in want], rtol=1e-12, atol=0)
    assert [s.evicted_now for s in panel.view.steps] == [s.evicted_now for s in want]
    assert sum(want[-1].evicted_now) > 0
    last = want[-1]
    assert f"in pages of 2: {sum(last.bytes_paged):,} of {sum(last.bytes_full_paged):,}" in panel.bytes_label.text()
    assert "tova budget 8, every 2 steps, pages of 2, shared across a layer's heads (AdaKV)" in panel.status.text()
    assert not no_dialogs and not win.errors
    # a quantization takes none of these knobs
    panel.policy.setCurrentText("int4")
    assert not any(w.isEnabled() for w in (panel.schedule, panel.page, panel.shared)) and panel.options() == {}


def test_a_page_too_big_for_the_budget_is_a_dialog_in_words(make_window, qtbot, no_dialogs):
    win = make_window(prompt=PROMPT)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    panel.policy.setCurrentText("tova")
    panel.budget.setValue(8)
    panel.page.setFocus()
    qtbot.keyClick(panel.page, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(panel.page, "8")
    qtbot.keyClick(panel.page, Qt.Key.Key_Return)
    assert panel.page.value() == 8
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(no_dialogs), timeout=20000)
    assert "pages of 8" in no_dialogs[-1][1] and panel.view is None and panel.run_button.isEnabled()
