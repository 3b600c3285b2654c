"""Full-resolution exports written in row bands (figures.stream) against the in-memory exporter they replace
(figures.head_figure(..., full_resolution=True) + figures.to_bytes, which holds the T x T cells and the
whole canvas): the same pixels, decoded, in PNG, SVG and PDF, with budgets shrunk so that every file is
written in many chunks, tiles and bands."""

from __future__ import annotations

import base64
import io
import re
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest
from PIL import Image

from gpt_inspector import MaskEdit, Session, export, figures
from gpt_inspector.figures import fullres, stream


@pytest.fixture(scope="module")
def sessions(tiny_lm):
    out = {}
    for family, n in (("llama", 41), ("gpt2", 29)):  # GQA and multi-head
        lm = tiny_lm(family)
        s = Session(lm, prompt_ids=np.random.default_rng(1).integers(0, lm.vocab_size - 2, n).tolist())
        s.run(1)
        out[family] = s
    out["llama"].set_mask_edits([MaskEdit(20, 3)])  # a masked cell below the diagonal
    return out


@pytest.fixture
def small_budgets(monkeypatch):
    """Chunks of 3 query rows, tiles of a few rows above and below the cells, bands of a few pixel rows."""

    def apply(source):
        monkeypatch.setattr(fullres, "ROWS_BUDGET", 3 * source.n_heads * source.cache_length)
        monkeypatch.setattr(stream, "TILE_BYTES", 1 << 18)  # a few tiles: each draws the figure again
        monkeypatch.setattr(stream, "BAND_BYTES", 1 << 14)

    return apply


def _old(source, layer, head, kind, fmt, dpi):
    fig = figures.head_figure(source, layer, head, kind, dpi=dpi, full_resolution=True, vector=fmt != "png")
    data = figures.to_bytes(fig, fmt, dpi)
    cells = next(a.rgba for a in fig.heatmaps[0].artists if isinstance(a, fullres.CellImage))  # rows bottom-up
    return data, cells, fig


def _rgba(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGBA"))


@pytest.mark.parametrize(
    "family, kind, scale",
    # 17, 1 (cells below a pixel in the usual figure), 13 and 5 pixels per cell
    [("llama", "masked_scores", 1.0), ("llama", "probs", 0.1), ("gpt2", "probs", 0.6), ("gpt2", "scores", 0.25)],
)
def test_png_has_the_in_memory_exporters_pixels(sessions, small_budgets, monkeypatch, tmp_path, family, kind, scale):
    s = sessions[family]
    small_budgets(s)
    calls = []
    real = s.attention_rows
    monkeypatch.setattr(s, "attention_rows", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(s, "attention", None)  # no whole matrix
    monkeypatch.setattr(fullres, "head_cells", None)  # no whole (T, T, 4) buffer
    path = export.render_heatmap(s, 1, 1, kind, tmp_path / "h.png", scale=scale, full_resolution=True)
    monkeypatch.undo()
    t = s.cache_length
    assert calls and max(b - a for a, b in calls) <= 3 and max(b for _, b in calls) == t
    # probabilities span [0, 1]: one pass over the rows; other kinds find their colour range first
    assert len(calls) == (-(-t // 3)) * (1 if kind == "probs" else 2)
    old, _, fig = _old(s, 1, 1, kind, "png", scale * figures.DPI)
    new = path.read_bytes()
    a, b = _rgba(old), _rgba(new)
    assert a.shape == b.shape and a.shape[:2][::-1] == figures.pixel_size(fig, scale * figures.DPI)
    np.testing.assert_array_equal(b, a)
    info = Image.open(io.BytesIO(new)).info
    assert info["Title"] == fig.heading and round(info["dpi"][0]) == round(scale * figures.DPI)


def test_png_past_the_cell_limit_and_from_a_whole_matrix_source(sessions, small_budgets, monkeypatch, tmp_path):
    """Pooled b x b past MAX_CELLS; a duck-typed source (whole matrices only) with the red UNVERIFIED band."""
    from known_source import KnownSource

    s = sessions["llama"]
    small_budgets(s)
    monkeypatch.setattr(fullres, "MAX_CELLS", 16)
    path = export.render_heatmap(s, 0, 2, "masked_scores", tmp_path / "p.png", scale=1, full_resolution=True)
    old, _, fig = _old(s, 0, 2, "masked_scores", "png", 100)
    assert fig.pool > 1
    np.testing.assert_array_equal(_rgba(path.read_bytes()), _rgba(old))
    src = KnownSource(t=30)
    src.unverified = "probe mismatch"
    path = export.render_heatmap(src, 1, 2, "raw", tmp_path / "k.png", scale=1, full_resolution=True)
    np.testing.assert_array_equal(_rgba(path.read_bytes()), _rgba(_old(src, 1, 2, "raw", "png", 100)[0]))


_IMAGE = re.compile(rb"<image [^>]*/>")


def _svg_images(svg: bytes):
    return [(m, _rgba(base64.b64decode(re.search(rb"base64,\s*([A-Za-z0-9+/=]+)", m.group(0)).group(1))))
            for m in _IMAGE.finditer(svg)]  # fmt: skip


@pytest.mark.parametrize("family, kind", [("llama", "probs"), ("gpt2", "raw")])
def test_svg_is_the_same_page_with_the_cells_streamed_in(sessions, small_budgets, tmp_path, family, kind):
    s = sessions[family]
    small_budgets(s)
    new = export.render_heatmap(s, 1, 1, kind, tmp_path / "h.svg", scale=0.5, full_resolution=True).read_bytes()
    old, cells, _ = _old(s, 1, 1, kind, "svg", 50)
    (mo, io_), (mn, in_) = [
        next((m, im) for m, im in _svg_images(x) if im.shape[0] == s.cache_length) for x in (old, new)
    ]
    # one image for the whole matrix (no bands to seam), every byte of the page around it matplotlib's
    assert sum(im.shape[0] == s.cache_length for _, im in _svg_images(new)) == 1
    assert new[: mn.start()] == old[: mo.start()] and new[mn.end() :] == old[mo.end() :]
    strip = [re.sub(rb'base64,\s*[A-Za-z0-9+/=]+|id="[^"]*"', b"", m.group(0)) for m in (mo, mn)]
    assert strip[0] == strip[1]  # size, placement (transform) and style as matplotlib wrote them
    np.testing.assert_array_equal(in_, io_)
    np.testing.assert_array_equal(in_, cells)  # rows bottom-up, as matplotlib embeds them


def _pdf_objects(pdf: bytes) -> dict[int, bytes]:
    """Every object by number, found through the cross-reference table (which must point at each)."""
    start = int(pdf[pdf.rindex(b"startxref") :].split()[1])
    m = re.match(rb"xref\n0 (\d+)\n", pdf[start:])
    assert m, "the startxref offset points at the table"
    table = pdf[start + m.end() :]
    offsets = {i: int(table[20 * i : 20 * i + 10]) for i in range(1, int(m.group(1)))}
    ends = sorted(offsets.values()) + [start]
    out = {}
    for i, off in offsets.items():
        assert pdf[off:].startswith(b"%d 0 obj" % i), i
        out[i] = pdf[off : ends[ends.index(off) + 1]]
    return out


def _pdf_cells(pdf: bytes, n: int) -> np.ndarray:
    """The n x n image XObject decoded: its Flate stream with PNG predictors is a PNG's IDAT data."""
    (obj,) = [o for o in _pdf_objects(pdf).values() if b"/Width %d /Height %d" % (n, n) in o]
    assert b"/ColorSpace /DeviceRGB" in obj and b"/Predictor 15 /Colors 3" in obj
    length = int(re.search(rb"/Length (\d+)", obj).group(1))
    data = obj[obj.index(b"stream\n") + 7 :][:length]
    zlib.decompress(data)  # a whole zlib stream, the length exact

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", n, n, 8, 2, 0, 0, 0))
    return np.asarray(Image.open(io.BytesIO(png + chunk(b"IDAT", data) + chunk(b"IEND", b""))))


@pytest.mark.parametrize("family, kind", [("llama", "masked_scores"), ("gpt2", "probs")])
def test_pdf_embeds_the_same_cells_and_rasterises_the_same(sessions, small_budgets, tmp_path, family, kind):
    s = sessions[family]
    small_budgets(s)
    t = s.cache_length
    new = export.render_heatmap(s, 0, 1, kind, tmp_path / "h.pdf", scale=0.5, full_resolution=True).read_bytes()
    old, cells, _ = _old(s, 0, 1, kind, "pdf", 50)
    np.testing.assert_array_equal(_pdf_cells(new, t), cells[::-1, :, :3])  # a PDF image's first row is its top
    assert new.count(b"/Subtype /Image /Width %d" % t) == 1
    if shutil.which("gs") is None:
        pytest.skip("Ghostscript is not installed: the pages were not rasterised")
    (tmp_path / "old.pdf").write_bytes(old)
    pages = [subprocess.run(["gs", "-q", "-dNOPAUSE", "-dBATCH", "-dSAFER", "-sDEVICE=png16m", "-r150",
                             "-sOutputFile=-", str(p)], capture_output=True, check=True, timeout=60).stdout
             for p in (tmp_path / "old.pdf", tmp_path / "h.pdf")]  # fmt: skip
    a, b = _rgba(pages[0]), _rgba(pages[1])
    assert a.shape == b.shape and a.shape[0] > 500
    np.testing.assert_array_equal(b, a)
