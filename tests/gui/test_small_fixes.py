"""Issue 28's smaller items, each driven as a user drives the window and read off the screen."""

from __future__ import annotations

from keys import press
from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QMessageBox

from gpt_inspector.core.capture import MaskEdit


def test_restore_names_the_restored_model_and_load_keeps_it(make_window, wait_idle, qtbot, tiny_dir, monkeypatch):
    from gpt_inspector.gui.app import _offer_restore
    from gpt_inspector.gui.main_window import MainWindow

    win = make_window("llama")
    win.run(2)
    before = wait_idle(win)
    win.worker.stop()  # a crash: the next start offers the autosave
    other = MainWindow(restore_layout=False)
    qtbot.addWidget(other)
    other.show()
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    try:
        other.restore(_offer_restore(other))
        snap = wait_idle(other, timeout=60000)
        assert snap.labels == before.labels
        # the Model field shows the restored model (it said "Demo model", so Load switched models)
        assert other.session_panel.model.currentText() == str(tiny_dir["llama"])
        qtbot.mouseClick(other.session_panel.load_button, Qt.MouseButton.LeftButton)
        snap = wait_idle(other, timeout=60000)
        assert snap.model_name == before.model_name and snap.n_layers == before.n_layers
        assert not other.errors
    finally:
        other.worker.stop()


def test_a_fast_drag_in_edit_mask_blocks_every_cell_it_crossed(shown, wait_idle, qtbot):
    win = shown()
    win.run(2)
    t = wait_idle(win).T
    sm = win.score_matrix
    qtbot.mouseClick(sm.edit_button, Qt.MouseButton.LeftButton)
    assert sm.edit_mode

    def at(query, key):
        return sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(key + 0.5, query + 0.5)))

    vp = sm.glw.viewport()
    # down on the last row's first key, one move event to its last but one, up there: a flick of the wrist
    qtbot.mousePress(vp, Qt.MouseButton.LeftButton, pos=at(t - 1, 0))
    qtbot.mouseMove(vp, at(t - 1, t - 2))
    qtbot.mouseRelease(vp, Qt.MouseButton.LeftButton, pos=at(t - 1, t - 2))
    snap = wait_idle(win)
    sel = snap.selection
    assert list(snap.mask_edits) == [MaskEdit(t - 1, k, sel.layer, sel.head) for k in range(t - 1)]
    assert not win.errors


def test_top_k_lists_only_the_kept_tokens_best_first(shown, wait_idle, qtbot):
    win = shown()
    # sampled: greedy decoding ignores top-k (as generate does with do_sample=False)
    temp = win.session_panel.temperature
    temp.setFocus()
    temp.selectAll()
    qtbot.keyClicks(temp, "1")
    press(qtbot, win, Qt.Key.Key_Tab)
    qtbot.waitUntil(lambda: win.snapshot.decoding.get("temperature") == 1.0, timeout=5000)
    box = win.session_panel.top_k
    box.setFocus()
    box.selectAll()
    qtbot.keyClicks(box, "3")
    press(qtbot, win, Qt.Key.Key_Tab)
    qtbot.waitUntil(lambda: win.snapshot.decoding.get("top_k") == 3, timeout=5000)
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    # the three largest logits, by an independent sort; the rest have p = 0 and are not listed
    logits = snap.step.logits.double().numpy()
    want = sorted(range(len(logits)), key=lambda i: -logits[i])[:3]
    assert [e.token_id for e in snap.step.top] == want
    assert win.next_token.top_ids == want and win.next_token.shown == 3
    assert abs(sum(e.prob for e in snap.step.top) - 1.0) < 1e-6


def test_the_kv_lab_shows_its_progress_and_says_why_it_stopped_early(shown, wait_idle, qtbot, click_tab, tiny_lm):
    from gpt_inspector.core.kvlab import KVLab, make

    win = shown()
    click_tab(win, "KV cache lab")
    panel = win.kvlab_panel
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    seen = []
    panel.progressed.connect(lambda name, i, n: seen.append((i, n)), Qt.ConnectionType.DirectConnection)
    panel.policy.setCurrentText("streaming")
    panel.budget.setValue(8)
    panel.steps.setValue(100)  # more than the 64-position context leaves
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None, timeout=60000)
    wait_idle(win)
    ref = KVLab(tiny_lm("gpt2"), "She eats an apple. He reads", make("streaming", 8))
    n = len(ref.run_steps(100))
    assert n < 100 and ref.finished == "context"
    assert seen == [(i, 100) for i in range(1, n + 1)]  # one progress line a step, counted from 1
    assert f"finished after step {n} (context): no step can follow" in panel.status.text()
    assert f"{n} steps" in panel.status.text()


def test_a_new_session_leaves_no_panel_showing_the_old_one(shown, wait_idle, qtbot, click_tab):
    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    click_tab(win, "Compare decoding")
    cmp = win.compare_panel
    cmp.new_tokens.setValue(3)
    qtbot.mouseClick(cmp.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: cmp.result is not None, timeout=30000)
    click_tab(win, "KV cache lab")
    lab = win.kvlab_panel
    lab.steps.setValue(2)
    qtbot.mouseClick(lab.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: lab.view is not None, timeout=30000)
    click_tab(win, "Logit lens")
    qtbot.waitUntil(lambda: win.lens_panel.result is not None, timeout=30000)
    wait_idle(win)
    old = win.lens_panel.result
    assert cmp.table.rowCount() > 0 and lab.table.rowCount() > 0
    # the user types another prompt and steps: a new session
    box = win.session_panel.prompt
    qtbot.mouseClick(box.viewport(), Qt.MouseButton.LeftButton)
    box.selectAll()
    qtbot.keyClicks(box, "The cat sat")
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    assert snap.n_steps == 1 and "The cat sat" in "".join(snap.labels).replace("␣", " ")
    why = "the window shows another session now: run it again on this one"
    assert cmp.result is None and cmp.table.rowCount() == 0 and not cmp.inspect_button.isEnabled()
    assert cmp.summary.text() == why
    assert lab.view is None and lab.table.rowCount() == 0 and lab.status.text() == why
    # the lens in front follows the new session's step; never the old prompt's
    qtbot.waitUntil(lambda: win.lens_panel.result is not old, timeout=30000)
    r = win.lens_panel.result
    now, before = (snap.step.position, snap.step.token_id), (old.position, old.token_id)
    assert r is None or (r.position, r.token_id) == now != before
    assert not win.errors
