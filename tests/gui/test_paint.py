"""Images drawn from ready pixels (views.image, made by the worker in gui.paint) look exactly as
pyqtgraph's own ImageItem draws the same values, masked cells included; a part of a snapshot the
worker kept unchanged is not drawn again."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication

import gpt_inspector.gui.views.image as image_mod
from gpt_inspector import Session
from gpt_inspector.gui.views.common import CMAP, DIVERGING, MASKED_COLOR
from gpt_inspector.gui.views.image import ColourImage, argb, pixels

VIRIDIS = CMAP.getLookupTable(nPts=256)
SIGNED = DIVERGING.getLookupTable(nPts=256)
PROMPT = "She eats an apple. He reads a book"


def _drawn(item) -> QImage:
    item.render()
    return item.qimage.convertToFormat(QImage.Format.Format_ARGB32_Premultiplied)


def _cases():
    rng = np.random.default_rng(0)
    probs = rng.random((97, 97)).astype(np.float32)
    probs[np.triu_indices(97, 1)] = np.nan  # causal: the upper triangle masked
    scores = (rng.standard_normal((64, 64)) * 5).astype(np.float32)
    scores[np.triu_indices(64, 1)] = np.nan
    keys = rng.standard_normal((300, 16)).astype(np.float32)
    # the quantisation's edges: each end of the levels, a step either side of a colour boundary, outside
    edges = np.array([[0, 1 / 256, np.nextafter(1 / 256, 0), 255 / 256, 1, 1.5, -0.2, np.nan, 0.5]], np.float32)
    return [
        ("probs", probs, (0.0, 1.0), VIRIDIS),
        ("scores", scores, (float(np.nanmin(scores)), float(np.nanmax(scores))), VIRIDIS),
        ("clipped both ends", scores, (-1.0, 2.5), VIRIDIS),
        ("edges", edges, (0.0, 1.0), VIRIDIS),
        ("flat levels", np.ones((3, 5), np.float32), (1.0, 1.0), VIRIDIS),
        ("float64", scores.astype(np.float64) / 3, (-2.0, 2.0), VIRIDIS),
        ("keys", keys, (-3.0, 3.0), SIGNED),
        ("all masked", np.full((4, 4), np.nan, np.float32), (0.0, 1.0), VIRIDIS),
        # a table with its own alpha: left to ImageItem
        ("rgba table", probs, (0.0, 1.0), CMAP.getLookupTable(nPts=256, alpha=True)),
    ]


@pytest.mark.parametrize("name, values, levels, lut", _cases(), ids=[c[0] for c in _cases()])
def test_colour_image_draws_what_image_item_draws(qapp, monkeypatch, name, values, levels, lut):
    old = pg.ImageItem(axisOrder="row-major")
    old.setLookupTable(lut)
    old.setImage(values, autoLevels=False, levels=levels)
    want = _drawn(old)
    made_here = ColourImage()
    made_here.setLookupTable(lut)
    made_here.show(values, levels)
    assert _drawn(made_here) == want
    ready = ColourImage()
    ready.setLookupTable(lut)
    ready.show(values, levels, pixels(values, levels, lut))
    with monkeypatch.context() as m:  # the worker's pixels are drawn as they are: nothing made at paint
        m.setattr(image_mod, "argb", lambda *a: pytest.fail("pixels made again at paint"))
        assert _drawn(ready) == want
    # pixels made for other levels are not used for these
    stale = ColourImage()
    stale.setLookupTable(lut)
    stale.show(values, levels, pixels(values, (levels[0] - 1.0, levels[1] + 3.0), lut))
    assert _drawn(stale) == want
    a = argb(values, levels, lut)
    assert np.array_equal(a >> 24 == 0, np.isnan(values))  # masked cells, and only they, transparent
    assert not a[np.isnan(values)].any()


def _grab(win) -> dict[str, QImage]:
    return {name: w.grab().toImage() for name, w in
            (("matrix", win.score_matrix.glw), ("qkv", win.qkv.glw), ("kv", win.kv_cache.glw))}  # fmt: skip


def _items(win):
    return (win.score_matrix.image, win.qkv.kimg, win.qkv.vimg, win.kv_cache.kimg, win.kv_cache.vimg)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_window_images_are_pyqtgraphs_pixels(shown, wait_idle, qtbot, monkeypatch, no_dialogs, family):
    win = shown(family=family, prompt=PROMPT)
    for _ in range(2):
        qtbot.keyClick(QApplication.focusWidget() or win, Qt.Key.Key_F10)
        wait_idle(win)
    sm = win.score_matrix
    for kind in ("probs", "masked_scores", "raw"):
        qtbot.mouseClick(sm.kind_buttons[kind], Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda k=kind: win.snapshot.selection.kind == k and not win.busy, timeout=10000)
        snap = wait_idle(win)
        painted = snap.painted
        # the worker made the pixels of what is shown, and the views were handed them
        assert painted.matrix.values is snap.scores.matrix and sm.image.ready is painted.matrix
        assert win.qkv.kimg.ready is painted.qkv_k and win.kv_cache.kimg.ready is painted.kv_k
        assert sm.image.ready.levels == tuple(snap.scores.levels)
        new = _grab(win)
        with monkeypatch.context() as m:  # the same views drawn by pyqtgraph's own ImageItem
            m.setattr(ColourImage, "render", pg.ImageItem.render)
            for item in _items(win):
                item.updateImage()
            old = _grab(win)
        for item in _items(win):
            item.updateImage()
        for name in new:
            assert new[name] == old[name], (kind, name)
        assert _grab(win)["matrix"] == new["matrix"]
        if kind == "probs":  # a masked cell (query 0, key T-1) shows the masked grey
            t = snap.T
            p = sm.glw.mapFromScene(sm.vb.mapViewToScene(QPointF(t - 0.5, 0.5)))
            assert new["matrix"].pixelColor(p).name() == MASKED_COLOR.name()
            assert np.isnan(sm.image.image[0, t - 1])
    assert not no_dialogs and not win.errors


def test_an_unchanged_part_is_kept_and_not_drawn_again(shown, wait_idle, qtbot, tiny_lm, no_dialogs):
    win = shown(family="llama", prompt=PROMPT)
    qtbot.keyClick(QApplication.focusWidget() or win, Qt.Key.Key_F10)
    before = wait_idle(win)
    shows = []
    for item in (win.qkv.kimg, win.kv_cache.kimg):
        original = item.show
        item.show = lambda *a, _o=original, **k: shows.append(a[0]) or _o(*a, **k)
    curves = win.softmax_rows.curves[0]
    set_data = curves.setData
    curves.setData = lambda *a, **k: shows.append("rows") or set_data(*a, **k)
    # another stage of the matrix: only the score matrix's part changes
    qtbot.mouseClick(win.score_matrix.kind_buttons["raw"], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.snapshot.selection.kind == "raw" and not win.busy, timeout=10000)
    after = wait_idle(win)
    assert after.scores is not before.scores and after.T == before.T
    for part in ("qkv", "kv", "query_row", "tokens", "mask", "overview"):
        assert getattr(after, part) is getattr(before, part), part
    assert shows == []  # q / K / V, the KV cache and the softmax rows were not set again
    # what they show is still the model's (an independent session of the same checkpoint)
    ref = Session(tiny_lm("llama"), PROMPT)
    ref.step()
    layer, head = after.selection.layer, after.selection.head
    q, k, v = ref.qkv(layer)
    kvh = ref.kv_head_of(head, layer)
    np.testing.assert_array_equal(win.qkv.kimg.image, k[kvh])
    np.testing.assert_array_equal(win.qkv.vimg.image, v[kvh])
    np.testing.assert_allclose(win.softmax_rows.curves[0].getData()[1], ref.attention(layer, 0, "probs")[-1], atol=1e-6)
    # a step changes them: drawn again, with the new position's row
    qtbot.keyClick(QApplication.focusWidget() or win, Qt.Key.Key_F10)
    stepped = wait_idle(win)
    assert stepped.qkv is not after.qkv and len(shows) == 3 and "rows" in shows
    ref.step()
    q, k, v = ref.qkv(layer)
    np.testing.assert_array_equal(win.qkv.kimg.image, k[kvh])
    assert win.qkv.kimg.image.shape[0] == stepped.T == before.T + 1
    assert not no_dialogs and not win.errors


def test_an_image_too_tall_for_qt_is_left_to_pyqtgraph(qapp, monkeypatch):
    # past 32,767 rows (the K and V of a 32k context) pyqtgraph downsamples the image per view
    values = np.random.default_rng(1).standard_normal((2**15, 3)).astype(np.float32)
    ready = pixels(values, (-3.0, 3.0), SIGNED)
    assert ready.argb is None and ready.levels == (-3.0, 3.0)  # levels made, no pixels
    item = ColourImage()
    item.setLookupTable(SIGNED)
    called = []
    monkeypatch.setattr(pg.ImageItem, "render", lambda self: called.append(self))
    item.show(values, ready.levels, ready)
    assert item.autoDownsample
    item.render()
    assert called == [item]


@pytest.mark.parametrize("spoil", [None, np.inf, -np.inf, np.nan])
def test_the_workers_signed_levels_are_the_views_own(spoil):
    from gpt_inspector.gui.paint import _symmetric
    from gpt_inspector.gui.views.common import symmetric_levels

    rng = np.random.default_rng(2)
    q, k = rng.standard_normal(8).astype(np.float32), (rng.standard_normal((50, 8)) * 3).astype(np.float32)
    if spoil is not None:  # an overflowed half-precision cache: the scale leaves such cells out
        k[7, 3] = spoil
    assert _symmetric(q, k) == symmetric_levels(np.concatenate([q, k.ravel()]))
    assert _symmetric(k) == symmetric_levels(k)


def test_a_changed_part_keeps_its_unchanged_arrays_and_their_pixels(tiny_lm):
    """A part with one field changed (a pooled matrix's row count, as when a step's overview row
    follows) is a new part whose equal arrays are the old objects, their pixels the old pixels; an
    array with one cell changed, or a NaN where there was a number, is new and painted again."""
    import dataclasses

    from gpt_inspector.gui import paint
    from gpt_inspector.gui.viewdata import Selection, ViewModel

    s = Session(tiny_lm("llama"), PROMPT)
    s.run(2)
    vm = ViewModel(s)
    first = paint.prepare(None, vm.build(Selection(layer=1, head=0)))
    again = vm.build(Selection(layer=1, head=0))
    assert again.scores.matrix is not first.scores.matrix  # each build makes fresh arrays
    fresh = dataclasses.replace(
        again, scores=dataclasses.replace(again.scores, matrix_rows=first.scores.matrix_rows + 1)
    )
    kept = paint.prepare(first, fresh)
    assert kept.scores is not first.scores and kept.scores.matrix_rows == first.scores.matrix_rows + 1
    assert kept.scores.matrix is first.scores.matrix and kept.painted.matrix is first.painted.matrix
    assert kept.qkv is first.qkv and kept.painted.qkv_k is first.painted.qkv_k  # unchanged: the whole part
    for change in (lambda m: m.__setitem__((-1, 0), m[-1, 0] + 1e-6), lambda m: m.__setitem__((-1, 0), np.nan)):
        m = first.scores.matrix.copy()
        change(m)
        other = paint.prepare(first, dataclasses.replace(again, scores=dataclasses.replace(again.scores, matrix=m)))
        assert other.scores.matrix is m and other.painted.matrix is not first.painted.matrix
        assert other.painted.matrix.values is m
