"""The contract: the engine's numbers equal HF eager, output_attentions, generate and HF's warpers."""

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


@pytest.mark.parametrize(
    "num_beams,length_penalty,early_stopping", [(2, 1.0, False), (3, 0.5, True), (4, 2.0, "never")]
)
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
