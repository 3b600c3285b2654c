"""Queries after a cache under plain causality (a recompute's chunks, a chat turn) run without a (Tq, Tk)
mask: q0 zero rows padding the triangle square, or the cached keys and the chunk's own keys as two
mask-free flash calls merged by their log-sum-exp. Both give the masked equation's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpt_inspector as gi
from gpt_inspector.core import capture
from gpt_inspector.core.capture import kernel


class _Layer:
    layer_idx = None  # a bare call: nothing recorded, no interventions


def _equation(q, k, v, scaling):
    """softmax(q Kᵀ · scaling + lower-right causal) V in float64, K/V repeated to every query head."""
    h, tq, tk = q.shape[1], q.shape[2], k.shape[2]
    k, v = (x.double().repeat_interleave(h // x.shape[1], 1) for x in (k, v))  # (B, H, Tk, d)
    scores = q.double() @ k.transpose(-1, -2) * scaling  # (B, H, Tq, Tk)
    allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]  # (Tq, Tk)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v  # (B, H, Tq, d_v)


def _plain_mask(tq, tk, dtype=torch.float32):
    """The additive mask inspector_mask builds after a cache, marked plain as it marks it."""
    m = kernel.causal_additive(tq, tk, dtype, torch.device("cpu"))  # (1, 1, Tq, Tk)
    setattr(m, kernel.PLAIN_CAUSAL, True)
    return m


def _inputs(h, hkv, tq, tk, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, tq, d, generator=g) * 2  # (B, H, Tq, d): far from uniform attention
    k = torch.randn(1, hkv, tk, d, generator=g) * 2  # (B, Hkv, Tk, d)
    v = torch.randn(1, hkv, tk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("q0,tq", [(2, 30), (7, 28), (40, 16), (300, 64), (1, 2)])
def test_a_chunk_after_a_cache_equals_the_masked_equation(heads, q0, tq, monkeypatch):
    q, k, v = _inputs(*heads, tq, q0 + tq)
    kernel._flash_reads_groups()  # its one check of the kernel runs before the spy counts calls
    calls = []
    flash = kernel._CPU_FLASH
    monkeypatch.setattr(kernel, "_CPU_FLASH", lambda *a, **kw: calls.append(a[4]) or flash(*a, **kw))
    out, _ = capture.inspector_attention(_Layer(), q, k, v, _plain_mask(tq, q0 + tq), scaling=0.3)  # (B, Tq, H, d)
    ref = _equation(q, k, v, 0.3).transpose(1, 2)  # (B, Tq, H, d)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)  # float32 rounding; a wrong mask is ~0.1
    # a short cache pads; a long one splits: the cached keys unmasked, the chunk's own top-left causal
    assert calls == ([] if 4 * q0 <= tq else [False, True])
    # and the masked call it stands for gives the same numbers
    masked = F.scaled_dot_product_attention(q, k.repeat_interleave(heads[0] // heads[1], 1),
                                            v.repeat_interleave(heads[0] // heads[1], 1),
                                            attn_mask=kernel.causal_additive(tq, q0 + tq, q.dtype, q.device), scale=0.3)  # fmt: skip
    torch.testing.assert_close(out, masked.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_split_merges_in_float32_or_wider(dtype):
    q0, tq = 50, 20
    q, k, v = _inputs(8, 2, tq, q0 + tq, dtype=dtype)
    out, _ = capture.inspector_attention(_Layer(), q, k, v, _plain_mask(tq, q0 + tq, dtype), scaling=0.25)
    ref = _equation(q, k, v, 0.25).transpose(1, 2)  # (B, Tq, H, d)
    masked = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                            attn_mask=kernel.causal_additive(tq, q0 + tq, dtype, q.device), scale=0.25)  # fmt: skip
    masked_err = (masked.transpose(1, 2).double() - ref).abs().max()
    err = (out.double() - ref).abs().max()
    assert out.dtype == dtype
    if dtype == torch.float64:
        assert err < 1e-12
    else:  # within one bfloat16 step (8 bits) of the largest output beyond the masked call's own error
        assert err <= masked_err + ref.abs().max() * 2**-7


def test_an_unmarked_or_wider_mask_is_applied_as_it_is(monkeypatch):
    """Only a mask marked plain over exactly these keys is dropped; any other goes to sdpa whole."""
    q0, tq = 40, 16
    q, k, v = _inputs(4, 4, tq, q0 + tq)
    monkeypatch.setattr(kernel, "_CPU_FLASH", None)  # the split would hide which mask ran
    mask = kernel.causal_additive(tq, q0 + tq, q.dtype, q.device).clone()
    top = int((q[0, :, 3] @ k[0, :, : q0 + 4].transpose(-1, -2)).sum(0).argmax())  # row 3's strongest key
    mask[..., 3, top] = torch.finfo(q.dtype).min  # not plain: one more cell blocked
    unmarked, _ = capture.inspector_attention(_Layer(), q, k, v, mask, scaling=0.3)
    assert unmarked[0, 3].sub(_equation(q, k, v, 0.3)[0, :, 3]).abs().max() > 1e-2  # the cell counted
    wider = _plain_mask(tq, q0 + tq + 5)  # plain over more keys than the call has: its slice is not causal
    call = kernel.Call(q, k, v, wider, 0.3)
    assert call.mask is not None and call.mask.shape[-1] == q0 + tq
    assert kernel.Call(q, k, v, _plain_mask(tq, q0 + tq), 0.3).mask is None


def test_no_flash_kernel_falls_back_to_the_masked_call(monkeypatch):
    monkeypatch.setattr(kernel, "_CPU_FLASH", None)  # an older torch, another device
    q, k, v = _inputs(8, 2, 16, 56)
    out, _ = capture.inspector_attention(_Layer(), q, k, v, _plain_mask(16, 56), scaling=0.3)
    torch.testing.assert_close(out.double(), _equation(q, k, v, 0.3).transpose(1, 2), rtol=0, atol=2e-6)


def test_head_sizes_that_differ_take_the_masked_call():
    q, k, _ = _inputs(4, 2, 16, 56)
    v = torch.randn(1, 2, 56, 8)  # (B, Hkv, Tk, d_v): d_v != d, which the CPU flash kernel refuses
    out, _ = capture.inspector_attention(_Layer(), q, k, v, _plain_mask(16, 56), scaling=0.3)
    torch.testing.assert_close(out.double(), _equation(q, k, v, 0.3).transpose(1, 2), rtol=0, atol=2e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_recompute_marks_its_masks_plain_and_builds_none_of_its_own(family, tiny_lm, monkeypatch):
    """The model still gets its mask (a family may read it); the attention runs without one."""
    from transformers.masking_utils import AttentionMaskInterface

    from gpt_inspector.core import recompute

    lm = tiny_lm(family)
    s = gi.Session(lm, "One two three four five six seven eight nine ten eleven twelve")
    s.run(4)
    seen, masks = [], []
    real_sdpa, real_mask = F.scaled_dot_product_attention, capture.inspector_mask

    def spy_sdpa(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[2], None if attn_mask is None else attn_mask.shape[-2]))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def spy_mask(*a, **kw):
        masks.append(real_mask(*a, **kw))
        return masks[-1]

    monkeypatch.setattr(kernel.F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 4)
    AttentionMaskInterface.register(capture.ATTN_NAME, spy_mask)
    try:
        s.set_mask_edits([gi.MaskEdit(query=2, key=1)])
    finally:
        AttentionMaskInterface.register(capture.ATTN_NAME, capture.inspector_mask)
    built = [m for m in masks if m is not None]  # None: one query (a last chunk of one position)
    assert built and all(getattr(m, kernel.PLAIN_CAUSAL, False) for m in built)
    # sdpa ran mask-free except on the one edited row (its own mask, once per layer)
    assert [x for x in seen if x[1] is not None] == [(1, 1)] * lm.n_layers
