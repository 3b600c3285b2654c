"""The window's chat mode, driven as a user does: Ctrl+Shift+C opens the turns editor, typed turns render
through the model's chat template, Start chat starts a session on exactly apply_chat_template's ids, the
token strip shows each token's role, Plain prompt leaves chat mode."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from keys import press  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

import gpt_inspector as gi  # noqa: E402

TURNS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "She eats"}]


@pytest.fixture
def chat_window(qtbot, chat_dir, wait_idle):
    from gpt_inspector.gui.main_window import MainWindow

    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    win.resize(1400, 900)
    win.show()
    win.session_panel.prompt.setPlainText("She eats")
    win.show_source(gi.Session(gi.load_model(chat_dir("gpt2"), device="cpu"), "She eats"))
    wait_idle(win)
    win.activateWindow()
    qtbot.waitExposed(win)
    yield win
    win.worker.stop()


def test_chat_journey(qtbot, chat_window, wait_idle, chat_dir, dialogs):
    from transformers import AutoTokenizer

    win = chat_window
    press(qtbot, win, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    qtbot.waitUntil(lambda: getattr(win, "chat_dialog", None) is not None and win.chat_dialog.isVisible(), timeout=3000)
    d = win.chat_dialog
    assert not d.ok_button.isEnabled()  # no turn typed yet
    for (_combo, edit, _x), turn in zip(d.rows, TURNS):
        qtbot.mouseClick(edit, Qt.MouseButton.LeftButton)
        qtbot.keyClicks(edit, turn["content"])
    assert [r[0].currentText() for r in d.rows] == ["system", "user"]
    tok = AutoTokenizer.from_pretrained(chat_dir("gpt2"))
    text = tok.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=True)
    # the preview is the template's exact text, rendered on the worker
    qtbot.waitUntil(lambda: d.preview.toPlainText() == text, timeout=10000)
    assert d.status.text().endswith("tokens") and d.ok_button.isEnabled()
    qtbot.mouseClick(d.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.session_panel.chat is not None and win.snapshot is not None
                    and len(win.snapshot.roles) > 0, timeout=20000)  # fmt: skip
    snap = wait_idle(win)
    ids = tok.apply_chat_template(TURNS, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert list(snap.token_ids[: snap.prompt_len]) == ids and snap.prompt_len == len(ids)
    sp = win.session_panel
    assert sp.prompt.toPlainText() == text and sp.prompt.isReadOnly()
    assert (
        sp.chat_label.isVisible()
        and "system, user + generation prompt" in sp.chat_label.text()
        and sp.plain_button.isVisible()
    )
    # the strip: each prompt token's role, in its tooltip and the strip's legend
    strip = win.token_strip
    roles = list(snap.roles)
    assert set(roles) == {"system", "user", "template"} and len(roles) == len(ids)
    first_user = roles.index("user")
    assert "user" in strip.tooltip(first_user) and "template" in strip.tooltip(0)
    assert "system" in strip.toolTip() and "template" in strip.toolTip()
    # a step continues the chat prompt; the session stays a chat session
    assert not d.isVisible()
    win.activateWindow()  # the dialog gave the focus back (offscreen, the platform does not)
    qtbot.waitUntil(win.isActiveWindow, timeout=3000)
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    assert snap.n_steps == 1 and list(snap.roles) == roles and not win.errors
    assert win.controller.run_infos  # the window shows the live session
    # Chat… again: the dialog opens with the session's turns
    qtbot.mouseClick(sp.chat_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.chat_dialog is not d and win.chat_dialog.isVisible(), timeout=3000)
    assert win.chat_dialog.messages() == TURNS
    qtbot.keyClick(win.chat_dialog, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not win.chat_dialog.isVisible(), timeout=3000)
    # Plain prompt: an ordinary box again; Start runs a plain session with no roles
    qtbot.mouseClick(sp.plain_button, Qt.MouseButton.LeftButton)
    assert not sp.prompt.isReadOnly() and sp.chat is None
    sp.prompt.clear()
    qtbot.mouseClick(sp.prompt.viewport(), Qt.MouseButton.LeftButton)
    qtbot.keyClicks(sp.prompt, "One two")
    qtbot.mouseClick(sp.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not win.busy and win.snapshot is not None and not win.snapshot.roles, timeout=20000)
    assert win.session_panel.prompt.toPlainText() == "One two" and not sp.chat_label.isVisible()


def test_no_chat_template_says_so_in_the_dialog(qtbot, make_window, dialogs):
    win = make_window("gpt2", "She eats")  # the plain tiny tokenizer: no chat template
    qtbot.mouseClick(win.session_panel.chat_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: getattr(win, "chat_dialog", None) is not None and win.chat_dialog.isVisible(), timeout=3000)
    d = win.chat_dialog
    qtbot.mouseClick(d.rows[1][1], Qt.MouseButton.LeftButton)
    qtbot.keyClicks(d.rows[1][1], "hello")
    qtbot.waitUntil(lambda: "no chat template" in d.status.text(), timeout=10000)
    assert not d.ok_button.isEnabled() and not win.errors
    d.reject()
    QApplication.processEvents()
    assert win.session_panel.chat is None


def test_restored_chat_session_shows_its_turns(qtbot, chat_dir, wait_idle, dialogs):
    """The autosaved recipe of a chat session restores as a chat session: same ids, roles, chat mode."""
    from gpt_inspector.gui.main_window import MainWindow

    s = gi.Session(gi.load_model(chat_dir("gpt2"), device="cpu"), messages=TURNS)
    s.run(2)
    recipe = s.recipe()
    recipe["model"] = str(chat_dir("gpt2"))
    recipe["load"] = {"device": "cpu"}
    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    win.show()
    try:
        win.restore(recipe)  # what the start does when the user answers Yes to "Restore the last session?"
        qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.n_steps == 2, timeout=30000)
        snap = wait_idle(win)
        assert list(snap.token_ids) == s.tokens and list(snap.roles) == list(s.chat.roles)
        assert win.session_panel.chat == s.chat.to_json() and win.session_panel.prompt.toPlainText() == s.prompt
        assert not win.errors
    finally:
        win.worker.stop()
