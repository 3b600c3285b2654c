"""Long contexts in the view model: a streamed overview, a pooled score matrix, exact zoomed-in tiles.

The limits are lowered so that tiny checkpoints exercise the long-context paths; every figure is
checked against the full (T, T) matrices the run source derives, pooled here independently.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpt_inspector.core.pooling as pooled_mod
import gpt_inspector.gui.viewdata as vd
from gpt_inspector import MaskEdit, Session
from gpt_inspector.gui.viewdata import Selection, ViewModel, full_thumbnails

PROMPT = "She eats an apple. He reads a book every evening and she writes long letters to him."


def _block_max(source, layer, head, kind, block):
    """Independent pooling: the whole (T, T) matrix, masked cells dropped, max over each block."""
    full = source.attention(layer, head, kind).astype(np.float64)
    if kind in ("masked_scores", "probs"):
        full = np.where(source.allowed(layer, head), full, -np.inf)
    t = full.shape[0]
    nb = -(-t // block)
    pad = np.full((nb * block, nb * block), -np.inf)
    pad[:t, :t] = full
    out = pad.reshape(nb, block, nb, block).max(axis=(1, 3))
    return np.where(np.isneginf(out), np.nan, out)


@pytest.fixture
def long_limits(monkeypatch):
    monkeypatch.setattr(vd, "EXACT_LIMIT", 6)  # past 6 positions the matrix is pooled...
    monkeypatch.setattr(vd, "DISPLAY_CELLS", 4)  # ...to at most 4 blocks per side
    monkeypatch.setattr(vd, "TILE_CELLS", 5)


@pytest.mark.parametrize("kind", ["raw", "scores", "masked_scores", "probs"])
def test_pooled_matrix_is_the_block_maximum_through_steps_backs_and_edits(tiny_lm, long_limits, monkeypatch, kind):
    s = Session(tiny_lm("qwen2"), PROMPT, temperature=1.0, seed=3)
    vm = ViewModel(s)
    sel = Selection(1, 2, None, kind)

    def check():
        snap = vm.build(sel)
        assert snap.allowed is None and snap.matrix_block > 1
        assert -(-snap.T // snap.matrix_block) <= vd.DISPLAY_CELLS < -(-snap.T // (snap.matrix_block // 2))
        want = _block_max(s, 1, 2, kind, snap.matrix_block)
        np.testing.assert_allclose(snap.matrix, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(snap.query_allowed, s.allowed(1, 2)[snap.query])
        return snap

    s.step()
    t0 = s.cache_length  # display cells chosen so that the block size doubles within the steps below
    cells = next(
        c
        for c in range(2, t0)
        if pooled_mod.pow2_block(t0, c) != pooled_mod.pow2_block(t0 + 4, c) and pooled_mod.pow2_block(t0, c) > 1
    )
    monkeypatch.setattr(vd, "DISPLAY_CELLS", cells)
    blocks = {check().matrix_block}
    for _ in range(5):  # the incremental path: one row block per step, blocks merged as T doubles
        s.step()
        blocks.add(check().matrix_block)
    assert len(blocks) > 1
    s.step_back()
    s.step_back()
    check()
    s.set_mask_edits([MaskEdit(s.cache_length - 3, 2, layer=1, head=2), MaskEdit(4, 0)])
    check()
    s.step()
    check()


def test_zoomed_in_view_gets_exact_cells_and_a_too_large_one_does_not(tiny_lm, long_limits):
    s = Session(tiny_lm("llama"), PROMPT)
    s.step()
    vm = ViewModel(s)
    t = s.cache_length
    q0, k0 = t - 5, 2
    snap = vm.build(Selection(0, 1, None, "probs", view=(q0, t, k0, k0 + 4)))
    want = np.where(s.allowed(0, 1), s.attention(0, 1, "probs"), np.nan)[q0:t, k0 : k0 + 4]
    assert snap.tile_origin == (q0, k0)
    np.testing.assert_allclose(snap.tile, want, rtol=1e-5, atol=1e-7)
    s.step()  # the tile follows the run
    t = s.cache_length
    snap = vm.build(Selection(0, 1, None, "raw", view=(t - 3, t, 0, 5)))
    np.testing.assert_allclose(snap.tile, s.attention(0, 1, "raw")[t - 3 : t, 0:5], rtol=1e-5, atol=1e-6)
    assert vm.build(Selection(0, 1, None, "probs", view=(0, t, 0, t))).tile is None  # more than TILE_CELLS
    # a view over the newest rows follows the run: each step adds the new row and key to the tile
    follow = Selection(0, 1, None, "probs", view=(t - 3, t + 2, t - 4, t + 1))
    vm.build(follow)
    for _ in range(2):
        s.step()
        t = s.cache_length
        snap = vm.build(follow)
        want = np.where(s.allowed(0, 1), s.attention(0, 1, "probs"), np.nan)
        q0, k0 = snap.tile_origin
        assert snap.tile.shape == (min(t, q0 + 5) - q0, min(t, k0 + 5) - k0)
        np.testing.assert_allclose(
            snap.tile, want[q0 : q0 + snap.tile.shape[0], k0 : k0 + snap.tile.shape[1]], rtol=1e-5, atol=1e-7
        )
    s.step_back()
    snap = vm.build(follow)
    t = s.cache_length
    want = np.where(s.allowed(0, 1), s.attention(0, 1, "probs"), np.nan)
    np.testing.assert_allclose(snap.tile, want[snap.tile_origin[0] : t, snap.tile_origin[1] : t], rtol=1e-5, atol=1e-7)


def test_first_overview_streams_in_refinement_order_and_ends_exact(tiny_lm, monkeypatch):
    monkeypatch.setattr(pooled_mod, "CHUNK_ROWS", 2)
    s = Session(tiny_lm("qwen2"), PROMPT)
    s.step()
    vm = ViewModel(s, max_bins=4)
    per_row = s.n_layers * s.n_heads * s.cache_length
    assert not vm.reconcile(budget=3 * per_row)  # a first build past the budget: partial
    th = vm.thumbs
    assert 0 < th.rows_done <= 3 < s.cache_length and not vm.overview_complete
    # the refinement order visits every bin before it completes any
    while not (th.counts[: th.bins] > 0).all():
        vm.refine(budget=2 * per_row)
    assert th.rows_done < s.cache_length
    monkeypatch.setattr(vd, "SYNC_BUDGET", per_row)  # a build adds at most a row of its own
    snap = vm.build()
    assert snap.thumb_rows == th.rows_done < snap.T
    while not vm.refine(budget=2 * per_row):
        pass
    np.testing.assert_allclose(vm.build().thumbs, full_thumbnails(s, 4).image(), atol=1e-6)
    monkeypatch.setattr(vd, "SYNC_BUDGET", 1 << 22)
    # a mask edit early in the context makes the rows after it pending again; a step adds its row
    s.set_mask_edits([MaskEdit(3, 1)])
    vm.reconcile(budget=per_row)
    assert th.rows_done < s.cache_length
    s.step()
    while not vm.reconcile(budget=2 * per_row):
        pass
    assert vm.build().thumb_rows == s.cache_length
    np.testing.assert_allclose(vm.build().thumbs, full_thumbnails(s, 4).image(), atol=1e-6)


def test_kv_cache_rows_are_block_means_past_the_limit(tiny_lm, long_limits):
    s = Session(tiny_lm("llama"), PROMPT)
    s.step()
    snap = ViewModel(s).build()
    k = s.qkv(0)[1]  # (Hkv, T, d)
    side = np.concatenate(list(k), axis=1)  # (T, Hkv*d)
    b = snap.kv_block
    assert b > 1 and snap.kv_k.shape == (-(-s.cache_length // b), side.shape[1])
    np.testing.assert_allclose(snap.kv_k[0], side[:b].mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(snap.kv_k[-1], side[(snap.kv_k.shape[0] - 1) * b :].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_pooled_matrix_first_build_streams_then_matches(tiny_lm, long_limits, monkeypatch):
    s = Session(tiny_lm("llama"), PROMPT)
    s.step()
    t = s.cache_length
    monkeypatch.setattr(vd, "SYNC_BUDGET", 1)  # one row block per build
    vm = ViewModel(s)
    sel = Selection(1, 2, None, "probs")
    snap = vm.build(sel)
    b = snap.matrix_block
    assert snap.matrix_rows == b < t and not vm.overview_complete
    assert np.isnan(snap.matrix[1:]).all() and not np.isnan(snap.matrix[0, 0])
    builds = 1
    while vm.build(sel).matrix_rows < t:
        builds += 1
    assert builds == -(-t // b) - 1
    np.testing.assert_allclose(vm.build(sel).matrix, _block_max(s, 1, 2, "probs", b), rtol=1e-5, atol=1e-6)
