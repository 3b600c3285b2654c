"""What a view shows of a run, at the resolution it shows it: the reads a remote engine answers itself.

Part of the run-source reader (``RunSource`` inherits ``ViewTiles``): the overview's binned sums,
one head's pooled rows and one block of cells. A source in this process computes them here from
its primitives; a remote one (``remote.client.RemoteSession``) asks the engine, which runs this
same code, so only the small result crosses the wire and the numbers are the same bits.

At long T these are streams of row chunks through the one equation (``attention_rows``), each
chunk computed in a buffer kept per thread and reduced in torch: a fresh 32 MB result per chunk
cost as much in page faults as the softmax, and numpy's float64 reductions over T x T rows as
much again (``benchmarks/bench_overview.py`` measures the old path beside this one).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import attention as eq
from . import pooling
from .pooling import pool_max

_LOCAL = threading.local()
KEY_BLOCK = 1024  # keys per block of the overview's plain causal rows (attention.causal_bin_mass)
BLOCK_NUMBERS = 1 << 18  # rows x keys per such block: 1 MB of float32, within a core's L2 cache


def work_buffer(numbers: int) -> torch.Tensor:
    """A flat float32 buffer of at least ``numbers``, one per thread, grown when asked for more.

    Row chunks of a stream are computed in it (``attention_rows(work=...)``); its pages stay
    mapped between chunks (at most ``pooling.ROWS_BUDGET`` numbers, 32 MB, in the streams here).
    """
    w = getattr(_LOCAL, "work", None)
    if w is None or w.numel() < numbers:
        w = _LOCAL.work = torch.empty(max(1, numbers), dtype=torch.float32)
    return w


def block_max(cells: torch.Tensor, block: int) -> torch.Tensor:
    """(n, k) -> (ceil(n / block), ceil(k / block)): the maximum of each ``block`` x ``block``
    cells (the last blocks may be short); -inf where every cell is -inf."""
    n, k = cells.shape
    R, C = -(-n // block), -(-k // block)
    if (R * block, C * block) != (n, k):
        cells = torch.nn.functional.pad(cells, (0, C * block - k, 0, R * block - n), value=-math.inf)
    # the rows first, vectorised along the contiguous keys (one pass over every cell), then the key
    # blocks of the small result: short inner reductions first took twice as long
    return cells.unflatten(0, (R, block)).amax(1).unflatten(1, (C, block)).amax(-1)  # (R, C)


def in_layers(fn, layers) -> None:
    """``fn(layer)`` for every layer, on as many threads as torch may use, each running torch on one.

    Each layer's rows are independent, so the layers are the coarse grain to share out (as sdpa
    shares heads): torch's own threads split each small product and softmax of a row chunk, and
    on a busy 2-core machine their barriers cost more than they gain (a streamed overview 5 to 9x
    the same rows on one thread, where layers on two threads cost about what sdpa's heads do).
    """
    layers = list(layers)
    k = min(torch.get_num_threads(), len(layers))
    if k <= 1:
        for layer in layers:
            fn(layer)
        return

    def alone(layer: int) -> None:
        # torch's thread count is per thread under OpenMP: a pool thread starts with the machine's
        torch.set_num_threads(1)
        fn(layer)

    with pooling.torch_threads(1):
        list(_pool(k).map(alone, layers))


def _pool(k: int) -> ThreadPoolExecutor:
    """The calling thread's pool of ``k`` threads (kept: a stream calls this once per chunk)."""
    have = getattr(_LOCAL, "pool", None)  # (k, pool) or None
    if have is None or have[0] != k:
        if have is not None:
            have[1].shutdown(wait=False)
        have = _LOCAL.pool = (k, ThreadPoolExecutor(k, thread_name_prefix="gpt-inspector-rows"))
    return have[1]


class ViewTiles:
    """The view-sized reads of a run source (see the module docstring); mixed into ``RunSource``."""

    engine: str | None = None  # where the engine a remote source drives listens ("ws://host:port"); None: here

    def overview_bins(self, p0: int, p1: int, size: int) -> np.ndarray:
        """(L, H, row bins, key bins) float64: query rows p0..p1 of every head's softmax, summed into
        ``size`` x ``size`` bins (``pooling.Thumbnails.add_bins`` adds them to the overview). Row
        bins start at p0 // size; a layer without attention (a hybrid's state-space layer) is 0."""
        src: Any = self  # a RunSource
        h, first = src.n_heads, p0 // size
        out = np.zeros((src.n_layers, h, (p1 - 1) // size - first + 1, len(range(0, p1, size))), dtype=np.float64)
        if p1 <= p0:
            return out
        # rows in chunks, so a first build at long T never holds H x T x T for a layer at once
        chunk = max(1, pooling.ROWS_BUDGET // max(1, h * p1))

        def add(layer: int, heads: slice, a: int, b: int, r: torch.Tensor) -> None:
            """Add rows a..b's key-bin sums r (h, b - a or 1 if summed already, key bins) of ``heads`` to their row bins."""
            r0, r1 = a // size, (b - 1) // size
            if r0 == r1:  # the usual chunk, inside one row bin: sum its rows first (n times less to bin)
                sums = r.sum(1, keepdim=True)  # (h, 1, key bins)
            else:
                rb = torch.arange(a, b) // size - r0  # (n,) each row's bin
                sums = r.new_zeros(r.shape[0], r1 - r0 + 1, r.shape[2]).index_add_(1, rb, r)  # (h, row bins, key bins)
            out[layer, heads, r0 - first : r1 - first + 1, : sums.shape[2]] += sums.double().numpy()

        def add_layer_blocked(layer: int) -> None:
            # plain causal rows: each KV head's query heads in key blocks that stay in the cache
            q, k = src.records.queries(layer), src.records.keys(layer)  # (H, T, d), (Hkv, T, d)
            hkv = k.shape[0]
            g = h // hkv  # query heads h*g .. h*g+g-1 read KV head h
            n = max(1, BLOCK_NUMBERS // (g * KEY_BLOCK))
            # a block: about BLOCK_NUMBERS cells, twice where a short last run widens it, the last block
            # of a run longer by its rows (causal_bin_mass grows its own where this is short)
            work = work_buffer(2 * BLOCK_NUMBERS + g * n * (size + n))
            scaling, cap = src.scaling(layer), src.softcap(layer)
            for a in range(p0, p1, n):
                b = min(p1, a + n)
                for kv in range(hkv):
                    mass = eq.causal_bin_mass(q[kv * g : kv * g + g, a:b], k[kv, :b], scaling, cap, a, size, KEY_BLOCK,
                                              BLOCK_NUMBERS, work)  # fmt: skip
                    add(layer, slice(kv * g, kv * g + g), a, b, mass)

        def add_layer(layer: int) -> None:
            if src.sink(layer) is None and src.score_bias(layer) is None and src.plain_causal(layer, p0, p1):
                return add_layer_blocked(layer)
            work = work_buffer(min(chunk, p1 - p0) * h * p1)
            for a in range(p0, p1, chunk):
                b = min(p1, a + chunk)
                # keys past the last row get probability 0 at every head: leaving them out halves a full pass
                r = src.attention_rows(layer, a, b, "probs", keys=b, work=work)  # (H, n, b)
                if a // size == (b - 1) // size:  # one row bin: its rows summed before the keys are binned
                    r = r.sum(1, keepdim=True)  # (H, 1, b)
                add(layer, slice(None), a, b, eq.key_bin_sums(r, size))

        in_layers(add_layer, src.attention_layers)
        return out

    def pooled_rows(self, layer: int, head: int, kind: str, p0: int, p1: int, keys: int, block: int) -> np.ndarray:
        """(n / block, keys / block) float32: query rows p0..p1 of one head over the first ``keys``
        keys, the maximum of each ``block`` x ``block`` cells; NaN where every cell is masked."""
        src: Any = self  # a RunSource
        work = work_buffer((p1 - p0) * keys)
        rows = src.attention_rows(layer, p0, p1, kind, heads=(head,), keys=keys, work=work)[0]  # (n, keys)
        if kind in eq.MASKING_KINDS:
            allowed, c = src._allowed_from(layer, p0, p1, keys)  # (H, n, keys - c): keys before c all allowed
            rows[:, c:].masked_fill_(~allowed[head], -math.inf)
        pooled = block_max(rows, block)  # (n / block, keys / block); a NaN cell makes its block NaN
        if bool(pooled.isnan().any()):  # a NaN cell counts as masked, as in pool_max: looked for only where one is
            pooled = block_max(rows.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf), block)
        return pooled.masked_fill_(pooled.isneginf(), math.nan).numpy()

    def attention_block(self, layer: int, head: int, kind: str, p0: int, p1: int, k0: int, k1: int,
                        every: bool = False, block: int = 1) -> np.ndarray:  # fmt: skip
        """(n, k1 - k0) float32: query rows p0..p1 and keys k0..k1 of one head at ``kind``.

        ``every``: every key counts as allowed (the raw stages' future keys, which the causal mask
        hides from the later stages); else as ``attention_rows`` gives them, NaN where masked at the
        masked stages. ``block`` > 1: the maximum of each ``block`` x ``block`` cells instead.
        """
        src: Any = self  # a RunSource
        if every:
            q = src.queries(layer)[head, p0:p1]  # (n, d)
            k = src.keys(layer)[src.kv_head_of(head, layer), k0:k1]  # (m, d)
            allowed = torch.ones(p1 - p0, k1 - k0, dtype=torch.bool)
            bias = None if kind == "raw" else src.bias_rows(layer, p0, p1, (head,))
            bias = None if bias is None else bias[0, :, k0:k1]  # (n, m): ALiBi, doge
            scaling, cap = src.scaling(layer), src.softcap(layer)
            cells = eq.equation(q, k, scaling, cap, allowed, kind, None, bias).numpy()  # (n, m)
        else:
            # keys past max(p1, k1) are masked for these rows (they never attend past themselves) and
            # not shown: leaving them out spares a zoom the rest of a long row (a softmax over them adds
            # only zeros, so the cells agree to float32 rounding)
            kt = max(p1, k1)
            cells = src.attention_rows(layer, p0, p1, kind, heads=(head,), keys=kt)[0].numpy()[:, k0:k1]
            if kind in eq.MASKING_KINDS:
                allowed, c = src._allowed_from(layer, p0, p1, kt)  # (H, n, kt - c): keys before c all allowed
                ok = np.ones((p1 - p0, kt), dtype=bool)
                ok[:, c:] = allowed[head].numpy()
                cells = np.where(ok[:, k0:k1], cells, np.float32(np.nan))
        if block > 1:
            pv, pm = pool_max(cells, np.zeros(cells.shape, bool), block, block)
            cells = np.where(pm, np.float32(np.nan), pv)
        return np.ascontiguousarray(cells, dtype=np.float32)
