"""The contract for beams: the step-through search equals generate(num_beams=...), beam views equal eager attention."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt_inspector import InspectorError
from gpt_inspector.core.beams import BeamSearch, first_difference
from gpt_inspector.core.compare import Comparison, compare

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "resources" / "demo-gpt2"


@pytest.fixture(scope="module")
def hf_model(hf_sdpa):
    """family -> the same checkpoint in plain transformers with sdpa attention: what generate runs by default."""
    return hf_sdpa


def _generate(hf, prompt, **kw):
    x = torch.tensor([prompt])
    with torch.no_grad():
        return hf.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, output_scores=True, return_dict_in_generate=True,
            **kw,
        )  # fmt: skip


def _argmax_tokens(hf, prompt, k):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].topk(k).indices.tolist()


def _assert_same(ours, ref, num_beams):
    r = ours.result()
    assert r.sequences == ref.sequences.tolist()
    # the same number of steps, and each step saw the same beams (row for row)
    assert ours.n_steps == len(ref.scores)
    for step, ref_scores in zip(ours.steps_done, ref.scores):
        # generate keeps log-probs for beams, raw logits for greedy
        mine = step.logits if num_beams == 1 else torch.log_softmax(step.logits, dim=-1)
        torch.testing.assert_close(mine, ref_scores.float(), atol=1e-4, rtol=0)
    if num_beams > 1:
        np.testing.assert_allclose(r.sequences_scores, ref.sequences_scores.float().numpy(), atol=1e-4, rtol=0)
    else:  # generate runs greedy decoding for one beam and gives no score
        assert getattr(ref, "sequences_scores", None) is None
    return r


@st.composite
def _settings(draw):
    n_prompt = draw(st.integers(1, 6))
    nb = draw(st.integers(1, 4))
    return dict(
        prompt=draw(st.lists(st.integers(0, 300), min_size=n_prompt, max_size=n_prompt)),
        num_beams=nb,
        num_return_sequences=draw(st.integers(1, nb)),
        new=draw(st.integers(1, 8)),
        limit=draw(st.sampled_from(["max_new_tokens", "max_length"])),
        length_penalty=draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0])),
        early_stopping=draw(st.sampled_from([True, False, "never"])),
        # "model": the config's EOS (rarely predicted by a random net); "top": EOS is the prompt's
        # argmax next token, so hypotheses do finish early and get padded; "two": two EOS ids
        eos=draw(st.sampled_from(["model", "top", "top", "two"])),
    )


def _hf_attentions(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_attentions=True)
    return [a[0].numpy() for a in out.attentions], out.logits[0].float()  # (H, T, T) per layer, (T, V)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gpt_neox"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=_settings())
def test_matches_generate(family, s, tiny_lm, hf_model):
    lm, hf = tiny_lm(family), hf_model(family)
    prompt = [t % lm.vocab_size for t in s["prompt"]]
    special = {}
    if s["eos"] == "top":
        special = dict(eos_token_id=_argmax_tokens(hf, prompt, 1)[0])
    elif s["eos"] == "two":
        top = _argmax_tokens(hf, prompt, 3)
        special = dict(eos_token_id=top[:2], pad_token_id=top[2])
    limit = {s["limit"]: s["new"] + (len(prompt) if s["limit"] == "max_length" else 0)}
    kw = dict(
        num_beams=s["num_beams"], num_return_sequences=s["num_return_sequences"],
        length_penalty=s["length_penalty"], early_stopping=s["early_stopping"], **limit, **special,
    )  # fmt: skip
    ref = _generate(hf, prompt, **kw)
    ours = BeamSearch(lm, prompt_ids=prompt, **kw)
    ours.run()
    _assert_same(ours, ref, s["num_beams"])


def test_eos_and_padding_really_happen(tiny_lm, hf_model):
    """The property above is only worth something if hypotheses end early and get padded."""
    lm, hf = tiny_lm("gpt2"), hf_model("gpt2")
    early = padded = 0
    for i in range(12):
        prompt = [(7 * i + j * 13) % lm.vocab_size for j in range(1 + i % 4)]
        eos = _argmax_tokens(hf, prompt, 1)[0]
        for nb, es in ((3, False), (2, True), (4, "never")):
            kw = dict(num_beams=nb, num_return_sequences=nb, max_new_tokens=6, early_stopping=es, eos_token_id=eos)
            ours = BeamSearch(lm, prompt_ids=prompt, **kw)
            ours.run()
            r = _assert_same(ours, _generate(hf, prompt, **kw), nb)
            early += ours.cur_len < ours.max_length
            padded += len(set(r.lengths)) > 1
            for seq, n in zip(r.sequences, r.lengths):
                assert all(t == eos for t in seq[n:])  # padded with the pad token, here the EOS
    assert early > 0 and padded > 0


def test_step_reports_candidates_survivors_and_finished(tiny_lm, hf_model):
    lm, hf = tiny_lm("gpt2"), hf_model("gpt2")
    prompt = [5, 9, 22]
    eos = _argmax_tokens(hf, prompt, 1)[0]
    nb = 3
    bs = BeamSearch(lm, prompt_ids=prompt, num_beams=nb, max_new_tokens=5, eos_token_id=eos)
    first = bs.step()
    k = 2 * nb
    assert len(first.candidates) == k
    scores = [c.score for c in first.candidates]
    assert scores == sorted(scores, reverse=True)
    assert all(c.parent_beam == 0 for c in first.candidates)  # step 0 only extends the first beam
    for c in first.candidates:
        assert math.isclose(c.score, c.logprob, abs_tol=1e-5)  # cumulative = first token's log-prob
    # the top candidate is the EOS: a hypothesis of one generated token, score / 1 ** penalty
    top = first.candidates[0]
    assert top.token_id == eos and top.stopped and top.fate == "finished"
    assert first.finished[0].score == pytest.approx(top.score)
    assert len(first.survivors) == nb and {c.beam for c in first.survivors} == set(range(nb))
    assert all(not c.stopped for c in first.survivors)
    assert first.top_for_beam(0, 3)[0][2] == pytest.approx(top.score, abs=1e-5)
    second = bs.step()
    for c in second.candidates:
        parent = bs.nodes[c.parent]
        assert parent.fate == "beam" and parent.beam == c.parent_beam
        assert c.score == pytest.approx(parent.score + c.logprob, abs=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_beam_views_match_eager_attention(family, tiny_lm, hf_eager, tmp_path):
    lm, hf = tiny_lm(family), hf_eager(family)
    prompt = [3, 17, 40, 41]
    eos = _argmax_tokens(hf, prompt, 2)[1]  # finishes some beams early, so views differ in length
    bs = BeamSearch(lm, prompt_ids=prompt, num_beams=3, num_return_sequences=2, max_new_tokens=5, eos_token_id=eos)
    with pytest.raises(InspectorError):
        bs.beam_view(0).attention(0, 0)  # nothing processed yet
    bs.run(3)
    views = [bs.beam_view(i) for i in range(3)]
    bs.run()
    views += [bs.result_view(r) for r in range(2)] + [bs.hypothesis_view(j) for j in range(len(bs.hypotheses))]
    seqs = set()
    for v in views:
        ids = v.processed_tokens
        seqs.add(tuple(v.tokens))
        assert v.cache_length == len(v.tokens) - 1 == len(ids)
        ref, logits = _hf_attentions(hf, ids)
        for layer in range(lm.n_layers):
            for head in range(lm.n_heads):
                np.testing.assert_allclose(v.attention(layer, head, "probs"), ref[layer][head], atol=1e-5)
            q, k, vv = v.qkv(layer)
            t = len(ids)
            assert q.shape == (lm.n_heads, t, lm.head_dim) and k.shape == vv.shape == (lm.n_kv_heads, t, lm.head_dim)
            assert v.attention_output(layer).shape == (lm.n_heads, t, lm.head_dim)
        assert v.kv_cache_bytes() == 2 * lm.n_layers * lm.n_kv_heads * t * lm.head_dim * 4
        assert v.token_labels() and len(v.token_labels()) == len(v.tokens)
        # each step's logits are what the model gave that beam at that position
        steps = v.steps_done
        assert [s.token_id for s in steps] == v.tokens[len(prompt) :]
        for s in steps:
            torch.testing.assert_close(s.logits, logits[s.position], atol=1e-4, rtol=0)
    assert len(seqs) > 2
    # a beam saves as a trace like a session does
    from gpt_inspector import load_trace

    path = views[3].save_trace(tmp_path / "beam.safetensors")
    tr = load_trace(path)
    assert tr.tokens == views[3].tokens
    np.testing.assert_allclose(tr.attention(1, 2, "probs"), views[3].attention(1, 2, "probs"), atol=1e-6)
    assert bs.result().sequences[0][: len(views[3].tokens)] == views[3].tokens


def test_compare_greedy_beams_and_sample(tiny_lm, hf_model):
    lm, hf = tiny_lm("gpt2"), hf_model("gpt2")
    prompt = "She eats an apple"
    ids = list(lm.tokenizer(prompt)["input_ids"])
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, sample=True, temperature=1.5, seed=3)
    out = compare(lm, prompt, **kw)
    assert isinstance(out, Comparison)
    greedy_ref = _generate(hf, ids, max_new_tokens=6, num_beams=1)
    assert out.greedy["token_ids"] == greedy_ref.sequences[0].tolist()
    beam_ref = _generate(hf, ids, max_new_tokens=6, num_beams=3, num_return_sequences=2)
    assert [b["token_ids"] for b in out.beams] == beam_ref.sequences.tolist()
    np.testing.assert_allclose([b["score"] for b in out.beams], beam_ref.sequences_scores.numpy(), atol=1e-4)
    g = out.greedy["token_ids"]
    for entry in [*out.beams, out.sampled]:
        assert entry["token_ids"][: len(ids)] == ids
        unpadded = entry["token_ids"][: entry.get("length", len(entry["token_ids"]))]
        assert entry["diverges_at"] == first_difference(unpadded, g)
        assert all(0.0 <= p <= 1.0 for p in entry["probs"])
        assert len(entry["probs"]) == len(entry["tokens"])
    assert len(out.greedy["probs"]) == len(g) - len(ids)
    assert out.sampled["seed"] == 3
    again = compare(lm, prompt, **kw)
    assert again.sampled["token_ids"] == out.sampled["token_ids"]  # seeded
    assert compare(lm, prompt, max_new_tokens=2).sampled is None
    assert out.beam_tree[0]["parent"] is None
    # each returned beam opens as a view of exactly that sequence
    for r, b in enumerate(out.beams):
        view = out.beam_view(r)
        assert view.tokens == b["token_ids"][: b["length"]]
    with pytest.raises(InspectorError):
        out.beam_view(2)  # only two returned


def test_demo_model_she_eats_apple():
    if not (DEMO / "config.json").is_file():
        pytest.skip("resources/demo-gpt2 is not there yet")
    from transformers import AutoModelForCausalLM

    from gpt_inspector import load_model

    lm = load_model(DEMO, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(DEMO, attn_implementation="eager").eval()
    prompt = list(lm.tokenizer("She eats apple")["input_ids"])
    kw = dict(max_length=10, num_beams=2, num_return_sequences=2)
    ours = BeamSearch(lm, "She eats apple", **kw)
    ours.run()
    _assert_same(ours, _generate(hf, prompt, **kw), 2)
