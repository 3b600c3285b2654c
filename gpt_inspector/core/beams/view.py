"""One beam (running or finished) as a read-only run source: every accessor of a Session."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import decoding
from ..attention import ScoreBias
from ..live import Live
from ..models import LoadedModel
from ..source import ModelShape, RunRecords, RunSource, model_refusals
from ..step import Step

if TYPE_CHECKING:
    from .search import BeamSearch


class _Rows:
    """One beam's records: per layer q, out (H, T, d), k, v (H_kv, T, d), the score bias or None, and
    the beam's own mask rows where the model masks each row and head differently (position -> (H, T)).
    """

    def __init__(self, q, out, k, v, bias, masks):
        self.q, self.out, self.k, self.v, self.bias, self.masks = q, out, k, v, bias, masks


class _BeamRecords(RunRecords):
    """The run-source records of one beam: its own rows, the search's per-layer constants."""

    head_output_start = 0  # a beam keeps every head output
    edits = None  # a search runs without mask edits

    def __init__(self, search: BeamSearch, rows: _Rows | None):
        rec = search.recorder
        self._rows = rows
        self._scaling, self._softcap, self._sinks = list(rec.scaling), list(rec.softcap), list(rec.sinks)
        self._mask_rows_of = rec.mask_rows

    def _own(self) -> _Rows:
        # a beam without rows has length 0, so no view asks it for a layer's rows
        assert self._rows is not None
        return self._rows

    def queries(self, layer: int) -> torch.Tensor:
        return self._own().q[layer]

    def keys(self, layer: int) -> torch.Tensor:
        return self._own().k[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self._own().v[layer]

    def head_outputs(self, layer: int) -> torch.Tensor:
        return self._own().out[layer]

    def scaling(self, layer: int) -> float:
        return self._scaling[layer]

    def softcap(self, layer: int) -> float | None:
        return self._softcap[layer]

    def sink(self, layer: int) -> torch.Tensor | None:
        return self._sinks[layer]

    def score_bias(self, layer: int) -> ScoreBias | None:
        return None if self._rows is None else self._rows.bias[layer]

    def mask_rows(self, layer: int) -> dict:
        own = None if self._rows is None else self._rows.masks[layer]
        if not own:
            return self._mask_rows_of[layer]
        shared = {p: m for p, m in self._mask_rows_of[layer].items() if m.dim() < 3}  # positional (sliding windows)
        return {**shared, **own}


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
        self.records = _BeamRecords(search, rows)
        self._steps: list[Step] | None = None

    @property
    def source_name(self) -> str:
        return f"{self.name} of a beam search"

    @property
    def live(self) -> Live:
        """The model is at hand (the probe and the KV lab run it); the beam itself is read-only."""
        return Live({
            **model_refusals(self.lm),
            "step": "stepping needs a live session: a beam is read-only (it shows the search as it ran)",
            "recompute": "a beam keeps every head output: nothing to recompute",
            "lens": "the logit lens needs a live session: a beam keeps no residual stream",
            "kvlab": "the KV cache lab needs a live session: it runs a session's prompt and decoding, not a beam's",
        })  # fmt: skip

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

    def record_bytes(self) -> int:
        r = self._rows
        # a hybrid's state-space layers have no attention records (None)
        return 0 if r is None else sum(t.numel() * t.element_size() for t in (*r.q, *r.out) if t is not None)
