"""Whole-model grids at long contexts: block maxima from row chunks, exact within the work budget and
over a stated sample of query rows beyond it; checked against full matrices pooled independently."""

from __future__ import annotations

import numpy as np
import pytest

from gpt_inspector import Session, figures
from gpt_inspector.core import pooling
from gpt_inspector.figures import drawing

PROMPT = "She eats an apple. He reads a book every evening and she writes long letters to him."


def _independent(source, layer, head, kind, k, rows):
    """Max over the chosen query rows of each row block and every key of each key block."""
    full = source.attention(layer, head, kind).astype(np.float64)
    if kind in ("masked_scores", "probs"):
        full = np.where(source.allowed(layer, head), full, -np.inf)
    t = full.shape[0]
    nb = -(-t // k)
    out = np.full((nb, nb), -np.inf)
    for r in range(nb):
        b1 = min((r + 1) * k, t)
        sel = full[max(r * k, b1 - rows) : b1]
        for c in range(nb):
            out[r, c] = sel[:, c * k : (c + 1) * k].max()
    return out


@pytest.mark.parametrize("kind", ["probs", "scores"])
@pytest.mark.parametrize("budget", [1 << 40, 1])  # exact, then one sampled row per block
def test_long_grid_is_block_maxima_and_says_when_rows_are_sampled(tiny_lm, monkeypatch, kind, budget):
    monkeypatch.setattr(drawing, "LONG_GRID_CELLS", 0)  # a tiny model takes the long-context path
    monkeypatch.setattr(pooling, "EXACT_BUDGET", budget)
    s = Session(tiny_lm("qwen2"), PROMPT)
    s.step()
    fig = figures.grid_figure(s, None, kind, dpi=8)  # a low density: several positions per pixel
    k = fig.pool
    rows = pooling.rows_per_block(s.n_layers * s.n_heads, s.cache_length, s.head_dim, k, budget)
    assert k > 1 and (rows == k) == (budget > 1)
    i = 0
    for layer in range(s.n_layers):
        for head in range(s.n_heads):
            want = _independent(s, layer, head, kind, k, rows)
            got = np.where(np.isneginf(want), 0.0, fig.panel_values[i])
            np.testing.assert_allclose(got, np.where(np.isneginf(want), 0.0, want), rtol=1e-5, atol=1e-6)
            i += 1
    assert f"pooled {k}×{k} (block maximum)" in fig.subheading
    assert (f"over {rows} of every {k} query rows (sampled)" in fig.subheading) == (rows < k)
    figures.to_bytes(fig, "png")
