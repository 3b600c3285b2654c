"""The window at long contexts, driven as a user drives it: a pooled score matrix that shows exact
cells where the user zooms in, an overview that streams in without blocking, hidden panels idle.

The view model's limits are lowered so that a tiny checkpoint takes the long-context paths.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from keys import press
from PySide6.QtCore import QPointF, Qt

import gpt_inspector.core.pooling as pooled_mod
import gpt_inspector.gui.viewdata as vd
import gpt_inspector.gui.worker as worker_mod
from gpt_inspector import Session

PROMPT = "She eats an apple. He reads a book every evening and she writes long letters to him."


@pytest.fixture
def long_limits(monkeypatch):
    monkeypatch.setattr(vd, "EXACT_LIMIT", 8)
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 4)
    monkeypatch.setattr(vd, "TILE_CELLS", 12)  # the matrix keeps square cells: a zoom may show a wider span


def test_pooled_matrix_then_exact_cells_where_zoomed_in(shown, wait_idle, qtbot, long_limits, tiny_lm, no_dialogs):
    win = shown(prompt=PROMPT)
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    sm = win.score_matrix
    t, b = snap.T, snap.matrix_block
    assert b > 1 and sm.image.image.shape == (-(-t // b),) * 2
    assert f"pooled {b}×{b} (block max)" in sm.title.text() and not sm.tile.isVisible()
    # the user zooms into the bottom-left corner (what a wheel zoom or a drag does to the view box)
    sm.vb.setRange(xRange=(0, 5), yRange=(t - 5, t), padding=0)
    qtbot.waitUntil(
        lambda: win.snapshot is not None and win.snapshot.tile is not None and sm.tile.isVisible(), timeout=10000
    )
    snap = wait_idle(win)
    layer, head = snap.selection.layer, snap.selection.head
    ref = Session(tiny_lm("gpt2"), PROMPT)
    ref.step()
    want = np.where(ref.allowed(layer, head), ref.attention(layer, head, "probs"), np.nan)
    q0, k0 = snap.tile_origin
    n, m = sm.tile.image.shape
    np.testing.assert_allclose(sm.tile.image, want[q0 : q0 + n, k0 : k0 + m], rtol=1e-5, atol=1e-7)
    assert "exact cells where zoomed in" in sm.title.text()
    # hovering a cell inside the tile reads its exact value; outside, the block's maximum
    sm._hover(QPointF(1.5, t - 0.5))
    assert sm.readout.text().endswith(f"{want[t - 1, 1]:.4g}")
    sm._hover(QPointF(t - 1.5, t - 0.5))  # key t - 2: outside the tile
    block_max = np.nanmax(want[(t - 1) // b * b : t, (t - 2) // b * b : ((t - 2) // b + 1) * b])
    assert sm.readout.text().endswith(f"block {b}×{b} max {block_max:.4g} (zoom in for exact cells)")
    sm.vb.setRange(xRange=(0, t), yRange=(0, t), padding=0)  # zoomed out again: the tile goes
    qtbot.waitUntil(lambda: win.snapshot.tile is None and not sm.tile.isVisible(), timeout=10000)
    assert not no_dialogs and not win.errors


def test_first_overview_streams_while_the_window_answers(shown, wait_idle, qtbot, monkeypatch, no_dialogs):
    monkeypatch.setattr(vd, "SYNC_BUDGET", 1)  # every build adds one chunk; the rest streams in slices
    monkeypatch.setattr(pooled_mod, "CHUNK_ROWS", 1)
    monkeypatch.setattr(worker_mod, "REFINE_SLICE", 0.0)  # one chunk per slice
    add = pooled_mod.Thumbnails.add_bins

    def slow_add(self, *a):  # a long context's chunk takes a while: the window must not wait for the last
        time.sleep(0.03)
        return add(self, *a)

    monkeypatch.setattr(pooled_mod.Thumbnails, "add_bins", slow_add)
    win = shown(prompt=PROMPT)
    seen = []
    win.snapshot_changed.connect(
        lambda s: seen.append((s.thumb_rows, s.T, s.selection.head, win.overview.title.text()))
    )
    messages = []
    win.statusBar().messageChanged.connect(messages.append)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: any(0 < r < t for r, t, *_ in seen), timeout=20000)
    head = win.selection.head
    press(qtbot, win, Qt.Key.Key_BracketRight)  # the user picks the next head while the overview streams
    qtbot.waitUntil(lambda: bool(seen) and seen[-1][0] == seen[-1][1] > 0, timeout=20000)
    partial = [(r, h, title) for r, t, h, title in seen if 0 < r < t]
    assert len(partial) >= 2 and [p[0] for p in partial] == sorted(p[0] for p in partial)  # shown as it grew
    assert any(h == head + 1 for _, h, _ in partial)  # the key was answered before the overview was done
    assert all("% of query rows so far" in p[2] for p in partial)
    assert any(m.startswith("Overview: ") and "% of the query rows so far" in m for m in messages)
    assert "Overview complete" in messages
    assert "% of query rows" not in win.overview.title.text()
    from gpt_inspector.gui.viewdata import full_thumbnails

    ref = Session(win.worker.lm, PROMPT)
    ref.step()
    snap = wait_idle(win)
    np.testing.assert_allclose(snap.thumbs, full_thumbnails(ref).image(), atol=1e-6)
    assert not no_dialogs and not win.errors


def test_a_hidden_panel_does_no_work_until_shown(shown, wait_idle, qtbot, no_dialogs):
    win = shown()
    calls = []
    original = win.softmax_rows.set_snapshot
    win.softmax_rows.set_snapshot = lambda s: calls.append(s.n_steps) or original(s)
    win.docks["softmax"].toggleViewAction().trigger()  # View ▸ Softmax rows: closed
    assert not win.softmax_rows.isVisibleTo(win)
    for _ in range(2):
        press(qtbot, win, Qt.Key.Key_F10)
        wait_idle(win)
    assert calls == []
    win.docks["softmax"].toggleViewAction().trigger()  # shown again: it catches up at once
    qtbot.waitUntil(lambda: calls == [2], timeout=3000)
    assert win.softmax_rows.title.text().startswith("softmax of query")
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    assert calls == [2, 3] and not no_dialogs and not win.errors


def test_kv_export_of_pooled_rows_says_so(shown, wait_idle, qtbot, long_limits, monkeypatch, no_dialogs):
    from PySide6.QtWidgets import QPushButton

    import gpt_inspector.gui.export_dialog as dlg

    shown_figs = []
    monkeypatch.setattr(
        dlg,
        "_show",
        lambda parent, fig, name, scale, title: shown_figs.append(
            (fig.subheading, fig.panel_values[0].shape, list(fig.row_labels))
        ),
    )
    win = shown(prompt=PROMPT)
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    b = snap.kv_block
    assert b > 1 and f"rows: means of {b} positions" in win.kv_cache.title.text()
    button = next(w for w in win.kv_cache.findChildren(QPushButton) if w.text() == "Export K…")
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert len(shown_figs) == 1 and not no_dialogs
    sub, shape, labels = shown_figs[0]
    assert f"rows: means of {b} positions" in sub and shape[0] == -(-snap.T // b) == len(labels)


def test_softmax_rows_past_two_keys_a_pixel_show_block_maxima(shown, wait_idle, qtbot, tiny_lm, monkeypatch):
    # a row of more keys than the plot has pixels for: each bar is its block's maximum (the limit
    # lowered so that the tiny checkpoint's T takes that path), computed independently here
    import gpt_inspector.gui.views.softmax_rows as rows_mod

    monkeypatch.setattr(rows_mod, "MIN_BARS", 4)
    monkeypatch.setattr(rows_mod, "BARS_PER_PIXEL", 0.0)
    win = shown(prompt=PROMPT)
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    ref = Session(tiny_lm("gpt2"), PROMPT)
    ref.step()
    t, layer = snap.T, snap.selection.layer
    b = -(-t // 4)
    assert t > 8 and b > 1
    for h, c in enumerate(win.softmax_rows.curves):
        x, y = c.getData()
        row = ref.attention(layer, h, "probs")[-1]
        want = [row[k : k + b].max() for k in range(0, t, b)]
        np.testing.assert_allclose(y, want, atol=1e-6)
        assert list(x) == [min(k, t) for k in range(0, len(want) * b + 1, b)]
    # the label's sum and top key still read the whole row
    row0 = ref.attention(layer, 0, "probs")[-1]
    assert win.softmax_rows.labels[0].toPlainText().startswith(f"H0 Σ={row0.sum():.3f}\nmax {row0.max():.2f}")
