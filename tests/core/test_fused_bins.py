"""The overview's key-bin sums from the fused kernel == the softmax written out here in float64."""

from __future__ import annotations

import numpy as np
import pytest

import gpt_inspector.core.attention as eq
from gpt_inspector import MaskEdit, Session

PROMPT = "She eats an apple. He reads a book every evening, and they walk to the park after dinner."


def reference_bins(s, p0: int, p1: int, size: int) -> np.ndarray:
    """(L, H, row bins, key bins): causal softmax(q·k × scaling) over keys <= the row, summed into bins."""
    out = []
    for layer in range(s.n_layers):
        q, k, _ = s.qkv(layer)  # (H, T, d), (Hkv, T, d)
        g = q.shape[0] // k.shape[0]
        kk = np.repeat(k.astype(np.float64), g, axis=0)[:, :p1]  # (H, p1, d): query head h reads KV head h // g
        sc = np.einsum("hnd,htd->hnt", q[:, p0:p1].astype(np.float64), kk) * s.scaling(layer)  # (H, n, p1)
        sc[:, np.arange(p1)[None, :] > np.arange(p0, p1)[:, None]] = -np.inf  # causal
        p = np.exp(sc - sc.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        rows = np.arange(p0, p1) // size - p0 // size
        cell = np.zeros((q.shape[0], rows[-1] + 1, -(-p1 // size)))
        for j in range(p1):
            np.add.at(cell[:, :, j // size], (slice(None), rows), p[:, :, j])
        out.append(cell)
    return np.stack(out)


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = eq.causal_key_bins

    def spy(*a):
        out = real(*a)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(eq, "causal_key_bins", spy)
    return calls


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])  # multi-head, and query heads over shared KV heads
def test_fused_key_bins_match_the_softmax_written_out(tiny_lm, family, fused_calls):
    s = Session(tiny_lm(family), PROMPT)
    s.step()
    t = s.cache_length
    want = []
    for p0, p1, size in ((0, t, 4), (0, 5, 2), (7, t, 8), (t - 1, t, 4), (9, 13, 1), (0, t, t)):
        got = s.overview_bins(p0, p1, size)
        np.testing.assert_allclose(got, reference_bins(s, p0, p1, size), rtol=1e-5, atol=1e-6)
        want += [-(-p1 // size) <= s.head_dim] * s.n_layers  # the kernel's values hold at most d key bins
    assert fused_calls == want and any(want)


def test_rows_the_kernel_cannot_take_go_through_the_equation(tiny_lm, fused_calls):
    """A soft-capped model (gemma2) and rows under a mask edit: the equation's rows, not the kernel."""
    s = Session(tiny_lm("gemma2"), PROMPT)
    s.step()
    s.overview_bins(0, s.cache_length, 4)
    assert not fused_calls
    s = Session(tiny_lm("llama"), PROMPT)
    s.step()
    t = s.cache_length
    s.set_mask_edits([MaskEdit(t - 3, 1)])
    got = s.overview_bins(t - 3, t, 1)  # (L, H, 3, t): one bin per position
    assert not fused_calls
    assert (got[:, :, 0, 1] == 0).all() and (got[:, :, 1:, 1] > 0).all()  # the edit hides key 1 from row t - 3 only
    np.testing.assert_allclose(got[:, :, :, : t - 2].sum(axis=-1)[:, :, 0], 1.0, rtol=1e-5)
    s.overview_bins(0, t - 3, t)  # rows before the edit are plain causal again (one key bin: within d)
    assert fused_calls and all(fused_calls)
