"""The worker's build after a step at long T: the KV cache view pools only its new rows, and the
overview's new row follows the picture in the next idle slice; the numbers are the model's.

The view model's limits are lowered so that a tiny checkpoint takes the long-context paths; the
references are HF eager (its cache's keys and values, its attention weights) with the pooling and
the binning written out here.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from keys import press
from PySide6.QtCore import Qt

import gpt_inspector.gui.viewdata as vd
import gpt_inspector.gui.worker as worker_mod
from gpt_inspector import Session
from gpt_inspector.gui.viewdata import Selection, ViewModel

PROMPT = "She eats an apple. He reads a book."  # and 20 steps fit the tiny checkpoints' 64 positions


def _hf(hf_eager, family: str, ids) -> tuple[list, list, list]:
    """HF eager over ``ids``: per layer the cached keys and values, (Hkv, T, d), and the weights, (H, T, T)."""
    with torch.no_grad():
        out = hf_eager(family)(torch.tensor([list(ids)]), use_cache=True, output_attentions=True)
    c = out.past_key_values
    n = len(out.attentions)
    if hasattr(c, "layers"):
        ks, vs = [c.layers[i].keys[0] for i in range(n)], [c.layers[i].values[0] for i in range(n)]
    else:
        ks, vs = [c[i][0][0] for i in range(n)], [c[i][1][0] for i in range(n)]
    return ks, vs, [a[0].double().numpy() for a in out.attentions]


def _pooled(x: torch.Tensor, block: int) -> np.ndarray:
    """(Hkv, T, d) -> the mean of each ``block`` positions, written out: (ceil(T / block), Hkv*d)."""
    rows = x.double().permute(1, 0, 2).reshape(x.shape[1], -1).numpy()
    return np.stack([rows[i : i + block].mean(axis=0) for i in range(0, len(rows), block)])


def _thumbs(probs: list, size: int) -> np.ndarray:
    """The overview as ``Thumbnails.image`` shows it, from the weights: per layer and head the mean over
    each bin's query rows of the mass its key bin gets, scaled by the thumbnail's maximum, square-rooted."""
    t = probs[0].shape[-1]
    nb = -(-t // size)
    H = probs[0].shape[0]
    out = np.zeros((len(probs) * nb, H * nb))
    for layer, w in enumerate(probs):
        for h in range(H):
            m = np.array([[w[h, r : r + size, k : k + size].sum(axis=1).mean() for k in range(0, t, size)]
                          for r in range(0, t, size)])  # fmt: skip
            out[layer * nb : (layer + 1) * nb, h * nb : (h + 1) * nb] = np.sqrt(m / m.max())
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_steps_pool_only_the_new_cache_rows_and_the_overview_row_follows(family, tiny_lm, hf_eager, monkeypatch):
    monkeypatch.setattr(vd, "EXACT_LIMIT", 8)  # the KV cache view pools blocks of 4, then 8 positions
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 8)  # the score matrix too: a step adds a row to a cut row block
    s = Session(tiny_lm(family), PROMPT)
    s.step()
    vm = ViewModel(s)
    sel = Selection(layer=1, head=1)
    vm.build(sel)
    while not vm.refine():
        pass
    t0 = s.cache_length
    blocks = set()
    for i in range(20):
        if i == 10:  # two steps back and another token: the kept rows are dropped, not reused
            s.step_back()
            s.step_back()
            s.force_token((s.tokens[-1] + 1) % s.lm.vocab_size)
            s.step()  # with the loop's step T is back where it was: other keys at the last two positions
        s.step()
        snap = vm.build(sel, defer=True)
        t = s.cache_length
        block = snap.kv.kv_block
        blocks.add(block)
        ks, vs, probs = _hf(hf_eager, family, s.tokens[:t])
        kvh = s.kv_head_of(1, 1)
        np.testing.assert_allclose(
            snap.kv.kv_k, _pooled(ks[1], block), rtol=1e-5, atol=1e-5
        )  # decode vs prefill rounding: ~2e-6
        np.testing.assert_allclose(
            snap.kv.kv_v, _pooled(vs[1], block), rtol=1e-5, atol=1e-5
        )  # decode vs prefill rounding: ~2e-6
        w = probs[1][1]  # (T, T): the selected head's weights, masked cells NaN, then block maxima written out
        w = np.where(np.tril(np.ones(w.shape, dtype=bool)), w, np.nan)
        b = snap.scores.matrix_block
        want = np.array([[np.nanmax(w[r : r + b, c : c + b]) if c <= r + b - 1 else np.nan for c in range(0, t, b)]
                         for r in range(0, t, b)])  # fmt: skip
        assert b in (4, 8) and snap.scores.matrix_rows == t
        np.testing.assert_allclose(snap.scores.matrix, want, rtol=1e-5, atol=1e-6)
        fresh = ViewModel(s).build(sel)  # the whole cache pooled again: the same numbers, bit for bit
        np.testing.assert_array_equal(snap.kv.kv_k, fresh.kv.kv_k)
        np.testing.assert_array_equal(snap.kv.kv_v, fresh.kv.kv_v)
        np.testing.assert_allclose(
            snap.qkv.k, ks[1][kvh].numpy(), rtol=1e-5, atol=1e-5
        )  # decode vs prefill rounding: ~2e-6
        # the picture came first: the overview holds every row but the new one (after the steps back,
        # but the rows of the bin they cut through too), and says so
        behind = t - snap.overview.thumb_rows
        assert snap.overview.rows_behind and (behind == 1 if i != 10 else 1 <= behind <= vm.thumbs.size + 2)
        assert not vm.overview_complete and vm.rows_behind
        assert vm.refine()  # the worker's next idle slice
        th = vm.thumbs
        assert th.rows_done == t and not vm.rows_behind
        np.testing.assert_allclose(th.image(), _thumbs(probs, th.size), atol=1e-5)
    assert t == t0 + 19 and blocks == {4, 8}


def test_a_step_shows_the_picture_then_the_overview_row(shown, wait_idle, qtbot, tiny_lm, hf_eager, monkeypatch,
                                                        no_dialogs):  # fmt: skip
    monkeypatch.setattr(vd, "EXACT_LIMIT", 8)
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 4)
    # the GUI takes each picture long before the row's slice replaces it in the worker's one-slot mailbox
    monkeypatch.setattr(worker_mod, "ROW_GRACE", 0.5)
    win = shown(prompt=PROMPT)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.thumb_rows == win.snapshot.T > 8, timeout=20000)
    seen = []
    win.snapshot_changed.connect(lambda s: seen.append((s.T, s.thumb_rows, win.overview.title.text())))
    messages = []
    win.statusBar().messageChanged.connect(messages.append)
    ts = []
    for _ in range(3):
        t = win.snapshot.T
        press(qtbot, win, Qt.Key.Key_F10)
        qtbot.waitUntil(lambda t=t: bool(seen) and seen[-1][:2] == (t + 1, t + 1), timeout=20000)
        ts.append(t + 1)
    snap = wait_idle(win)
    for t in ts:  # each step's picture came with the overview one row behind (said in its title), then the row
        first = next(r for r in seen if r[0] == t)
        assert first[1] == t - 1 and "the newest 1 query row next" in first[2]
    assert "query row" not in win.overview.title.text()
    assert not any("Overview" in m for m in messages)  # a step's row is not a stream: nothing in the status bar
    _, _, probs = _hf(hf_eager, "gpt2", snap.token_ids[: snap.T])
    np.testing.assert_allclose(win.overview.image.image, _thumbs(probs, snap.thumb_bin_size), atol=1e-5)
    assert not no_dialogs and not win.errors


def test_a_zoom_shows_its_exact_cells_before_the_pooled_matrix_completes(shown, wait_idle, qtbot, hf_eager,
                                                                          monkeypatch, no_dialogs):  # fmt: skip
    import gpt_inspector.core.pooling as pooling

    monkeypatch.setattr(vd, "EXACT_LIMIT", 8)
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 16)  # blocks of 4 positions: several chunks to stream
    monkeypatch.setattr(vd, "TILE_CELLS", 12)
    monkeypatch.setattr(vd, "SYNC_BUDGET", 1)  # each build or slice adds one chunk of the pooled matrix
    monkeypatch.setattr(worker_mod, "REFINE_SLICE", 0.0)
    update = pooling.PooledMatrix.update

    slow = []

    def slow_update(self, *a, **k):  # a long context's chunk takes a while (once the user switches heads)
        time.sleep(0.15 if slow else 0.0)
        return update(self, *a, **k)

    monkeypatch.setattr(pooling.PooledMatrix, "update", slow_update)
    win = shown(prompt=PROMPT)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.matrix_rows == win.snapshot.T > 8, timeout=30000)
    seen = []
    win.snapshot_changed.connect(lambda s: seen.append((s.selection.head, s.matrix_rows, s.T, s.tile is not None)))
    head = win.selection.head
    slow.append(True)
    press(qtbot, win, Qt.Key.Key_BracketRight)  # the next head: its pooled matrix streams in
    qtbot.waitUntil(lambda: any(h == head + 1 for h, *_ in seen), timeout=20000)
    sm, t = win.score_matrix, win.snapshot.T
    sm.vb.setRange(xRange=(0, 5), yRange=(t - 5, t), padding=0)  # what a wheel zoom does to the view box
    qtbot.waitUntil(lambda: sm.tile.isVisible() and win.snapshot.tile is not None, timeout=20000)
    first = next(r for r in seen if r[3])
    assert first[0] == head + 1 and first[1] < first[2]  # the exact cells came before the pooled rows were all in
    qtbot.waitUntil(lambda: win.snapshot.matrix_rows == win.snapshot.T, timeout=30000)
    snap = wait_idle(win)
    with torch.no_grad():
        w = hf_eager("gpt2")(torch.tensor([list(snap.token_ids[: snap.T])]), output_attentions=True).attentions
    want = w[snap.selection.layer][0, head + 1].double().numpy()
    want = np.where(np.tril(np.ones_like(want, dtype=bool)), want, np.nan)
    q0, k0 = snap.tile_origin
    n, m = sm.tile.image.shape
    np.testing.assert_allclose(sm.tile.image, want[q0 : q0 + n, k0 : k0 + m], rtol=1e-5, atol=1e-6)
    assert not no_dialogs and not win.errors


def test_a_new_zoom_builds_its_tile_without_a_chunk_of_the_streaming_matrix(tiny_lm, hf_eager, monkeypatch):
    monkeypatch.setattr(vd, "EXACT_LIMIT", 8)
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 16)
    monkeypatch.setattr(vd, "SYNC_BUDGET", 1)  # each build adds one chunk (4 rows) of the pooled matrix
    s = Session(tiny_lm("llama"), PROMPT)
    s.step()
    vm = ViewModel(s)
    t = s.cache_length
    sel = Selection(layer=1, head=2)
    first = vm.build(sel)
    rows = [first.scores.matrix_rows]
    zoom = vm.build(Selection(layer=1, head=2, view=(t - 6, t, 0, 6)))
    rows.append(zoom.scores.matrix_rows)
    rows.append(vm.build(Selection(layer=1, head=2, view=(t - 6, t, 0, 6))).scores.matrix_rows)  # the same view
    assert rows[0] == rows[1] < rows[2] < t  # the new zoom added no rows; the next build went on streaming
    with torch.no_grad():
        w = hf_eager("llama")(torch.tensor([s.tokens[:t]]), output_attentions=True).attentions[1][0, 2].double()
    want = np.where(np.tril(np.ones((t, t), dtype=bool)), w.numpy(), np.nan)
    assert zoom.scores.tile_origin == (t - 6, 0)
    np.testing.assert_allclose(zoom.scores.tile, want[t - 6 :, :6], rtol=1e-5, atol=1e-6)
    assert np.array_equal(zoom.scores.matrix, first.scores.matrix, equal_nan=True)  # the pooled rows as shown
