"""Every head of a layer as block maxima, computed in row chunks: the zoomed-out picture at any T.

An exact block maximum needs every q·k of the block; for a whole model at T = 8,192 that is
L*H*T*T*d multiply-adds (275 G for 8 layers x 8 heads, d = 64), minutes on a CPU. Past a work
budget the blocks are therefore taken over a *sample* of their query rows (the last
``rows_per_block`` rows of each block, every key), and the caller says so on the figure.
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics

import numpy as np

from .attention import MASKING_KINDS

EXACT_BUDGET = 1 << 32  # multiply-adds the exact block maxima of a whole figure may cost (~a few s on a CPU)
ROWS_BUDGET = 1 << 23  # numbers per evaluation (32 MB of float32)


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
    last few chunks) runs, and every ``PROBE``-th chunk tries the other, so a machine that gets
    busy or quiet later is followed. Create it where torch still has all its threads.
    """

    PROBE = 8

    def __init__(self):
        import torch

        self.most = torch.get_num_threads()
        self.times: dict[int, collections.deque] = {
            1: collections.deque(maxlen=4),
            self.most: collections.deque(maxlen=4),
        }
        self.chunks = 0

    def pick(self) -> int:
        if self.most == 1:
            return 1
        self.chunks += 1
        one, many = self.times[1], self.times[self.most]
        if len(one) < 2 or len(many) < 2:
            return 1 if len(one) <= len(many) else self.most
        best = 1 if statistics.median(one) <= statistics.median(many) else self.most
        if self.chunks % self.PROBE == 0:
            return self.most if best == 1 else 1
        return best

    def record(self, threads: int, seconds: float, numbers: int) -> None:
        self.times[threads].append(seconds / max(1, numbers))


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
