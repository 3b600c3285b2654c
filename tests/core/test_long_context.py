"""Capture costs that must stay flat in T: no K/V copies per query head, no T x T mask where sdpa
needs none, record buffers that grow without re-copying everything every few steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpt_inspector as gi
from gpt_inspector.core import capture, rowbuffer
from gpt_inspector.core.rowbuffer import RowBuffer

PROMPT = "One two three four five six"


def test_record_buffer_grows_geometrically_and_keeps_every_row():
    buf = RowBuffer()
    rows = torch.randn(1, 2, 3000, 4)  # (B, H, T, d)
    reallocations, ptr = 0, None
    for p in range(rows.shape[2]):
        buf.write(rows[:, :, p : p + 1], p)
        if buf.t.data_ptr() != ptr:
            reallocations, ptr = reallocations + 1, buf.t.data_ptr()
    assert torch.equal(buf.view(3000), rows)
    # growing by a fixed 64 positions would reallocate (and re-copy all) 47 times; by a quarter, ~15
    assert reallocations <= 16
    assert buf.t.shape[2] <= 1.25 * 3000 + 2 * rowbuffer._GROW  # capacity stays close to what is held


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (GPT_INSPECTOR_TEST_DEVICE=cuda runs)")
def test_rows_from_a_gpu_land_in_order_when_read():
    # rows from the GPU are staged and placed on the first read: through regrowth (which places what
    # is staged first) and rows written twice (an undone forward's, then the redo's), the buffer
    # holds what a CPU buffer given the same writes holds
    g = torch.Generator().manual_seed(0)
    gpu, cpu = RowBuffer(), RowBuffer()
    writes = [
        (torch.randn(1, 2, n, 4, generator=g), p)
        for p, n in [(0, 5), (5, 1), (6, 1), (6, 1), (7, 90), (40, 3), (97, 1)]
    ]
    for i, (rows, p) in enumerate(writes):
        gpu.write(rows.cuda(), p)
        cpu.write(rows, p)
        if i == 3:
            assert torch.equal(gpu.view(7), cpu.view(7))  # a read in between places what is staged
    # a restore writes CPU rows over staged ones: the restored rows win
    gpu.write(writes[-1][0].cuda(), 50)
    back = torch.randn(1, 2, 1, 4, generator=g)
    gpu.write(back, 50)
    cpu.write(back, 50)
    assert torch.equal(gpu.view(98), cpu.view(98))


def test_plain_causal_forwards_build_no_mask(tiny_lm, monkeypatch):
    """Prefill and decode of an unpadded run hand the attention no mask (sdpa's is_causal does it)."""
    lm = tiny_lm("llama")
    seen, built = [], []
    real_mask, real_causal = capture.inspector_mask, capture.kernel.causal_additive

    def spy_mask(*a, **k):
        m = real_mask(*a, **k)
        seen.append(m)
        return m

    monkeypatch.setattr(capture.kernel, "causal_additive", lambda *a: built.append(a) or real_causal(*a))
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(capture.ATTN_NAME, spy_mask)
    try:
        s = gi.Session(lm, PROMPT)
        s.run(3)
        assert seen and all(m is None for m in seen)
        assert built == []
        # a recompute from position 2 over a kept prefix hands the model the real lower-right causal mask
        # (the attention then runs without it: tests/core/test_causal_after_cache.py)
        s.set_mask_edits([gi.MaskEdit(query=2, key=1, layer=0)])
        assert any(m is not None for m in seen)
    finally:
        AttentionMaskInterface.register(capture.ATTN_NAME, capture.inspector_mask)


def test_sliding_window_in_reach_is_still_materialised(tiny_lm):
    """gemma2's window (4) bites on a longer prompt: the mask must reach the attention and the records."""
    lm = tiny_lm("gemma2")
    s = gi.Session(lm, PROMPT + " seven eight nine ten")
    s.run(2)
    windowed = [layer for layer in range(lm.n_layers) if s.recorder.mask_rows[layer]]
    assert windowed  # some layer recorded rows that are not plain causal


@pytest.mark.parametrize("tq", [1, 5])
def test_grouped_query_sdpa_equals_expanded_kv(tq):
    """enable_gqa reads the KV head of each query-head group; the numbers are those of repeating K/V."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, tq, 16, generator=g) * 3  # (B, H, Tq, d)
    k = torch.randn(1, 2, 40, 16, generator=g) * 3  # (B, Hkv, Tk, d)
    v = torch.randn(1, 2, 40, 16, generator=g)

    class Layer:
        layer_idx = None

    out, _ = capture.inspector_attention(Layer(), q, k, v, None, scaling=0.25)  # (B, Tq, H, d)
    mask = capture.causal_additive(tq, 40, q.dtype, q.device)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                         attn_mask=mask, scale=0.25).transpose(1, 2)  # fmt: skip
    # float32 rounding of a different reduction order (packed rows in decode), far below any real difference
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _state(s):
    """Everything a recompute touches, copied: tokens, step logits, cache, records, derived attention."""
    layers = range(s.n_layers)
    return {
        "tokens": list(s.tokens),
        "logits": [st.logits.clone() for st in s.steps_done],
        "kv": [(l.keys.clone(), l.values.clone()) for l in s.cache.layers],
        "qkv": [x for layer in layers for x in s.qkv(layer)],
        "out": [s.attention_output(layer) for layer in layers],
        "probs": [s.attention(layer, h) for layer in layers for h in range(s.n_heads)],
        "edits": s.mask_edits,
        "length": s.recorder.length,
    }


def _assert_same(a, b, exact=True):
    assert a["tokens"] == b["tokens"] and a["edits"] == b["edits"] and a["length"] == b["length"]
    check = torch.testing.assert_close if not exact else (lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=0))
    for x, y in zip(a["logits"], b["logits"]):
        check(x, y)
    for (k1, v1), (k2, v2) in zip(a["kv"], b["kv"]):
        check(k1, k2), check(v1, v2)
    for key in ("qkv", "out", "probs"):
        for x, y in zip(a[key], b[key]):
            check(torch.as_tensor(x), torch.as_tensor(y))


def test_chunked_recompute_reports_progress_and_equals_one_forward(tiny_lm, monkeypatch):
    from gpt_inspector.core import recompute

    lm = tiny_lm("llama")
    one, chunked = gi.Session(lm, PROMPT), gi.Session(lm, PROMPT)
    for s in (one, chunked):
        s.run(8)
    edits = [gi.MaskEdit(query=2, key=1, layer=1), gi.MaskEdit(query=9, key=4, head=3)]
    one.set_mask_edits(edits)
    seen = []
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 3)
    report = chunked.set_mask_edits(edits, progress=lambda done, total: seen.append((done, total)))
    total = chunked.cache_length - 2
    assert report.earliest_position == 2 and report.recomputed == total
    assert seen == [(min(d, total), total) for d in range(3, total + 3, 3)]
    # the same numbers as one forward over the span, to float32 rounding (chunks change matmul shapes)
    _assert_same(_state(chunked), _state(one), exact=False)
    assert one.current.probs.argmax() == chunked.current.probs.argmax()
    # and the edited cells really are blocked, in the chunk that held them
    assert chunked.attention(1, 0)[2, 1] == 0 and chunked.attention(0, 3)[9, 4] == 0


@pytest.mark.parametrize("stop_after", [0, 1, 2])
def test_cancel_puts_the_session_back_exactly(tiny_lm, monkeypatch, stop_after):
    from gpt_inspector.core import recompute
    from gpt_inspector.core.errors import Cancelled

    lm = tiny_lm("llama")
    s, ref = gi.Session(lm, PROMPT), gi.Session(lm, PROMPT)
    for x in (s, ref):  # ref: a session that never sees the cancelled edit
        x.run(6)
        x.set_mask_edits([gi.MaskEdit(query=4, key=0)])
    before = _state(s)
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 3)
    chunks = []
    with pytest.raises(Cancelled):
        s.set_mask_edits([gi.MaskEdit(query=1, key=0, layer=0)], progress=lambda d, t: chunks.append(d),
                         cancelled=lambda: len(chunks) >= stop_after)  # fmt: skip
    assert len(chunks) == stop_after
    _assert_same(_state(s), before)
    # and it goes on exactly as a session that never saw the cancelled edit
    s.run(2), ref.run(2)
    _assert_same(_state(s), _state(ref))


def test_a_fault_halfway_through_a_recompute_puts_the_session_back_exactly(tiny_lm, monkeypatch):
    from gpt_inspector.core import recompute
    from gpt_inspector.core.errors import StepFailed

    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(6)
    before = _state(s)
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 4)
    real, calls = lm.model.forward, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(lm.model, "forward", failing)
    with pytest.raises(StepFailed):
        s.set_mask_edits([gi.MaskEdit(query=1, key=0)])
    monkeypatch.undo()
    assert len(calls) == 2
    _assert_same(_state(s), before)


def test_torch_without_enable_gqa_repeats_kv_and_records_the_kv_heads(tiny_lm, monkeypatch):
    """torch < 2.5 has no enable_gqa: K/V are repeated for the kernel, the records keep the KV heads."""
    lm = tiny_lm("llama")
    ref = gi.Session(lm, PROMPT)
    ref.run(3)
    monkeypatch.setattr(capture.kernel, "_SDPA_GQA", False)
    real = F.scaled_dot_product_attention

    def old_sdpa(*a, **k):
        assert "enable_gqa" not in k
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", old_sdpa)
    s = gi.Session(lm, PROMPT)
    s.recorder = capture.Recorder(lm.n_layers, mirror_kv=True)  # the accelerator path records K/V itself
    s.run(3)
    assert s.tokens == ref.tokens
    for layer in range(lm.n_layers):
        k, v = s.recorder.k[layer].view(s.cache_length), s.recorder.v[layer].view(s.cache_length)
        assert k.shape[1] == lm.n_kv_heads and torch.equal(k, s.cache.layers[layer].keys.cpu())
        assert torch.equal(v, s.cache.layers[layer].values.cpu())
        torch.testing.assert_close(
            torch.as_tensor(s.attention_output(layer)), torch.as_tensor(ref.attention_output(layer))
        )
