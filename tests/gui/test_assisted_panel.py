"""The assisted decoding panel, driven as a user would: pick the proposer, Start, Round by key and by
click, Back; the table and the rate say what the core's rounds say, and the window shows the target's steps."""

from __future__ import annotations

import pytest
import tiny_models
from PySide6.QtCore import Qt

from gpt_inspector.core.assisted import Assisted

PROMPT = "She eats an apple. He eats an apple and she eats an"
CTRL_SHIFT = Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier


def _panel(win, qtbot):
    panel = win.assisted_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.isVisible, timeout=3000)
    return panel


def _rows(panel) -> list[list[str]]:
    t = panel.table
    return [[t.item(r, c).text() for c in range(t.columnCount())] for r in range(t.rowCount())]


def test_prompt_lookup_rounds_by_key_and_click_then_back(make_window, wait_idle, qtbot, tiny_lm, no_dialogs):
    from gpt_inspector import Session

    win = make_window(prompt=PROMPT)
    qtbot.keyClick(win, Qt.Key.Key_F10)  # a step first: Start goes back to the prompt
    wait_idle(win)
    panel = _panel(win, qtbot)
    panel.tokens.setValue(3)
    panel.max_new.setValue(12)
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run is not None and panel.round_button.isEnabled(), timeout=20000)
    assert wait_idle(win).n_steps == 0
    qtbot.keyClick(win, Qt.Key.Key_R, CTRL_SHIFT)  # Tools ▸ Assisted decoding: next round
    qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.rounds) == 1, timeout=20000)
    for n in (2, 3):
        qtbot.mouseClick(panel.round_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda n=n: len(panel.view.rounds) == n and not panel.job.running, timeout=20000)
    ref = Assisted(Session(tiny_lm("gpt2"), PROMPT), prompt_lookup_num_tokens=3, max_new_tokens=12)
    want = ref.run(3)
    snap = wait_idle(win)
    assert snap.n_steps == len(ref.session.steps_done) and list(snap.token_ids) == ref.session.tokens
    lab = ref.session.label
    rows = _rows(panel)
    for row, r in zip(rows, want):
        assert row[0] == str(r.index + 1)
        assert row[1] == (" · ".join(lab(i) for i in r.proposed) or "—")
        assert row[2] == f"{r.accepted} of {len(r.proposed)}"
        assert row[3] == (" · ".join(lab(i) for i in r.rejected) or "—")
        assert row[5] == f"{r.target_cache_verified} → {r.target_cache}" and row[6] == "—"
    rate = ref.acceptance_rate
    assert f"acceptance rate {'—' if rate is None else f'{rate:.0%}'} ({ref.accepted} of {ref.proposed} proposed)" \
        in panel.rate.text()  # fmt: skip
    assert f"target KV cache {want[-1].target_cache} positions" in panel.rate.text()
    # Back: the last round's steps are undone in the window too
    qtbot.mouseClick(panel.back_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(panel.view.rounds) == 2 and not panel.job.running, timeout=20000)
    assert wait_idle(win).n_steps == len(ref.session.steps_done) - len(want[-1].tokens)
    assert not no_dialogs and not win.errors


def test_a_draft_model_typed_in_shows_both_caches_and_a_foreign_vocabulary_is_refused(
    make_window, wait_idle, qtbot, tiny_lm, tmp_path, no_dialogs
):
    from transformers import AutoModelForCausalLM

    from gpt_inspector import Session, load_model

    draft = tiny_models.build(tmp_path / "draft", "gpt2", seed=11)
    win = make_window(prompt=PROMPT)
    panel = _panel(win, qtbot)
    panel.mode.setCurrentText("draft model")
    qtbot.mouseClick(panel.path, Qt.MouseButton.LeftButton)
    qtbot.keyClicks(panel.path, str(draft))
    panel.tokens.setValue(4)
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.run is not None and panel.round_button.isEnabled(), timeout=30000)
    for n in (1, 2):
        qtbot.mouseClick(panel.round_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda n=n: panel.view is not None and len(panel.view.rounds) == n and not panel.job.running,
                        timeout=20000)  # fmt: skip
    ref = Assisted(Session(tiny_lm("gpt2"), PROMPT), load_model(draft), num_assistant_tokens=4, max_new_tokens=32)
    want = ref.run(2)
    rows = _rows(panel)
    assert [row[6] for row in rows] == [f"{r.draft_cache_proposed} → {r.draft_cache}" for r in want]
    assert list(wait_idle(win).token_ids) == ref.session.tokens
    assert "draft model: acceptance rate" in panel.rate.text() and "· draft " in panel.rate.text()
    # a draft with another tokenizer: a dialog in words, the session as it was
    other = tmp_path / "other"
    other.mkdir()
    tok = tiny_models.build_tokenizer(other, vocab_size=300)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    AutoModelForCausalLM.from_config(tiny_models.config_for("gpt2", len(tok), eos)).save_pretrained(other)
    panel.path.clear()
    qtbot.keyClicks(panel.path, str(other))
    steps = wait_idle(win).n_steps
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(no_dialogs) or bool(win.errors), timeout=30000)
    shown = " ".join(t for _, t in no_dialogs) + " ".join(map(str, win.errors))
    assert "vocabulary has" in shown
    assert wait_idle(win).n_steps == steps


@pytest.mark.parametrize("temperature", [0.8])
def test_sampling_is_refused_in_words(make_window, wait_idle, qtbot, temperature, no_dialogs):
    win = make_window(prompt=PROMPT, temperature=temperature)
    panel = _panel(win, qtbot)
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(no_dialogs) or bool(win.errors), timeout=20000)
    shown = " ".join(t for _, t in no_dialogs) + " ".join(map(str, win.errors))
    assert "greedy" in shown and panel.run is None
