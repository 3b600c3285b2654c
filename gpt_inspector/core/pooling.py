"""Attention zoomed out: block maxima and means, computed where the user looks, never T x T for all heads.

The one home of pooling for the window, the figures and the CLI (numpy; torch only inside the
functions that compute rows). Quadratic work is the enemy at long contexts: a model with L x H heads
has L*H*T*T attention weights, 275 G multiply-adds for a small 8-layer model at T = 8,192. So:

- block sizes: :func:`pow2_block` for the window (powers of two, so a growing T regroups 2 x 2
  blocks without recomputing a cell) and :func:`fit_block` for figures (the smallest block that fits);
- :func:`pool_max` (block maxima, masked cells ignored) and :func:`pool_rows` (row-block means);
- :func:`head_blocks`, every head of a layer as block maxima: past a work budget over a *sample*
  of each block's query rows (the last ``rows_per_block`` rows, every key), and the caller says so;
- :class:`Thumbnails` (the L x H overview) keeps binned sums and adds query rows in any order. A
  step adds its one new row (O(L*H*T*d)); a first build or a rebuild after a mask edit is a
  stream of row chunks in *refinement order* (a few rows of every bin first, then the rest), so
  the whole overview is readable after a small share of the work and is exact once complete.
- :class:`PooledMatrix` is one head's T x T matrix at display resolution: the maximum over
  ``block`` x ``block`` cells (a single strong weight stays visible), one row block per step;
- the torch thread count for these small chunks of work (:func:`one_thread`, :class:`ThreadChooser`).

All compute rows through the run source's one equation, in chunks.
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import warnings

import numpy as np

from .attention import MASKING_KINDS

EXACT_BUDGET = 1 << 32  # multiply-adds the exact block maxima of a whole figure may cost (~a few s on a CPU)
ROWS_BUDGET = 1 << 23  # numbers per evaluation of a chunk of rows (32 MB of float32)
CHUNK_ROWS = 16  # rows per streamed chunk of the overview: the unit of its refinement order
# rows x heads x keys per layer in a chunk once the overview is readable (~0.1 s for 8 layers on 2 threads)
FILL_NUMBERS = 1 << 23


# ------------------------------------------------------------------------------- block sizes
def pow2_block(t: int, max_cells: int) -> int:
    """The smallest power of two ``b`` with ceil(t / b) <= max_cells (the window's rule: see the module)."""
    b = 1
    while -(-t // b) > max_cells:
        b *= 2
    return b


def fit_block(t: int, max_cells: float) -> int:
    """The smallest block ``b`` with ceil(t / b) <= max_cells, any size (the figures' rule: 1 when t fits)."""
    return max(1, math.ceil(t / max(1.0, max_cells)))


# ------------------------------------------------------------------------------ reductions
def pool_max(values: np.ndarray, masked: np.ndarray, kr: int, kc: int) -> tuple[np.ndarray, np.ndarray]:
    """Block maximum over ``kr`` x ``kc`` cells, ignoring masked ones; a block is masked if all are.

    The maximum keeps a single strong attention weight visible in a thumbnail; a mean would wash it out.
    """
    if kr == 1 and kc == 1:
        return values, masked
    r, c = values.shape
    R, C = -(-r // kr), -(-c // kc)
    v = np.asarray(values)
    dtype = v.dtype if v.dtype in (np.float32, np.float64) else np.float64
    pad = np.full((R * kr, C * kc), -np.inf, dtype=dtype)
    pad[:r, :c] = v
    pad[:r, :c][masked | np.isnan(v)] = -np.inf
    pooled = pad.reshape(R, kr, C, kc).max(axis=(1, 3))
    pmask = np.isneginf(pooled)
    return np.where(pmask, 0.0, pooled), pmask


def pool_rows(a: np.ndarray, block: int, dtype=np.float32) -> np.ndarray:
    """(T, w) -> (ceil(T / block), w): the mean of each block of rows (the last block may be short)."""
    if block == 1:
        return a
    starts = np.arange(0, a.shape[0], block)
    counts = np.diff(np.append(starts, a.shape[0]))[:, None]
    return np.ascontiguousarray(np.add.reduceat(a, starts, axis=0) / counts, dtype=dtype)


# ------------------------------------------------------------------------------ threads
@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch threads (process-wide), then put the count back."""
    import torch  # here, not at the top: figures import this module and must load without the engine

    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread():
    """Run small tensor work (a few rows per call) on one torch thread.

    On a busy machine a thread pool's barriers cost ten times more than they save on tensors this
    small (measured: 600 ms vs 35 ms per window snapshot at T = 1,024 on a loaded 2-core box).
    """
    return torch_threads(1)


class ThreadChooser:
    """The torch thread count for a stream of similar chunks of work, chosen by timing them.

    One thread is the safe choice on a busy machine (see ``one_thread``); on a quiet one all of
    torch's threads nearly halve a long stream (the overview at T = 8,192). So the first chunks
    run with each count in turn, then the faster one (by the median seconds per number of its
    last few chunks) runs, and now and then a chunk tries the other, so a machine that gets busy
    or quiet later is followed. A probe runs at the other count's speed, about half the best's:
    one every 8 chunks made the 32k overview 12 % slower, so each probe that confirms the choice
    doubles the wait before the next (to ``PROBE_MAX`` chunks), and one that does not brings it
    back to ``PROBE``. Create it where torch still has all its threads.
    """

    PROBE = 8
    PROBE_MAX = 64

    def __init__(self):
        import torch

        self.most = torch.get_num_threads()
        self.times: dict[int, collections.deque] = {
            1: collections.deque(maxlen=4),
            self.most: collections.deque(maxlen=4),
        }
        self.chunks = 0
        self.every = self.PROBE  # chunks from one probe to the next
        self.next_probe = self.PROBE
        self.probing: tuple[int, int] | None = None  # (the count probed, the best one then)

    def _best(self) -> int:
        one, many = self.times[1], self.times[self.most]
        return 1 if statistics.median(one) <= statistics.median(many) else self.most

    def pick(self) -> int:
        if self.most == 1:
            return 1
        self.chunks += 1
        one, many = self.times[1], self.times[self.most]
        if len(one) < 2 or len(many) < 2:
            return 1 if len(one) <= len(many) else self.most
        best = self._best()
        if self.chunks >= self.next_probe:
            other = self.most if best == 1 else 1
            self.probing = (other, best)
            return other
        return best

    def record(self, threads: int, seconds: float, numbers: int) -> None:
        per = seconds / max(1, numbers)
        if self.probing is not None and threads == self.probing[0]:
            confirmed = per >= statistics.median(self.times[self.probing[1]])  # the probe was slower
            self.every = min(2 * self.every, self.PROBE_MAX) if confirmed else self.PROBE
            self.next_probe = self.chunks + self.every
            self.probing = None
        self.times[threads].append(per)


# --------------------------------------------------------------------- a layer's heads
def rows_per_block(n_heads_total: int, t: int, d: int, block: int, budget: int | None = None) -> int:
    """How many query rows of each block of ``block`` rows fit the budget (``block``: all of them, exact)."""
    budget = EXACT_BUDGET if budget is None else budget
    blocks = -(-t // block)
    per_row = max(1, n_heads_total * t * d)
    return int(min(block, max(1, budget // (per_row * blocks))))


def head_blocks(source, layer: int, kind: str, block: int, sampled: int | None = None):
    """(values, masked, spans) for every head of ``layer`` at ``kind``.

    values: (H, nb, nb) float32, the maximum over each ``block`` x ``block`` cells that are not
    masked (0 where all are); masked: (H, nb, nb) bool; spans: per head (min, max) of the cells
    computed, or None. ``sampled``: query rows per row block (the last ones); None: every row.
    """
    t = int(source.cache_length)
    H = int(source.n_heads)
    nb = -(-t // block)
    g = block if sampled is None else max(1, min(block, int(sampled)))
    out = np.full((H, nb, nb), -np.inf, dtype=np.float32)
    lo = np.full(H, np.inf)
    hi = np.full(H, -np.inf)
    masking = kind in MASKING_KINDS
    pad = nb * block - t
    step = max(1, ROWS_BUDGET // max(1, H * t))
    with one_thread():
        for r in range(nb):
            b1 = min((r + 1) * block, t)
            for c0 in range(max(r * block, b1 - g), b1, step):  # the block's last g rows, in chunks
                c1 = min(b1, c0 + step)
                v = source.attention_rows(layer, c0, c1, kind).numpy()  # (H, n, t)
                ok = np.isfinite(v)
                if masking:
                    ok &= source.allowed_rows(layer, c0, c1).numpy()
                v = np.where(ok, v, -np.inf)
                if ok.any():
                    lo = np.minimum(lo, np.where(ok, v, np.inf).min(axis=(1, 2)))
                    hi = np.maximum(hi, v.max(axis=(1, 2)))
                v = v.max(axis=1)  # (H, t): the maximum over this block's rows
                if pad:
                    v = np.concatenate([v, np.full((H, pad), -np.inf, dtype=v.dtype)], axis=1)
                out[:, r] = np.maximum(out[:, r], v.reshape(H, nb, block).max(axis=2))
    masked = np.isneginf(out)
    spans = [(float(a), float(b)) if math.isfinite(a) else None for a, b in zip(lo, hi)]
    return np.where(masked, 0.0, out).astype(np.float32), masked, spans


# ------------------------------------------------------------------ the window's overview
def _spread(n: int) -> list[int]:
    """0..n-1 in an order that halves the gaps first (0, n/2, n/4, 3n/4, ...): coarse to fine."""
    order, seen, step = [], set(), 1 << max(0, (n - 1).bit_length())
    while step >= 1:
        for i in range(0, n, step):
            if i not in seen:
                seen.add(i)
                order.append(i)
        step //= 2
    return order


def bin_rows(rows_of, n_layers: int, n_heads: int, size: int, p0: int, p1: int) -> np.ndarray:
    """(L, H, row bins, key bins) float64: query rows p0..p1 summed into ``size`` x ``size`` bins.

    ``rows_of(layer, p0, p1)`` -> (H, n, k) probs over the first k keys, p1 <= k (the keys it leaves
    out have probability 0: rows never attend past themselves). Row bins start at p0 // size.
    """
    s = size
    key_starts = np.arange(0, p1, s)
    out = np.zeros((n_layers, n_heads, (p1 - 1) // s - p0 // s + 1, len(key_starts)), dtype=np.float64)
    # rows in chunks, so a first build at long T never holds H x T x T for a layer at once
    chunk = max(1, ROWS_BUDGET // max(1, n_heads * p1))
    for layer in range(n_layers):
        for c0 in range(p0, p1, chunk):
            c1 = min(p1, c0 + chunk)
            rb = np.arange(c0, c1) // s
            row_starts = np.concatenate([[0], np.flatnonzero(np.diff(rb)) + 1])
            r = rows_of(layer, c0, c1)  # (H, n, k)
            ks = key_starts[key_starts < r.shape[2]]
            if len(row_starts) == 1:  # the usual chunk, inside one row bin: sum its rows first (n times less to bin)
                kb = np.add.reduceat(r.sum(axis=1, keepdims=True), ks, axis=2)  # (H, 1, nbk)
            else:
                kb = np.add.reduceat(np.add.reduceat(r, ks, axis=2), row_starts, axis=1)  # (H, n_rowbins, nbk)
            first = int(rb[0]) - p0 // s
            out[layer, :, first : first + kb.shape[1], : kb.shape[2]] += kb
    return out


class Thumbnails:
    """L x H downsampled attention patterns, kept as binned sums of query rows.

    Positions fall into fixed bins of ``size`` positions (a power of two, doubled when T
    outgrows ``max_bins`` bins, never shrunk until a reset). Each thumbnail cell is the mean,
    over the bin's query rows added so far, of the attention mass the row gives the key bin, so
    every thumbnail row sums to 1 like the matrix it summarises. ``have[p]`` says whether query
    row p is in the sums; rows may be added in any order (see :meth:`pending`).
    """

    def __init__(self, n_layers: int, n_heads: int, max_bins: int = 32):
        self.L, self.H, self.B = n_layers, n_heads, max_bins
        self.reset()

    def reset(self) -> None:
        self.size = 1
        self.T = 0
        self.sums = np.zeros((self.L, self.H, self.B, self.B), dtype=np.float64)
        self.counts = np.zeros(self.B, dtype=np.int64)
        self.have = np.zeros(0, dtype=bool)
        self._image: np.ndarray | None = None

    @property
    def bins(self) -> int:
        return max(1, -(-self.T // self.size))

    @property
    def rows_done(self) -> int:
        return int(self.counts.sum())

    @property
    def complete(self) -> bool:
        return self.rows_done >= self.T

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

    def extend(self, t: int) -> None:
        """The run now has ``t`` positions; rows >= the old T are pending until added."""
        if t <= self.T:
            return
        self._grow(t)
        self.have = np.concatenate([self.have, np.zeros(t - self.T, dtype=bool)])
        self.T = t

    def add_rows(self, rows_of, p0: int, p1: int) -> None:
        """Add query rows p0..p1, none added before (``bin_rows`` says what ``rows_of`` gives)."""
        if p1 > p0:
            self.extend(p1)
            self.add_bins(p0, p1, bin_rows(rows_of, self.L, self.H, self.size, p0, p1))

    def add_bins(self, p0: int, p1: int, bins: np.ndarray) -> None:
        """Add query rows p0..p1, none added before, as ``bin_rows`` summed them at this ``size``
        (computed here or where the model runs: a remote engine sends these sums, not the rows)."""
        if p1 <= p0:
            return
        self.extend(p1)
        assert not self.have[p0:p1].any(), (p0, p1)
        b0 = p0 // self.size
        self.sums[:, :, b0 : b0 + bins.shape[2], : bins.shape[3]] += bins
        np.add.at(self.counts, np.arange(p0, p1) // self.size, 1)
        self.have[p0:p1] = True
        self._image = None

    def truncate(self, t: int) -> None:
        """Forget rows >= t (step back, mask edits); the rest of the bin that t cuts through becomes pending.

        Rows before t keep their sums: a causal row p < t never attends to a key >= t.
        """
        if t >= self.T:
            return
        if t <= 0:
            self.reset()
            return
        b = t // self.size
        self.sums[:, :, b:] = 0.0
        self.counts[b:] = 0
        self.have = self.have[:t].copy()
        self.have[b * self.size :] = False
        self.T = t
        self._image = None

    def pending(self, max_chunks: int | None = None) -> list[tuple[int, int]]:
        """Row chunks not added yet, in refinement order: one row of every bin that has none (the
        overview is then readable), then a chunk of every bin, then the next, ...

        The single rows first: at T = 16,384 a chunk of 16 rows in each of 32 bins took 10 s
        before every thumbnail had a row; one row each takes a sixteenth of the work. Once every
        bin has a chunk's worth of rows the rest comes in longer runs: a call per 16 rows cost
        1.7x the work of the rows themselves at T = 4,096.
        """
        nb, s, c = self.bins, self.size, min(self.size, CHUNK_ROWS)
        if self.T:
            lengths = np.minimum(s, self.T - np.arange(nb) * s)  # rows per bin (the last may be short)
            if bool((self.counts[:nb] >= np.minimum(c, lengths)).all()):
                return self._runs(max_chunks)
        out: list[tuple[int, int]] = []
        for empty in np.flatnonzero(self.counts[:nb] == 0).tolist():  # a bin with no row yet: its first row
            out.append((empty * s, empty * s + 1))
            if max_chunks is not None and len(out) >= max_chunks:
                return out
        if out:  # the chunks below may hold these rows: they come in a later call
            return out
        order = _spread(s // c if s >= c else 1)
        for j in order:
            for b in range(self.bins):
                p0 = b * s + j * c
                p1 = min(p0 + c, (b + 1) * s, self.T)
                if p0 < p1 and not self.have[p0:p1].all():
                    # a chunk may be partly added (a step added its newest row): take its missing run
                    missing = np.flatnonzero(~self.have[p0:p1])
                    out.append((p0 + int(missing[0]), p0 + int(missing[-1]) + 1))
                    if max_chunks is not None and len(out) >= max_chunks:
                        return out
        return out

    def _runs(self, max_chunks: int | None) -> list[tuple[int, int]]:
        """The missing rows as contiguous runs, in order, each about FILL_NUMBERS rows x keys x heads
        (at least CHUNK_ROWS rows): a row reads only the keys up to itself, so early runs are longer."""
        missing = np.flatnonzero(~self.have)
        out: list[tuple[int, int]] = []
        if not len(missing):
            return out
        per_head = FILL_NUMBERS // max(1, self.H)
        breaks = np.flatnonzero(np.diff(missing) > 1)
        for a, b in zip(np.concatenate([[0], breaks + 1]), np.concatenate([breaks, [len(missing) - 1]])):
            p0, end = int(missing[a]), int(missing[b]) + 1
            while p0 < end:
                # the most rows n with n x (p0 + n) keys within the budget
                n = max(CHUNK_ROWS, (math.isqrt(p0 * p0 + 4 * per_head) - p0) // 2)
                out.append((p0, min(p0 + n, end)))
                p0 += n
                if max_chunks is not None and len(out) >= max_chunks:
                    return out
        return out

    def image(self) -> np.ndarray:
        """(L*nb, H*nb) float32 in [0, 1], each thumbnail scaled by its own maximum."""
        if self._image is not None:
            return self._image
        nb = self.bins
        c = np.maximum(self.counts[:nb], 1)[None, None, :, None]
        m = self.sums[:, :, :nb, :nb] / c  # (L, H, nb, nb)
        mx = m.max(axis=(2, 3), keepdims=True)
        m = np.sqrt(m / np.where(mx > 0, mx, 1.0))  # sqrt: faint structure stays visible next to a sink
        self._image = np.ascontiguousarray(m.transpose(0, 2, 1, 3).reshape(self.L * nb, self.H * nb), dtype=np.float32)
        return self._image


class PooledMatrix:
    """One head's T x T matrix at one stage, as the maximum over ``block`` x ``block`` cells.

    NaN where every cell of a block is masked (the masked stages). A step recomputes only the
    last row block (and, for the stages that show future keys, the newest key block of the
    earlier rows); ``invalidate(p)`` makes rows >= p stale.
    """

    def __init__(self, layer: int, head: int, kind: str, block: int):
        self.layer, self.head, self.kind, self.block = layer, head, kind, block
        self.T = 0  # positions at the last update
        self.done = 0  # query rows computed (a first build at long T comes in several updates)
        self.img = np.zeros((0, 0), dtype=np.float32)
        self.dirty = 0

    @property
    def complete(self) -> bool:
        return self.done >= self.T

    def regroup(self, block: int) -> None:
        """Double the block size (T grew past a power of two): the maximum of 2 x 2 maxima is the
        maximum of the bigger block, so no cell is recomputed; the last, partial blocks are."""
        assert block == 2 * self.block, (block, self.block)
        n = self.img.shape[0] // 2  # whole new blocks; a trailing odd block row is recomputed
        m = self.img[: 2 * n, : 2 * n].reshape(n, 2, n, 2)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN blocks stay NaN (masked)
            self.img = np.nanmax(m, axis=(1, 3)).astype(np.float32)
        self.block = block
        self.T = min(self.T, n * block)
        self.done = min(self.done, self.T)
        self.dirty = min(self.dirty, self.T)

    def invalidate(self, position: int) -> None:
        self.dirty = min(self.dirty, position)

    def update(self, source, budget: int | None = None) -> np.ndarray:
        """Bring the image up to ``source.cache_length``, computing at most about ``budget``
        numbers of rows (one chunk at least; None: all); returns a new (owned) array, NaN in
        the rows not computed yet (``done``)."""
        t, s = source.cache_length, self.block
        nb = -(-t // s)
        r0 = min(self.dirty, self.done, self.T, t) // s  # first row block to recompute
        img = np.full((nb, nb), np.nan, dtype=np.float32)
        keep = min(r0, self.img.shape[0])
        img[:keep, : min(nb, self.img.shape[1])] = self.img[:keep, :nb]
        masked = self.kind in ("masked_scores", "probs")
        layer, head = self.layer, self.head
        chunk = max(s, (ROWS_BUDGET // max(1, t)) // s * s)
        if budget is not None:
            chunk = min(chunk, max(s, (budget // max(1, t)) // s * s))
        done, first = t, r0 * s
        if masked and min(self.dirty, self.done) >= self.T > first and t > self.T and r0 < self.img.shape[0]:
            # a step: the rows of the cut row block before the old T keep their maxima (causal rows never
            # see the new keys), so only the new rows of that block are computed and merged in
            first = min(t, (r0 + 1) * s)
            pv = source.pooled_rows(layer, head, self.kind, self.T, first, min(t, -(-first // s) * s), s)  # (1, m)
            old = np.full(pv.shape[1], np.nan, dtype=np.float32)
            old[: min(len(old), self.img.shape[1])] = self.img[r0, : len(old)]
            img[r0, : pv.shape[1]] = np.fmax(old, pv[0])  # NaN (every cell masked) only where both are
        for p0 in range(first, t, chunk):
            if budget is not None and p0 > first:
                done = p0  # the rest comes with the next updates
                break
            p1 = min(t, p0 + chunk)
            # the masked stages hide every key past the chunk's last row: those whole blocks stay NaN
            kt = min(t, -(-p1 // s) * s) if masked else t
            pv = source.pooled_rows(layer, head, self.kind, p0, p1, kt, s)  # (n/s, kt/s), NaN: masked
            img[p0 // s : p0 // s + pv.shape[0], : pv.shape[1]] = pv
        if not masked and keep and t != self.T:
            # the raw stages show every key: the earlier rows gain the new keys' columns (or, after
            # a step back, lose the cut ones from their last key block)
            c0 = (min(self.T, t) // s) * s
            img[:keep, c0 // s :] = source.attention_block(layer, head, self.kind, 0, keep * s, c0, t, every=True,
                                                           block=s)  # fmt: skip
        self.img, self.T, self.dirty, self.done = img, t, t, done
        return img
