"""The run-source protocol: what a run *is*, and one reader that derives everything else from it.

A run source is anything that holds a processed sequence: the live ``Session``, one beam of a
search (``BeamView``), a saved ``Trace``. Each implements only the primitives, the things the
model's attention function received or produced:

- shapes (``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``context_length``,
  ``vocab_size``), ``model_name``, ``read_only``;
- ``tokens``, ``prompt_ids``, ``prompt``, ``steps_done`` (``Step`` records), ``finished``,
  ``decoding``, ``mask_edits``, ``seed``, and ``label(token_id)`` for readable token text;
- ``cache_length`` and, per layer, ``_queries`` (H, T, d), ``_keys`` / ``_values`` (Hkv, T, d),
  ``_head_outputs`` (H, T, d), ``_mask_rows`` (the model's own mask where it is not plain
  causal), ``_edits`` (compiled mask edits or None), ``_scaling`` / ``_softcap`` lists, and
  ``kv_itemsize`` (bytes per cached number, the model's dtype); optionally ``_sinks`` (per layer
  None or the (H,) attention-sink logits) and ``unverified`` (why the load's fidelity self-test
  could not vouch for the numbers, or None).

``RunSource`` turns those into the public accessors every reader uses (``attention``,
``attention_rows``, ``qkv``, ``allowed``, ``kv_cache_bytes``, ...) through the one equation in
``core.attention``. A view, a figure or a CLI command that needs something new adds it here,
never in a second adapter.
"""

from __future__ import annotations

import numpy as np
import torch

from . import attention as eq
from .capture import allowed_rows
from .errors import InspectorError, check_index


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """An owned float32 copy (views of live records change at the next step)."""
    return t.detach().to(torch.float32).numpy().copy()


class RunSource:
    """The shared reader over a run's primitives (see the module docstring)."""

    read_only: bool = True
    # the reason the model's fidelity self-test failed (loaded with --unverified), or None
    unverified: str | None = None

    @property
    def source_name(self) -> str:
        """What a window title calls this run."""
        return self.model_name

    # ------------------------------------------------------------------ shapes and tokens
    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    @property
    def current(self):
        steps = self.steps_done
        return steps[-1] if steps else None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def processed_tokens(self) -> list[int]:
        """Tokens whose K/V are in the cache (all but the last chosen one)."""
        return list(self.tokens[: self.cache_length])

    def token_labels(self, ids=None) -> list[str]:
        return [self.label(int(i)) for i in (self.tokens if ids is None else ids)]

    def kv_head_of(self, head: int) -> int:
        return eq.kv_head_of(head, self.n_heads, self.n_kv_heads)

    def check_layer(self, layer) -> int:
        return check_index(layer, self.n_layers, "layer")

    def check_head(self, head) -> int:
        return check_index(head, self.n_heads, "head")

    def require_positions(self) -> int:
        t = self.cache_length
        if t == 0:
            raise InspectorError("nothing processed yet: run a step first")
        return t

    # ------------------------------------------------------------------ primitives, checked
    # zero-copy views for front ends that must stay fast at long contexts; read them on the
    # thread that changes the source, and only until its next change (do not modify)
    def queries(self, layer: int) -> torch.Tensor:
        """q of every processed position as attention received it, (H, T, d)."""
        layer = self.check_layer(layer)
        self.require_positions()
        return self._queries(layer)

    def keys(self, layer: int) -> torch.Tensor:
        """The cached keys, (H_kv, T, d)."""
        layer = self.check_layer(layer)
        self.require_positions()
        return self._keys(layer)

    def values(self, layer: int) -> torch.Tensor:
        """The cached values, (H_kv, T, d)."""
        layer = self.check_layer(layer)
        self.require_positions()
        return self._values(layer)

    def head_outputs(self, layer: int) -> torch.Tensor:
        """The attention output per head, (H, T, d), before the output projection."""
        layer = self.check_layer(layer)
        self.require_positions()
        return self._head_outputs(layer)

    def scaling(self, layer: int) -> float:
        return float(self._scaling[self.check_layer(layer)])

    def softcap(self, layer: int) -> float | None:
        """The layer's attention-logit soft-cap (tanh(x / cap) * cap), or None."""
        cap = self._softcap[self.check_layer(layer)]
        return None if cap is None else float(cap)

    def sink(self, layer: int) -> torch.Tensor | None:
        """The layer's attention-sink logit per head, (H,), or None (most models have no sink).

        A sink takes a share of each softmax row and contributes no value, so that row's
        probabilities sum to 1 - sink mass.
        """
        layer = self.check_layer(layer)
        sinks = getattr(self, "_sinks", None)  # a source of a model without sinks need not have it
        return None if sinks is None else sinks[layer]

    def allowed_rows(self, layer: int, p0: int, p1: int) -> torch.Tensor:
        """(H, p1 - p0, T) bool: the keys query rows p0..p1 could attend to, for every head.

        Causal, then the model's own mask (sliding windows, ...), then the mask edits in force.
        """
        layer = self.check_layer(layer)
        t = self.require_positions()
        if not 0 <= p0 <= p1 <= t:
            raise InspectorError(f"query rows must lie in [0, {t}], got {p0}..{p1}")
        return allowed_rows(self._mask_rows(layer), t, p0, p1, self._edits, layer, None, self.n_heads)

    # ------------------------------------------------------------------ derived, one equation
    def attention_rows(self, layer: int, p0: int, p1: int, kind: str = "probs", heads=None) -> torch.Tensor:
        """Query rows p0..p1 of ``kind`` for ``heads`` (default every head): (h, n, T) float32.

        One batched evaluation of the equation; the caller owns the result.
        """
        eq.check_stage(kind)
        allowed = self.allowed_rows(layer, p0, p1)  # (H, n, T)
        q = self._queries(layer)[:, p0:p1]  # (H, n, d)
        keys = self._keys(layer)  # (Hkv, T, d)
        sink = self.sink(layer)  # (H,) or None
        if heads is not None:
            idx = torch.as_tensor([self.check_head(h) for h in heads], dtype=torch.long)
            kv = torch.as_tensor([self.kv_head_of(int(h)) for h in idx], dtype=torch.long)
            q, k, allowed = q[idx], keys[kv], allowed[idx]
            sink = None if sink is None else sink[idx]
            return eq.equation(q, k, self.scaling(layer), self.softcap(layer), allowed, kind, sink)
        if sink is not None:  # one sink logit per head: the equation takes it per leading index
            k = eq.expand_kv(keys, self.n_heads)  # (H, T, d)
            return eq.equation(q, k, self.scaling(layer), self.softcap(layer), allowed, kind, sink)
        # every head: each KV head's group of query heads in one product, so the keys are read
        # once per KV head instead of copied to every query head (at long T that copy dominated)
        hkv, (h, n, d) = keys.shape[0], q.shape
        qg = q.reshape(hkv, (h // hkv) * n, d)  # (Hkv, g*n, d): query heads h*g .. h*g+g-1 read KV head h
        grouped = allowed.reshape(hkv, (h // hkv) * n, -1)  # (Hkv, g*n, T)
        out = eq.equation(qg, keys, self.scaling(layer), self.softcap(layer), grouped, kind)  # (Hkv, g*n, T)
        return out.reshape(h, n, -1)  # (H, n, T)

    def attention(self, layer: int, head: int, kind: str = "probs") -> np.ndarray:
        """(T, T) float32 over all processed positions; kind: raw, scores, masked_scores or probs."""
        layer, head = self.check_layer(layer), self.check_head(head)
        eq.check_stage(kind)
        t = self.require_positions()
        return self.attention_rows(layer, 0, t, kind, heads=(head,))[0].numpy()

    def allowed(self, layer: int, head: int) -> np.ndarray:
        """(T, T) bool: keys each query could attend to (the model's own mask and the edits in force)."""
        layer, head = self.check_layer(layer), self.check_head(head)
        t = self.require_positions()
        return allowed_rows(self._mask_rows(layer), t, 0, t, self._edits, layer, head).numpy()

    def qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (H, T, d), k (H_kv, T, d), v (H_kv, T, d) as owned float32 numpy arrays."""
        return to_numpy(self.queries(layer)), to_numpy(self.keys(layer)), to_numpy(self.values(layer))

    def attention_output(self, layer: int) -> np.ndarray:
        """The attention output the model computed, per head: (H, T, d) float32, before the output projection."""
        return to_numpy(self.head_outputs(layer))

    def kv_cache_bytes(self, layer: int | None = None) -> int:
        """Bytes the model's KV cache holds for this run (one layer, or all)."""
        t = self.cache_length
        if t == 0:
            return 0
        layers = range(self.n_layers) if layer is None else [self.check_layer(layer)]
        return sum(2 * self.n_kv_heads * t * self.head_dim for _ in layers) * self.kv_itemsize


class ModelShape:
    """Shapes of a source that has the loaded model (``self.lm``): a Session, a beam."""

    lm = None

    @property
    def n_layers(self) -> int:
        return self.lm.n_layers

    @property
    def n_heads(self) -> int:
        return self.lm.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.lm.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.lm.head_dim

    @property
    def context_length(self) -> int:
        return self.lm.context_length

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def model_name(self) -> str:
        return self.lm.name

    @property
    def unverified(self) -> str | None:
        return getattr(self.lm, "unverified", None)

    @property
    def cache_dtype(self) -> str:
        return str(self.lm.dtype).removeprefix("torch.")

    @property
    def kv_itemsize(self) -> int:
        return torch.empty((), dtype=self.lm.dtype).element_size()

    @property
    def text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens)

    @property
    def generated_text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens[len(self.prompt_ids) :])

    def label(self, token_id: int) -> str:
        from .tokens import token_label

        return token_label(self.lm.tokenizer, token_id)
