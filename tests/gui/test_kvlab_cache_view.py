"""The KV cache panel under a cache policy: evicted rows greyed, crossed and labelled per KV head,
a quantizing policy's row error beside V; driven as a user does (the lab panel, F10, ] for the next
head, PgDown for the next layer) and checked against the lab's own ``evicted`` / ``row_error``."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt

from gpt_inspector.gui.views.kv_cache import EVICTED_ALPHA, EVICTED_LABEL

PROMPT = "She eats an apple. He reads a book. They walk"


def _lab_in_window(win, qtbot, wait_idle, policy, budget, steps):
    """Run a lab from the KV cache lab panel, then Show policy run: the window shows the policy run."""
    panel = win.kvlab_panel
    win.raise_panel(panel)
    panel.policy.setCurrentText(policy)
    if budget is not None:
        panel.budget.setValue(budget)
    panel.steps.setValue(steps)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and len(panel.view.steps) == steps, timeout=30000)
    qtbot.mouseClick(panel.show_button, Qt.MouseButton.LeftButton)
    return wait_idle(win)


def _key(win, qtbot, wait_idle, key, modifier=Qt.KeyboardModifier.NoModifier):
    qtbot.keyClick(win, key, modifier)
    return wait_idle(win)


def _shown_cells(view, heads):
    """(rows, KV heads) the panel greys in K and V, and the cells it crosses in each."""
    alpha = [veil.image[..., 3] for veil in view.evicted_veils]  # (T, Hkv) each
    crossed = []
    for mark, width in zip(view.evicted_marks, (view.kimg.width(), view.vimg.width())):
        xs, ys = mark.getData()
        cells = np.zeros_like(alpha[0], dtype=bool)
        if xs is not None and len(xs):
            x0, y0 = xs[0::4], ys[0::4]  # each X: 4 points, the first at its cell's top-left corner
            cells[y0.astype(int), (x0 / (width / heads)).round().astype(int)] = True
        crossed.append(cells)
    return alpha, crossed


def _check_panel(win, lab, layer, head):
    view, snap = win.kv_cache, win.snapshot
    assert (snap.selection.layer, snap.selection.head) == (layer, head)
    want = lab.evicted(layer)  # (Hkv, T): the lab's own account
    kvh = lab.run.kv_head_of(head)
    assert snap.kv_head == kvh
    np.testing.assert_array_equal(snap.kv_evicted, want)
    alpha, crossed = _shown_cells(view, lab.lm.n_kv_heads)
    for a, c in zip(alpha, crossed):
        np.testing.assert_array_equal(a == EVICTED_ALPHA, want.T)  # greyed: every KV head's own rows
        np.testing.assert_array_equal(a[~want.T], 0)
        np.testing.assert_array_equal(c, want.T)  # crossed
    marked = np.array([lab_.startswith(EVICTED_LABEL) for lab_ in view.axis.labels])
    np.testing.assert_array_equal(marked, want[kvh])  # the labels: the selected head's KV head
    assert f"KV head {kvh}: {int(want[kvh].sum())} of {lab.run.cache_length} rows evicted" in view.title.text()
    return want


def test_evicted_rows_are_greyed_crossed_and_labelled_for_the_selected_head(make_window, wait_idle, qtbot, tiny_lm,
                                                                            no_dialogs):  # fmt: skip
    from gpt_inspector.core.kvlab import KVLab, make

    lm = tiny_lm("llama")  # 4 query heads on 2 KV heads
    win = make_window("llama", prompt=PROMPT)
    _lab_in_window(win, qtbot, wait_idle, "h2o", 6, 3)
    twin = KVLab(lm, PROMPT, make("h2o", 6))  # the same lab, stepped the same way, outside the window
    twin.run_steps(3)
    _check_panel(win, twin, 0, 0)
    # the window steps the policy run on its own from here: the policy keeps evicting, the panel follows
    for _ in range(2):
        _key(win, qtbot, wait_idle, Qt.Key.Key_F10)
        twin.run.step()
        _check_panel(win, twin, 0, 0)
    _key(win, qtbot, wait_idle, Qt.Key.Key_PageDown)
    shown = {}
    for head in range(4):
        if head:
            _key(win, qtbot, wait_idle, Qt.Key.Key_BracketRight)
        want = _check_panel(win, twin, 1, head)
        shown[head] = [lab_.startswith(EVICTED_LABEL) for lab_ in win.kv_cache.axis.labels]
    # the two KV heads evicted different rows, so labels from the wrong head would have failed above
    assert not np.array_equal(want[0], want[1])
    assert shown[0] == shown[1] != shown[2] == shown[3]
    assert not win.kv_cache.eplot.isVisible()  # eviction keeps exact rows: no error column
    assert not no_dialogs


def test_quantization_error_column_shows_the_selected_kv_heads_rows(make_window, wait_idle, qtbot, tiny_lm, no_dialogs):
    from gpt_inspector.core.kvlab import KVLab, make

    lm = tiny_lm("llama")
    win = make_window("llama", prompt=PROMPT)
    _lab_in_window(win, qtbot, wait_idle, "int4", None, 12)
    twin = KVLab(lm, PROMPT, make("int4"))
    twin.run_steps(12)
    _key(win, qtbot, wait_idle, Qt.Key.Key_F10)
    twin.run.step()
    view = win.kv_cache
    for head in (0, 2):
        while win.snapshot.selection.head < head:
            _key(win, qtbot, wait_idle, Qt.Key.Key_BracketRight)
        kvh = twin.run.kv_head_of(head)
        keys, values = twin.row_error(0)  # (Hkv, T) each
        assert keys[kvh].max() > 0 and values[kvh].max() > 0 and keys[kvh][-16:].max() == 0  # residual rows exact
        assert view.eplot.isVisible()
        xk, yk = view.ek_curve.getData()
        xv, _ = view.ev_curve.getData()
        np.testing.assert_array_equal(yk, np.arange(twin.run.cache_length) + 0.5)
        np.testing.assert_allclose(xk, keys[kvh], rtol=1e-6, atol=0)
        np.testing.assert_allclose(xv, values[kvh], rtol=1e-6, atol=0)
        assert f"KV head {kvh} quantization error: keys max {float(keys[kvh].max()):.3g}" in view.title.text()
    assert not np.allclose(
        twin.row_error(0)[0][0], twin.row_error(0)[0][1]
    )  # the heads differ: the wrong one would fail
    assert not twin.evicted(0).any() and not any(lab_.startswith(EVICTED_LABEL) for lab_ in view.axis.labels)
    assert not no_dialogs


def test_a_session_under_no_policy_shows_no_veil(make_window, wait_idle, qtbot):
    win = make_window("llama", prompt=PROMPT)
    snap = _key(win, qtbot, wait_idle, Qt.Key.Key_F10)
    assert snap.kv_evicted is None and snap.kv_error is None
    assert all(not v.isVisible() for v in win.kv_cache.evicted_veils) and not win.kv_cache.eplot.isVisible()
    assert not any(lab_.startswith(EVICTED_LABEL) for lab_ in win.kv_cache.axis.labels)


def test_pooled_rows_are_veiled_in_proportion_to_their_evicted_positions():
    from gpt_inspector.gui.views.kv_cache import _pool_share

    ev = np.zeros((2, 5), dtype=bool)  # (Hkv, T)
    ev[0, [0, 1, 4]] = True
    ev[1, 2] = True
    np.testing.assert_array_equal(_pool_share(ev, 1), ev.T)
    np.testing.assert_allclose(_pool_share(ev, 2), [[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]])  # the last block is short
