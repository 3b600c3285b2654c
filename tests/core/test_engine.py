"""The engine's numbers against independent computations: HF eager, HF generate, 4-D masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit

FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox", "gemma2"]
PROMPT = "She eats an apple. He reads"


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_are_the_attention_equation(family, tiny_lm):
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT)
    s.run(3)
    for layer in range(lm.n_layers):
        q, k, v = s.qkv(layer)
        assert q.shape == (lm.n_heads, s.cache_length, lm.head_dim)
        assert k.shape == v.shape == (lm.n_kv_heads, s.cache_length, lm.head_dim)
        for head in range(lm.n_heads):
            kh = k[lm.kv_head_of(head)].astype(np.float64)
            scores = q[head].astype(np.float64) @ kh.T * s.scaling(layer)
            np.testing.assert_allclose(s.attention(layer, head, "raw"), scores / s.scaling(layer), atol=1e-4)
            if s.softcap(layer) is None:
                np.testing.assert_allclose(s.attention(layer, head, "scores"), scores, atol=1e-5)
            cap = s.softcap(layer)
            if cap is not None:
                scores = np.tanh(scores / cap) * cap
                np.testing.assert_allclose(s.attention(layer, head, "scores"), scores, atol=1e-5)
            allowed = s.allowed(layer, head)
            masked = np.where(allowed, scores, -np.inf)
            p = np.exp(masked - masked.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(s.attention(layer, head, "probs"), p, atol=1e-6)
            # the model's own attention output is probs @ V
            out = s.attention_output(layer)[head]
            np.testing.assert_allclose(out, p @ v[lm.kv_head_of(head)].astype(np.float64), atol=1e-5)


def test_sliding_window_and_softcap_are_recorded(tiny_lm):
    lm = tiny_lm("gemma2")
    s = gi.Session(lm, PROMPT)
    s.run(4)
    t = s.cache_length
    pos = np.arange(t)
    window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
    causal = pos[None, :] <= pos[:, None]
    # Gemma 2 alternates sliding-window and global layers
    assert (s.allowed(0, 0) == window).all() and (s.allowed(1, 0) == causal).all()
    assert s.softcap(0) == s.softcap(1) == 5.0
    assert np.abs(s.attention(0, 0, "scores")).max() <= 5.0


def test_gqa_mapping_recorded(tiny_lm):
    lm = tiny_lm("llama")
    assert (lm.n_heads, lm.n_kv_heads, lm.kv_group) == (4, 2, 2)
    assert [lm.kv_head_of(h) for h in range(4)] == [0, 0, 1, 1]
    lm = tiny_lm("qwen2")
    assert [lm.kv_head_of(h) for h in range(4)] == [0, 0, 0, 0]


def test_seeded_sampling_is_reproducible(tiny_lm):
    lm = tiny_lm("gpt2")
    a = gi.Session(lm, PROMPT, temperature=1.5, seed=7)
    b = gi.Session(lm, PROMPT, temperature=1.5, seed=7)
    c = gi.Session(lm, PROMPT, temperature=1.5, seed=8)
    ta = [x.token_id for x in a.steps(12)]
    tb = [x.token_id for x in b.steps(12)]
    tc = [x.token_id for x in c.steps(12)]
    assert ta == tb
    assert ta != tc


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_step_back_then_step_reproduces_exactly(tiny_lm, temperature):
    lm = tiny_lm("llama")
    s = gi.Session(lm, PROMPT, temperature=temperature, top_k=20, seed=5)
    first = s.run(6)
    kv = s.kv_cache_bytes()
    q_before = s.qkv(1)[0].copy()
    for _ in range(3):
        s.step_back()
    assert s.n_steps == 3 and s.cache_length == len(s.prompt_ids) + 2
    again = s.run(3)
    for x, y in zip(first[3:], again):
        assert x.same_as(y)
    assert s.kv_cache_bytes() == kv
    np.testing.assert_array_equal(s.qkv(1)[0], q_before)
    # back to nothing, then forward again
    s.restart()
    assert s.cache_length == 0 and s.tokens == s.prompt_ids
    assert s.step().same_as(first[0])


def test_kv_cache_grows_one_row_per_step(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT, temperature=1.0)
    s.step()
    per_row = 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * 4  # K and V, float32
    assert s.kv_cache_bytes() == per_row * len(s.prompt_ids)
    for i in range(1, 4):
        s.step()
        assert s.kv_cache_bytes() == per_row * (len(s.prompt_ids) + i)
        assert s.kv_cache_bytes(0) * lm.n_layers == s.kv_cache_bytes()


def test_decoding_changes_distribution_without_model_run(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT, temperature=1.0, seed=2)
    st = s.step()
    p1 = st.probs.clone()
    calls = []
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: calls.append(1))
    s.set_temperature(0.3)
    assert not calls
    assert st.probs.max() > p1.max()  # colder is peakier
    np.testing.assert_allclose(st.probs.numpy(), torch.softmax(st.logits / 0.3, -1).numpy(), atol=1e-6)
    s.set_top_k(3)
    assert int((st.probs > 0).sum()) == 3
    s.set_decoding(top_k=None, top_p=0.5)
    kept = st.probs > 0
    base = torch.softmax(st.logits / 0.3, -1)
    assert base[kept].sum() >= 0.5 and kept.sum() >= 1
    s.set_decoding(temperature=0.0, top_p=None, redecide=True)
    assert st.token_id == int(torch.argmax(st.logits)) and s.tokens[-1] == st.token_id


def test_mask_edit_single_layer_against_written_out_attention(tiny_lm):
    """A layer-scoped edit: check the edited layer's probs by the equation and that the other layer is causal."""
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(3)
    t = s.cache_length
    s.set_mask_edits([MaskEdit(t - 1, 1, layer=1)])
    p1 = s.attention(1, 0, "probs")
    assert p1[t - 1, 1] == 0
    assert s.attention(0, 0, "probs")[t - 1, 1] > 0
    q, k, _ = s.qkv(1)
    sc = q[0] @ k[0].T * s.scaling(1)
    allowed = np.tril(np.ones((t, t), bool))
    allowed[t - 1, 1] = False
    sc = np.where(allowed, sc, -np.inf)
    e = np.exp(sc - sc.max(-1, keepdims=True))
    np.testing.assert_allclose(p1, e / e.sum(-1, keepdims=True), atol=1e-6)


def test_key_limited_rows_keep_the_mask_edits_and_refuse_short_spans(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(3)
    t = s.cache_length
    s.set_mask_edits([MaskEdit(t - 2, 1, layer=1, head=0)])
    full = s.attention_rows(1, t - 3, t - 1, "masked_scores")  # (H, 2, T)
    short = s.attention_rows(1, t - 3, t - 1, "masked_scores", keys=t - 1)  # (H, 2, T - 1)
    assert torch.equal(short, full[..., : t - 1])  # same operations on the same cells: exact
    assert short[0, 1, 1] == -np.inf and short[1, 1, 1] > -np.inf  # the edit, on its head only
    for bad in (t - 2, t + 1):  # fewer keys than the rows reach, or more than there are
        with pytest.raises(gi.InspectorError, match="keys must lie"):
            s.attention_rows(1, t - 3, t - 1, keys=bad)


def test_mask_edit_refusals_keep_session(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(2)
    with pytest.raises(gi.InspectorError, match="future"):
        s.set_mask_edits([MaskEdit(2, 5, blocked=False)])
    with pytest.raises(gi.InspectorError, match="every key"):
        s.set_mask_edits([MaskEdit(2, j) for j in range(3)])
    with pytest.raises(gi.InspectorError, match="layer"):
        s.set_mask_edits([MaskEdit(2, 1, layer=9)])
    assert s.mask_edits == []
    s.step()  # still usable
    # a later allow removes an earlier block
    rep = s.set_mask_edits([MaskEdit(3, 1), MaskEdit(3, 1, blocked=False)])
    assert s.mask_edits == [] and rep.recomputed == 0


def test_trace_round_trip_is_exact(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    s = gi.Session(lm, PROMPT, temperature=0.9, top_p=0.9, seed=4)
    s.run(5)
    s.set_mask_edits([MaskEdit(s.cache_length - 1, 1, layer=0, head=3)])
    path = s.save_trace(tmp_path / "t.safetensors")
    tr = gi.load_trace(path)
    assert tr.tokens == s.tokens and tr.text == s.text and tr.prompt == PROMPT
    assert tr.cache_length == s.cache_length and tr.n_steps == 5
    assert tr.decoding == s.decoding and tr.read_only and not s.read_only
    assert tr.mask_edits == s.mask_edits and tr.seed == 4
    assert tr.kv_cache_bytes() == s.kv_cache_bytes()
    for layer in range(lm.n_layers):
        for a, b in zip(tr.qkv(layer), s.qkv(layer)):
            np.testing.assert_array_equal(a, b)
        start = tr.head_output_start  # head outputs are kept from the prompt's last position on
        assert start == len(s.prompt_ids) - 1
        np.testing.assert_array_equal(tr.attention_output(layer)[:, start:], s.attention_output(layer)[:, start:])
        for head in range(lm.n_heads):
            # one equation on the same stored arrays: bit-identical, every stage
            for kind in ("raw", "scores", "masked_scores", "probs"):
                np.testing.assert_array_equal(tr.attention(layer, head, kind), s.attention(layer, head, kind))
            np.testing.assert_array_equal(tr.allowed(layer, head), s.allowed(layer, head))
    for a, b in zip(tr.steps_done, s.steps_done):
        np.testing.assert_array_equal(a.logits, b.logits)
        np.testing.assert_array_equal(a.probs, b.probs)
        assert a.token_id == b.token_id and a.top == b.top and a.label == b.label
    mine = tr.attention(0, 0, "raw")
    was = float(mine[0, 0])
    mine[0, 0] = was + 1  # the caller's copy; the trace is unchanged
    assert tr.attention(0, 0, "raw")[0, 0] == was


def test_stops_at_eos_and_context(tiny_dir, tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.step()
    s.force_token(lm.eos_token_ids[0])
    assert s.finished == "eos"
    with pytest.raises(gi.InspectorError, match="finished"):
        s.step()
    s.step_back()
    assert s.finished is None
    # the context limit: 64 positions
    s = gi.Session(lm, prompt_ids=[5] * 60)
    steps = []
    while not s.finished:
        st = s.step()
        if st.token_id in lm.eos_token_ids:
            s.force_token(6)
        steps.append(st)
    # every one of the 64 positions is processed; the token chosen from the last one cannot be fed
    assert s.finished == "context" and s.cache_length == 64 and len(s.tokens) == 65


def test_empty_prompt_uses_bos(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, "")
    assert s.prompt_ids == [lm.bos_token_id]
    s.step()


def test_record_memory_is_bounded_by_cache(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(20)
    # q (the size of K for multi-head attention) plus the head outputs of the positions where steps
    # decided tokens; the prompt's earlier rows are not kept. On a GPU a CPU copy of K/V as well
    kv, t, start = s.kv_cache_bytes(), s.cache_length, len(s.prompt_ids) - 1
    out = lm.n_layers * lm.n_heads * (t - start) * lm.head_dim * 4
    assert s.record_bytes() == kv // 2 + out + (kv if s.recorder.mirror_kv else 0) and out < kv // 2


def test_accelerator_kv_mirror_path_matches_cache_on_cpu(tiny_lm):
    """On a GPU the records keep a CPU mirror of K/V; run that path here and compare with the cache."""
    from gpt_inspector.core.capture import Recorder

    lm = tiny_lm("llama")
    if lm.device.type != "cpu":
        pytest.skip("the model is on an accelerator: every session here takes the mirror path")
    a = gi.Session(lm, PROMPT, temperature=1.0, seed=9)
    b = gi.Session(lm, PROMPT, temperature=1.0, seed=9)
    b.recorder = Recorder(lm.n_layers, mirror_kv=True)
    b.recorder.out_from = a.recorder.out_from
    for s in (a, b):
        s.run(4)
        s.step_back()
        s.set_mask_edits([MaskEdit(s.cache_length - 1, 1, layer=1)])
        s.run(2)
    assert a.tokens == b.tokens
    for layer in range(lm.n_layers):
        for x, y in zip(a.qkv(layer), b.qkv(layer)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.attention(layer, 3), b.attention(layer, 3))
    assert b.record_bytes() == a.record_bytes() + a.kv_cache_bytes()
