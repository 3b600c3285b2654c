"""The engine's numbers against independent computations: HF eager, HF generate, 4-D masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit

FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox", "gemma2"]
PROMPT = "She eats an apple. He reads"


@pytest.fixture(scope="module")
def eager(hf_eager):
    return hf_eager


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_eager_every_step(family, tiny_lm, eager):
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT, temperature=0.8, seed=3)  # sampling visits varied tokens
    steps = list(s.steps(8))
    ids = torch.tensor([s.tokens[:-1]])
    with torch.no_grad():
        ref = eager(family)(ids).logits[0]  # (T, V)
    for st in steps:
        assert st.position == len(s.prompt_ids) - 1 + st.index
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_probs_match_hf_output_attentions(family, tiny_lm, eager):
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT, temperature=1.0, seed=1)
    s.run(6)
    t = s.cache_length
    with torch.no_grad():
        out = eager(family)(torch.tensor([s.tokens[:t]]), output_attentions=True)
    assert len(out.attentions) == lm.n_layers
    for layer in range(lm.n_layers):
        for head in range(lm.n_heads):
            ours = s.attention(layer, head, "probs")
            ref = out.attentions[layer][0, head].numpy()
            assert ours.shape == (t, t)
            np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
            np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-5)
            hidden = ~s.allowed(layer, head)
            assert np.triu(np.ones((t, t), bool), 1)[~hidden].sum() == 0  # never a future key
            assert (ours[hidden] == 0).all()
            ms = s.attention(layer, head, "masked_scores")
            assert np.isneginf(ms[hidden]).all() and np.isfinite(ms[~hidden]).all()


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


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate(family, tiny_lm, eager):
    lm = tiny_lm(family)
    for prompt in (PROMPT, "One two three", "Grüße"):
        s = gi.Session(lm, prompt)
        steps = list(s.steps(10))
        ids = torch.tensor([s.prompt_ids])
        with torch.no_grad():
            ref = eager(family).generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=lm.eos_token_ids[0])
        assert s.tokens == ref[0].tolist(), (prompt, s.tokens, ref[0].tolist())
        assert len(steps) <= 10


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


def test_top_p_matches_hf_warper():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from gpt_inspector.core import decoding

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        for t, k, p in [(0.7, None, 0.9), (1.0, 5, None), (1.3, 10, 0.5), (2.0, None, 0.1)]:
            ours = decoding.warp(logits, decoding.Decoding(t, k, p))
            ref = TemperatureLogitsWarper(t)(None, logits[None].clone())
            if k:
                ref = TopKLogitsWarper(k)(None, ref)
            if p:
                ref = TopPLogitsWarper(p)(None, ref)
            assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
            fin = torch.isfinite(ours)
            torch.testing.assert_close(ours[fin], ref[0][fin])


def test_force_token_branches(tiny_lm, eager):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(2)
    forced = (s.tokens[-1] + 1) % lm.vocab_size
    s.force_token(forced)
    assert s.current.forced and s.tokens[-1] == forced
    s.run(3)
    with torch.no_grad():
        ref = eager("gpt2")(torch.tensor([s.tokens[:-1]])).logits[0]
    for st in s.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=1e-5)


def _hf_mask(t: int, heads: int, blocked: list[tuple[int | None, int, int]]) -> torch.Tensor:
    neg = torch.finfo(torch.float32).min
    m = torch.full((t, t), neg).triu(1)[None, None].expand(1, heads, t, t).clone()  # (1, H, T, T)
    for h, i, j in blocked:
        if h is None:
            m[0, :, i, j] = neg
        else:
            m[0, h, i, j] = neg
    return m


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mask_edit_equals_hf_eager_with_4d_mask(family, tiny_lm, eager):
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT)
    s.run(5)
    before = s.current.probs.clone()
    t = s.cache_length
    edits = [MaskEdit(t - 1, 2), MaskEdit(t - 2, 0, head=1), MaskEdit(4, 3, head=2)]
    rep = s.set_mask_edits(edits)
    assert rep.earliest_position == 4 and rep.recomputed == t - 4
    assert rep.total_variation > 0 and torch.equal(rep.before, before)
    mask = _hf_mask(t, lm.n_heads, [(None, t - 1, 2), (1, t - 2, 0), (2, 4, 3)])
    with torch.no_grad():
        ref = eager(family)(torch.tensor([s.tokens[:t]]), attention_mask=mask).logits[0]
    for st in s.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=1e-5)
    # records agree with the edit: blocked cells are masked, their probability exactly 0
    assert s.attention(0, 0, "probs")[t - 1, 2] == 0 and np.isneginf(s.attention(1, 3, "masked_scores")[t - 1, 2])
    assert s.attention(0, 1, "probs")[t - 2, 0] == 0 and s.attention(0, 0, "probs")[t - 2, 0] > 0
    assert not s.allowed(1, 2)[4, 3] and s.allowed(1, 1)[4, 3]
    # tokens are teacher-forced; the distribution changed as reported
    np.testing.assert_allclose(s.current.probs.numpy(), rep.after.numpy())
    # removing the edits restores the original numbers
    s.clear_mask_edits()
    np.testing.assert_allclose(s.current.probs.numpy(), before.numpy(), atol=1e-6)


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
        np.testing.assert_array_equal(tr.attention_output(layer), s.attention_output(layer))
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
    # q + attention output on the CPU: the size of K + V for multi-head attention
    assert s.record_bytes() == s.kv_cache_bytes()


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping", [(2, 1.0, False), (3, 0.5, True), (4, 2.0, "never")])
def test_beams_equal_generate_on_sliding_window_model(tiny_lm, eager, num_beams, length_penalty, early_stopping):
    from gpt_inspector.core.beams import BeamSearch

    lm = tiny_lm("gemma2")
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    kw = dict(num_beams=num_beams, num_return_sequences=2, max_new_tokens=7, length_penalty=length_penalty,
              early_stopping=early_stopping)  # fmt: skip
    b = BeamSearch(lm, prompt_ids=ids, **kw)
    b.run()
    r = b.result()
    with torch.no_grad():
        g = eager("gemma2").generate(torch.tensor([ids]), do_sample=False, output_scores=True,
                                     return_dict_in_generate=True, **kw)  # fmt: skip
    assert r.sequences == g.sequences.tolist()
    np.testing.assert_allclose(r.sequences_scores, g.sequences_scores.numpy(), atol=1e-4)
    # a returned beam's attention, sliding window included, is what HF eager computes for it
    view = b.result_view(0)
    t = view.cache_length
    with torch.no_grad():
        ref = eager("gemma2")(torch.tensor([view.tokens[:t]]), output_attentions=True).attentions
    for layer in range(lm.n_layers):
        np.testing.assert_allclose(view.attention(layer, 1), ref[layer][0, 1].numpy(), atol=1e-5)


def test_accelerator_kv_mirror_path_matches_cache_on_cpu(tiny_lm):
    """On a GPU the records keep a CPU mirror of K/V; run that path here and compare with the cache."""
    from gpt_inspector.core.capture import Recorder

    lm = tiny_lm("llama")
    a = gi.Session(lm, PROMPT, temperature=1.0, seed=9)
    b = gi.Session(lm, PROMPT, temperature=1.0, seed=9)
    b.recorder = Recorder(lm.n_layers, mirror_kv=True)
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
