"""The sampler in the window, driven with keys and clicks: advanced settings, then the stage picker."""

from __future__ import annotations

import pytest
import torch
from keys import press
from PySide6.QtCore import Qt


def _type_into(qtbot, w, text: str) -> None:
    """Select what a spin box or line edit shows and type over it, then Tab away, as a user does."""
    edit = w.lineEdit() if hasattr(w, "lineEdit") else w
    qtbot.mouseDClick(edit, Qt.MouseButton.LeftButton)
    edit.selectAll()
    qtbot.keyClicks(edit, text)
    qtbot.keyClick(edit, Qt.Key.Key_Tab)


def test_set_a_repetition_penalty_step_and_read_the_stages(shown, wait_idle, qtbot, dialogs):
    win = shown(prompt="She eats an apple. He eats an apple and she eats an")
    sp, nt = win.session_panel, win.next_token
    assert not sp.advanced.isVisible()
    qtbot.mouseClick(sp.advanced_toggle, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(sp.advanced.isVisible, timeout=3000)
    _type_into(qtbot, sp.repetition_penalty, "3")
    _type_into(qtbot, sp.suppress, "5, 6")
    qtbot.waitUntil(lambda: (win.snapshot.decoding or {}).get("suppress_tokens") == [5, 6], timeout=5000)
    assert win.snapshot.decoding["repetition_penalty"] == 3.0
    win.score_matrix.setFocus()  # back into a view, so F10 reaches the window
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    st = snap.step
    # generate's order: the penalty, then the suppressed tokens; the final one is preselected
    items = [nt.stage.itemText(i) for i in range(nt.stage.count())]
    assert items == ["0. raw logits", "1. repetition penalty 3", "2. suppress tokens [5, 6] (final)"]
    assert nt.stage.currentIndex() == 2 and nt.stage.isEnabled()
    assert st.probs[5] == 0 and st.probs[6] == 0 and st.token_id not in (5, 6)

    # pick the penalty's stage with the keyboard: the bars are that stage's distribution, by the equation
    nt.stage.setFocus()
    qtbot.keyClick(nt.stage, Qt.Key.Key_Up)
    qtbot.waitUntil(lambda: nt.stage.currentIndex() == 1, timeout=3000)
    seen = set(snap.token_ids[: snap.prompt_len + st.index])
    raw = st.logits.double()
    pen = torch.where(raw > 0, raw / 3.0, raw * 3.0)
    want = torch.where(torch.tensor([t in seen for t in range(raw.numel())]), pen, raw)
    probs = torch.softmax(want, -1)
    top = torch.topk(probs, nt.shown)
    assert nt.top_ids[: nt.shown] == top.indices.tolist()
    assert nt.probs[: nt.shown] == pytest.approx(top.values.tolist(), abs=1e-5)
    text = nt.stage_info.text()
    assert "repetition penalty 3" in text and "(yours)" in text and "keeps" in text

    # the raw logits: plain softmax
    qtbot.keyClick(nt.stage, Qt.Key.Key_Up)
    qtbot.waitUntil(lambda: nt.stage.currentIndex() == 0, timeout=3000)
    assert nt.probs[0] == pytest.approx(float(torch.softmax(raw, -1).max()), abs=1e-5)
    assert nt.stage_info.text().startswith("raw logits")

    # a malformed id list: a dialog, and the last good list stays
    _type_into(qtbot, sp.suppress, "5, x")
    qtbot.waitUntil(lambda: bool(dialogs), timeout=3000)
    assert "suppress tokens" in dialogs[-1][1] and sp.suppress.text() == "5, 6"
    assert len(win.errors) == 1  # that one dialog, and no other error
    assert wait_idle(win).decoding["suppress_tokens"] == [5, 6]


def test_advanced_controls_show_what_a_recipe_holds(qtbot):
    """A restored recipe's settings appear in the controls, and the controls give them back unchanged."""
    from gpt_inspector.core.decoding import Decoding
    from gpt_inspector.gui.controls import SessionPanel

    panel = SessionPanel()
    qtbot.addWidget(panel)
    empty = panel.sampler_settings()
    assert all(v is None for v in empty.values()) and not panel.advanced_toggle.isChecked()
    want = Decoding(0.7, repetition_penalty=1.35, no_repeat_ngram_size=3, min_p=0.05, typical_p=0.9,
                    epsilon_cutoff=0.0005, eta_cutoff=0.002, min_new_tokens=4, suppress_tokens=[1, 2],
                    bad_words_ids=[[3], [4, 5]], forced_eos_token_id=9, max_new_tokens=panel.max_steps.value())  # fmt: skip
    panel.set_sampler_settings(want.to_json())
    assert panel.advanced_toggle.isChecked()
    assert Decoding(0.7, **panel.sampler_settings()) == want
