"""What the views read after one change: a ``Snapshot`` of the run shown, in one small part per view.

Qt-free and immutable: the worker builds it (``viewdata.ViewModel``), the GUI thread reads it at any
time. Each part holds what one view draws; a view reads its part (``snap.scores``, ``snap.kv``) or,
as every view still may, the part's fields by their own names on the snapshot (``snap.matrix`` is
``snap.scores.matrix``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from ..core.capture import HeadEdit, MaskEdit
from ..core.live import Live
from ..core.step import Step

if TYPE_CHECKING:
    from .paint import Painted

__all__ = ["KVCachePart", "MaskPart", "MaskReportInfo", "OverviewPart", "QKVPart", "QueryRowPart",
           "ScoreMatrixPart", "Selection", "Snapshot", "TokensPart"]  # fmt: skip


@dataclass(frozen=True)
class Selection:
    layer: int = 0
    head: int = 0
    query: int | None = None  # None: follow the newest position
    kind: str = "probs"
    # (q0, q1, k0, k1): the part of a pooled score matrix the view shows, for exact cells there
    view: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class MaskReportInfo:
    earliest_position: int | None
    recomputed: int
    total_variation: float
    # (label, prob before, prob after) for the tokens that lead either distribution
    rows: tuple[tuple[str, float, float], ...]
    before: np.ndarray | None = field(default=None, repr=False)  # (V,)
    after: np.ndarray | None = field(default=None, repr=False)  # (V,)


@dataclass(frozen=True)
class TokensPart:
    """The token strip, the next-token panel and the status line: the run's tokens and its newest step."""

    token_ids: tuple[int, ...] = ()  # prompt + chosen (the last chosen one is not in the cache yet)
    labels: tuple[str, ...] = ()
    prompt_len: int = 0
    token_probs: tuple[float | None, ...] = ()  # per token: probability it was chosen with (None: prompt)
    n_steps: int = 0
    finished: str | None = None
    step: Step | None = None  # a copy of the newest step (its tensors are never modified in place)
    decoding: dict = field(default_factory=dict)
    roles: tuple[str, ...] = ()  # a chat prompt's tokens' roles (core.chat), else empty
    vocab_size: int = 0  # the model's: Step.top lists min(TOP_N, vocab_size) tokens unless the sampler cut some


@dataclass(frozen=True)
class MaskPart:
    """The mask editor and the interventions panel: the edits in force and the last recompute's report."""

    mask_edits: tuple[MaskEdit, ...] = ()
    mask_report: MaskReportInfo | None = None
    head_edits: tuple[tuple[HeadEdit, str], ...] = ()  # knock-outs and patches in force, each with its source's text


@dataclass(frozen=True)
class ScoreMatrixPart:
    """The score matrix of the selected head and stage (None while nothing is processed)."""

    matrix: np.ndarray | None = (
        None  # (T, T) float32, NaN where masked (masked/softmax stages); pooled past EXACT_LIMIT
    )
    allowed: np.ndarray | None = None  # (T, T) bool; None when the matrix is pooled
    matrix_block: int = 1  # positions per matrix cell: > 1 means each cell is the maximum over block x block
    matrix_rows: int = 0  # query rows of a pooled matrix computed so far (its first build streams in)
    tile: np.ndarray | None = None  # exact cells of the zoomed-in part of a pooled matrix, NaN where masked
    tile_origin: tuple[int, int] = (0, 0)  # (query, key) of tile[0, 0]
    levels: tuple[float, float] = (0.0, 1.0)


@dataclass(frozen=True)
class QueryRowPart:
    """The softmax rows of the selected query position."""

    query_allowed: np.ndarray | None = None  # (T,) bool: the keys the selected query may attend to
    query_bias: np.ndarray | None = None  # (T,) the model's additive score bias on that row (ALiBi), or None
    head_rows: np.ndarray | None = None  # (H, T) softmax row of the query, every head of the layer


@dataclass(frozen=True)
class QKVPart:
    """The q / K / V view of the selected head."""

    q: np.ndarray | None = None  # (d,) query vector of the selected head at the query position
    k: np.ndarray | None = None  # (T, d) keys of the head's KV head
    v: np.ndarray | None = None  # (T, d)
    scaling: float = 1.0
    softcap: float | None = None
    kv_head: int = 0  # the KV head the selected head reads


@dataclass(frozen=True)
class KVCachePart:
    """The KV cache view: the selected layer's cache rows and what the cache takes, step by step."""

    kv_bytes: tuple[int, ...] = ()  # per layer, what the model's own cache holds (sliding-window layers: their window)
    kv_history: tuple[int, ...] = ()  # total of kv_bytes after each step
    # per layer, what the inspector keeps for inspection: every position, so more than kv_bytes on windowed layers
    kv_kept: tuple[int, ...] = ()
    kv_kept_history: tuple[int, ...] = ()  # total of kv_kept after each step
    kv_positions: tuple[int, ...] = ()  # per layer, the positions the model's own cache holds
    kv_k: np.ndarray | None = None  # (T, Hkv*d) the selected layer's K cache
    kv_v: np.ndarray | None = None
    kv_block: int = 1  # positions per row of kv_k / kv_v (mean over each block) past EXACT_LIMIT
    kv_cached: np.ndarray | None = None  # (T, n) the layer's cache rows as stored, where not per-head K/V (MLA)
    # a run under a KV cache policy (core.kvlab), else None: the layer's rows the policy's cache no
    # longer holds, (Hkv, T) bool, and each row's quantization error (keys, values), (2, Hkv, T) float32
    kv_evicted: np.ndarray | None = None
    kv_error: np.ndarray | None = None


@dataclass(frozen=True)
class OverviewPart:
    """The L x H overview of thumbnails."""

    thumbs: np.ndarray | None = None  # (L*nb, H*nb) float32 in [0, 1]
    thumb_bins: int = 0  # nb: bins per side of one thumbnail
    thumb_bin_size: int = 1  # positions per bin
    thumb_rows: int = 0  # query rows in the overview so far: fewer than T while a first build streams in
    rows_behind: bool = False  # what is missing is only the newest steps' rows: they follow in the next slice


@dataclass(frozen=True)
class Snapshot:
    """Everything every view needs after one change; arrays are owned copies (float32, C order).

    What the run is (shapes, names, the selection, ``live``) here; what each view draws in its part.
    """

    serial: int
    state_version: int  # bumps whenever the session's numbers change (not on selection changes)
    read_only: bool
    source_name: str
    model_name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int  # the selected layer's (Gemma 4's full-attention layers have their own)
    head_dim: int
    context_length: int
    device: str
    dtype: str
    T: int  # positions in the KV cache
    selection: Selection
    query: int  # the resolved query position (-1 when T == 0)
    tokens: TokensPart
    mask: MaskPart
    kv: KVCachePart
    scores: ScoreMatrixPart = ScoreMatrixPart()  # the parts of the selection: empty while T == 0
    query_row: QueryRowPart = QueryRowPart()
    qkv: QKVPart = QKVPart()
    overview: OverviewPart = OverviewPart()
    t_model_done: float = 0.0  # perf_counter() when the model work behind this snapshot ended
    t_built: float = 0.0
    source_id: int = 0  # changes when another session, model or trace is shown: results about the old one are stale
    unverified: str | None = None  # why the load's fidelity self-test could not vouch for the numbers
    engine: str | None = None  # the remote engine the run is on ("ws://host:port"), or None: this process
    # what can be executed on the source shown (core.source.Live): every "can I run this here"
    live: Live = Live.nothing("no run is shown")
    # the images' pixels and levels, made by the worker after the build (gui.paint); None: the views make them
    painted: Painted | None = None

    def edits_for(self, layer: int, head: int) -> list[MaskEdit]:
        return [
            e for e in self.mask_edits if (e.layer is None or e.layer == layer) and (e.head is None or e.head == head)
        ]


PARTS = {"tokens": TokensPart, "mask": MaskPart, "kv": KVCachePart, "scores": ScoreMatrixPart,
         "query_row": QueryRowPart, "qkv": QKVPart, "overview": OverviewPart}  # fmt: skip

# every part's field, read by its own name on the snapshot (snap.matrix is snap.scores.matrix)
for _name, _cls in PARTS.items():
    for _f in fields(_cls):
        assert not hasattr(Snapshot, _f.name), _f.name  # one name, one meaning
        setattr(Snapshot, _f.name, property(operator.attrgetter(f"{_name}.{_f.name}"), doc=f"``{_name}.{_f.name}``"))
