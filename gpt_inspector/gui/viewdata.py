"""What the views show, computed away from the GUI thread (no Qt here).

A :class:`ViewModel` wraps one run source (a live Session, a beam, a read-only Trace: anything
implementing ``core.source.RunSource``) and turns it into
immutable :class:`Snapshot` values: plain numpy arrays the GUI can read at any time while the
worker keeps mutating the session. Everything is sized for the current selection only (one
T x T matrix, one layer's K/V), except the L x H overview, which is kept as binned sums and
updated incrementally: a step adds one query row, so only that row (q_new . K for every head)
is computed, never L*H full matrices.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..core import attention as eq
from ..core.attention import KINDS, STAGE_TITLES
from ..core.stages import STAGE_LABELS
from ..core.capture import MaskEdit
from ..core.source import RunSource
from ..core.step import Step

KIND_TITLES = STAGE_TITLES
KIND_LABELS = STAGE_LABELS  # "scores (scaled)": the CLI's name with its title


_SOURCE_IDS = itertools.count(1)


@dataclass(frozen=True)
class Selection:
    layer: int = 0
    head: int = 0
    query: int | None = None  # None: follow the newest position
    kind: str = "probs"


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
class Snapshot:
    """Everything every view needs after one change; arrays are owned copies (float32, C order)."""

    serial: int
    state_version: int  # bumps whenever the session's numbers change (not on selection changes)
    read_only: bool
    source_name: str
    model_name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    device: str
    dtype: str
    T: int  # positions in the KV cache
    token_ids: tuple[int, ...]  # prompt + chosen (the last chosen one is not in the cache yet)
    labels: tuple[str, ...]
    prompt_len: int
    token_probs: tuple[float | None, ...]  # per token: probability it was chosen with (None: prompt)
    n_steps: int
    finished: str | None
    step: Step | None  # a copy of the newest step (its tensors are never modified in place)
    decoding: dict
    kv_bytes: tuple[int, ...]  # per layer
    kv_history: tuple[int, ...]  # total cache bytes after each step
    mask_edits: tuple[MaskEdit, ...]
    mask_report: MaskReportInfo | None
    selection: Selection
    query: int  # the resolved query position (-1 when T == 0)
    # selection-dependent arrays (None when T == 0)
    matrix: np.ndarray | None = None  # (T, T) float32, NaN where masked (masked/softmax stages)
    allowed: np.ndarray | None = None  # (T, T) bool
    levels: tuple[float, float] = (0.0, 1.0)
    head_rows: np.ndarray | None = None  # (H, T) softmax row of the query, every head of the layer
    q: np.ndarray | None = None  # (d,) query vector of the selected head at the query position
    k: np.ndarray | None = None  # (T, d) keys of the head's KV head
    v: np.ndarray | None = None  # (T, d)
    scaling: float = 1.0
    softcap: float | None = None
    kv_k: np.ndarray | None = None  # (T, Hkv*d) the selected layer's K cache
    kv_v: np.ndarray | None = None
    thumbs: np.ndarray | None = None  # (L*nb, H*nb) float32 in [0, 1]
    thumb_bins: int = 0  # nb: bins per side of one thumbnail
    thumb_bin_size: int = 1  # positions per bin
    t_model_done: float = 0.0  # perf_counter() when the model work behind this snapshot ended
    t_built: float = 0.0
    source_id: int = 0  # changes when another session, model or trace is shown: results about the old one are stale
    unverified: str | None = None  # why the load's fidelity self-test could not vouch for the numbers

    @property
    def empty(self) -> bool:
        return self.T == 0

    def edits_for(self, layer: int, head: int) -> list[MaskEdit]:
        return [e for e in self.mask_edits if (e.layer is None or e.layer == layer) and (e.head is None or e.head == head)]


@contextlib.contextmanager
def _one_thread():
    """Run view math on one torch thread.

    The tensors here are small (one row per head, one T x T matrix); on a busy machine a
    thread pool's barriers cost ten times more than they save (measured: 600 ms vs 35 ms per
    snapshot at T=1024 on a loaded 2-core box).
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _probs_rows(source: RunSource):
    """``rows_of(layer, p0, p1)`` -> (H, n, T) softmax rows, for the overview."""
    attending = set(source.attention_layers)

    def rows(layer, p0, p1):
        if layer not in attending:  # a hybrid's state-space layer: no attention, a blank thumbnail row
            return np.zeros((source.n_heads, p1 - p0, p1), dtype=np.float32)
        return source.attention_rows(layer, p0, p1, "probs").numpy()

    return rows


# ---------------------------------------------------------------------------------------- overview
ROWS_BUDGET = 1 << 23  # numbers per evaluation of the overview's rows (32 MB of float32)


class Thumbnails:
    """L x H downsampled attention patterns, kept as binned sums and updated row by row.

    Positions fall into fixed bins of ``size`` positions (a power of two, doubled when T
    outgrows ``max_bins`` bins, never shrunk until a reset). Each thumbnail cell is the mean,
    over the bin's query rows, of the attention mass the row gives the key bin, so every
    thumbnail row sums to 1 like the matrix it summarises.
    """

    def __init__(self, n_layers: int, n_heads: int, max_bins: int = 32):
        self.L, self.H, self.B = n_layers, n_heads, max_bins
        self.reset()

    def reset(self) -> None:
        self.size = 1
        self.T = 0
        self.sums = np.zeros((self.L, self.H, self.B, self.B), dtype=np.float64)
        self.counts = np.zeros(self.B, dtype=np.int64)

    @property
    def bins(self) -> int:
        return max(1, -(-self.T // self.size))

    def _grow(self, t: int) -> None:
        while -(-t // self.size) > self.B:
            b2 = self.B // 2
            s = self.sums.reshape(self.L, self.H, b2, 2, b2, 2).sum(axis=(3, 5))
            self.sums = np.zeros_like(self.sums)
            self.sums[:, :, :b2, :b2] = s
            c = self.counts.reshape(b2, 2).sum(axis=1)
            self.counts = np.zeros_like(self.counts)
            self.counts[:b2] = c
            self.size *= 2

    def add_rows(self, rows_of, p0: int, p1: int) -> None:
        """Add query rows p0..p1 (``rows_of(layer, p0, p1)`` -> (H, n, T=p1) probs)."""
        if p1 <= p0:
            return
        assert p0 == self.T, (p0, self.T)
        self._grow(p1)
        s = self.size
        key_starts = np.arange(0, p1, s)
        # rows in chunks, so a first build at long T never holds H x T x T for a layer at once
        chunk = max(1, ROWS_BUDGET // max(1, self.H * p1))
        for layer in range(self.L):
            for c0 in range(p0, p1, chunk):
                c1 = min(p1, c0 + chunk)
                rb = np.arange(c0, c1) // s
                row_starts = np.concatenate([[0], np.flatnonzero(np.diff(rb)) + 1])
                r = rows_of(layer, c0, c1)  # (H, n, T)
                kb = np.add.reduceat(r, key_starts, axis=2)  # (H, n, nbk)
                kb = np.add.reduceat(kb, row_starts, axis=1)  # (H, n_rowbins, nbk)
                first_bin = int(rb[0])
                self.sums[layer, :, first_bin : first_bin + kb.shape[1], : kb.shape[2]] += kb
        np.add.at(self.counts, np.arange(p0, p1) // s, 1)
        self.T = p1

    def truncate(self, rows_of, t: int) -> None:
        """Forget rows >= t (step back, mask edits), recomputing the bin that t cuts through."""
        if t >= self.T:
            return
        if t <= 0:
            self.reset()
            return
        s = self.size
        b = t // s
        self.sums[:, :, b:] = 0.0
        self.counts[b:] = 0
        self.T = b * s
        self.add_rows(rows_of, b * s, t)

    def image(self) -> np.ndarray:
        """(L*nb, H*nb) float32 in [0, 1], each thumbnail scaled by its own maximum."""
        nb = self.bins
        c = np.maximum(self.counts[:nb], 1)[None, None, :, None]
        m = self.sums[:, :, :nb, :nb] / c  # (L, H, nb, nb)
        mx = m.max(axis=(2, 3), keepdims=True)
        m = np.sqrt(m / np.where(mx > 0, mx, 1.0))  # sqrt: faint structure stays visible next to a sink
        return np.ascontiguousarray(m.transpose(0, 2, 1, 3).reshape(self.L * nb, self.H * nb), dtype=np.float32)


def full_thumbnails(source: RunSource, max_bins: int = 32) -> Thumbnails:
    th = Thumbnails(source.n_layers, source.n_heads, max_bins)
    th.add_rows(_probs_rows(source), 0, source.cache_length)
    return th


# ---------------------------------------------------------------------------------------- the model
class ViewModel:
    """Turns a run source into Snapshots; lives on the thread that owns the source.

    It subscribes to a live session's events so that *any* change made on that thread
    (stepping, a mask edit, a plugin's call) is noticed; the expensive reconciliation runs at
    ``build()``. Read-only sources (traces, beams) never change.
    """

    def __init__(self, source: RunSource, device: str = "", dtype: str = "", max_bins: int = 32):
        self.obj = source
        self.read_only = source.read_only
        self.L, self.H = source.n_layers, source.n_heads
        lm = getattr(source, "lm", None)
        self.device = device or (str(lm.device) if lm is not None else "trace")
        self.dtype = dtype or source.cache_dtype
        self.thumbs = Thumbnails(self.L, self.H, max_bins)
        self._rows_of = _probs_rows(source)
        self.selection = Selection()
        self.version = 0
        self.serial = 0
        self.source_id = next(_SOURCE_IDS)
        self._dirty_from = 0  # thumbnail rows >= this are stale
        self._mat: tuple | None = None  # (layer, head, kind), T, display matrix, allowed: the last one built
        self._mat_dirty = 0  # its rows (and keys) >= this are stale
        self._labels: dict[int, str] = {}
        self._probs: dict[int, float] = {}  # step index -> probability of its chosen token
        per_pos = self._bytes_per_position()
        self._kv_hist = [per_pos * (source.prompt_length + st.index) for st in source.steps_done]
        self.mask_report: MaskReportInfo | None = None
        self.t_model_done = time.perf_counter()
        if not self.read_only:
            source.subscribe(self._on_event)

    # -- events (worker thread, inside the engine call) -------------------------------------
    def _on_event(self, event: str, payload) -> None:
        s = self.obj
        self.version += 1
        self.t_model_done = time.perf_counter()
        if event == "step":
            self._kv_hist[payload.index :] = [s.kv_cache_bytes()]
            self.mask_report = None
        elif event == "step_back":
            self._invalidate(s.cache_length)
            del self._kv_hist[s.n_steps :]
            self._probs.pop(payload.index, None)
            self.mask_report = None
        elif event == "mask":
            if payload.earliest_position is not None:
                self._invalidate(payload.earliest_position)
            self._probs.clear()
            self.mask_report = self._report(payload)
        elif event in ("decoding", "force"):
            self._probs.clear()
        elif event == "fault":
            self._invalidate(s.cache_length)

    def _invalidate(self, position: int) -> None:
        self._dirty_from = min(self._dirty_from, position)
        self._mat_dirty = min(self._mat_dirty, position)

    def _bytes_per_position(self) -> int:
        t = self.obj.cache_length
        return self.obj.kv_cache_bytes() // t if t else 0

    def _report(self, r) -> MaskReportInfo:
        if r.before is None or r.after is None:
            return MaskReportInfo(r.earliest_position, r.recomputed, 0.0, ())
        before, after = r.before.float(), r.after.float()
        ids = []
        for p in (after, before):
            for i in torch.topk(p, min(6, p.shape[0])).indices.tolist():
                if i not in ids:
                    ids.append(i)
        ids.sort(key=lambda i: -float(after[i]))
        rows = tuple((self._label(i), float(before[i]), float(after[i])) for i in ids[:8])
        return MaskReportInfo(r.earliest_position, r.recomputed, r.total_variation, rows,
                              before.numpy().copy(), after.numpy().copy())  # fmt: skip

    # -- helpers ------------------------------------------------------------------------------
    def _label(self, token_id: int) -> str:
        lab = self._labels.get(token_id)
        if lab is None:
            lab = self._labels[token_id] = self.obj.label(token_id)
        return lab

    def _token_probs(self, prompt_len: int, n_tokens: int) -> tuple[float | None, ...]:
        out: list[float | None] = [None] * prompt_len
        for st in self.obj.steps_done:
            p = self._probs.get(st.index)
            if p is None:
                p = self._probs[st.index] = st.prob
            out.append(p)
        return tuple(out[:n_tokens])

    def reconcile(self) -> None:
        """Bring the overview up to date with the source (cheap after a single step)."""
        t = self.obj.cache_length
        if self._dirty_from < self.thumbs.T or t < self.thumbs.T:
            self.thumbs.truncate(self._rows_of, min(self._dirty_from, t))
        if self.thumbs.T == 0:
            self.thumbs.reset()
        self.thumbs.add_rows(self._rows_of, self.thumbs.T, t)
        self._dirty_from = t

    def resolve(self, sel: Selection) -> Selection:
        layer = min(max(sel.layer, 0), self.L - 1)
        attending = self.obj.attention_layers  # a hybrid's state-space layers have nothing to show: the nearest that attends
        if layer not in attending:
            layer = min(attending, key=lambda i: (abs(i - layer), i))
        head = min(max(sel.head, 0), self.H - 1)
        kind = sel.kind if sel.kind in KINDS else "probs"
        return replace(sel, layer=layer, head=head, kind=kind)

    # -- the snapshot ------------------------------------------------------------------------------
    def build(self, selection: Selection | None = None) -> Snapshot:
        with _one_thread():
            return self._build(selection)

    def _build(self, selection: Selection | None) -> Snapshot:
        if selection is not None:
            self.selection = self.resolve(selection)
        sel = self.selection
        o = self.obj
        self.reconcile()
        t = o.cache_length
        tokens = list(o.tokens)
        prompt_len = o.prompt_length
        query = -1 if t == 0 else (t - 1 if sel.query is None else min(max(sel.query, 0), t - 1))
        arrays = self._selection_arrays(sel, query) if t > 0 else {}
        cur = o.current
        self.serial += 1
        return Snapshot(
            serial=self.serial,
            source_id=self.source_id,
            state_version=self.version,
            read_only=self.read_only,
            source_name=o.source_name,
            model_name=o.model_name,
            unverified=getattr(o, "unverified", None),
            n_layers=self.L,
            n_heads=self.H,
            n_kv_heads=o.n_kv_heads,
            head_dim=o.head_dim,
            context_length=o.context_length,
            device=self.device,
            dtype=self.dtype,
            T=t,
            token_ids=tuple(tokens),
            labels=tuple(self._label(i) for i in tokens),
            prompt_len=prompt_len,
            token_probs=self._token_probs(prompt_len, len(tokens)),
            n_steps=o.n_steps,
            finished=o.finished,
            step=None if cur is None else copy.copy(cur),
            decoding=o.decoding.to_json(),
            kv_bytes=tuple(int(o.kv_cache_bytes(i)) for i in range(self.L)) if t else (0,) * self.L,
            kv_history=tuple(self._kv_hist),
            mask_edits=tuple(o.mask_edits),
            mask_report=self.mask_report,
            selection=sel,
            query=query,
            thumbs=self.thumbs.image() if t else None,
            thumb_bins=self.thumbs.bins if t else 0,
            thumb_bin_size=self.thumbs.size,
            t_model_done=self.t_model_done,
            t_built=time.perf_counter(),
            **arrays,
        )

    def _matrix(self, layer: int, head: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """The display matrix (NaN where masked, for the masked stages) and the allowed mask.

        After a step only the new query rows (and, for the raw stages, the new keys' columns) are
        computed; older rows cannot change when keys are appended, because the causal mask hides
        the new keys from them. Step back and mask edits crop to the first stale position.
        """
        o, t = self.obj, self.obj.cache_length
        key = (layer, head, kind)
        c = self._mat
        v = min(self._mat_dirty, c[1], t) if c is not None and c[0] == key else 0
        if not (v > 0 and t - v <= max(8, t // 4)):
            v = 0  # rebuild: nothing to keep, or most of it changed
        masked = kind in ("masked_scores", "probs")
        rows = o.attention_rows(layer, v, t, kind, heads=(head,))[0].numpy()  # (t - v, T)
        arows = o.allowed_rows(layer, v, t)[head].numpy()  # (t - v, T)
        m = np.empty((t, t), dtype=np.float32)
        a = np.empty((t, t), dtype=bool)
        m[v:] = np.where(arows, rows, np.float32(np.nan)) if masked else rows
        a[v:] = arows
        if v:
            m[:v, :v] = c[2][:v, :v]
            a[:v, :v] = c[3][:v, :v]
            a[:v, v:] = False  # earlier queries never see later keys
            if masked:
                m[:v, v:] = np.nan
            else:  # the raw stages show future keys too: the new keys' columns of the earlier rows
                q = o.queries(layer)[head, :v]  # (v, d)
                k = o.keys(layer)[o.kv_head_of(head), v:t]  # (t - v, d)
                every = torch.ones(v, t - v, dtype=torch.bool)
                m[:v, v:] = eq.equation(q, k, o.scaling(layer), o.softcap(layer), every, kind).numpy()
        self._mat, self._mat_dirty = (key, t, m, a), t
        return m, a

    def _selection_arrays(self, sel: Selection, query: int) -> dict:
        o = self.obj
        layer, head, kind = sel.layer, sel.head, sel.kind
        m, allowed = self._matrix(layer, head, kind)
        if kind == "probs":
            levels = (0.0, 1.0)
        else:
            lo, hi = float(np.nanmin(m)), float(np.nanmax(m))
            if not (np.isfinite(lo) and np.isfinite(hi)):
                lo, hi = 0.0, 1.0
            levels = (lo, hi if hi > lo else lo + 1.0)
        kvh = o.kv_head_of(head)
        keys, values = o.keys(layer), o.values(layer)  # (Hkv, T, d)
        return dict(
            matrix=m,
            allowed=allowed,
            levels=levels,
            head_rows=np.ascontiguousarray(o.attention_rows(layer, query, query + 1)[:, 0, :].numpy()),
            q=o.queries(layer)[head, query].float().numpy().copy(),  # (d,)
            k=keys[kvh].float().numpy().copy(),  # (T, d)
            v=values[kvh].float().numpy().copy(),
            scaling=o.scaling(layer),
            softcap=o.softcap(layer),
            kv_k=_heads_side_by_side(keys),
            kv_v=_heads_side_by_side(values),
        )


def _heads_side_by_side(x: torch.Tensor) -> np.ndarray:
    """(Hkv, T, d) -> (T, Hkv*d): one row per position, the layer's heads side by side."""
    x = x.float()
    return np.ascontiguousarray(x.permute(1, 0, 2).reshape(x.shape[1], -1).numpy())
