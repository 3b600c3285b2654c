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

import copy
import itertools
import time
from dataclasses import replace

import numpy as np
import torch

from ..core.attention import KIND_LABELS, KINDS
from ..core.kvlab import policy_rows
from ..core.pooling import PooledMatrix, ThreadChooser, Thumbnails, one_thread, pool_rows, pow2_block, torch_threads
from ..core.source import RunSource
from .snapshot import (
    KVCachePart,
    MaskPart,
    MaskReportInfo,
    OverviewPart,
    QKVPart,
    QueryRowPart,
    ScoreMatrixPart,
    Selection,
    Snapshot,
    TokensPart,
)

__all__ = ["KIND_LABELS", "MaskReportInfo", "Selection", "Snapshot", "Thumbnails", "ViewModel", "full_thumbnails"]


_SOURCE_IDS = itertools.count(1)


# ---------------------------------------------------------------------------------------- overview
EXACT_LIMIT = 1024  # up to this many positions the score matrix is exact cell for cell
DISPLAY_CELLS = 1024  # beyond, it is pooled to at most this many blocks per side...
TILE_CELLS = 512  # ...and a zoomed-in view of at most this many positions per side gets exact cells
SYNC_BUDGET = 1 << 22  # overview numbers (rows x keys x heads) a build adds before streaming the rest
DEFER_ROWS = 64  # past EXACT_LIMIT a build may leave this many newest overview rows to the next idle slice


def full_thumbnails(source: RunSource, max_bins: int = 32) -> Thumbnails:
    th = Thumbnails(source.n_layers, source.n_heads, max_bins)
    th.extend(source.cache_length)
    th.add_bins(0, source.cache_length, source.overview_bins(0, source.cache_length, th.size))
    return th


# ---------------------------------------------------------------------------------------- the model
class ViewModel:
    """Turns a run source into Snapshots; lives on the thread that owns the source.

    It subscribes to a live session's events so that *any* change made on that thread
    (stepping, a mask edit, a plugin's call) is noticed; the expensive reconciliation runs at
    ``build()``. Read-only sources (traces, beams) never change.
    """

    def __init__(self, source: RunSource, max_bins: int = 32):
        self.obj = source
        self.read_only = source.read_only
        self.L, self.H = source.n_layers, source.n_heads
        lm = source.lm
        if lm is not None:
            self.device = str(lm.device)
        else:  # a remote engine's device, named with the engine; a trace runs nowhere
            self.device = "trace" if source.engine is None else f"{source.device} on {source.engine}"
        self.dtype = source.cache_dtype  # a model's dtype, or what a trace's cache held
        self.thumbs = Thumbnails(self.L, self.H, max_bins)
        self._threads = ThreadChooser()  # for the streamed overview: one thread or all, by timing
        self.selection = Selection()
        self.version = 0
        self.serial = 0
        self.source_id = next(_SOURCE_IDS)
        self._dirty_from = 0  # thumbnail rows >= this are stale
        self._mat: tuple | None = None  # (layer, head, kind), T, display matrix, allowed: the last one built
        self._mat_dirty = 0  # its rows (and keys) >= this are stale
        self._pooled: PooledMatrix | None = None  # the score matrix past EXACT_LIMIT
        self._tile: tuple | None = None  # ((layer, head, kind, q0, k0), q1, k1, tile): the exact cells last built
        self._kv_pool: tuple | None = None  # (layer, block, T, kv_k, kv_v): the cache's pooled rows last built
        self._view: tuple | None = None  # the zoomed-in view of the last build
        self._ids: tuple[int, ...] = ()
        self._id_labels: tuple[str, ...] = ()
        self._labels: dict[int, str] = {}
        self._probs: dict[int, float] = {}  # step index -> probability of its chosen token
        # after step i the cache holds the prompt and i tokens; a window's bytes stop growing at its size
        lengths = [source.prompt_length + st.index for st in source.steps_done]
        self._kv_hist = [self._kv_totals(length) for length in lengths]
        self.mask_report: MaskReportInfo | None = None
        self.t_model_done = time.perf_counter()
        if not self.read_only:
            source.subscribe(self._on_event)

    # -- events (worker thread, inside the engine call) -------------------------------------
    def _on_event(self, event: str, payload) -> None:
        s = self.obj
        self.version += 1
        self.t_model_done = time.perf_counter()
        if event != "step":  # only a step leaves every cached key and value as it was (it appends)
            self._kv_pool = None
        if event == "step":
            # after step i the cache holds the prompt and i tokens (a remote run may report several steps at once)
            self._kv_hist[payload.index :] = [self._kv_totals(s.prompt_length + payload.index)]
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

    def _kv_totals(self, length: int) -> tuple[int, int]:
        """(the model's cache, what the inspector keeps) in bytes once ``length`` positions have run."""
        o = self.obj
        return o.kv_cache_bytes(length=length), o.kv_kept_bytes(length=length)

    def _invalidate(self, position: int) -> None:
        self._dirty_from = min(self._dirty_from, position)
        self._mat_dirty = min(self._mat_dirty, position)
        if self._pooled is not None:
            self._pooled.invalidate(position)
        self._tile = None

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
    def _labels_of(self, ids: tuple[int, ...]) -> tuple[str, ...]:
        """Token labels, extended rather than rebuilt when a step appended tokens (T can be 8k+)."""
        n = len(self._ids)
        if ids[:n] == self._ids:
            self._id_labels = self._id_labels + tuple(self._label(i) for i in ids[n:])
        else:
            self._id_labels = tuple(self._label(i) for i in ids)
        self._ids = ids
        return self._id_labels

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

    def reconcile(self, budget: int | None = None, defer: bool = False) -> bool:
        """Bring the overview up to date with the source; True when it is complete.

        A step's new row is added here (O(L*H*T*d)) unless ``defer`` and :attr:`rows_behind` (the
        worker's build after a step at long T: the picture first, the row in the next idle slice);
        a first build or a rebuild after a mask edit adds at most ``budget`` numbers here and
        leaves the rest to :meth:`refine`, which the worker runs in slices between commands.
        """
        t = self.obj.cache_length
        th = self.thumbs
        if self._dirty_from < th.T or t < th.T:
            th.truncate(min(self._dirty_from, t))
        if th.T == 0:
            th.reset()
        th.extend(t)
        self._dirty_from = t
        if defer and self.rows_behind:
            return False
        return self.refine(budget=SYNC_BUDGET if budget is None else budget, matrix=False)

    def refine(self, budget: int | None = None, deadline: float | None = None, matrix: bool = True) -> bool:
        """Add pending overview rows in refinement order until ``budget`` numbers are computed
        or ``deadline`` (perf_counter) passes (one chunk at least), then (``matrix``) rows of a
        pooled score matrix still building; True when nothing is left to stream."""
        th = self.thumbs
        per_row = max(1, th.L * th.H * th.T)
        spent = 0
        with one_thread():
            while not th.complete:
                for p0, p1 in th.pending(max_chunks=8):
                    cost = (p1 - p0) * per_row
                    if budget is not None and spent and spent + cost > budget:  # one chunk at least: progress
                        return False
                    k = self._threads.pick()
                    t0 = time.perf_counter()
                    with torch_threads(k):
                        th.add_bins(p0, p1, self.obj.overview_bins(p0, p1, th.size))
                    self._threads.record(k, time.perf_counter() - t0, cost)
                    spent += cost
                    if deadline is not None and time.perf_counter() >= deadline:
                        return th.complete and not matrix
            p = self._pooled
            while matrix and p is not None and not p.complete and p.T == self.obj.cache_length:
                p.update(self.obj, budget=SYNC_BUDGET)
                if budget is not None or (deadline is not None and time.perf_counter() >= deadline):
                    break
        return self._pooled is None or self._pooled.complete or not matrix

    @property
    def rows_behind(self) -> bool:
        """Past EXACT_LIMIT, only the newest few overview rows are missing (steps since the last
        slice) and no pooled matrix is streaming: a slice now is a step's catch-up, not a stream."""
        th = self.thumbs
        n = th.T - th.rows_done
        if th.T <= EXACT_LIMIT or not 0 < n <= DEFER_ROWS or not th.have[: th.rows_done].all():
            return False
        return self._pooled is None or self._pooled.complete

    @property
    def overview_complete(self) -> bool:
        """Nothing left to stream: the overview has every row, and so has a pooled score matrix."""
        matrix_done = self._pooled is None or self._pooled.complete
        return matrix_done and self.thumbs.complete and self.thumbs.T == self.obj.cache_length

    def resolve(self, sel: Selection) -> Selection:
        layer = min(max(sel.layer, 0), self.L - 1)
        attending = (
            self.obj.attention_layers
        )  # a hybrid's state-space layers have nothing to show: the nearest that attends
        if layer not in attending:
            layer = min(attending, key=lambda i: (abs(i - layer), i))
        head = min(max(sel.head, 0), self.H - 1)
        kind = sel.kind if sel.kind in KINDS else "probs"
        return replace(sel, layer=layer, head=head, kind=kind)

    # -- the snapshot ------------------------------------------------------------------------------
    def build(self, selection: Selection | None = None, defer: bool = False) -> Snapshot:
        """A snapshot of ``selection``; ``defer``: a step's newest overview rows may follow in
        :meth:`refine` (the overview says how many rows it holds)."""
        with one_thread():
            return self._build(selection, defer)

    def _build(self, selection: Selection | None, defer: bool = False) -> Snapshot:
        if selection is not None:
            self.selection = self.resolve(selection)
        sel = self.selection
        o = self.obj
        self.reconcile(defer=defer)
        t = o.cache_length
        tokens = list(o.tokens)
        prompt_len = o.prompt_length
        query = -1 if t == 0 else (t - 1 if sel.query is None else min(max(sel.query, 0), t - 1))
        parts = self._selection_parts(sel, query) if t > 0 else {"kv": {}}
        self._view = sel.view
        cur = o.current
        self.serial += 1
        shape = parts.pop("shape", {"n_kv_heads": o.n_kv_heads, "head_dim": o.head_dim})  # the selected layer's
        return Snapshot(
            serial=self.serial,
            source_id=self.source_id,
            state_version=self.version,
            read_only=self.read_only,
            unverified=o.unverified,
            engine=o.engine,
            live=o.live,
            source_name=o.source_name,
            model_name=o.model_name,
            n_layers=self.L,
            n_heads=self.H,
            context_length=o.context_length,
            device=self.device,
            dtype=self.dtype,
            T=t,
            selection=sel,
            query=query,
            tokens=TokensPart(
                token_ids=tuple(tokens),
                labels=self._labels_of(tuple(tokens)),
                prompt_len=prompt_len,
                token_probs=self._token_probs(prompt_len, len(tokens)),
                n_steps=o.n_steps,
                finished=o.finished,
                step=None if cur is None else copy.copy(cur),
                decoding=o.decoding.to_json(),
                roles=() if getattr(o, "chat", None) is None else tuple(o.chat.roles),
                vocab_size=int(o.vocab_size),
            ),
            mask=MaskPart(
                tuple(o.mask_edits),
                self.mask_report,
                tuple((e, "".join(map(self._label, e.patch_from or ()))) for e in o.head_edits),
            ),
            kv=KVCachePart(
                kv_bytes=tuple(int(o.kv_cache_bytes(i)) for i in range(self.L)) if t else (0,) * self.L,
                kv_history=tuple(h[0] for h in self._kv_hist),
                kv_kept=tuple(int(o.kv_kept_bytes(i)) for i in range(self.L)) if t else (0,) * self.L,
                kv_kept_history=tuple(h[1] for h in self._kv_hist),
                kv_positions=tuple(o.kv_cache_positions(i) for i in range(self.L)),
                **parts.pop("kv"),
            ),
            overview=OverviewPart(
                thumbs=self.thumbs.image() if t else None,
                thumb_bins=self.thumbs.bins if t else 0,
                thumb_bin_size=self.thumbs.size,
                thumb_rows=self.thumbs.rows_done if t else 0,
                rows_behind=self.rows_behind,
            ),
            t_model_done=self.t_model_done,
            t_built=time.perf_counter(),
            **shape,
            **parts,
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
                m[:v, v:] = o.attention_block(layer, head, kind, 0, v, v, t, every=True)  # (v, t - v)
        self._mat, self._mat_dirty = (key, t, m, a), t
        return m, a

    def _pooled_matrix(self, layer: int, head: int, kind: str, hurry: bool = False) -> tuple[np.ndarray, int]:
        t = self.obj.cache_length
        block = pow2_block(t, DISPLAY_CELLS)
        p = self._pooled
        if p is not None and (p.layer, p.head, p.kind) == (layer, head, kind) and block == 2 * p.block:
            p.regroup(block)  # T crossed a power of two: merge blocks rather than recompute T x T
        elif p is None or (p.layer, p.head, p.kind, p.block) != (layer, head, kind, block):
            p = self._pooled = PooledMatrix(layer, head, kind, block)
        elif hurry and p.T == t and p.dirty >= t and not p.complete:
            return p.img, block  # as last shown (rows not computed yet NaN): no chunk before the tile
        return p.update(self.obj, budget=SYNC_BUDGET), block

    def _exact_tile(self, sel: Selection) -> tuple[np.ndarray | None, tuple[int, int]]:
        """Exact cells of the part of a pooled matrix the view is zoomed into (None: too big a part)."""
        o, t = self.obj, self.obj.cache_length
        if sel.view is None:
            return None, (0, 0)
        q0, q1, k0, k1 = sel.view
        q0, k0 = max(0, q0), max(0, k0)
        q1, k1 = min(t, q1), min(t, k1)
        if q1 <= q0 or k1 <= k0 or q1 - q0 > TILE_CELLS or k1 - k0 > TILE_CELLS:
            return None, (0, 0)
        key = (sel.layer, sel.head, sel.kind, q0, k0)
        masked = sel.kind in ("masked_scores", "probs")
        prev = self._tile  # (key, q1, k1, tile); dropped by any change to earlier rows
        start = q0
        if prev is not None and prev[0] == key and prev[1] <= q1 and prev[2] <= k1 and (masked or prev[2] == k1):
            if (prev[1], prev[2]) == (q1, k1):
                return prev[3], (q0, k0)
            # a view that follows the newest rows: keep the rows it has; their new keys are future ones
            start = prev[1]
        rows = o.attention_block(sel.layer, sel.head, sel.kind, start, q1, k0, k1)  # (n, m), NaN where masked
        if start > q0:
            old = np.full((start - q0, k1 - k0), np.nan, dtype=np.float32)
            old[:, : prev[3].shape[1]] = prev[3]
            rows = np.concatenate([old, rows])
        tile = np.ascontiguousarray(rows, dtype=np.float32)
        self._tile = (key, q1, k1, tile)
        return tile, (q0, k0)

    def _selection_parts(self, sel: Selection, query: int) -> dict:
        """The selection's parts of a snapshot (the KV part's selection fields as a dict), and the
        selected layer's ``shape``."""
        o = self.obj
        layer, head, kind = sel.layer, sel.head, sel.kind
        t = o.cache_length
        tile, origin = None, (0, 0)
        if t <= EXACT_LIMIT:
            m, allowed = self._matrix(layer, head, kind)
            block = 1
            self._pooled = None
        else:
            # a new zoom shows its exact cells first: a pooled matrix still streaming in waits for the next slice
            hurry = sel.view is not None and sel.view != self._view
            (m, block), allowed = self._pooled_matrix(layer, head, kind, hurry), None
            self._mat = None
            tile, origin = self._exact_tile(sel)
        if kind == "probs":
            levels = (0.0, 1.0)
        else:
            lo, hi = float(np.nanmin(m)), float(np.nanmax(m))
            if not (np.isfinite(lo) and np.isfinite(hi)):
                lo, hi = 0.0, 1.0
            levels = (lo, hi if hi > lo else lo + 1.0)
        kvh = o.kv_head_of(head, layer)
        keys, values = o.keys(layer), o.values(layer)  # (Hkv, T, d)
        kv_block = pow2_block(t, EXACT_LIMIT)
        bias = o.bias_rows(
            layer, query, query + 1, (head,)
        )  # (1, 1, T): the model's additive score bias (ALiBi, doge), or None
        cached = o.cached_rows(layer)  # (T, n) or None
        evicted, error = policy_rows(o, layer) or (None, None)  # a run under a KV cache policy, else None
        kv_k, kv_v = self._kv_pooled(layer, keys, values, kv_block, evicted is None)
        return dict(
            scores=ScoreMatrixPart(
                matrix=m,
                allowed=allowed,
                matrix_block=block,
                matrix_rows=t if self._pooled is None else self._pooled.done,
                tile=tile,
                tile_origin=origin,
                levels=levels,
            ),
            query_row=QueryRowPart(
                query_allowed=o.allowed_rows(layer, query, query + 1)[head, 0].numpy().copy(),
                query_bias=None if bias is None else bias[0, 0].numpy().copy(),
                head_rows=np.ascontiguousarray(o.attention_rows(layer, query, query + 1)[:, 0, :].numpy()),
            ),
            qkv=QKVPart(
                q=o.queries(layer)[head, query].float().numpy().copy(),  # (d,)
                k=keys[kvh].float().numpy().copy(),  # (T, d)
                v=values[kvh].float().numpy().copy(),
                scaling=o.scaling(layer),
                softcap=o.softcap(layer),
                kv_head=kvh,
            ),
            kv=dict(
                kv_k=kv_k,
                kv_v=kv_v,
                kv_block=kv_block,
                kv_cached=None if cached is None else pool_rows(cached.float().numpy(), kv_block),
                kv_evicted=None if evicted is None else np.ascontiguousarray(evicted),
                kv_error=None if error is None else np.ascontiguousarray(error),
            ),
            # the selected layer's own: Gemma 4's full-attention layers have their own head size and KV heads
            shape=dict(n_kv_heads=int(keys.shape[0]), head_dim=int(keys.shape[-1])),
        )

    def _kv_pooled(self, layer: int, keys: torch.Tensor, values: torch.Tensor, block: int, plain: bool):
        """The KV cache view's rows, (ceil(T / block), Hkv*d) each for K and V: after steps only the
        block the old T cut through and the new ones are pooled again (a step appends keys and
        values; any other event drops what was kept). ``plain``: not a run under a cache policy."""
        t = int(keys.shape[1])
        c = self._kv_pool
        keep = 0
        if plain and c is not None and c[:2] == (layer, block) and c[2] <= t:
            if c[2] == t:
                return c[3], c[4]  # the same arrays: the snapshot's part stays the one drawn
            keep = c[2] // block  # whole blocks before the old T: their rows are as they were
        start = keep * block
        k, v = (pool_rows(_heads_side_by_side(x[:, start:]), block) for x in (keys, values))  # (n, Hkv*d)
        if keep:
            k, v = np.concatenate([c[3][:keep], k]), np.concatenate([c[4][:keep], v])
        self._kv_pool = (layer, block, t, k, v) if plain else None
        return k, v


def _heads_side_by_side(x: torch.Tensor) -> np.ndarray:
    """(Hkv, T, d) -> (T, Hkv*d): one row per position, the layer's heads side by side."""
    x = x.float()
    return np.ascontiguousarray(x.permute(1, 0, 2).reshape(x.shape[1], -1).numpy())
