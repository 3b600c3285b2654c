"""Runs as tabs: an inspected beam, the KV lab's policy run and an opened trace sit beside the live
session, which none of them replaces. Driven with keys, clicks and menu entries; what is asserted
is what the window shows (tabs, title, status bar, the snapshot the views show, files written)."""

from __future__ import annotations

import json

import torch
from keys import click_cell, press, run_lab
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QMessageBox, QTabBar

from gpt_inspector import Session, load_trace
from gpt_inspector.gui import autosave

PROMPT = "She eats an apple. He reads"


def tabs(win) -> list[str]:
    bar = win.run_switcher.bar
    return [bar.tabText(i) for i in range(bar.count())]


def shown_tab(win) -> str:
    bar = win.run_switcher.bar
    return bar.tabText(bar.currentIndex())


def click_tab(qtbot, win, text: str) -> None:
    bar = win.run_switcher.bar
    i = tabs(win).index(text)
    qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(i).center())


def menu_entry(win, text: str):
    """The View ▸ Runs entry named ``text``, as the menu lists it when it opens."""
    win.acts.runs_menu.aboutToShow.emit()
    return next(a for a in win.acts.runs_menu.actions() if a.text() == text)


def test_a_beam_and_a_trace_beside_the_live_session(shown, wait_idle, qtbot, dialogs, monkeypatch, tmp_path):
    win = shown("llama", PROMPT)
    for _ in range(3):
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
    qtbot.mouseClick(win.score_matrix.edit_button, Qt.MouseButton.LeftButton)
    click_cell(qtbot, win, 3, 1)
    live = wait_idle(win)
    assert live.n_steps == 3 and len(live.mask_edits) == 1
    assert tabs(win) == ["Live session"] and not win.acts.close_run.isEnabled()  # the only run stays
    assert win.st_run.text() == "Live session" and "Live session" in win.windowTitle()

    # Compare ▸ Inspect beam: a run of its own
    cmp = win.compare_panel
    win.raise_panel(cmp)
    cmp.beams.setValue(2)
    cmp.returns.setValue(2)
    cmp.new_tokens.setValue(3)
    qtbot.mouseClick(cmp.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: cmp.result is not None, timeout=30000)
    beam = cmp.result.beams[1]
    cmp.inspect_pick.setCurrentIndex(1)
    qtbot.mouseClick(cmp.inspect_button, Qt.MouseButton.LeftButton)
    snap = wait_idle(win)
    assert tabs(win) == ["Live session", "Beam 2 · read-only"] and shown_tab(win) == "Beam 2 · read-only"
    assert snap.read_only and "Beam 2" in win.windowTitle() and "read-only" in win.windowTitle()
    assert win.st_run.text() == "Beam 2 (read-only)"
    assert not win.acts.step.isEnabled() and win.acts.save.isEnabled()  # a beam saves, as the README says
    beam_labels = snap.labels

    # Ctrl+S saves the beam: its tokens are the ones the comparison returned for it
    path = tmp_path / "beam.safetensors"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(path), ""))
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    saved = load_trace(path)
    n = len(saved.tokens)
    assert n > saved.prompt_length and list(saved.tokens) == list(beam["token_ids"][:n])
    assert win.statusBar().currentMessage().startswith(f"Saved trace to {path}")

    # Ctrl+Tab: back to the live session, its steps and its mask edit as they were
    press(qtbot, win, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)
    back = wait_idle(win)
    assert shown_tab(win) == "Live session" and win.st_run.text() == "Live session"
    assert back.n_steps == 3 and back.mask_edits == live.mask_edits and back.labels == live.labels
    assert not back.read_only and win.acts.step.isEnabled() and "read-only" not in win.windowTitle()
    # and it steps on as a session with that edit does, made here from scratch
    press(qtbot, win, Qt.Key.Key_F10)
    on = wait_idle(win)
    ref = Session(win.worker.lm, PROMPT)
    ref.set_mask_edits(list(live.mask_edits))
    for _ in range(4):
        ref.step()
    assert on.n_steps == 4 and list(on.labels) == ref.token_labels()

    # File ▸ Open trace: a third run, nothing asked
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(path), ""))
    press(qtbot, win, Qt.Key.Key_O, Qt.KeyboardModifier.ControlModifier)
    tr = wait_idle(win)
    assert tabs(win) == ["Live session", "Beam 2 · read-only", "beam.safetensors · read-only"]
    assert tr.read_only and tr.labels == beam_labels and "beam.safetensors" in win.windowTitle()
    assert not dialogs

    # View ▸ Runs lists every run, the shown one checked; choosing one shows it
    assert menu_entry(win, "beam.safetensors · read-only").isChecked()
    menu_entry(win, "Beam 2 · read-only").trigger()
    assert wait_idle(win).labels == beam_labels and shown_tab(win) == "Beam 2 · read-only"

    # the close button on the trace's tab drops it; Ctrl+W the beam; the live session is what is left
    bar = win.run_switcher.bar
    close = bar.tabButton(2, QTabBar.ButtonPosition.RightSide) or bar.tabButton(2, QTabBar.ButtonPosition.LeftSide)
    qtbot.mouseClick(close, Qt.MouseButton.LeftButton)
    wait_idle(win)
    assert tabs(win) == ["Live session", "Beam 2 · read-only"]
    press(qtbot, win, Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier)
    end = wait_idle(win)
    assert tabs(win) == ["Live session"] and end.n_steps == 4 and not end.read_only


def test_closing_the_live_session_asks_first(shown, wait_idle, qtbot, dialogs, monkeypatch, tmp_path):
    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    path = tmp_path / "t.safetensors"
    win.save_trace(path)
    wait_idle(win)
    win.open_trace(str(path))
    wait_idle(win)
    press(qtbot, win, Qt.Key.Key_Home, Qt.KeyboardModifier.AltModifier)  # Alt+Home: the live session
    assert not wait_idle(win).read_only and shown_tab(win) == "Live session"
    press(qtbot, win, Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)  # the user said No (the fixture's answer): nothing closed
    assert [t for t, _ in dialogs] == ["Close the live session?"] and len(tabs(win)) == 2
    assert "Kept the live session" in win.statusBar().currentMessage()
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Close)
    press(qtbot, win, Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier)
    snap = wait_idle(win)
    assert tabs(win) == ["t.safetensors · read-only"] and snap.read_only
    assert not win.acts.step.isEnabled() and not win.acts.live_run.isEnabled()


def test_the_policy_run_beside_the_live_session(make_window, wait_idle, qtbot, no_dialogs, monkeypatch, tmp_path):
    win = make_window(prompt=PROMPT)
    for _ in range(2):
        win.score_matrix.setFocus()
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
    live = win.snapshot
    panel = run_lab(qtbot, win, "streaming", 4, 3)
    wait_idle(win)
    qtbot.mouseClick(panel.show_button, Qt.MouseButton.LeftButton)
    pol = wait_idle(win)
    assert tabs(win) == ["Live session", "KV lab policy run"] and pol.n_steps == 3
    assert "KV lab policy run" in win.windowTitle() and "read-only" not in win.windowTitle()
    assert win.st_run.text() == "KV lab policy run"
    # it steps (the lab follows) and saves: Ctrl+S writes it with its evictions
    assert win.acts.step.isEnabled() and win.acts.save.isEnabled()
    assert win.acts.save.toolTip() == "Save “KV lab policy run” as a trace file (Ctrl+S)"
    run = win.worker.runs.shown.obj  # the policy run's session, read after the worker is idle
    path = tmp_path / "policy.safetensors"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(path), ""))
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    wait_idle(win)
    assert win.statusBar().currentMessage().startswith(f"Saved trace to {path}")
    saved = load_trace(path)
    t = saved.cache_length
    assert t == run.cache_length and saved.tokens == run.tokens and saved.kv_policy.describe() == "streaming budget 4"
    evicted = 0
    for layer in range(saved.n_layers):
        # the reopened rows mask what the policy had dropped: softmax(q·k) over them, times V, is the
        # head output the model's attention returned under the policy (stored), computed here in float64
        q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in saved.qkv(layer))  # (H, T, d), (Hkv, T, d) x2
        allowed = saved.allowed_rows(layer, 0, t)  # (H, T, T)
        rep = saved.n_heads // saved.n_kv_heads
        scores = q @ k.repeat_interleave(rep, 0).transpose(1, 2) * saved.scaling(layer)  # (H, T, T)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        out = p @ v.repeat_interleave(rep, 0)  # (H, T, d)
        start = saved.head_output_start
        assert torch.allclose(out[:, start:], saved.head_outputs(layer)[:, start:].double(), atol=1e-5)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        evicted += int((causal & ~allowed).sum())
        assert saved.kv_cache_bytes(layer) == run.kv_cache_bytes(layer)
    assert evicted > 0  # a budget of 4 over 3 steps of a 7-token prompt dropped entries
    assert saved.kv_cache_bytes() < saved.kv_kept_bytes()
    # a click on the live session's tab: its two steps, as they were
    click_tab(qtbot, win, "Live session")
    back = wait_idle(win)
    assert back.n_steps == 2 and back.labels == live.labels and win.acts.save.isEnabled()
    # the live session is what autosave keeps, whichever run is shown
    click_tab(qtbot, win, "KV lab policy run")
    assert wait_idle(win).n_steps == 3
    recipe = json.loads(autosave.path(win.worker.autosave_owner).read_text())
    assert len(recipe["tokens"]) == back.prompt_len + 2 and recipe["tokens"][: back.prompt_len + 2] == list(
        win.worker.runs.live.obj.tokens
    )
    assert not no_dialogs and not win.errors
