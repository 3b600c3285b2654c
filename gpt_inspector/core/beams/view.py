"""One beam (running or finished) as a read-only run source: every accessor of a Session."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import decoding
from ..models import LoadedModel
from ..source import ModelShape, RunSource
from ..step import Step

if TYPE_CHECKING:
    from .search import BeamSearch


class _Rows:
    """One beam's records: per layer q, out (H, T, d), k, v (H_kv, T, d), the score bias or None, and
    the beam's own mask rows where the model masks each row and head differently (position -> (H, T)).
    """

    def __init__(self, q, out, k, v, bias, masks):
        self.q, self.out, self.k, self.v, self.bias, self.masks = q, out, k, v, bias, masks


class BeamView(ModelShape, RunSource):
    """One beam (running or finished) as a read-only run source: every Session accessor.

    A view is a snapshot: it keeps showing the beam as it was when the view was made.
    """

    def __init__(self, search: BeamSearch, rows: _Rows | None, length: int, tokens: list[int], node: int, label: str):
        self._search = search
        self.lm: LoadedModel = search.lm
        self._rows = rows
        self._length = length if rows is not None else 0
        self.tokens: list[int] = list(tokens)
        self.node = node
        self.name = label
        self.prompt = search.prompt
        self.prompt_ids = list(search.prompt_ids)
        self.decoding = decoding.Decoding(0.0)
        self.seed = 0
        self.mask_edits: list = []
        self._scaling = list(search.recorder.scaling)
        self._softcap = list(search.recorder.softcap)
        self._sinks = list(search.recorder.sinks)
        self._mask_rows_of = search.recorder.mask_rows
        self._edits = None
        self._steps: list[Step] | None = None

    @property
    def source_name(self) -> str:
        return f"{self.name} of a beam search"

    @property
    def cache_length(self) -> int:
        return self._length

    @property
    def steps_done(self) -> list[Step]:
        if self._steps is None:
            self._steps = self._search._path_steps(self.node)
        return self._steps

    @property
    def finished(self) -> str | None:
        cur = self.current
        return cur.finish_reason if cur else None

    # run-source primitives
    def _queries(self, layer: int) -> torch.Tensor:
        return self._rows.q[layer]

    def _keys(self, layer: int) -> torch.Tensor:
        return self._rows.k[layer]

    def _values(self, layer: int) -> torch.Tensor:
        return self._rows.v[layer]

    def _head_outputs(self, layer: int) -> torch.Tensor:
        return self._rows.out[layer]

    def _score_bias(self, layer: int):
        return None if self._rows is None else self._rows.bias[layer]

    def _mask_rows(self, layer: int) -> dict:
        own = None if self._rows is None else self._rows.masks[layer]
        if not own:
            return self._mask_rows_of[layer]
        shared = {p: m for p, m in self._mask_rows_of[layer].items() if m.dim() < 3}  # positional (sliding windows)
        return {**shared, **own}

    def record_bytes(self) -> int:
        r = self._rows
        # a hybrid's state-space layers have no attention records (None)
        return 0 if r is None else sum(t.numel() * t.element_size() for t in (*r.q, *r.out) if t is not None)
