"""The view-sized reads (core/tiles.py) against the attention equation written out here in float64.

The overview's binned sums, one head's pooled rows and a block of cells are computed in row chunks,
in a reused buffer, reduced in torch and (the overview) over layers on several threads; each must
still be the model's numbers: checked on GPT-2 (multi-head), Llama (grouped-query) and Gemma 2
(soft-cap, sliding windows: a mask that is not plain causal).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector.core.pooling as pooling
from gpt_inspector import Session
from gpt_inspector.core.pooling import Thumbnails

PROMPT = "She eats an apple. He reads a book every evening and she writes long letters to him."
FAMILIES = ["gpt2", "llama", "gemma2"]


@pytest.fixture(scope="module")
def runs(tiny_dir):
    from gpt_inspector import load_model

    out = {}
    for family in FAMILIES:
        s = Session(load_model(tiny_dir[family], device="cpu"), PROMPT)
        s.run(3)
        out[family] = s
    return out


def written_out(s, layer: int, kind: str) -> np.ndarray:
    """(H, T, T) float64: the equation by hand from q, K and the mask; masked cells NaN from masked_scores on."""
    q = s.queries(layer).double().numpy()  # (H, T, d)
    k = s.keys(layer).double().numpy()  # (Hkv, T, d)
    k = k[[s.kv_head_of(h, layer) for h in range(s.n_heads)]]  # (H, T, d): each query head's KV head
    x = np.einsum("htd,hsd->hts", q, k)  # (H, T, T)
    if kind == "raw":
        return x
    x = x * s.scaling(layer)
    cap = s.softcap(layer)
    if cap is not None:
        x = np.tanh(x / cap) * cap
    if kind == "scores":
        return x
    allowed = np.stack([s.allowed(layer, h) for h in range(s.n_heads)])  # (H, T, T)
    x = np.where(allowed, x, -np.inf)
    if kind == "probs":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        x = e / e.sum(axis=-1, keepdims=True)
    return np.where(allowed, x, np.nan)


def binned(probs: np.ndarray, p0: int, p1: int, size: int) -> np.ndarray:
    """(H, row bins from p0 // size, key bins) float64: rows p0..p1 summed into size x size bins."""
    p = np.nan_to_num(probs[:, p0:p1, :p1])  # (H, n, p1): rows never attend past themselves
    rows = np.arange(p0, p1) // size - p0 // size
    keys = np.arange(p1) // size
    out = np.zeros((p.shape[0], rows[-1] + 1, keys[-1] + 1))
    for i, r in enumerate(rows):
        for j in range(keys[-1] + 1):
            out[:, r, j] += p[:, i, keys == j].sum(axis=1)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_overview_bins_are_the_equation_binned_in_chunks_and_on_threads(runs, family, monkeypatch):
    s = runs[family]
    t = s.cache_length
    want = {layer: written_out(s, layer, "probs") for layer in range(s.n_layers)}
    cases = [(0, t, 1), (0, t, 4), (t - 1, t, 8), (5, t - 3, 4), (9, 10, 16)]
    for p0, p1, size in cases:
        got = s.overview_bins(p0, p1, size)
        for layer in range(s.n_layers):
            np.testing.assert_allclose(got[layer], binned(want[layer], p0, p1, size), rtol=1e-5, atol=1e-6)
    # row chunks of three (several per row bin, and chunks across row bins) and layers on two threads
    monkeypatch.setattr(pooling, "ROWS_BUDGET", 3 * s.n_heads * t)
    one = [s.overview_bins(p0, p1, size) for p0, p1, size in cases]
    with pooling.torch_threads(2):
        two = [s.overview_bins(p0, p1, size) for p0, p1, size in cases]
    for (p0, p1, size), a, b in zip(cases, one, two):
        np.testing.assert_array_equal(a, b)  # each layer is computed alone either way: the same bits
        for layer in range(s.n_layers):
            np.testing.assert_allclose(a[layer], binned(want[layer], p0, p1, size), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "p0, n, size, key_block, cells, cap",
    [
        (0, 40, 4, 8, 0, None),  # blocks of two bins, the last one longer (it starts at or before p0)
        (17, 9, 5, 8, 0, None),  # a bin that is no power of two, a block size that is no multiple of it
        (30, 6, 16, 4, 0, 2.5),  # bins longer than a block (blocks inside one bin) and a soft-cap
        (30, 6, 12, 5, 0, None),  # bins longer than a block and no multiple of it: one bin per block
        (3, 2, 4, 4, 64, None),  # few rows: longer blocks to hold ``cells``
        (50, 14, 64, 1024, 0, None),  # one block
        (40, 1, 8, 1024, 0, 2.0),  # a step's newest row: few rows, the keys as the product's rows
        (37, 2, 8, 4, 0, None),  # two newest rows: the causal mask in that layout
    ],
)
def test_causal_bin_mass_is_the_softmax_binned(p0, n, size, key_block, cells, cap):
    """attention.causal_bin_mass (the overview's plain causal rows, key block by key block) against the
    equation written out in float64 over whole rows, with rows far from uniform (large scores)."""
    from gpt_inspector.core.attention import causal_bin_mass

    g, d, t = 3, 8, p0 + n
    gen = torch.Generator().manual_seed(p0 + n)
    q, k = torch.randn(g, n, d, generator=gen) * 2, torch.randn(t + 5, d, generator=gen) * 2
    scaling = d**-0.5
    x = np.einsum("gnd,td->gnt", q.double().numpy(), k[:t].double().numpy()) * scaling  # (g, n, t)
    if cap is not None:
        x = np.tanh(x / cap) * cap
    x = np.where(np.arange(t)[None, :] <= np.arange(p0, t)[:, None], x, -np.inf)  # causal
    e = np.exp(x - x.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)  # (g, n, t)
    bins = np.arange(t) // size
    want = np.stack([probs[..., bins == b].sum(-1) for b in range(bins[-1] + 1)], axis=-1)  # (g, n, key bins)
    work = torch.full((4,), float("nan"))  # too short: grown, and never read before it is written
    got = causal_bin_mass(q, k[:t], scaling, cap, p0, size, key_block, cells, work)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("few_rows", [0, 8])
@pytest.mark.parametrize("family", [*FAMILIES, "qwen2"])
def test_the_overview_takes_key_blocks_where_rows_are_plain_causal(runs, tiny_dir, family, few_rows, monkeypatch):
    """Plain causal layers go through ``causal_bin_mass`` in blocks of a few keys here (as many as at
    32k), or (``few_rows``) two rows at a time with the keys as the product's rows; sliding-window
    rows (Gemma 2's odd layers past the window) and mask edits take whole rows."""
    import gpt_inspector.core.attention as eq
    import gpt_inspector.core.tiles as tiles
    from gpt_inspector import load_model
    from gpt_inspector.core.edits import MaskEdit

    s = runs.get(family) or Session(load_model(tiny_dir[family], device="cpu"), PROMPT)
    if family not in runs:
        s.run(3)
    monkeypatch.setattr(tiles, "KEY_BLOCK", 3)
    monkeypatch.setattr(tiles, "BLOCK_NUMBERS", 4 * 3 * 2)  # two rows of four heads per block of three keys
    monkeypatch.setattr(eq, "FEW_ROWS", few_rows)
    blocked = []
    real = eq.causal_bin_mass
    # the keys each call reads name the layer and KV head it is for
    monkeypatch.setattr(eq, "causal_bin_mass", lambda *a, **kw: blocked.append(a[1].data_ptr()) or real(*a, **kw))
    t = s.cache_length
    for edits in ([], [MaskEdit(t - 2, 3, layer=1)]):
        s.set_mask_edits(edits)
        want = {layer: written_out(s, layer, "probs") for layer in range(s.n_layers)}
        for p0, p1, size in [(0, t, 4), (t - 7, t, 2), (5, 6, 8)]:
            blocked.clear()
            got = s.overview_bins(p0, p1, size)
            for layer in range(s.n_layers):
                np.testing.assert_allclose(got[layer], binned(want[layer], p0, p1, size), rtol=1e-5, atol=1e-6)
            plain = [layer for layer in range(s.n_layers) if s.plain_causal(layer, p0, p1)]
            if family == "gemma2" and p1 == t:
                assert len(plain) < s.n_layers  # a sliding-window layer's rows past its window
            if edits and p1 == t:
                assert 1 not in plain
            keys = {s.records.keys(layer)[kv].data_ptr() for layer in plain for kv in range(s.n_kv_heads)}
            assert set(blocked) == keys  # every plain layer took the blocks, the others whole rows
    s.set_mask_edits([])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["raw", "scores", "masked_scores", "probs"])
def test_pooled_rows_and_blocks_are_the_equation(runs, family, kind):
    s = runs[family]
    t = s.cache_length
    layer, head = s.n_layers - 1, s.n_heads - 1
    full = written_out(s, layer, kind)[head]  # (T, T), NaN where masked from masked_scores on
    for p0, p1, block in [(0, t, 1), (4, t, 4), (8, 16, 8), (0, t, 3)]:
        keys = min(t, -(-p1 // block) * block)
        got = s.pooled_rows(layer, head, kind, p0, p1, keys, block)
        cells = full[p0:p1, :keys]
        nr, nc = -(-cells.shape[0] // block), -(-keys // block)
        pad = np.full((nr * block, nc * block), -np.inf)
        pad[: cells.shape[0], :keys] = np.nan_to_num(cells, nan=-np.inf)
        want = pad.reshape(nr, block, nc, block).max(axis=(1, 3))
        want[np.isneginf(want)] = np.nan
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for p0, p1, k0, k1 in [(t - 6, t, 0, 9), (3, 9, 2, t), (t - 4, t, t - 4, t)]:
        got = s.attention_block(layer, head, kind, p0, p1, k0, k1)
        np.testing.assert_allclose(got, full[p0:p1, k0:k1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_rows_computed_in_a_work_buffer_are_the_same_bits(runs, family):
    s = runs[family]
    t = s.cache_length
    work = torch.full((s.n_heads * t * t,), float("nan"))
    for kind in ("raw", "scores", "masked_scores", "probs"):
        for heads in (None, (1,), (0, s.n_heads - 1)):
            for p0, p1, keys in [(0, t, None), (t - 5, t, t), (3, 11, 11)]:
                a = s.attention_rows(1, p0, p1, kind, heads=heads, keys=keys)
                b = s.attention_rows(1, p0, p1, kind, heads=heads, keys=keys, work=work)
                assert torch.equal(a, b), (kind, heads, p0, p1)


def test_the_first_rows_streamed_give_every_bin_one_row_then_chunks_then_runs(runs, monkeypatch):
    s = runs["llama"]
    t = s.cache_length
    monkeypatch.setattr(pooling, "CHUNK_ROWS", 2)
    th = Thumbnails(s.n_layers, s.n_heads, 4)
    th.extend(t)
    nb, size = th.bins, th.size
    assert nb == 4 and size >= 4
    order = []
    while not th.complete:
        chunks = th.pending(max_chunks=3)
        assert chunks
        for p0, p1 in chunks:
            th.add_bins(p0, p1, s.overview_bins(p0, p1, th.size))
            order.append((p0, p1))
    # one row of every bin first (their first rows), before any bin gets a second
    assert order[:nb] == [(b * size, b * size + 1) for b in range(nb)]
    # then a chunk of CHUNK_ROWS rows of every bin, the rest of it after the single row
    assert order[nb : 2 * nb] == [(b * size + 1, b * size + 2) for b in range(nb)]
    # every row exactly once, and the overview the one-pass sums
    rows = np.concatenate([np.arange(p0, p1) for p0, p1 in order])
    assert sorted(rows.tolist()) == list(range(t))
    one = Thumbnails(s.n_layers, s.n_heads, 4)
    one.extend(t)
    one.add_bins(0, t, s.overview_bins(0, t, one.size))
    np.testing.assert_allclose(th.image(), one.image(), atol=1e-6)


def test_runs_after_the_refinement_hold_about_the_same_work_each(monkeypatch):
    """Once every bin has a chunk, the rest comes in runs of about FILL_NUMBERS rows x keys x heads:
    longer early (rows there read fewer keys), never shorter than CHUNK_ROWS, every row once."""
    monkeypatch.setattr(pooling, "FILL_NUMBERS", 4 * 64 * 64)
    th = Thumbnails(2, 4, 4)
    th.extend(256)
    th.counts[: th.bins] = pooling.CHUNK_ROWS  # as if the refinement had run (no row added yet)
    runs = th.pending()
    assert sorted(p for a, b in runs for p in range(a, b)) == list(range(256))
    sizes = [b - a for a, b in runs]
    # 64 rows x 64 keys x 4 heads first; the last run is what the runs before it leave
    assert sizes[0] == 64 and sizes[-2] == pooling.CHUNK_ROWS and sizes == sorted(sizes, reverse=True)
    for a, b in runs:
        assert (b - a) * b * th.H <= pooling.FILL_NUMBERS or b - a <= pooling.CHUNK_ROWS


def test_a_nan_cell_counts_as_masked_in_pooled_rows(runs):
    """A broken model's NaN (here one query row) is left out of its block's maximum, as pool_max leaves it."""
    from gpt_inspector.core.pooling import pool_max
    from gpt_inspector.core.source import RunRecords, RunSource

    s = runs["llama"]
    t = s.cache_length
    q = [s.queries(i).clone() for i in range(s.n_layers)]
    q[1][2, 5, 0] = float("nan")  # head 2, query row 5: every cell of that row is NaN

    class Records(RunRecords):
        head_output_start, edits = 0, None

        def queries(self, layer):
            return q[layer]

        def keys(self, layer):
            return s.keys(layer)

        def values(self, layer):
            return s.values(layer)

        def head_outputs(self, layer):
            return s.head_outputs(layer)

        def mask_rows(self, layer):
            return s.mask_rows(layer)

        def scaling(self, layer):
            return s.scaling(layer)

        def softcap(self, layer):
            return s.softcap(layer)

    class Broken(RunSource):
        n_layers, n_heads, n_kv_heads, head_dim = s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
        cache_length, kv_itemsize, cache_dtype = t, 4, "float32"
        records = Records()

    b = Broken()
    for kind in ("raw", "probs"):
        cells = b.attention_rows(1, 0, t, kind, heads=(2,))[0].numpy()  # (T, T)
        assert np.isnan(cells[5]).all() and not np.isnan(np.delete(cells, 5, axis=0)).any()
        hidden = ~b.allowed_rows(1, 0, t)[2].numpy() if kind == "probs" else np.zeros(cells.shape, bool)
        pv, pm = pool_max(cells, hidden, 4, 4)
        want = np.where(pm, np.nan, pv)
        got = b.pooled_rows(1, 2, kind, 0, t, t, 4)
        assert not np.isnan(got[1, 0])  # the block of row 5: the maximum of rows 4, 6 and 7
        np.testing.assert_array_equal(got, want.astype(np.float32))
