"""One beam (running or finished) seen with the accessors of a Session, read-only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import decoding
from ..capture import allowed_matrix, derive
from ..errors import InspectorError
from ..models import LoadedModel
from ..session import KINDS, ModelShape, Session, Step, _np
from ..tokens import token_label

if TYPE_CHECKING:
    from .search import BeamSearch

class _Rows:
    """One beam's records: per layer q, out (H, T, d), k, v (H_kv, T, d)."""

    def __init__(self, q, out, k, v):
        self.q, self.out, self.k, self.v = q, out, k, v


class BeamView(ModelShape):
    """One beam (running or finished) with the accessors of a Session, read-only.

    A view is a snapshot: it keeps showing the beam as it was when the view was made.
    """

    def __init__(self, search: BeamSearch, rows: _Rows | None, length: int, tokens: list[int], node: int, label: str):
        self._search = search
        self.lm: LoadedModel = search.lm
        self._rows = rows
        self._length = length
        self.tokens: list[int] = list(tokens)
        self.node = node
        self.label = label
        self.prompt = search.prompt
        self.prompt_ids = list(search.prompt_ids)
        self.decoding = decoding.Decoding(0.0)
        self.seed = 0
        self.mask_edits: list = []
        self._scaling = list(search.recorder.scaling)
        self._softcap = list(search.recorder.softcap)
        self._mask_rows = search.recorder.mask_rows
        self._steps: list[Step] | None = None

    @property
    def cache_length(self) -> int:
        return self._length

    @property
    def text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens)

    @property
    def generated_text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens[len(self.prompt_ids) :])

    @property
    def processed_tokens(self) -> list[int]:
        return self.tokens[: self._length]

    @property
    def steps_done(self) -> list[Step]:
        if self._steps is None:
            self._steps = self._search._path_steps(self.node)
        return self._steps

    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    @property
    def current(self) -> Step | None:
        steps = self.steps_done
        return steps[-1] if steps else None

    @property
    def finished(self) -> str | None:
        cur = self.current
        return cur.finish_reason if cur else None

    def token_labels(self, ids=None) -> list[str]:
        return [token_label(self.lm.tokenizer, i) for i in (self.tokens if ids is None else ids)]

    _check_layer = Session._check_layer
    _check_head = Session._check_head

    def _require_positions(self) -> int:
        if self._rows is None or self._length == 0:
            raise InspectorError("nothing processed yet: run a step first")
        return self._length

    def qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (H, T, d), k (H_kv, T, d), v (H_kv, T, d) as float32 numpy arrays."""
        layer = self._check_layer(layer)
        self._require_positions()
        r = self._rows
        return _np(r.q[layer]), _np(r.k[layer]), _np(r.v[layer])

    def attention_output(self, layer: int) -> np.ndarray:
        layer = self._check_layer(layer)
        self._require_positions()
        return _np(self._rows.out[layer])

    def _allowed(self, layer: int, head: int, t: int) -> torch.Tensor:
        return allowed_matrix(self._mask_rows[layer], t)

    def allowed(self, layer: int, head: int) -> np.ndarray:
        layer, head = self._check_layer(layer), self._check_head(head)
        return self._allowed(layer, head, self._require_positions()).numpy()

    def attention(self, layer: int, head: int, kind: str = "probs") -> np.ndarray:
        """(T, T) float32 over this beam's processed positions; kind: raw, scores, masked_scores or probs."""
        layer, head = self._check_layer(layer), self._check_head(head)
        if kind not in KINDS:
            raise InspectorError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
        t = self._require_positions()
        q = self._rows.q[layer][head]  # (T, d)
        k = self._rows.k[layer][self.lm.kv_head_of(head)]  # (T, d)
        return derive(q, k, self._scaling[layer], self._softcap[layer], self._allowed(layer, head, t), kind).numpy()

    def scaling(self, layer: int) -> float:
        return float(self._scaling[self._check_layer(layer)])

    def softcap(self, layer: int) -> float | None:
        cap = self._softcap[self._check_layer(layer)]
        return None if cap is None else float(cap)

    def kv_cache_bytes(self, layer: int | None = None) -> int:
        """Bytes this beam's rows of the KV cache hold (one layer, or all)."""
        if self._rows is None:
            return 0
        layers = range(self.lm.n_layers) if layer is None else [self._check_layer(layer)]
        return sum(
            (self._rows.k[i].numel() + self._rows.v[i].numel()) * self._rows.k[i].element_size() for i in layers
        )

    def record_bytes(self) -> int:
        if self._rows is None:
            return 0
        r = self._rows
        return sum(t.numel() * t.element_size() for t in (*r.q, *r.out))

    def save_trace(self, path):
        from ..trace import save_trace

        return save_trace(self, path)

