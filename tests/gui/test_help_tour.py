"""Help, tooltips, colour bars and the tour, driven like a user: keys, clicks, the Help menu.

Every number a page or a tour stage shows is checked against a computation written here from the
session's recorded q, K, V (the equation in float64), the model's own recorded head outputs, or
the bytes of its cache tensors.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from keys import press
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QHelpEvent
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractItemView,
    QAbstractSpinBox,
    QApplication,
    QComboBox,
    QLineEdit,
    QListWidget,
    QPlainTextEdit,
    QSlider,
    QTabBar,
    QTextEdit,
    QToolTip,
    QWidget,
)

import gpt_inspector as gi
from gpt_inspector.core.tokens import token_label
from gpt_inspector.gui import help as gui_help
from gpt_inspector.gui import settings
from gpt_inspector.gui import tour as gui_tour

PROMPT = "She eats apple"  # the seed tutorial's prompt, on the demo model


@pytest.fixture(scope="module")
def demo_lm():
    return gi.load_model(gi.DEMO_MODEL)


@pytest.fixture
def demo(window_on, demo_lm, wait_idle, qtbot):
    """The window on the demo model after two steps (F10 twice), shown and active."""
    win, s = window_on(demo_lm, PROMPT)
    win.activateWindow()
    qtbot.waitUntil(win.isActiveWindow, timeout=3000)
    for _ in range(2):
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
    return win, s


def number(text: str, label: str) -> float:
    m = re.search(re.escape(label) + r" = (-?\d+\.\d+)", text)
    assert m, f"no '{label} = …' in:\n{text}"
    return float(m.group(1))


def click_plot(qtbot, glw):
    """A left click in the middle of a plot: the focus goes to its panel."""
    vp = glw.viewport()
    qtbot.mouseClick(vp, Qt.MouseButton.LeftButton, pos=vp.rect().center())


def equation(s, layer: int, head: int, query: int, key: int):
    """raw, scaled and p of one cell, from the recorded q and K in float64 (causal mask: keys ≤ query)."""
    q = s.queries(layer)[head, query].double()  # (d,)
    keys = s.keys(layer)[s.kv_head_of(head, layer), : query + 1].double()  # (query + 1, d)
    scores = keys @ q * s.scaling(layer)  # (query + 1,)
    p = torch.softmax(scores, dim=0)
    return float(keys[key] @ q), float(scores[key]), float(p[key])


def test_f1_on_the_focused_score_matrix_writes_out_the_hovered_cell(demo, qtbot, wait_idle):
    win, s = demo
    press(qtbot, win, Qt.Key.Key_PageDown)  # layer 1
    press(qtbot, win, Qt.Key.Key_BracketRight)  # head 1
    snap = wait_idle(win)
    layer, head, query = snap.selection.layer, snap.selection.head, snap.query
    assert (layer, head) == (1, 1) and query == snap.T - 1
    sm = win.score_matrix
    pos = sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(1.5, query + 0.5)))
    qtbot.mouseClick(sm.glw.viewport(), Qt.MouseButton.LeftButton, pos=pos)  # the focus, on the query's own row
    qtbot.mouseMove(sm.glw.viewport(), pos)  # rest on (query, key 1)
    qtbot.waitUntil(lambda: sm.readout.text().startswith(f"query {query} "), timeout=3000)
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_F1)
    dialog = win.findChild(gui_help.HelpDialog, "help_dialog")
    qtbot.waitUntil(lambda: dialog is not None and dialog.isVisible(), timeout=3000)
    assert dialog.windowTitle() == "What am I looking at: Score matrix"
    text = dialog.text.toPlainText()
    assert f"query {query} “{snap.labels[query]}” → key 1 “{snap.labels[1]}”" in text
    raw, scaled, p = equation(s, layer, head, query, 1)
    assert number(text, "q·k") == pytest.approx(raw, abs=1e-4)
    assert number(text, "scaled") == pytest.approx(scaled, abs=1e-4)
    assert number(text, "masked") == pytest.approx(scaled, abs=1e-4)  # key 1 ≤ query: allowed
    assert number(text, "p") == pytest.approx(p, abs=1e-4)
    assert "1/√" in text and "Edit mask" in text  # the words, not only the numbers
    # another key under the pointer: the open page follows it
    pos = sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(0.5, query + 0.5)))
    qtbot.mouseMove(sm.glw.viewport(), pos)
    qtbot.waitUntil(lambda: "→ key 0 " in dialog.text.toPlainText(), timeout=3000)
    assert number(dialog.text.toPlainText(), "p") == pytest.approx(equation(s, layer, head, query, 0)[2], abs=1e-4)


def test_f1_follows_the_focus_qkv_page_gives_the_heads_own_output(demo, qtbot, wait_idle):
    win, s = demo
    snap = wait_idle(win)
    layer, head, query = snap.selection.layer, snap.selection.head, snap.query
    click_plot(qtbot, win.qkv.glw)
    assert gui_help.dock_key_of(win, QApplication.focusWidget()) == "qkv"
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_F1)
    dialog = win.findChild(gui_help.HelpDialog, "help_dialog")
    qtbot.waitUntil(lambda: dialog is not None and dialog.isVisible(), timeout=3000)
    assert dialog.windowTitle() == "What am I looking at: Q / K / V"
    text = dialog.text.toPlainText()
    shown = [float(x) for x in re.search(r"o = \[([^\]…]+)", text).group(1).rstrip(", ").split(", ")]
    own = s.head_outputs(layer)[head, query, : len(shown)].tolist()  # what the model's attention returned
    assert len(shown) == 4 and shown == pytest.approx(own, abs=2e-4)
    # the KV cache panel: its bytes are the cache tensors' bytes
    click_plot(qtbot, win.kv_cache.glw)
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_F1)
    qtbot.waitUntil(lambda: dialog.windowTitle().endswith("KV cache"), timeout=3000)
    text = dialog.text.toPlainText()
    k, v = s.keys(layer), s.values(layer)
    layer_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    assert f"= {layer_bytes:,} bytes" in text
    assert f"{snap.T} positions × 2 (K and V) × {k.shape[0]} kv heads × {k.shape[2]} dims × 4 bytes" in text
    # nothing focused in a dock (the prompt box is in one; the toolbar is not): the panel under the pointer
    win.acts.toolbar.setFocus()
    assert gui_help.panel_in_question(win) in gui_help.PAGES


def test_help_menu_keyboard_and_about_pages(demo, qtbot):
    win, _ = demo
    help_menu = next(a.menu() for a in win.menuBar().actions() if a.text() == "&Help")
    assert {a.text() for a in help_menu.actions()} >= {"What am I looking at", "Panels", "Tour",
                                                       "Keyboard shortcuts", "About"}  # fmt: skip
    win.acts.keys_help.trigger()
    dialog = win.findChild(gui_help.HelpDialog, "help_dialog")
    text = dialog.text.toPlainText()
    assert dialog.isVisible() and "F10" in text and "Step back" in text and "F1" in text and "Esc" in text
    win.acts.about.trigger()
    assert f"gpt-inspector {gi.__version__}" in dialog.text.toPlainText()
    win.acts.pages_menu.aboutToShow.emit()
    titles = [a.text() for a in win.acts.pages_menu.actions()]
    assert "Softmax rows" in titles and "Logit lens" in titles  # a panel added after the menu was built
    next(a for a in win.acts.pages_menu.actions() if a.text() == "Softmax rows").trigger()
    text = dialog.text.toPlainText()
    rows = win.snapshot.head_rows
    assert dialog.windowTitle().endswith("Softmax rows")
    assert f"H0: Σ p = {rows[0].sum():.4f} · max p = {rows[0].max():.4f}" in text


def test_every_dock_and_control_has_a_tooltip(demo, qtbot):
    win, _ = demo
    kinds = (QAbstractButton, QComboBox, QAbstractSpinBox, QLineEdit, QPlainTextEdit, QTextEdit, QSlider, QListWidget)
    qtbot.waitUntil(lambda: all(d.toolTip() for d in win.docks.values()), timeout=3000)  # late panels included
    missing, seen = [], 0
    for key, dock in win.docks.items():
        for c in dock.widget().findChildren(QWidget):
            parent = c.parentWidget()
            if not isinstance(c, kinds) or isinstance(parent, (QComboBox, QAbstractSpinBox, QAbstractItemView)):
                continue  # a combo box's line edit, a table's corner button: parts of one control
            seen += 1
            if not c.toolTip().strip():
                missing.append(f"{key}: {type(c).__name__} {getattr(c, 'text', lambda: '')()!r}")
    assert seen >= 40 and not missing, missing
    # a dock's tip shows on its tab, never over its contents (where it would hide the cells being read)
    dock = win.docks["mask"]
    bar = next(b for b in win.findChildren(QTabBar) if b.isVisible() and "Mask edits" in
               [b.tabText(i) for i in range(b.count())])  # fmt: skip
    i = next(i for i in range(bar.count()) if bar.tabText(i) == "Mask edits")
    at = bar.tabRect(i).center()
    QApplication.sendEvent(bar, QHelpEvent(QEvent.Type.ToolTip, at, bar.mapToGlobal(at)))
    qtbot.waitUntil(lambda: QToolTip.text() == dock.toolTip(), timeout=3000)
    assert "blocked" in QToolTip.text()
    QToolTip.hideText()
    qtbot.waitUntil(lambda: not QToolTip.isVisible(), timeout=3000)
    scores = win.docks["scores"]
    inside = scores.widget().geometry().center()
    help_event = QHelpEvent(QEvent.Type.ToolTip, inside, scores.mapToGlobal(inside))
    assert QApplication.sendEvent(scores, help_event) and not QToolTip.isVisible()  # taken, nothing shown
    chip = win.token_strip
    i = next(i for i, lab in enumerate(chip.labels) if lab.startswith("␣"))
    assert "␣ = a space" in chip.tooltip(i) and "&lt;0xNN&gt;" in chip.toolTip() and "␣ a space" in chip.toolTip()


def test_colour_bars_on_every_heatmap_and_kv_heads_labelled(demo, wait_idle):
    win, s = demo
    snap = wait_idle(win)
    layer, head, query = snap.selection.layer, snap.selection.head, snap.query
    q = s.queries(layer)[head, query].double()
    k, v = s.keys(layer).double(), s.values(layer).double()  # (Hkv, T, d)
    kvh = s.kv_head_of(head, layer)
    qk = max(q.abs().max().item(), k[kvh].abs().max().item())
    assert win.qkv.kbar.isVisible() and win.qkv.kbar.levels() == pytest.approx((-qk, qk), rel=1e-5)
    assert win.qkv.vbar.levels() == pytest.approx((-v[kvh].abs().max().item(), v[kvh].abs().max().item()), rel=1e-5)
    kbar, vbar = win.kv_cache.bars_kv
    assert kbar.isVisible() and kbar.levels() == pytest.approx((-k.abs().max().item(), k.abs().max().item()), rel=1e-5)
    assert vbar.levels() == pytest.approx((-v.abs().max().item(), v.abs().max().item()), rel=1e-5)
    sm_levels = win.score_matrix.cbar.levels()
    assert win.score_matrix.cbar.isVisible() and sm_levels == pytest.approx((0.0, 1.0))  # softmax: 0 to 1
    assert win.overview.cbar.isVisible() and win.overview.cbar.levels() == pytest.approx((0.0, 1.0))
    axis = win.kv_cache.heads_axes[0]
    d = k.shape[2]
    values = axis.tickValues(0, k.shape[0] * d, 1000)[0][1]  # wide enough for every label
    assert axis.tickStrings(values, 1, 1) == [f"kv head {h}" for h in range(k.shape[0])]
    assert values == [(h + 0.5) * d for h in range(k.shape[0])]
    assert f"(kv head {kvh})" in win.qkv.title.text()


def hf_beams(lm, ids):
    """transformers' own beam search with the tour's settings: 2 beams, 2 returned, 3 new tokens."""
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        return lm.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=2,
                                 num_return_sequences=2, max_new_tokens=3, output_scores=True,
                                 return_dict_in_generate=True)  # fmt: skip


def _stage_text(win) -> str:
    """The card's text as it reads (its HTML without the tags)."""
    return re.sub(r"<[^>]+>", "", win.tour.card.body.text())


def test_tour_walked_with_keys(window_on, demo_lm, wait_idle, qtbot, dialogs):
    win, s = window_on(demo_lm, PROMPT)  # step 0: the tour runs the prompt itself
    win.acts.tour.trigger()  # Help ▸ Tour
    t = win.tour
    qtbot.waitUntil(lambda: t.active and "tokens" in _stage_text(win) and "[She]" in _stage_text(win), timeout=20000)
    assert t.card.hasFocus() and t.frame.isVisible()
    snap = wait_idle(win)
    assert snap.n_steps == 1 and snap.T == snap.prompt_len == 3
    seen = []
    for i, stage in enumerate(gui_tour.STAGES):
        if i:
            qtbot.keyClick(t.card, Qt.Key.Key_Right)
        qtbot.waitUntil(lambda stage=stage: t.card.title.text() == stage.title and not _stage_text(win).endswith("…"),
                        timeout=20000)  # fmt: skip
        snap = wait_idle(win)
        dock = win.docks[stage.dock]
        assert dock.isVisible() and not dock.visibleRegion().isEmpty()  # raised: in front of its tab group
        assert t.frame.geometry() == dock.geometry().adjusted(-2, -2, 2, 2) and t.frame.isVisible()
        assert (
            not t.card.geometry().intersects(dock.geometry()) or stage.dock == "scores"
        )  # never over it (but the big one)
        if stage.kind is not None:
            assert snap.selection.kind == stage.kind and win.score_matrix.kind_buttons[stage.kind].isChecked()
        seen.append(_stage_text(win))
    layer, head = snap.selection.layer, snap.selection.head
    query = 2  # the stages before the last ran at T = 3, the newest position
    key = int(np.argmax(s.attention(layer, head)[query, :3]))
    raw, scaled, p = equation(s, layer, head, query, key)
    assert f"q·k = Σᵢ qᵢkᵢ = {raw:.4f}" in seen[2]
    assert f"= {scaled:.4f}" in seen[3] and f"1/√d, d = {s.queries(layer).shape[-1]}" in seen[3]
    assert "3 of the 3 × 3 cells" in seen[4]  # the future of a 3-token prompt
    assert f"p = {p:.4f}" in seen[5]
    o = s.head_outputs(layer)[head, query, :3].tolist()
    shown = [float(x) for x in re.search(r"\[([-\d., ]+), …\]", seen[6]).group(1).split(", ")]
    assert shown == pytest.approx(o, abs=2e-3)
    first = s.steps_done[0]
    assert f"“{first.label}” with p = {first.prob:.4f}" in seen[7]
    # two beams, as transformers' generate(num_beams=2) returns them for three new tokens
    ref = hf_beams(demo_lm, snap.token_ids[:3])
    assert win.compare_panel.result.settings["num_beams"] == 2
    for i, (seq, score) in enumerate(zip(ref.sequences.tolist(), ref.sequences_scores.tolist())):
        chips = "".join(f"[{token_label(demo_lm.tokenizer, t)}]" for t in seq[3:])
        assert f"beam {i + 1}: {chips} score = {score:.4f}" in seen[8]
    # the cache grew by the tour's own step: 3 → 4 positions, and the bytes of the cache tensors
    assert snap.T == 4 and snap.n_steps == 2
    before = sum(s.keys(i)[:, :3].numel() * 4 * 2 for i in range(s.n_layers))  # K and V, float32
    after = sum(s.keys(i).numel() * 4 * 2 for i in range(s.n_layers))
    assert "3 → 4 positions" in seen[9] and f"{before:,} → {after:,} bytes" in seen[9]
    assert t.card.next.text() == "Finish"
    qtbot.keyClick(t.card, Qt.Key.Key_Left)
    qtbot.waitUntil(lambda: t.card.title.text() == gui_tour.STAGES[8].title, timeout=3000)
    qtbot.keyClick(t.card, Qt.Key.Key_Right)  # back to the last stage: no second step
    qtbot.waitUntil(lambda: t.card.title.text() == gui_tour.STAGES[9].title, timeout=3000)
    assert wait_idle(win).n_steps == 2
    qtbot.keyClick(t.card, Qt.Key.Key_Escape)  # ends the tour (not Pause)
    assert not t.active and not t.frame.isVisible() and wait_idle(win).selection.kind == "probs"
    assert not dialogs and not win.errors


def test_tour_is_offered_once_at_first_start(window_on, demo_lm, wait_idle, qtbot, dialogs):
    win, _ = window_on(demo_lm, PROMPT)
    assert gui_tour.offer_at_start(win)
    qtbot.waitUntil(lambda: getattr(win, "tour", None) is not None and win.tour.active, timeout=10000)
    t = win.tour
    assert t.card.title.text() == "Welcome to gpt-inspector" and t.card.end.text() == "Not now"
    qtbot.keyClick(t.card, Qt.Key.Key_Escape)
    assert not t.active
    assert settings.settings().value(gui_tour.OFFERED, False, type=bool)  # persisted
    assert not gui_tour.offer_at_start(win)  # never again
    assert not t.active and not dialogs
    t.offer()  # an offer taken: Enter starts the tour on its first stage
    qtbot.keyClick(t.card, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: t.card.title.text() == gui_tour.STAGES[0].title, timeout=20000)
    assert t.frame.isVisible() and wait_idle(win).n_steps == 1  # it ran the prompt
    qtbot.keyClick(t.card, Qt.Key.Key_Escape)


def test_the_keys_go_back_where_they_were_when_the_welcome_card_closes(window_on, demo_lm, wait_idle, qtbot, dialogs):
    # the card takes the keys while it is up (Esc ends it, not Pause); closed, they were left to whatever
    # Qt found next (the session panel's scroll area), not the panel the user had been typing in
    from PySide6.QtWidgets import QApplication

    win, _ = window_on(demo_lm, PROMPT)
    prompt = win.session_panel.prompt
    qtbot.mouseClick(prompt.viewport(), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(prompt.hasFocus, timeout=3000)
    assert gui_tour.offer_at_start(win)
    qtbot.waitUntil(lambda: getattr(win, "tour", None) is not None and win.tour.active, timeout=10000)
    assert QApplication.focusWidget() is win.tour.card
    qtbot.mouseClick(win.tour.card.end, Qt.MouseButton.LeftButton)  # Not now
    assert not win.tour.active and QApplication.focusWidget() is prompt
    win.tour.offer()
    qtbot.keyClick(win.tour.card, Qt.Key.Key_Escape)
    assert QApplication.focusWidget() is prompt
    assert not dialogs and not win.errors
