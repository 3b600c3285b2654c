"""ALiBi on screen: the score matrix and the Q/K/V readout show the scores BLOOM computed, bias included."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_families
import tiny_models
from keys import press
from PySide6.QtCore import Qt


@pytest.fixture(scope="module")
def bloom(tmp_path_factory):
    from gpt_inspector.core.models import from_model

    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))
    return from_model(tiny_families.build_model("bloom", tok.convert_tokens_to_ids("<|endoftext|>")), tok, "bloom")


def test_alibi_scores_and_readout_carry_the_bias(qtbot, wait_idle, window_on, bloom):
    win, s = window_on(bloom, "She eats an apple. He reads")
    press(qtbot, win, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)  # scores
    wait_idle(win)
    for _ in range(3):  # each step extends the shown matrix: earlier rows gain the new keys' cells
        win.acts.step.trigger()
        wait_idle(win)
    snap = wait_idle(win)
    sel = snap.selection
    assert sel.kind == "scores"
    want = s.attention(sel.layer, sel.head, "scores")  # (T, T): q.k x scale + ALiBi, future keys included
    raw = s.attention(sel.layer, sel.head, "raw") * s.scaling(sel.layer)
    assert not np.allclose(want, raw)  # the bias is really there
    np.testing.assert_allclose(snap.matrix, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    key = win.qkv.key
    text = win.qkv.readout.text()
    bias = float(s.bias_rows(sel.layer, snap.query, snap.query + 1, (sel.head,))[0, 0, key])
    assert f"+ bias {bias:+.4g}" in text and f"score <b>{want[snap.query, key]:.4f}</b>" in text
