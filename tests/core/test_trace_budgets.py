"""Small hostile traces are refused at load in one line, and the math check streams a long trace
instead of building (H, T, T) float64 at once (issue 33)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import save_file

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.core import mathcheck
from gpt_inspector.core.trace import FORMAT


def _trace(path, heads=2, T=1, labels=None, model="tiny", v=None, out=None, text=None):
    """A whole, valid trace written by hand: one layer, one KV head, head size 1, no steps."""
    labels = ["a"] * T if labels is None else labels
    text = "".join(labels) if text is None else text
    shape = dict(n_layers=1, n_heads=heads, n_kv_heads=1, head_dim=1, context_length=T + 1, vocab_size=8)
    meta = {"format": FORMAT, "model": model, "prompt": text, "text": text, "seed": "0",
            "prompt_length": str(T), "shape": json.dumps(shape), "decoding": json.dumps({"temperature": 0.0}),
            "mask_edits": "[]", "token_labels": json.dumps(labels), "steps": "[]", "scaling": "[1.0]"}  # fmt: skip
    f32 = np.float32
    v = np.ones((1, T, 1), f32) if v is None else v
    tensors = {"tokens": np.arange(T, dtype=np.int64) % 8, "layers.0.q": np.zeros((heads, T, 1), f32),
               "layers.0.k": np.zeros((1, T, 1), f32), "layers.0.v": v,
               "layers.0.attn_out": np.ones((heads, T, 1), f32) if out is None else out}  # fmt: skip
    save_file(tensors, str(path), metadata=meta)
    return path


def test_a_plain_hand_written_trace_opens(tmp_path):
    tr = gi.load_trace(_trace(tmp_path / "ok.safetensors", heads=4, T=3, labels=["ab", "c", "d" * 1000]))
    assert tr.n_heads == 4 and tr.token_labels()[2] == "d" * 1000  # the ceilings leave real traces alone


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(heads=4096), "4,096 heads"),  # 33 KB on disk
        (dict(T=1, labels=["x" * 60_000_000], text="x"), "token label is 60,000,000"),
        (dict(T=8, labels=["x" * 1_000_000] * 8), "token label is 1,000,000"),
        (dict(model="m" * 10_000), "name is 10,000 characters"),
    ],
    ids=["4096-heads", "60MB-label", "8x1MB-labels", "long-name"],
)
def test_absurd_traces_are_refused_at_load_in_one_line(tmp_path, capsys, kw, words):
    path = _trace(tmp_path / "hostile.safetensors", **kw)
    with pytest.raises(gi.InspectorError, match=words) as e:
        gi.load_trace(path)
    assert "\n" not in str(e.value)
    assert main(["math-check", "--trace", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def _uniform_trace(tmp_path, T, heads=2):
    """q and K zero: every head spreads its weight evenly over the keys it may see, so the output at
    position t is mean(v[0..t]), computed here in float64 as the model's own record."""
    rng = np.random.default_rng(0)
    v = rng.normal(size=(1, T, 1))  # (1, T, 1)
    out = np.cumsum(v[0, :, 0]) / np.arange(1, T + 1)  # (T,)
    out = np.broadcast_to(out[None, :, None], (heads, T, 1)).astype(np.float32).copy()  # (H, T, 1)
    return _trace(tmp_path / "long.safetensors", heads=heads, T=T, v=v.astype(np.float32), out=out), out


def test_check_every_head_streams_a_long_trace(tmp_path, monkeypatch):
    T, H = 4096, 2
    path, out = _uniform_trace(tmp_path, T, H)
    monkeypatch.setattr(mathcheck, "BLOCK_BYTES", 16 << 20)
    tr = gi.load_trace(path)
    tracemalloc.start()
    try:
        report = mathcheck.check_all(tr)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok and report.n_positions == T and report.max_abs_diff < 1e-6
    # one (H, T, T) float64 array alone is 268 MB; the streamed check stays near its block budget
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"


def test_a_streamed_check_still_finds_the_one_wrong_row(tmp_path, monkeypatch):
    T = 600
    path, out = _uniform_trace(tmp_path, T)
    bad = out.copy()
    bad[1, 457, 0] += 0.01  # a row in a later block than the first
    rng_v = gi.load_trace(path).values(0).numpy()  # (1, T, 1)
    path = _trace(tmp_path / "bad.safetensors", heads=2, T=T, v=rng_v, out=bad)
    monkeypatch.setattr(mathcheck, "BLOCK_BYTES", 1 << 20)  # several row blocks
    assert mathcheck._blocks(2, T, 1)[1] < 457
    report = mathcheck.check_all(gi.load_trace(path))
    assert [f[:3] for f in report.failures()] == [(0, 1, 457)]
    assert report.max_diff[0, 1] == pytest.approx(0.01, rel=1e-3)
