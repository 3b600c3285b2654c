"""The view data the worker prepares: incremental overview == recomputed from scratch, at every turn."""

from __future__ import annotations

import numpy as np
import pytest

from gpt_inspector import MaskEdit, Session
from gpt_inspector.gui.viewdata import Selection, Thumbnails, ViewModel, full_thumbnails


def _check(vm, snap, max_bins):
    """Compare with thumbnails computed from scratch at the same bin size (bins never shrink)."""
    full = Thumbnails(vm.L, vm.H, max_bins)
    full.size = vm.thumbs.size
    src = vm.obj
    full.add_rows(lambda layer, p0, p1: src.attention_rows(layer, p0, p1).numpy(), 0, src.cache_length)
    np.testing.assert_allclose(snap.thumbs, full.image(), atol=1e-6)
    if vm.thumbs.size == 1:
        np.testing.assert_allclose(snap.thumbs, full_thumbnails(src, max_bins).image(), atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_overview_stays_exact_through_steps_backs_and_edits(tiny_lm, family):
    lm = tiny_lm(family)
    s = Session(lm, "She eats an apple.", temperature=1.0, seed=2)
    vm = ViewModel(s, max_bins=4)  # tiny bins: the bin size doubles several times
    assert vm.build().thumbs is None
    for _ in range(6):
        s.step()
        _check(vm, vm.build(), 4)
    assert vm.thumbs.size > 1
    s.step_back()
    s.step_back()
    _check(vm, vm.build(), 4)
    s.set_mask_edits([MaskEdit(s.cache_length - 2, 1, layer=1, head=None)])
    snap = vm.build(Selection(1, 3, None, "probs"))
    _check(vm, snap, 4)
    assert np.isnan(snap.matrix[s.cache_length - 2, 1])
    np.testing.assert_allclose(np.nan_to_num(snap.matrix), s.attention(1, 3, "probs"), atol=1e-6)
    np.testing.assert_allclose(snap.head_rows, np.stack([s.attention(1, h)[-1] for h in range(lm.n_heads)]), atol=1e-6)
    s.restart()
    snap = vm.build()
    assert snap.T == 0 and vm.thumbs.size == 1


def test_selection_is_clamped_and_query_follows(tiny_lm):
    s = Session(tiny_lm("llama"), "One two three")
    vm = ViewModel(s)
    s.run(2)
    snap = vm.build(Selection(layer=99, head=-3, query=None, kind="nope"))
    assert (snap.selection.layer, snap.selection.head, snap.selection.kind) == (s.n_layers - 1, 0, "probs")
    assert snap.query == s.cache_length - 1
    snap = vm.build(Selection(0, 1, 2, "raw"))
    assert snap.query == 2 and not np.isnan(snap.matrix).any()
    q, k, v = s.qkv(0)
    np.testing.assert_array_equal(snap.q, q[1, 2])
    np.testing.assert_array_equal(snap.k, k[s.lm.kv_head_of(1)])
    assert snap.kv_k.shape == (s.cache_length, s.n_kv_heads * s.head_dim)
    np.testing.assert_array_equal(snap.kv_k[:, : s.head_dim], k[0])


@pytest.mark.parametrize("kind", ["raw", "scores", "masked_scores", "probs"])
def test_selected_matrix_grows_by_one_row_and_matches_the_engine(tiny_lm, kind):
    s = Session(tiny_lm("llama"), "She eats an apple. He reads", temperature=1.0, seed=1)
    vm = ViewModel(s)
    sel = Selection(1, 3, None, kind)

    def check(snap):
        want = s.attention(1, 3, kind)
        allowed = s.allowed(1, 3)
        np.testing.assert_array_equal(snap.allowed, allowed)
        if kind in ("masked_scores", "probs"):
            want = np.where(allowed, want, np.nan)
        np.testing.assert_allclose(snap.matrix, want, rtol=1e-5, atol=1e-6)

    s.step()
    first = vm.build(sel)
    check(first)
    for _ in range(4):
        s.step()
        check(vm.build(sel))  # the incremental path
    before = vm.build(sel)
    s.step()
    vm.build(sel)
    s.step_back()
    after = vm.build(sel)
    np.testing.assert_array_equal(after.matrix, before.matrix)  # cropped, bit for bit
    s.set_mask_edits([MaskEdit(s.cache_length - 3, 2, layer=1, head=3), MaskEdit(s.cache_length - 1, 0)])
    check(vm.build(sel))
    s.step()
    check(vm.build(sel))


@pytest.mark.parametrize("path", ["key blocks", "whole rows"])
def test_overview_built_in_row_chunks_equals_one_pass(tiny_lm, monkeypatch, path):
    """A first build at long T goes through rows in chunks of three (plain causal rows in key blocks,
    the others whole); the bins are the same as in one pass."""
    import gpt_inspector.core.attention as eq
    import gpt_inspector.core.pooling as pooled_mod
    import gpt_inspector.core.tiles as tiles

    s = Session(tiny_lm("llama"), "She eats an apple. He reads a book every evening.")
    s.step()
    one = full_thumbnails(s, max_bins=4).image()
    seen = []
    if path == "key blocks":
        real = eq.causal_bin_mass
        g = s.n_heads // s.n_kv_heads
        monkeypatch.setattr(eq, "FEW_ROWS", 0)
        monkeypatch.setattr(tiles, "KEY_BLOCK", 4)
        monkeypatch.setattr(tiles, "BLOCK_NUMBERS", 3 * g * 4)  # three rows of a KV head's queries per block
        monkeypatch.setattr(eq, "causal_bin_mass", lambda q, *a, **k: seen.append(q.shape[1]) or real(q, *a, **k))
    else:
        rows = s.attention_rows

        def spy(layer, p0, p1, *a, **k):
            seen.append(p1 - p0)
            return rows(layer, p0, p1, *a, **k)

        monkeypatch.setattr(s, "plain_causal", lambda *a: False)
        monkeypatch.setattr(pooled_mod, "ROWS_BUDGET", 3 * s.n_heads * s.cache_length)  # three rows per evaluation
        monkeypatch.setattr(s, "attention_rows", spy)
    chunked = full_thumbnails(s, max_bins=4).image()
    assert max(seen) == 3 and len(seen) > s.n_layers
    np.testing.assert_allclose(chunked, one, atol=1e-6)
