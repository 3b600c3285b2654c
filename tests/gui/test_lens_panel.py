"""The logit lens panel, driven as a user would: step with F10, open the panel, read what it shows."""

from __future__ import annotations

import numpy as np
import pytest
from keys import press
from PySide6.QtCore import QPointF, Qt


def test_lens_follows_steps_and_a_click_selects_the_head(make_window, wait_idle, qtbot, tiny_lm, no_dialogs):

    win = make_window()
    win.activateWindow()
    qtbot.waitExposed(win)
    panel = win.lens_panel
    win.raise_panel(panel)  # the user brings the Logit lens tab to the front
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    for _ in range(2):
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
    qtbot.waitUntil(lambda: panel.result is not None and panel.result.step == 1, timeout=10000)
    lm = tiny_lm("gpt2")
    assert panel.table.rowCount() == lm.n_layers
    r = panel.result
    assert r.attribution.shape == (lm.n_layers, lm.n_heads)
    assert panel.image.image.shape == (lm.n_layers, lm.n_heads)
    # counted as the status bar counts steps done
    assert f"step {win.snapshot.n_steps} (position {r.position})" in panel.status.text() and win.snapshot.n_steps == 2
    assert "click a cell" in panel.map_note.text()
    # what the table shows is the model's logits at the last layer
    last = panel.table.item(lm.n_layers - 1, 1).text()
    assert float(last) == pytest.approx(r.layers[-1].prob, abs=1e-4)
    ys = panel.curve.getData()[1]
    np.testing.assert_allclose(ys, [x.prob for x in r.layers])
    # a click on the attribution map selects that head everywhere
    view = panel.map_plot
    at = view.mapFromScene(panel.image.mapToScene(QPointF(3.5, 1.5)))  # the centre of cell (layer 1, head 3)
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=at)
    qtbot.waitUntil(lambda: (win.selection.layer, win.selection.head) == (1, 3), timeout=3000)
    # Export… hands the figure of what is on screen to the export dialog
    import gpt_inspector.gui.export_dialog as ed

    shown = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(ed, "_show", lambda parent, fig, name, scale, what, preview=None: shown.append((fig.heading, name)))
    try:
        qtbot.mouseClick(panel.export_button, Qt.MouseButton.LeftButton)
    finally:
        monkey.undo()
    assert shown and "logit lens" in shown[0][0] and shown[0][1] == f"lens-step{r.step + 1}.png"
    assert not no_dialogs and not win.errors


def test_lens_on_a_trace_says_it_needs_a_live_session(make_window, reopened_as_trace, no_dialogs):
    win = make_window()
    reopened_as_trace(win)
    assert win.snapshot.read_only
    assert "live session" in win.lens_panel.status.text()


def test_ctrl_k_knocks_out_the_selected_head_and_the_run_is_recomputed(make_window, wait_idle, qtbot, tiny_lm,
                                                                      no_dialogs, monkeypatch):  # fmt: skip
    import gpt_inspector as gi
    from gpt_inspector.core.capture import HeadEdit

    win = make_window()
    win.activateWindow()
    qtbot.waitExposed(win)
    qtbot.waitUntil(win.isActiveWindow, timeout=3000)

    def pressed(key, mod=Qt.KeyboardModifier.NoModifier):
        press(qtbot, win, key, mod)
        return wait_idle(win)

    for _ in range(3):
        pressed(Qt.Key.Key_F10)
    pressed(Qt.Key.Key_BracketRight)  # head 1
    snap = pressed(Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: "Head 0.1 knocked out" in win.statusBar().currentMessage(), timeout=5000)
    ref = gi.Session(tiny_lm("gpt2"), "She eats an apple. He reads")
    ref.run(3)
    ref.set_head_edits([HeadEdit(0, 1)])
    snap = wait_idle(win)
    np.testing.assert_allclose(snap.step.probs.numpy(), ref.current.probs.numpy(), atol=1e-6)
    assert snap.mask_report is not None and snap.mask_report.total_variation > 0  # before / after shown
    # patching the next head from another prompt, through the Tools menu (one intervention a head)
    from PySide6.QtWidgets import QInputDialog

    pressed(Qt.Key.Key_BracketRight)  # head 2

    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("The cat sat on the mat and the dog", True))
    next(a for a in win.tools_menu.actions() if a.text().startswith("Patch the selected head")).trigger()
    qtbot.waitUntil(lambda: "Head 0.2 patched from" in win.statusBar().currentMessage(), timeout=10000)
    assert not no_dialogs and not win.errors


def test_the_lens_costs_nothing_while_its_tab_is_behind_another(make_window, wait_idle, qtbot, click_tab, no_dialogs):
    # Qt keeps a dock on an unchosen tab "visible" (moved outside the window): the panel must not
    # take that for being seen, or every step would pay for a lens nobody looks at
    from gpt_inspector.gui.deferred import on_screen

    win = make_window()
    panel = win.lens_panel
    jobs = []
    real = win.run_in_worker
    win.run_in_worker = lambda job, done, *idle: jobs.append(job) or real(job, done, *idle)
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    assert panel.isVisible() and not on_screen(panel)  # what Qt says, and what the user sees
    assert panel.result is None and not jobs
    click_tab(win, "Logit lens")  # the user looks: the lens of the current step comes
    qtbot.waitUntil(lambda: panel.result is not None and panel.result.step == 0, timeout=10000)
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    qtbot.waitUntil(lambda: panel.result.step == 1, timeout=10000)
    click_tab(win, "KV cache")  # behind again: steps run no lens
    n = len(jobs)
    press(qtbot, win, Qt.Key.Key_F10)
    # the panels hear of a step with the snapshot that shows it: once it is on screen, a lens job
    # would already have been asked for
    wait_idle(win)
    qtbot.waitUntil(lambda: win.snapshot.n_steps == 3, timeout=10000)
    assert len(jobs) == n and panel.result.step == 1


def test_the_lens_gives_way_to_a_step_the_user_presses_while_it_waits(make_window, wait_idle, qtbot, click_tab,
                                                                       monkeypatch, no_dialogs):  # fmt: skip
    # the lens costs about a step: after a step it is idle work, and a step pressed meanwhile goes first
    import threading

    from gpt_inspector.core import lens as lens_mod

    win = make_window()
    panel = win.lens_panel
    click_tab(win, "Logit lens")
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    qtbot.waitUntil(lambda: panel.result is not None and panel.result.step == 0, timeout=10000)
    computed = []
    real = lens_mod.lens
    monkeypatch.setattr(lens_mod, "lens", lambda s, *a, **kw: computed.append(s.n_steps) or real(s, *a, **kw))
    gate = threading.Event()
    # step 1; behind it the worker waits at the gate, so the lens that step 1 asks for queues
    press(qtbot, win, Qt.Key.Key_F10)
    win.run_in_worker(lambda s: gate.wait(10))
    qtbot.waitUntil(lambda: win.snapshot.n_steps == 2 and panel.compute_button.isEnabled() is False, timeout=10000)
    press(qtbot, win, Qt.Key.Key_F10)  # step 2, pressed while the lens of step 1 still waits for the worker
    gate.set()
    wait_idle(win)
    qtbot.waitUntil(lambda: panel.result.step == 2, timeout=10000)
    assert computed == [3]  # the lens of step 1 gave way (never ran); step 2's came when the worker was idle
    assert not no_dialogs and not win.errors
