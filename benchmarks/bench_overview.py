"""The overview and one head's pooled matrix at long T: the previous row path beside the current one, in one process.

A micro-benchmark for issue 31's item 1, so a change to the row path needs no 20-minute ``bench_long.py``
run: a synthetic run source with the benchmark model's shapes (8 heads over 2 KV heads, head size 64,
``--layers`` layers: the cost per layer is the same, 2 by default to keep it short) and random q, K,
no model. Per T, each figure side by side, old / new alternating over ``--reps``, the load average
beside each (2 shared cores here: read the ratios):

  readable     the first overview until every row bin has rows: old order (a chunk of CHUNK_ROWS
               rows in every bin first) and old bins, vs the current order (one row per bin first)
               and bins
  complete     every row of the overview, streamed as the worker streams it (``Thumbnails.pending``
               chunks through ``overview_bins``): old order and bins vs current, with the equation's
               cost per cell (ns per causal cell of every head); and the current stream with every
               row taken as a masked one (whole rows in chunks, the path before plain causal rows
               went through ``attention.causal_bin_mass``'s key blocks)
  pooled       one head's pooled matrix (``PooledMatrix.update`` over every row, on one torch thread as the
               view model runs it): old ``pooled_rows`` vs current
  attention    torch's sdpa (the CPU flash kernel HF's prefill runs) over the same q, K and V, causal,
               every layer: the attention part of an HF prefill of T (the whole prefill adds the
               projections and MLPs), the reference the overview's ratio is quoted against here

    python benchmarks/bench_overview.py [--lengths 16384,32768] [--layers 2] [--reps 2] [--threads 1] [--old-complete-max 16384]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def synthetic(layers: int, t: int, heads: int = 8, kv_heads: int = 2, d: int = 64, seed: int = 0):
    """A run source of ``t`` positions with random q, K, V (no model): the benchmark model's shapes."""
    import torch

    from gpt_inspector.core.source import RunRecords, RunSource

    g = torch.Generator().manual_seed(seed)
    # scaled so that rows are far from uniform, as a trained model's are
    q = [torch.randn(heads, t, d, generator=g) * 0.5 for _ in range(layers)]
    k = [torch.randn(kv_heads, t, d, generator=g) * 0.5 for _ in range(layers)]

    class Records(RunRecords):
        head_output_start, edits = 0, None

        def queries(self, layer):
            return q[layer]

        def keys(self, layer):
            return k[layer]

        def values(self, layer):
            return k[layer]

        def head_outputs(self, layer):
            return q[layer]

        def mask_rows(self, layer):
            return {}

        def scaling(self, layer):
            return d**-0.5

        def softcap(self, layer):
            return None

    class Synthetic(RunSource):
        n_layers, n_heads, n_kv_heads, head_dim = layers, heads, kv_heads, d
        cache_length, kv_itemsize, cache_dtype = t, 4, "float32"
        records = Records()

    return Synthetic()


# ------------------------------------------------------------------ the previous row path, as it was
def old_overview_bins(src, p0: int, p1: int, size: int):
    """``ViewTiles.overview_bins`` before this round: a fresh result per chunk, numpy binning."""
    from gpt_inspector.core.pooling import bin_rows

    return bin_rows(lambda layer, a, b: src.attention_rows(layer, a, b, "probs", keys=b).numpy(), src.n_layers,
                    src.n_heads, size, p0, p1)  # fmt: skip


def old_pooled_rows(src, layer, head, kind, p0, p1, keys, block):
    """``ViewTiles.pooled_rows`` before this round: every head's allowed rows, numpy block maxima."""
    import numpy as np

    from gpt_inspector.core.attention import MASKING_KINDS
    from gpt_inspector.core.pooling import pool_max

    rows = src.attention_rows(layer, p0, p1, kind, heads=(head,), keys=keys)[0].numpy()  # (n, keys)
    hidden = (
        ~src.allowed_rows(layer, p0, p1, keys)[head].numpy() if kind in MASKING_KINDS else np.zeros(rows.shape, bool)
    )
    pv, pm = pool_max(rows, hidden, block, block)
    return np.where(pm, np.float32(np.nan), pv).astype(np.float32)


def old_pending(th, max_chunks=8):
    """``Thumbnails.pending`` before this round: a chunk of CHUNK_ROWS rows in every bin first."""
    import numpy as np

    from gpt_inspector.core import pooling

    if th.T and bool((th.counts[: th.bins] > 0).all()):
        return th._runs(max_chunks)
    s, c = th.size, min(th.size, pooling.CHUNK_ROWS)
    out = []
    for j in pooling._spread(s // c if s >= c else 1):
        for b in range(th.bins):
            p0 = b * s + j * c
            p1 = min(p0 + c, (b + 1) * s, th.T)
            if p0 < p1 and not th.have[p0:p1].all():
                missing = np.flatnonzero(~th.have[p0:p1])
                out.append((p0 + int(missing[0]), p0 + int(missing[-1]) + 1))
                if len(out) >= max_chunks:
                    return out
    return out


# ------------------------------------------------------------------ the measures
def stream(src, bins_of, pending_of, until_readable: bool):
    """Seconds to stream the overview as the worker does: until readable, or complete; and its image."""
    from gpt_inspector.core.pooling import Thumbnails

    th = Thumbnails(src.n_layers, src.n_heads, 32)
    th.extend(src.cache_length)
    t0 = time.perf_counter()
    while not th.complete:
        for p0, p1 in pending_of(th):
            th.add_bins(p0, p1, bins_of(src, p0, p1, th.size))
        if until_readable and (th.counts[: th.bins] > 0).all():
            break
    return time.perf_counter() - t0, th


def pooled(src, rows_of, layer=1, head=3):
    from gpt_inspector.core.pooling import PooledMatrix, one_thread, pow2_block

    t = src.cache_length
    pm = PooledMatrix(layer, head, "probs", pow2_block(t, 1024))
    saved = type(src).pooled_rows
    type(src).pooled_rows = rows_of
    try:
        t0 = time.perf_counter()
        with one_thread():  # as the window's view model builds it
            img = pm.update(src)
        return time.perf_counter() - t0, img
    finally:
        type(src).pooled_rows = saved


def sdpa(src):
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    for layer in range(src.n_layers):
        q, k = src.records.queries(layer)[None], src.records.keys(layer)[None]  # (1, H, T, d), (1, Hkv, T, d)
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    del torch
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the worker's streamed chunks: 1 or all)")
    ap.add_argument("--old-complete-max", type=int, default=16384,
                    help="time the old complete stream only up to this T (it takes minutes beyond), once")  # fmt: skip
    args = ap.parse_args()

    import numpy as np
    import torch

    from gpt_inspector.core.source import RunSource

    torch.set_num_threads(args.threads)
    new_bins = RunSource.overview_bins
    new_rows = RunSource.pooled_rows
    print(f"torch threads {torch.get_num_threads()}, {args.layers} layers x 8 heads over 2 KV heads, head size 64; "
          f"{load()}", flush=True)  # fmt: skip
    for T in (int(x) for x in args.lengths.split(",")):
        src = synthetic(args.layers, T)
        cells = src.n_layers * src.n_heads * T * (T + 1) / 2
        res: dict[str, list] = {k: [] for k in ("r_old", "r_new", "c_old", "c_new", "c_rows", "p_old", "p_new", "sdpa")}
        for rep in range(args.reps):
            res["r_old"].append((stream(src, old_overview_bins, old_pending, True)[0], load()))
            r_new, th = stream(src, new_bins, lambda th: th.pending(max_chunks=8), True)
            res["r_new"].append((r_new, load()))
            res["p_old"].append((pooled(src, old_pooled_rows)[0], load()))
            p_new, img_new = pooled(src, new_rows)
            res["p_new"].append((p_new, load()))
            res["sdpa"].append((sdpa(src), load()))
            if rep == 0 and T <= args.old_complete_max:
                c_old, th_old = stream(src, old_overview_bins, old_pending, False)
                res["c_old"].append((c_old, load()))
            c_new, th_new = stream(src, new_bins, lambda th: th.pending(max_chunks=8), False)
            res["c_new"].append((c_new, load()))
            src.plain_causal = lambda *a: False  # every row as a masked one: whole rows, as before key blocks
            c_rows, th_rows = stream(src, new_bins, lambda th: th.pending(max_chunks=8), False)
            del src.plain_causal
            res["c_rows"].append((c_rows, load()))
            if rep == 0:  # the same numbers both ways, to float32 rounding
                d_th = float(np.abs(th_old.image() - th_new.image()).max()) if res["c_old"] else float("nan")
                img_old = pooled(src, old_pooled_rows)[1]
                d_p = float(np.nanmax(np.abs(img_old - img_new)))
                same_nan = bool((np.isnan(img_old) == np.isnan(img_new)).all())
                d_rows = float(np.abs(th_rows.image() - th_new.image()).max())
                print(f"  T = {T:,}: largest difference key blocks vs whole rows: overview image {d_rows:.1e}")
                print(f"  T = {T:,}: largest difference old vs new: overview image {d_th:.1e}, pooled matrix {d_p:.1e} "
                      f"(masked blocks the same: {same_nan})", flush=True)  # fmt: skip
            print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in res.items() if v) + f"; {load()}",
                  flush=True)  # fmt: skip

        def med(key):
            return statistics.median(v for v, _ in res[key]), " / ".join(ld for _, ld in res[key])

        (r_old, l_ro), (r_new, l_rn) = med("r_old"), med("r_new")
        (c_old, l_co), (c_new, l_cn) = med("c_old") if res["c_old"] else (float("nan"), "not run"), med("c_new")
        (p_old, l_po), (p_new, l_pn) = med("p_old"), med("p_new")
        at, l_at = med("sdpa")
        c_rows, l_cr = med("c_rows")
        print(f"T = {T:,} ({args.layers} layers, medians of {args.reps}):\n"
              f"  overview readable: old {r_old:.2f} s ({l_ro}), new {r_new:.2f} s ({l_rn}): {r_old / r_new:.1f}x faster\n"
              f"  overview complete: old {c_old:.1f} s = {1e9 * c_old / cells:.2f} ns/cell ({l_co}), new {c_new:.1f} s = "
              f"{1e9 * c_new / cells:.2f} ns/cell ({l_cn}): {c_old / c_new:.2f}x faster\n"
              f"  overview complete in whole rows (every row as a masked one, the path before key blocks): {c_rows:.1f} s "
              f"({l_cr}): key blocks {c_rows / c_new:.2f}x faster\n"
              f"  sdpa attention of the same layers {at:.1f} s ({l_at}): complete / sdpa old {c_old / at:.2f}x, "
              f"whole rows {c_rows / at:.2f}x, new {c_new / at:.2f}x\n"
              f"  one head's pooled matrix: old {p_old:.2f} s ({l_po}), new {p_new:.2f} s ({l_pn}): "
              f"{p_old / p_new:.1f}x faster", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
