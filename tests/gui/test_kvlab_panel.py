"""The KV cache lab panel, driven as a user would: pick a policy, press Run, read the plot and table."""

from __future__ import annotations

import numpy as np
import pytest
from keys import run_lab
from PySide6.QtCore import Qt

PROMPT = "She eats an apple. He reads"


def test_run_step_and_probe_show_the_labs_numbers(make_window, wait_idle, qtbot, tiny_lm, no_dialogs):
    from gpt_inspector.core.kvlab import KVLab, make

    win = make_window(prompt=PROMPT)
    panel = run_lab(qtbot, win, "streaming", 4, 6)
    wait_idle(win)
    lm = tiny_lm("gpt2")
    ref = KVLab(lm, PROMPT, make("streaming", 4))
    want = ref.run_steps(6)
    xs, ys = panel.kl_curve.getData()
    np.testing.assert_array_equal(xs, [s.index + 1 for s in want])  # steps count from 1, as in the window
    np.testing.assert_allclose(ys, [s.kl for s in want], rtol=1e-12, atol=0)
    k = ref.first_divergence
    assert k is not None and panel.divergence.isVisible() and panel.divergence.value() == k + 1
    assert len(panel.miss.getData()[0]) == sum(not s.agree for s in want)
    assert f"first divergence step {k + 1}" in panel.status.text()
    assert panel.table.rowCount() == lm.n_layers
    assert panel.table.item(1, 1).text() == f"{want[-1].bytes_policy[1]:,}"
    assert panel.table.item(1, 2).text() == f"{want[-1].bytes_full[1]:,}"
    assert f"{sum(want[-1].bytes_policy):,} of {sum(want[-1].bytes_full):,} bytes" in panel.bytes_label.text()
    # one more step, then the probe
    qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(panel.view.steps) == 7, timeout=20000)
    ref.step()
    assert panel.kl_curve.getData()[1][-1] == pytest.approx(ref.history[-1].kl, rel=1e-12)
    qtbot.mouseClick(panel.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "recovered" in panel.privacy_label.text(), timeout=20000)
    r = ref.probe()
    assert (
        f"{r.recovered} of {r.prompt_tokens} prompt tokens recovered ({r.held} still held)"
        in panel.privacy_label.text()
    )
    # the shown session was never touched: still at its first state
    assert win.snapshot.n_steps == 0
    assert not no_dialogs and not win.errors
    # Show policy run: the window now shows the policy run; the score matrix masks what it evicted
    qtbot.mouseClick(panel.show_button, Qt.MouseButton.LeftButton)
    wait_idle(win)
    snap = win.snapshot
    assert snap.n_steps == 7
    win.select(layer=1, head=2)
    snap = wait_idle(win)
    t = len(snap.allowed)
    gone = (ref.policy.evicted_at[1][2] <= t - 1).numpy()  # (T,) evicted before the newest query ran
    assert gone.any() and not snap.allowed[t - 1][gone].any()
    assert sum(snap.kv_bytes) == sum(ref.history[-1].bytes_policy)  # the policy's bytes, not the simulation's
    # stepping it in the window ends the lab: Step says so instead of mixing runs
    qtbot.keyClick(win, Qt.Key.Key_F10)
    wait_idle(win)
    qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "outside the lab" in panel.status.text(), timeout=10000)


def test_quantization_disables_the_budget_and_a_trace_is_refused(make_window, qtbot, reopened_as_trace, no_dialogs):
    win = make_window(prompt=PROMPT)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    panel.policy.setCurrentText("int4")
    assert not panel.budget.isEnabled() and panel.settings()[1] is None
    reopened_as_trace(win)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "live session" in panel.status.text(), timeout=10000)
    assert no_dialogs and "live session" in no_dialogs[-1][1]
    assert panel.view is None and panel.run_button.isEnabled()


def test_back_in_the_panel_and_the_windows_step_back_undo_a_lab_step_exactly(make_window, wait_idle, qtbot, tiny_lm,
                                                                             no_dialogs):  # fmt: skip
    from gpt_inspector.core.kvlab import KVLab, make

    lm = tiny_lm("llama")
    win = make_window("llama", prompt=PROMPT)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    panel.policy.setCurrentText("h2o")
    panel.budget.setValue(5)
    panel.steps.setValue(4)
    clean = KVLab(lm, PROMPT, make("h2o", 5))
    want = clean.run_steps(5)

    def shown(n):
        qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == n and not win.busy, timeout=20000)
        for got, w in zip(panel.view.steps, want):
            assert (got.index, got.kl, got.agree, got.bytes_policy, got.evicted_now) == \
                (w.index, w.kl, w.agree, w.bytes_policy, w.evicted_now)  # fmt: skip
        np.testing.assert_array_equal(panel.kl_curve.getData()[1], [s.kl for s in want[:n]])

    def click(button):
        qtbot.waitUntil(button.isEnabled, timeout=20000)
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)

    click(panel.run_button)
    shown(4)
    click(panel.back_button)
    shown(3)
    click(panel.step_button)  # the same step again: the same numbers (H2O's scores were put back)
    shown(4)
    for n in (3, 2, 1, 0):
        click(panel.back_button)
        qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == n, timeout=20000)
    assert "at its prompt" in panel.status.text()
    click(panel.back_button)
    qtbot.waitUntil(lambda: "nothing to step back" in panel.status.text(), timeout=20000)
    assert no_dialogs and "the lab is at its prompt" in no_dialogs[-1][1]
    no_dialogs.clear()
    for n in (1, 2, 3, 4):
        click(panel.step_button)
        shown(n)
    # the window's Step back (Shift+F10) on the shown policy run undoes a lab step too
    click(panel.show_button)
    wait_idle(win)
    qtbot.keyClick(win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
    snap = wait_idle(win)
    assert snap.n_steps == 3
    shown(3)  # the panel follows: the undone lab step is gone from its plot
    twin = KVLab(lm, PROMPT, make("h2o", 5))
    twin.run_steps(3)
    np.testing.assert_array_equal(snap.kv_evicted, twin.evicted(snap.selection.layer))
    click(panel.step_button)
    shown(4)
    assert not no_dialogs and [e[1] for e in win.errors] == [
        "nothing to step back: the lab is at its prompt (no lab step has run)"
    ]


def test_on_a_sliding_window_model_the_full_cache_is_the_models_with_what_is_kept_beside(make_window, wait_idle,
                                                                                         qtbot, tiny_lm):  # fmt: skip
    # gemma2's layer 0 has a 4-key window: the model's own cache holds 3 positions there, the inspector every one
    win = make_window("gemma2", prompt=PROMPT)
    panel = run_lab(qtbot, win, "h2o", 0, 3)  # budget 0, unlimited: the policy's cache is the model's own
    wait_idle(win)
    lm = tiny_lm("gemma2")
    entry = 2 * lm.n_kv_heads * lm.head_dim * 4  # one position's K and V in one layer, float32
    t = win.snapshot.prompt_len + 3 - 1  # the prompt and two fed tokens (the third is chosen, not fed)
    full, kept = [3 * entry, t * entry], [t * entry, t * entry]
    assert [panel.table.item(i, 2).text() for i in range(2)] == [f"{full[0]:,} (kept {kept[0]:,})", f"{full[1]:,}"]
    assert [panel.table.item(i, 1).text() for i in range(2)] == [f"{b:,}" for b in full]
    assert panel.bytes_label.text() == (f"cache after step 3: {sum(full):,} of {sum(full):,} bytes (100.0%); "
                                        f"kept for inspection {sum(kept):,}")  # fmt: skip


def test_the_policy_picker_states_each_policys_rule(make_window, qtbot, no_dialogs):
    """The rule shown under the picker and on each item is the registry's paragraph, the README's text."""
    from PySide6.QtCore import Qt as _Qt

    from gpt_inspector.core.kvlab import registry

    win = make_window(prompt=PROMPT)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    assert panel.policy.currentText() == "h2o" and panel.rule.text() == registry.RULES["h2o"]
    panel.policy.setFocus()
    seen = []
    for _ in range(len(registry.NAMES) - 1):
        qtbot.keyClick(panel.policy, _Qt.Key.Key_Down)
        name = panel.policy.currentText()
        seen.append(name)
        assert panel.rule.text() == registry.rule(name)
    assert {"snapkv", "tova", "keynorm", "int4"} <= set(seen)
    i = panel.policy.findText("tova")
    assert panel.policy.itemData(i, _Qt.ItemDataRole.ToolTipRole) == registry.RULES["tova"]
    assert not no_dialogs
