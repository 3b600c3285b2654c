"""One head at full resolution (figures.fullres): every cell its own pixels in a PNG, the T x T image in
SVG and PDF, pooled with the block size named past the cell limit. Checked by decoding the written files'
colours back to values and comparing them with the run source's own matrix, computed independently."""

from __future__ import annotations

import base64
import io
import re
import xml.etree.ElementTree as ET

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread

from gpt_inspector import MaskEdit, Session, export, figures
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.figures import fullres

SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"
# matplotlib's own bytes for each of the 256 colormap entries, the colours a cell can have
LUT = matplotlib.colormaps[figures.CMAP_NAME](np.arange(256) / 255.0, bytes=True)[:, :3].astype(int)


@pytest.fixture(scope="module")
def session(tiny_lm):
    lm = tiny_lm("llama")  # GQA: 4 query heads over 2 KV heads
    ids = np.random.default_rng(0).integers(0, lm.vocab_size - 2, 58).tolist()
    s = Session(lm, prompt_ids=ids)
    s.run(2)
    s.set_mask_edits([MaskEdit(20, 3)])  # a masked cell below the diagonal, beside the causal ones
    assert s.cache_length > 7 * 8  # more positions than a 7-inch side has pixels at 8 dpi
    return s


def _expected(source, layer, head, kind):
    """(values, masked) of the whole matrix, from the source's own one-head accessors."""
    v = source.attention(layer, head, kind).astype(np.float64)
    masked = ~np.isfinite(v)
    if kind in ("masked_scores", "probs"):
        masked |= ~source.allowed(layer, head)
    return v, masked


def _block_max(v, masked, b):
    t = v.shape[0]
    n = -(-t // b)
    x = np.full((n * b, n * b), -np.inf)
    x[:t, :t] = np.where(masked, -np.inf, v)
    x = x.reshape(n, b, n, b).max(axis=(1, 3))
    return x, np.isneginf(x)


def _decode(rgb: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Cell colours back to values (the colormap entry's centre) and the masked-grey cells."""
    flat = rgb.reshape(-1, 3).astype(int)
    grey = (flat == np.array(figures.MASKED_RGB)).all(axis=1)
    dist = np.abs(flat[:, None, :] - LUT[None]).sum(axis=2)  # (cells, 256)
    assert (dist.min(axis=1)[~grey] == 0).all(), "a cell has a colour that is neither the colormap's nor masked"
    values = lo + (dist.argmin(axis=1) + 0.5) / 256 * (hi - lo)
    return values.reshape(rgb.shape[:2]), grey.reshape(rgb.shape[:2])


def _check_cells(rgb, want, want_masked, lo, hi):
    got, grey = _decode(rgb, lo, hi)
    np.testing.assert_array_equal(grey, want_masked)
    # one colormap entry spans (hi - lo) / 256; two entries share a colour in bytes, so 1.5 entries
    tol = 1.5 * (hi - lo) / 256 + 1e-6
    err = np.abs(got - want)[~want_masked]
    assert err.max() <= tol, (err.max(), tol)


def _png(data: bytes) -> np.ndarray:
    return np.rint(imread(io.BytesIO(data), format="png")[..., :3] * 255).astype(int)


def _heatmap_pixels(fig, img, n, p, dpi):
    """The n*p x n*p pixels from cell (0, 0)'s top-left corner, the corner found through the figure's axes."""
    x, y = figures.cell_center(fig, -0.5, -0.5, dpi)  # position -0.5: the edge of the first cell
    x0, y0 = round(x), round(y)
    assert abs(x - x0) < 1e-3 and abs(y - y0) < 1e-3, "the heatmap starts on a whole pixel"
    return img[y0 : y0 + n * p, x0 : x0 + n * p]


@pytest.mark.parametrize("kind", ["probs", "scores", "masked_scores"])
@pytest.mark.parametrize("dpi", [8.0, 200.0])  # 8: cells below a pixel in the usual figure; 200: p x p pixels each
def test_png_has_whole_pixels_per_cell_in_the_models_colours(session, monkeypatch, kind, dpi):
    monkeypatch.setattr(fullres, "ROWS_BUDGET", 4 * session.n_heads * session.cache_length)  # 4 rows a chunk
    calls = []
    real = session.attention_rows
    monkeypatch.setattr(session, "attention_rows", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(session, "attention", None)  # the whole-matrix path is never taken
    t, layer, head = session.cache_length, 1, 3
    fig = figures.head_figure(session, layer, head, kind, dpi=dpi, full_resolution=True)
    monkeypatch.undo()
    assert calls and max(p1 - p0 for p0, p1 in calls) == 4 and max(p1 for _, p1 in calls) == t
    p = int(7.0 * dpi // t) or 1
    if dpi < 10:
        assert figures.head_figure(session, layer, head, kind, dpi=dpi).pool > 1, "the usual figure would pool here"
        assert p == 1
    else:
        assert p > 1
    assert fig.pool == 1 and fig.full_resolution and "full resolution" in fig.subheading
    img = _png(figures.to_bytes(fig, "png", dpi))
    cells = _heatmap_pixels(fig, img, t, p, dpi)
    # every pixel of a cell's p x p block has the cell's colour
    blocks = cells.reshape(t, p, t, p, 3)
    assert (blocks == blocks[:, :1, :, :1]).all()
    want, masked = _expected(session, layer, head, kind)
    lo, hi = figures.value_range([(want[~masked].min(), want[~masked].max())], kind)
    assert masked[20, 3] == (kind != "scores")
    _check_cells(blocks[:, 0, :, 0], want, masked, lo, hi)
    with pytest.raises(AssertionError):  # the check tells rows from columns
        _check_cells(blocks[:, 0, :, 0].transpose(1, 0, 2), want, masked, lo, hi)


def test_past_the_cell_limit_it_pools_and_names_the_block(session, monkeypatch):
    monkeypatch.setattr(fullres, "MAX_CELLS", 16)
    t, b = session.cache_length, -(-session.cache_length // 16)
    fig = figures.head_figure(session, 0, 1, "probs", dpi=100, full_resolution=True)
    assert fig.pool == b > 1 and f"pooled {b}×{b} (block maximum)" in fig.subheading
    assert "full resolution stops at 16 positions" in fig.subheading
    n = -(-t // b)
    p = int(min(max(n * 0.28, 2.0), 7.0) * 100 // n)  # as many whole pixels as the usual side allows
    assert fullres.png_layout(t, 100) == (b, n, p)
    img = _png(figures.to_bytes(fig, "png", 100))
    blocks = _heatmap_pixels(fig, img, n, p, 100).reshape(n, p, n, p, 3)
    want, masked = _block_max(*_expected(session, 0, 1, "probs"), b)
    _check_cells(blocks[:, 0, :, 0], want, masked, 0.0, 1.0)


def _svg_image(svg: bytes, t: int) -> np.ndarray:
    """The embedded T x T image of the heatmap, rows top to bottom as drawn."""
    images = [e for e in ET.fromstring(svg).iter(f"{SVG}image") if e.get("width") == str(t)]
    assert len(images) == 1
    e = images[0]
    data = base64.b64decode(e.get(f"{XLINK}href").split(",", 1)[1])
    rgb = _png(data)
    assert rgb.shape[:2] == (t, t)  # unresampled
    d = float(re.match(r"matrix\(([-\d.e ]+)\)", e.get("transform")).group(1).split()[3])
    return rgb[::-1] if d < 0 else rgb  # matplotlib stores rows bottom-up and flips them when drawing


@pytest.mark.parametrize("kind", ["probs", "raw"])
def test_svg_and_pdf_embed_the_whole_matrix(session, tmp_path, kind):
    t = session.cache_length
    svg = export.render_heatmap(session, 1, 0, kind, tmp_path / "h.svg", full_resolution=True)
    want, masked = _expected(session, 1, 0, kind)
    lo, hi = figures.value_range([(want[~masked].min(), want[~masked].max())], kind)
    _check_cells(_svg_image(svg.read_bytes(), t), want, masked, lo, hi)
    texts = ["".join(e.itertext()) for e in ET.parse(svg).iter(f"{SVG}text")]
    assert any("full resolution" in x for x in texts)
    pdf = export.render_heatmap(session, 1, 0, kind, tmp_path / "h.pdf", full_resolution=True).read_bytes()
    sizes = re.findall(rb"/Subtype /Image /Width (\d+) /Height (\d+)", pdf)
    assert (str(t).encode(), str(t).encode()) in sizes
    # without the option the vector files keep the pooled picture: no T x T image at this density
    fig = figures.head_figure(session, 1, 0, kind, dpi=8)
    assert fig.pool > 1 and not fig.full_resolution


def test_the_usual_figure_and_the_full_one_agree_where_nothing_pools(session, tmp_path):
    """At 200 dpi the usual figure draws every cell too: both PNGs show the same colours cell by cell."""
    dpi, t = 200.0, session.cache_length
    usual = figures.head_figure(session, 1, 2, "probs", dpi=dpi)
    full = figures.head_figure(session, 1, 2, "probs", dpi=dpi, full_resolution=True)
    a, b = _png(figures.to_bytes(usual, "png", dpi)), _png(figures.to_bytes(full, "png", dpi))
    assert usual.pool == 1
    for r, c in [(0, 0), (5, 2), (t - 1, t - 1), (t - 1, 0), (20, 3), (20, 4), (2, 30)]:
        xa, ya = figures.cell_center(usual, r, c, dpi)
        xb, yb = figures.cell_center(full, r, c, dpi)
        pa, pb = a[int(ya), int(xa)], b[int(yb), int(xb)]
        assert np.abs(pa - pb).max() <= 1, (r, c, pa, pb)


def test_a_full_resolution_figure_is_written_only_as_laid_out(session):
    fig = figures.head_figure(session, 0, 0, "probs", dpi=100, full_resolution=True)
    with pytest.raises(InspectorError, match="laid out for 100 dpi"):
        figures.to_bytes(fig, "png", 150)
    vec = figures.head_figure(session, 0, 0, "probs", full_resolution=True, vector=True)
    with pytest.raises(InspectorError, match="SVG or PDF"):
        figures.to_bytes(vec, "png")
    assert figures.to_bytes(vec, "pdf").startswith(b"%PDF-")
    # matplotlib's own savefig at another density still draws each cell (nearest), twice the pixels here
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=200)
    img, t = _png(buf.getvalue()), session.cache_length
    want, masked = _expected(session, 0, 0, "probs")
    centres = [figures.cell_center(fig, r, c, 200) for r in range(t) for c in range(t)]
    rgb = np.array([img[int(y), int(x)] for x, y in centres]).reshape(t, t, 3)
    _check_cells(rgb, want, masked, 0.0, 1.0)
    for f in (fig, vec):  # close lets go of the (T, T, 4) buffer now
        figures.close(f)
        assert all(a.rgba.size == 4 for a in f.axes[0].artists)


def test_a_source_with_whole_matrices_only_and_the_unverified_band(tmp_path):
    """A duck-typed source (attention and allowed, no row accessors) at full resolution; the red band
    moves the layout, and the cells still land on whole pixels."""
    from known_source import KnownSource

    src = KnownSource(t=30)
    src.unverified = "probe mismatch"
    fig = figures.head_figure(src, 1, 2, "masked_scores", dpi=100, full_resolution=True)
    assert fig.unverified == "probe mismatch" and "full resolution (23×23 pixels per cell)" in fig.subheading
    img = _png(export.render_heatmap(src, 1, 2, "masked_scores", tmp_path / "u.png", scale=1,
                                     full_resolution=True).read_bytes())  # fmt: skip
    assert img.shape[:2][::-1] == figures.pixel_size(fig, 100)
    blocks = _heatmap_pixels(fig, img, 30, 23, 100).reshape(30, 23, 30, 23, 3)
    assert (blocks == blocks[:, :1, :, :1]).all()
    v = src.attention(1, 2, "masked_scores").astype(np.float64)
    masked = ~src.allowed(1, 2) | ~np.isfinite(v)
    _check_cells(blocks[:, 0, :, 0], v, masked, float(v[~masked].min()), float(v[~masked].max()))


class WholeMatrices:
    """The session seen through the whole-matrix accessors only (no row chunks): the pooled figure's other path."""

    def __init__(self, s):
        self._s = s

    def __getattr__(self, name):
        if name in ("attention_rows", "allowed_rows"):
            raise AttributeError(name)
        return getattr(self._s, name)


@pytest.mark.parametrize("kind", ["probs", "masked_scores", "raw"])
def test_the_pooled_head_figure_from_row_chunks_matches_the_whole_matrix(session, monkeypatch, kind):
    monkeypatch.setattr(fullres, "ROWS_BUDGET", 6 * session.n_heads * session.cache_length)  # a few chunks
    calls = []
    real = session.attention_rows
    monkeypatch.setattr(session, "attention_rows", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    chunked = figures.head_figure(session, 1, 3, kind, dpi=8)
    monkeypatch.undo()
    whole = figures.head_figure(WholeMatrices(session), 1, 3, kind, dpi=8)
    assert len(calls) > 1 and max(p1 - p0 for p0, p1 in calls) <= 6
    assert chunked.pool == whole.pool > 1 and f"pooled {whole.pool}×{whole.pool}" in chunked.subheading
    assert (chunked.heading, chunked.subheading, chunked.has_masked) == (
        whole.heading,
        whole.subheading,
        whole.has_masked,
    )
    np.testing.assert_allclose(chunked.panel_values[0], whole.panel_values[0], rtol=1e-5, atol=1e-6)
    a, b = _png(figures.to_bytes(chunked, "png", 8)), _png(figures.to_bytes(whole, "png", 8))
    assert a.shape == b.shape and np.abs(a - b).max() <= 1
