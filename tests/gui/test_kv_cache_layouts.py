"""The KV cache panel on models whose cache is not per-head K/V: MLA's latent, gemma3n's shared layers."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_families
import tiny_models
from keys import press


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    from gpt_inspector.core.models import from_model

    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    return {f: from_model(tiny_families.build_model(f, eos), tok, f) for f in ("deepseek_v3", "gemma3n_text")}


@pytest.fixture
def _window(window_on):
    return lambda qtbot, wait_idle, lm: window_on(lm)


def test_mla_panel_shows_per_head_k_and_v_and_the_latent_bytes(qtbot, wait_idle, lms, _window):
    win, s = _window(qtbot, wait_idle, lms["deepseek_v3"])
    try:
        win.run(2)
        snap = wait_idle(win)
        layer = snap.selection.layer
        _, k, v = s.qkv(layer)  # (4, T, 24), (4, T, 12): K and V differ in head size
        view = win.kv_cache
        assert view.kimg.image.shape == (s.cache_length, k.shape[0] * k.shape[2])
        assert view.vimg.image.shape == (s.cache_length, v.shape[0] * v.shape[2])
        np.testing.assert_array_equal(view.vimg.image, v.transpose(1, 0, 2).reshape(s.cache_length, -1))
        # separators between V's heads at V's own head size, not K's
        xs, _ = view.seps[1].getData()
        assert sorted(set(xs.tolist())) == [12.0, 24.0, 36.0]
        # the bars are the real cache: the latent rows, a quarter of what per-head K and V take
        cache = s.cache.layers[layer]
        latent = cache.keys.numel() * 4 + cache.values.numel() * 4
        assert view.bars.opts["height"][layer] == latent == s.kv_cache_bytes(layer) < (k.nbytes + v.nbytes)
        title = view.title.text()
        assert "24 dims in K, 12 in V" in title and "the model's cache holds" in title
    finally:
        win.worker.stop()


def test_a_kv_sharing_layer_says_whose_cache_it_reads(qtbot, wait_idle, lms, _window):
    win, s = _window(qtbot, wait_idle, lms["gemma3n_text"])
    try:
        win.run(1)
        win.kv_cache.layer_clicked.emit(2)
        snap = wait_idle(win)
        assert snap.selection.layer == 2
        assert win.kv_cache.bars.opts["height"][2] == 0 and win.kv_cache.bars.opts["height"][0] > 0
        assert "KV sharing" in win.kv_cache.title.text()
        np.testing.assert_array_equal(win.kv_cache.kimg.image, snap.kv_k)
        _, k0, _ = s.qkv(0)
        np.testing.assert_array_equal(snap.kv_k, k0.transpose(1, 0, 2).reshape(s.cache_length, -1))
    finally:
        win.worker.stop()


def test_hybrid_window_steps_and_selects_a_state_space_layer(qtbot, wait_idle, lms_hybrid, _window):
    win, s = _window(qtbot, wait_idle, lms_hybrid)
    try:
        win.run(2)
        snap = wait_idle(win)
        assert snap.T == s.cache_length and s.attention_layers == (1,)
        # jamba's layer 0 is a Mamba layer: choosing it shows the nearest layer that attends
        for layer in (1, 0):
            win.kv_cache.layer_clicked.emit(layer)
            snap = wait_idle(win)
            assert snap.selection.layer == 1
            np.testing.assert_array_equal(snap.matrix[~np.isnan(snap.matrix)], s.attention(1, 0)[snap.allowed])
        assert snap.kv_bytes == (0, s.kv_cache_bytes(1))
        nb = snap.thumb_bins
        assert not snap.thumbs[:nb].any() and snap.thumbs[nb:].any()  # the overview's Mamba row is blank
    finally:
        win.worker.stop()


@pytest.fixture(scope="module")
def lms_hybrid(tmp_path_factory):
    from gpt_inspector.core.models import from_model

    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))
    return from_model(tiny_families.build_model("jamba", tok.convert_tokens_to_ids("<|endoftext|>")), tok, "jamba")


def test_mla_panel_shows_the_latent_rows_as_cached(qtbot, wait_idle, lms, _window):
    """ "as cached" swaps the per-head K and V for the rows the model's cache really stores."""
    from PySide6.QtCore import Qt

    win, s = _window(qtbot, wait_idle, lms["deepseek_v3"])
    try:
        win.run(2)
        snap = wait_idle(win)
        view = win.kv_cache
        layer = snap.selection.layer
        assert view.as_cached.isVisible() and not view.as_cached.isChecked()
        qtbot.mouseClick(view.as_cached, Qt.MouseButton.LeftButton)
        cl = s.cache.layers[layer]
        t = s.cache_length
        want = np.concatenate([x[0, :, :t].numpy().transpose(1, 0, 2).reshape(t, -1) for x in (cl.keys, cl.values)], 1)
        np.testing.assert_array_equal(view.kimg.image, want)  # the latent rows, exactly as stored
        assert want.nbytes == s.kv_cache_bytes(layer) and not view.vplot.isVisible()
        assert "as stored" in view.title.text() and f"{want.shape[1]} numbers" in view.title.text()
        qtbot.mouseClick(view.as_cached, Qt.MouseButton.LeftButton)  # back to per-head K and V
        _, k, _ = s.qkv(layer)
        np.testing.assert_array_equal(view.kimg.image, k.transpose(1, 0, 2).reshape(t, -1))
        assert view.vplot.isVisible()
    finally:
        win.worker.stop()


def test_a_per_head_cache_offers_no_cached_view(shown):
    win = shown()
    assert win.snapshot.kv_cached is None and not win.kv_cache.as_cached.isVisible()


def test_a_sliding_window_model_shows_its_own_cache_and_what_the_inspector_keeps(shown, wait_idle, qtbot, tiny_lm):
    """gemma2's layer 0 has a 4-key window: the model's own cache (generate's) holds its newest 3 positions
    there. The status bar, the bars, the size-per-step curve and the title show that, and beside it,
    labelled, what the inspector keeps: every position of every layer."""
    from PySide6.QtCore import Qt

    from gpt_inspector.core.kv_layout import human_bytes

    lm = tiny_lm("gemma2")
    assert lm.model.config.sliding_window == 4 and lm.model.config.layer_types[:2] == [
        "sliding_attention",
        "full_attention",
    ]
    row = 2 * lm.n_kv_heads * lm.head_dim * 4  # K and V of one position and layer, float32: 128 bytes
    win = shown("gemma2")
    p = win.snapshot.prompt_len
    assert p > 3  # the prompt alone overflows the window

    def expect(n_steps: int) -> None:
        snap = wait_idle(win)
        t = p + n_steps - 1
        cached, kept = [3 * row, t * row], [t * row, t * row]
        assert (snap.T, snap.kv_bytes, snap.kv_kept, snap.kv_positions) == (t, tuple(cached), tuple(kept), (3, t))
        assert win.st_kv.text() == f"KV cache {human_bytes(sum(cached))} · kept {human_bytes(sum(kept))}"
        view = win.kv_cache
        assert list(view.bars.opts["height"]) == cached and list(view.kept_bars.opts["height"]) == kept
        # after step i the cache held the prompt and i tokens: the window's layer stopped growing at 3
        lengths = range(p, t + 1)
        assert list(view.hcurve.getData()[1]) == [(3 + n) * row for n in lengths]
        assert list(view.kept_curve.getData()[1]) == [2 * n * row for n in lengths]
        title = view.title.text()
        assert title.startswith(f"layer 0: model's cache {human_bytes(3 * row)} (last 3 positions), "
                                f"{human_bytes(sum(cached))} all layers")  # fmt: skip
        assert f"kept for inspection {human_bytes(t * row)}, {human_bytes(sum(kept))} all" in title

    for n in (1, 2, 3):
        press(qtbot, win, Qt.Key.Key_F10)  # Step
        expect(n)
    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)  # Step back
    expect(2)
    # the full-attention layer: no window to name, the bytes of every position
    win.kv_cache.layer_clicked.emit(1)
    wait_idle(win)
    assert win.kv_cache.title.text().startswith(f"layer 1: model's cache {human_bytes((p + 1) * row)}, ")
