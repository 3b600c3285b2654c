"""A figure source with chosen matrices, no model needed."""

from __future__ import annotations

import numpy as np

from gpt_inspector.core.errors import InspectorError


class KnownSource:
    """Causal mask plus one extra blocked cell (like a mask edit), random scores."""

    def __init__(self, n_layers=2, n_heads=3, t=6, labels=None, seed=0, model_name="known/model"):
        self.n_layers, self.n_heads, self.n_kv_heads = n_layers, n_heads, n_heads
        self.cache_length, self.n_steps, self.model_name = t, 2, model_name
        rng = np.random.default_rng(seed)
        self._scores = rng.normal(0, 2, size=(n_layers, n_heads, t, t)).astype(np.float32)
        self._labels = labels or [f"tok{i}" for i in range(t)] + ["next"]
        self.edit = (4, 2) if t > 4 else (t - 1, 0)  # this query may not see this key in any head

    def allowed(self, layer, head):
        t = self.cache_length
        a = np.tril(np.ones((t, t), dtype=bool))
        a[self.edit] = False
        return a

    def attention(self, layer, head, kind="probs"):
        if not 0 <= layer < self.n_layers:
            raise InspectorError(f"layer must be in [0, {self.n_layers}), got {layer!r}")
        if not 0 <= head < self.n_heads:
            raise InspectorError(f"head must be in [0, {self.n_heads}), got {head!r}")
        s = self._scores[layer, head]
        if kind == "raw":
            return s * 4.0
        if kind == "scores":
            return s.copy()
        m = np.where(self.allowed(layer, head), s, -np.inf).astype(np.float32)
        if kind == "masked_scores":
            return m
        e = np.exp(m - m.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)

    def token_labels(self):
        return list(self._labels)
