"""The window on a real ``gpt-inspector serve`` process, driven as a user does: a chat prompt and assisted
rounds run on the engine and show what a local session shows; the autosave keeps the way back to the
engine (reconnect, or rebuild the session there after the engine restarted); Load while connected asks
first, then closes the link and stops naming the engine."""

from __future__ import annotations

import argparse
import json
import stat
from dataclasses import replace

import pytest

pytest.importorskip("pytestqt")

from keys import press, wait  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QMessageBox  # noqa: E402

import gpt_inspector as gi  # noqa: E402
from gpt_inspector.core.assisted import Assisted  # noqa: E402
from gpt_inspector.gui import _pyside_fix  # noqa: E402
from gpt_inspector.remote.client import RemoteSession  # noqa: E402

_pyside_fix.install()

PROMPT = "one two three four one two three"
TURNS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "She eats"}]
CTRL_SHIFT = Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier
Yes, No, Cancel = QMessageBox.StandardButton.Yes, QMessageBox.StandardButton.No, QMessageBox.StandardButton.Cancel


@pytest.fixture(autouse=True)
def dialogs(monkeypatch, tmp_path):
    """Message boxes recorded, not opened; ``answers``: what the next questions are answered. Settings and
    autosaves in a temp folder, never the user's."""
    monkeypatch.setenv("GPT_INSPECTOR_SETTINGS", str(tmp_path / "settings.ini"))
    seen, answers = [], []

    def question(parent, title, text, *a, **k):
        seen.append((title, text))
        return answers.pop(0)

    for name in ("warning", "critical", "information"):
        monkeypatch.setattr(QMessageBox, name, lambda parent, title, text, *a, **k: seen.append((title, text)))
    monkeypatch.setattr(QMessageBox, "question", question)
    return seen, answers


@pytest.fixture
def windows(qtbot):
    """``windows(obj=None)``: a shown window, on ``obj`` (a RemoteSession) when given; each stopped at the end."""
    from gpt_inspector.gui.main_window import MainWindow

    made, links = [], []

    def make(obj=None):
        win = MainWindow(restore_layout=False)
        qtbot.addWidget(win)
        win.resize(1400, 900)
        win.show()
        if obj is not None:
            links.append(obj)
            win.show_source(obj)
            wait(qtbot, win)
        win.activateWindow()
        made.append(win)
        return win

    yield make
    for win in made:
        win.worker.stop()
    for obj in links:  # the engine's one client slot, free for the next test
        obj.close()


def opened(url, prompt=PROMPT) -> RemoteSession:
    r = RemoteSession(url, timeout=20)
    r.open(prompt)
    return r


def test_a_chat_prompt_and_assisted_rounds_in_a_window_on_the_engine(server, windows, local_lm, qtbot, dialogs):
    r = opened(server.url)
    win = windows(r)
    press(qtbot, win, Qt.Key.Key_C, CTRL_SHIFT)  # File ▸ Chat prompt…
    qtbot.waitUntil(lambda: getattr(win, "chat_dialog", None) is not None and win.chat_dialog.isVisible(), timeout=3000)
    d = win.chat_dialog
    for (_combo, edit, _x), turn in zip(d.rows, TURNS):
        qtbot.mouseClick(edit, Qt.MouseButton.LeftButton)
        qtbot.keyClicks(edit, turn["content"])
    tok = local_lm.tokenizer
    text = tok.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(TURNS, tokenize=True, return_dict=False, add_generation_prompt=True)
    qtbot.waitUntil(lambda: d.preview.toPlainText() == text, timeout=10000)  # rendered by the engine's template
    qtbot.mouseClick(d.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.snapshot is not None and len(win.snapshot.roles) > 0, timeout=20000)
    snap = wait(qtbot, win)
    local = gi.Session(local_lm, messages=TURNS)
    assert list(snap.token_ids) == ids == list(local.prompt_ids) and list(snap.roles) == list(local.chat.roles)
    assert win.session_panel.prompt.toPlainText() == text and r.chat.messages_json() == TURNS
    assert "on engine" in win.windowTitle()

    win.activateWindow()  # the dialog gave the focus back (offscreen, the platform does not)
    qtbot.waitUntil(win.isActiveWindow, timeout=3000)
    panel = win.assisted_panel  # prompt lookup, 3 a round, on the chat session: the engine runs the rounds
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    panel.tokens.setValue(3)
    panel.max_new.setValue(8)
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run is not None and panel.round_button.isEnabled(), timeout=20000)
    for n in (1, 2):
        press(qtbot, win, Qt.Key.Key_R, CTRL_SHIFT)  # Tools ▸ Assisted decoding: next round
        qtbot.waitUntil(lambda n=n: panel.view is not None and len(panel.view.rounds) == n and not panel.job.running,
                        timeout=20000)  # fmt: skip
    ref = Assisted(local, prompt_lookup_num_tokens=3, max_new_tokens=8)
    want = ref.run(2)
    snap = wait(qtbot, win)
    assert list(snap.token_ids) == ref.session.tokens and snap.n_steps == len(ref.session.steps_done)
    assert [replace(x, seconds=0) for x in panel.view.rounds] == [replace(x, seconds=0) for x in want]
    t = panel.table
    lab = ref.session.label
    for row, x in enumerate(want):
        assert t.item(row, 1).text() == (" · ".join(lab(i) for i in x.proposed) or "—")
        assert t.item(row, 2).text() == f"{x.accepted} of {len(x.proposed)}"
    assert f"({ref.accepted} of {ref.proposed} proposed)" in panel.rate.text()
    qtbot.mouseClick(panel.back_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(panel.view.rounds) == 1 and not panel.job.running, timeout=20000)
    assert wait(qtbot, win).n_steps == len(ref.session.steps_done) - len(want[-1].tokens)
    assert not dialogs[0] and not win.errors


def _autosaved(path):
    """The window's autosave files that hold a remote session."""
    found = []
    for p in path.parent.glob("autosave*.json"):
        try:
            d = json.loads(p.read_text())
        except ValueError:
            continue
        if "remote" in d:
            found.append((p, d))
    return found


def test_the_autosave_reconnects_to_the_engine_or_rebuilds_the_session_after_it_restarted(
    serve, windows, qtbot, dialogs, tmp_path
):  # fmt: skip
    from gpt_inspector.gui import app, autosave, remote_link

    seen, answers = dialogs
    srv = serve()
    r = opened(srv.url)
    win = windows(r)
    for _ in range(3):
        press(qtbot, win, Qt.Key.Key_F10)
        wait(qtbot, win)
    files = tmp_path / "autosave.json"
    qtbot.waitUntil(lambda: any(len(d["tokens"]) == len(r.tokens) for _, d in _autosaved(files)), timeout=10000)
    (p, saved), = _autosaved(files)  # fmt: skip
    assert saved["remote"]["url"] == srv.url and saved["tokens"] == r.tokens and len(saved["ops"]) == 3
    assert stat.S_IMODE(p.stat().st_mode) == 0o600  # it holds the token: the user's alone
    token = srv.url.split("token=")[1]
    assert token not in autosave.summary(saved) and token not in win.windowTitle()
    tokens = list(r.tokens)

    # the window crashes (its worker gone, no clean quit, its link closed): the next start offers to reconnect
    win.worker.stop()
    r.close()
    answers.append(Yes)
    again = windows()
    recipe = app._offer_restore(again)
    assert seen[-1][0] == "Reconnect to the last session?" and "on the engine at ws://127.0.0.1" in seen[-1][1]
    assert token not in seen[-1][1]
    again.restore(recipe)
    qtbot.waitUntil(lambda: again.snapshot is not None and again.snapshot.engine is not None, timeout=30000)
    snap = wait(qtbot, again)
    assert list(snap.token_ids) == tokens and snap.n_steps == 3 and "on engine" in again.windowTitle()
    assert "Rebuilt" not in again.statusBar().currentMessage()  # the engine kept it: taken back as it was

    # the engine is stopped (Ctrl+C saves its recipe there) and started again: a new URL, no session
    assert srv.interrupt() == 0 and json.loads(srv.recipe.read_text())["tokens"] == tokens
    again.worker.stop()  # and this window goes too
    srv2 = serve()
    args = argparse.Namespace(connect=srv2.url, prompt=None, seed=None)
    remote = app._connect(args, {})  # as gpt-inspector --connect URL starts: the engine's (default) session
    third = windows()
    answers.append(Yes)
    rebuild = remote_link.offer_rebuild(third, remote)
    assert seen[-1][0] == "Rebuild the last session on the engine?" and token not in seen[-1][1]
    third.show_source(remote)
    third.restore(rebuild)
    qtbot.waitUntil(lambda: third.snapshot is not None and list(third.snapshot.token_ids) == tokens, timeout=30000)
    snap = wait(qtbot, third)
    assert (
        snap.n_steps == 3 and remote.tokens == tokens and srv2.url.split("//")[1].split("/")[0] in third.windowTitle()
    )
    # the window carries on in the file it adopted, now naming the new engine
    press(qtbot, third, Qt.Key.Key_F10)
    wait(qtbot, third)
    qtbot.waitUntil(lambda: any(d["remote"]["url"] == srv2.url and len(d["ops"]) == 4 for _, d in _autosaved(files)),
                    timeout=10000)  # fmt: skip
    assert not third.errors


def test_load_while_connected_asks_then_closes_the_link(server, windows, qtbot, dialogs):
    seen, answers = dialogs
    r = opened(server.url)
    win = windows(r)
    press(qtbot, win, Qt.Key.Key_F10)
    wait(qtbot, win)
    host = server.url.split("//")[1].split("/")[0]
    answers.append(Cancel)
    win.acts.load.trigger()  # File ▸ Load model…: the remote session has a step, so it asks first
    assert seen[-1][0] == "Leave the remote session?" and host in seen[-1][1]
    snap = wait(qtbot, win)
    assert snap.engine is not None and f"on engine {host}" in win.windowTitle() and r.link_alive
    answers.append(Yes)
    win.acts.load.trigger()
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.engine is None, timeout=60000)
    wait(qtbot, win)
    assert "engine" not in win.windowTitle() and "engine" not in win.st_run.text()
    assert not win.st_link.isVisible() and not win.link_bar.isVisible() and not r.link_alive
    with gi.connect(server.url) as back:  # the link is closed: the engine takes a new client, its session kept
        assert back.n_steps == 1
    assert not win.errors
