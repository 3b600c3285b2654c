"""What a view shows of a run, at the resolution it shows it: the reads a remote engine answers itself.

Part of the run-source reader (``RunSource`` inherits ``ViewTiles``): the overview's binned sums,
one head's pooled rows and one block of cells. A source in this process computes them here from
its primitives; a remote one (``remote.client.RemoteSession``) asks the engine, which runs this
same code, so only the small result crosses the wire and the numbers are the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import attention as eq
from .pooling import bin_rows, pool_max


class ViewTiles:
    """The view-sized reads of a run source (see the module docstring); mixed into ``RunSource``."""

    engine: str | None = None  # where the engine a remote source drives listens ("ws://host:port"); None: here

    def overview_bins(self, p0: int, p1: int, size: int) -> np.ndarray:
        """(L, H, row bins, key bins) float64: query rows p0..p1 of every head's softmax, summed into
        ``size`` x ``size`` bins (``pooling.Thumbnails.add_bins`` adds them to the overview)."""
        src: Any = self  # a RunSource
        attending = set(src.attention_layers)
        h = src.n_heads

        def rows(layer, a, b):
            if layer not in attending:  # a hybrid's state-space layer: no attention, a blank thumbnail row
                return np.zeros((h, b - a, b), dtype=np.float32)  # (H, n, b)
            # keys past the last row get probability 0 at every head: leaving them out halves a full pass
            return src.attention_rows(layer, a, b, "probs", keys=b).numpy()

        return bin_rows(rows, src.n_layers, h, size, p0, p1)

    def pooled_rows(self, layer: int, head: int, kind: str, p0: int, p1: int, keys: int, block: int) -> np.ndarray:
        """(n / block, keys / block) float32: query rows p0..p1 of one head over the first ``keys``
        keys, the maximum of each ``block`` x ``block`` cells; NaN where every cell is masked."""
        src: Any = self  # a RunSource
        masked = kind in eq.MASKING_KINDS
        rows = src.attention_rows(layer, p0, p1, kind, heads=(head,), keys=keys)[0].numpy()  # (n, keys)
        if masked:
            hidden = ~src.allowed_rows(layer, p0, p1, keys)[head].numpy()  # (n, keys)
        else:
            hidden = np.zeros(rows.shape, bool)
        pv, pm = pool_max(rows, hidden, block, block)
        return np.where(pm, np.float32(np.nan), pv).astype(np.float32)

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
            cells = src.attention_rows(layer, p0, p1, kind, heads=(head,))[0].numpy()[:, k0:k1]
            if kind in eq.MASKING_KINDS:
                ok = src.allowed_rows(layer, p0, p1)[head].numpy()[:, k0:k1]
                cells = np.where(ok, cells, np.float32(np.nan))
        if block > 1:
            pv, pm = pool_max(cells, np.zeros(cells.shape, bool), block, block)
            cells = np.where(pm, np.float32(np.nan), pv)
        return np.ascontiguousarray(cells, dtype=np.float32)
