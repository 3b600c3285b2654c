"""A mask edit recomputed in chunks over a kept prefix (each chunk's attention mask-free: padded square or
split at the cache and merged) gives what HF eager gives with the edited mask written out as a 4D mask,
on every family the fast paths touch and on Gemma 2, whose soft-cap and window keep the dense path.
The reference hands each layer's eager attention its own mask (edits may name a layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import recompute
from gpt_inspector.core.capture import kernel

PROMPT = "She eats an apple. He reads a book while the cat sleeps on the warm mat"
NEG = torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def eager(hf_eager):
    return hf_eager


def _mask(t: int, heads: int, blocked, window: int | None = None) -> torch.Tensor:
    """(1, H, T, T) additive: causal (within ``window`` keys back where given), then the blocked cells."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i - j < window  # transformers' sliding window: the last `window` positions, itself included
    m = torch.zeros(t, t).masked_fill(~allowed, NEG)[None, None].repeat(1, heads, 1, 1)  # (1, H, T, T)
    for layer_heads, q, k in blocked:
        m[0, layer_heads, q, k] = NEG
    return m


def _edits_and_cells(t: int, n_heads: int, first: int):
    """Edits on the last row, on several rows of one head and from row ``first`` on; the cells per layer."""
    edits = [gi.MaskEdit(t - 1, 2), gi.MaskEdit(t - 1, t - 3, head=1), gi.MaskEdit(t - 5, 0, layer=1),
             gi.MaskEdit(t - 6, 4, layer=0, head=0), gi.MaskEdit(first, 1, head=2), gi.MaskEdit(10, 9)]  # fmt: skip
    every = list(range(n_heads))
    cells = {0: [(every, t - 1, 2), (1, t - 1, t - 3), (0, t - 6, 4), (2, first, 1), (every, 10, 9)],
             1: [(every, t - 1, 2), (1, t - 1, t - 3), (every, t - 5, 0), (2, first, 1), (every, 10, 9)]}  # fmt: skip
    return edits, cells


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("chunk,first", [(1024, 2), (8, 2), (1024, 9), (4, 9), (7, 9)])
def test_chunked_mask_edit_equals_hf_eager(family, chunk, first, tiny_lm, eager, monkeypatch):
    """Chunks from row 2 of 8 (and one chunk from row 2) pad; the rest split at the cache."""
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT)
    s.run(6)
    t = s.cache_length
    before = s.current.probs.clone()
    edits, cells = _edits_and_cells(t, lm.n_heads, first)
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", chunk)
    paths = []
    real = kernel._causal_after_cache
    monkeypatch.setattr(kernel, "_causal_after_cache", lambda call, *a: paths.append(call.q0) or real(call, *a))
    rep = s.set_mask_edits(edits)
    assert rep.earliest_position == first and rep.recomputed == t - first
    # every chunk of more than one query ran mask-free, except on Gemma 2 (soft-cap: the scores in hand)
    chunks = [a for a in range(first, t, chunk) if min(a + chunk, t) - a > 1]
    assert paths == ([] if family == "gemma2" else [a for a in chunks for _ in range(lm.n_layers)])
    model = eager(family)
    window = getattr(model.config, "sliding_window", None)
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * lm.n_layers
    hooks = [_attention(model, layer).register_forward_pre_hook(_with_mask(_mask(
        t, lm.n_heads, cells[layer], window if kinds[layer] == "sliding_attention" else None)), with_kwargs=True)
        for layer in range(lm.n_layers)]  # fmt: skip
    try:
        with torch.no_grad():
            out = model(torch.tensor([s.tokens[:t]]), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    for st in s.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), out.logits[0, st.position].numpy(), atol=1e-5)
    for layer in range(lm.n_layers):  # every recorded probability, the edited cells exactly 0
        for head in range(lm.n_heads):
            np.testing.assert_allclose(s.attention(layer, head, "probs"), out.attentions[layer][0, head].numpy(),
                                       atol=1e-5)  # fmt: skip
    assert s.attention(0, 0, "probs")[t - 1, 2] == 0 and s.attention(1, 2, "probs")[first, 1] == 0
    s.clear_mask_edits()
    np.testing.assert_allclose(s.current.probs.numpy(), before.numpy(), atol=1e-6)


def _attention(model, layer: int) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    return inner.layers[layer].self_attn if inner is not None else model.transformer.h[layer].attn


def _with_mask(mask: torch.Tensor):
    """A pre-hook handing an attention module ``mask`` (1, H, T, T) for the one the model built."""

    def hook(module, args, kwargs):
        kwargs["attention_mask"] = mask
        return args, kwargs

    return hook
