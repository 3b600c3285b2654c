"""The Interventions panel, driven as a user drives it: a click on a head, Ctrl+K, a right-click menu,
Undo buttons and Delete; each test reads what is on screen (the rows, the overview's marks, the
status bar) and checks the numbers shown against a session given the same edits directly."""

from __future__ import annotations

import pytest
import torch
from keys import press
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtWidgets import QApplication, QInputDialog

from gpt_inspector import Session
from gpt_inspector.core.capture import HeadEdit, MaskEdit

PROMPT = "She eats an apple. He reads"


def cell_pos(win, layer, head) -> QPoint:
    ov = win.overview
    return ov.glw.mapFromScene(ov.plot.getViewBox().mapViewToScene(QPointF(head + 0.5, layer + 0.5)))


def click_head(qtbot, win, layer, head):
    qtbot.mouseClick(win.overview.glw.viewport(), Qt.MouseButton.LeftButton, pos=cell_pos(win, layer, head))


def right_click_menu(qtbot, win, layer, head):
    """A right-click on the overview's cell: the context-menu event Qt sends for it; the menu that opens."""
    pos = cell_pos(win, layer, head)
    vp = win.overview.glw.viewport()
    QApplication.sendEvent(vp, QContextMenuEvent(QContextMenuEvent.Reason.Mouse, pos, vp.mapToGlobal(pos)))
    qtbot.waitUntil(lambda: win.overview.menu is not None and win.overview.menu.isVisible(), timeout=3000)
    return win.overview.menu


def choose(qtbot, menu, text):
    act = next(a for a in menu.actions() if a.text() == text)
    qtbot.mouseClick(menu, Qt.MouseButton.LeftButton, pos=menu.actionGeometry(act).center())


def same(shown, ref):
    # a recompute from the earliest edited position sums in another order than a fresh run: rounding only
    torch.testing.assert_close(shown, ref, rtol=1e-5, atol=1e-7)


def reference(tiny_lm, steps, mask=(), heads=()):
    s = Session(tiny_lm("gpt2"), PROMPT)
    s.run(steps)
    if mask:
        s.set_mask_edits(list(mask))
    if heads:
        s.set_head_edits(list(heads))
    return s


@pytest.fixture
def win(shown, wait_idle):
    w = shown()
    w.run(2)
    wait_idle(w)
    w.raise_panel(w.interventions_panel)
    return w


def test_ctrl_k_lists_the_knock_out_marks_the_head_and_refuses_a_duplicate(win, qtbot, wait_idle, tiny_lm):
    before = wait_idle(win).step.probs.clone()
    click_head(qtbot, win, 1, 2)
    qtbot.waitUntil(lambda: (win.selection.layer, win.selection.head) == (1, 2), timeout=3000)
    press(qtbot, win, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    snap = wait_idle(win)
    panel = win.interventions_panel
    assert panel.row_texts() == [("knock-out", "L1 H2", "attention output zeroed")]
    assert panel.summary.text() == "1 intervention in force"
    assert win.overview.marked == {(1, 2): "k"} and "1 head(s) with interventions" in win.overview.title.text()
    assert "Head 1.2 knocked out" in win.statusBar().currentMessage()
    ref = reference(tiny_lm, 2, heads=[HeadEdit(1, 2)])
    same(snap.step.probs, ref.current.probs)  # the numbers shown are the recomputed run's
    assert (snap.step.probs - before).abs().max() > 1e-3  # and the knock-out changed them, by far more
    # the same head again: one status line, nothing stacked, nothing recomputed
    version = snap.state_version
    press(qtbot, win, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    snap = wait_idle(win)
    assert win.statusBar().currentMessage() == (
        "Not applied: head 1.2 is knocked out already (undo it in the Interventions panel first)"
    )
    assert len(panel.row_texts()) == 1 and [e for e, _ in snap.head_edits] == [HeadEdit(1, 2)]
    assert snap.state_version == version
    assert not win.errors


def test_each_row_has_its_own_undo(win, qtbot, wait_idle, tiny_lm, monkeypatch):
    t = wait_idle(win).T
    win.select(layer=0, head=1)
    win.score_matrix.set_edit_mode(True)
    win.score_matrix.edit_cells([(t - 1, 0)])
    press(qtbot, win, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    # a patch from another prompt, through the overview's right-click menu on head 1.3
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("He eats a pear. She", True))
    menu = right_click_menu(qtbot, win, 1, 3)
    assert (win.selection.layer, win.selection.head) == (1, 3)  # the head under the pointer, not the one before
    choose(qtbot, menu, "Patch the selected head from another prompt…")
    snap = wait_idle(win)
    panel = win.interventions_panel
    rows = panel.row_texts()
    assert [r[:2] for r in rows] == [("mask edit", "L0 H1"), ("knock-out", "L0 H1"), ("patch", "L1 H3")]
    assert "He␣eats" in rows[2][2] or "He eats" in rows[2][2]
    assert win.overview.marked == {(0, 1): "mk", (1, 3): "p"}
    mask, knock = MaskEdit(t - 1, 0, layer=0, head=1), HeadEdit(0, 1)
    patch = next(e for e, _ in snap.head_edits if e.patch_from is not None)
    same(snap.step.probs, reference(tiny_lm, 2, [mask], [knock, patch]).current.probs)
    # the knock-out's own Undo button: the mask edit and the patch stay
    qtbot.mouseClick(panel.undo_button(1), Qt.MouseButton.LeftButton)
    snap = wait_idle(win)
    assert [r[0] for r in panel.row_texts()] == ["mask edit", "patch"]
    assert "Undid the knock-out of head 0.1" in win.statusBar().currentMessage()
    assert win.overview.marked == {(0, 1): "m", (1, 3): "p"}
    same(snap.step.probs, reference(tiny_lm, 2, [mask], [patch]).current.probs)
    # Delete on the selected row (the mask edit); the closed menu leaves activation to the window manager
    win.activateWindow()
    qtbot.waitUntil(win.isActiveWindow, timeout=3000)
    qtbot.mouseClick(panel.table.viewport(), Qt.MouseButton.LeftButton,
                     pos=panel.table.visualItemRect(panel.table.item(0, 0)).center())  # fmt: skip
    press(qtbot, win, Qt.Key.Key_Delete)
    snap = wait_idle(win)
    assert [r[0] for r in panel.row_texts()] == ["patch"] and snap.mask_edits == ()
    same(snap.step.probs, reference(tiny_lm, 2, heads=[patch]).current.probs)
    qtbot.mouseClick(panel.clear, Qt.MouseButton.LeftButton)
    snap = wait_idle(win)
    assert panel.row_texts() == [] and panel.summary.text() == "no intervention in force"
    assert win.overview.marked == {} and snap.head_edits == ()
    same(snap.step.probs, reference(tiny_lm, 2).current.probs)
    assert not win.errors


def test_right_click_knocks_out_the_head_under_the_pointer(win, qtbot, wait_idle):
    click_head(qtbot, win, 0, 0)
    qtbot.waitUntil(lambda: (win.selection.layer, win.selection.head) == (0, 0), timeout=3000)
    choose(qtbot, right_click_menu(qtbot, win, 1, 1), "Knock out the selected head")
    snap = wait_idle(win)
    assert [e for e, _ in snap.head_edits] == [HeadEdit(1, 1)]
    assert win.interventions_panel.row_texts() == [("knock-out", "L1 H1", "attention output zeroed")]
    assert win.overview.marked == {(1, 1): "k"}


def test_a_trace_lists_its_interventions_read_only(win, qtbot, wait_idle, tmp_path):
    press(qtbot, win, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    win.save_trace(tmp_path / "t.safetensors")
    wait_idle(win)
    win.open_trace(str(tmp_path / "t.safetensors"))
    wait_idle(win)
    panel = win.interventions_panel
    assert panel.row_texts() == [("knock-out", "L0 H0", "attention output zeroed")]
    assert not panel.undo_button(0).isEnabled() and not panel.clear.isEnabled()
