"""The sampler's stages by the equations, its settings through traces and recipes, and its bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import InspectorError
from gpt_inspector.core.decoding import YOURS, Decoding
from gpt_inspector.core.recipe_check import check_recipe

PROMPT = "She eats an apple. He eats an apple and she eats an"


def test_stages_follow_the_equations(tiny_lm):
    """Repetition penalty, then temperature, then top-k, written out here, against each stage's scores."""
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT, temperature=0.5, top_k=3, repetition_penalty=2.0, seed=1)
    s.run(3)
    st = s.current
    assert [x.key for x in st.stages] == ["", "repetition_penalty", "temperature", "top_k"]
    assert all(x.origin == YOURS for x in st.stages[1:])
    seen = set(s.tokens[: len(s.prompt_ids) + st.index])
    raw = st.logits.double()
    pen = raw.clone()
    for t in seen:
        pen[t] = raw[t] / 2.0 if raw[t] > 0 else raw[t] * 2.0
    want = {"": raw, "repetition_penalty": pen, "temperature": pen / 0.5}
    for stage in st.stages[:3]:
        ref = want[stage.key]
        for e in stage.top:
            assert e.logit == pytest.approx(float(ref[e.token_id]), abs=1e-4)
        probs = torch.softmax(ref, -1)
        assert [e.token_id for e in stage.top] == torch.topk(probs, len(stage.top)).indices.tolist()
        assert stage.top[0].prob == pytest.approx(float(probs.max()), abs=1e-6)
    top3 = set(torch.topk(want["temperature"], 3).indices.tolist())
    k = st.stages[3]
    assert k.kept == 3 and {e.token_id for e in k.top if e.prob > 0} == top3
    assert k.n_removed == lm.vocab_size - 3
    assert k.removed[0].token_id == torch.topk(want["temperature"], 4).indices[-1].item()  # the best one cut
    p = torch.softmax(want["temperature"][list(top3)], -1)
    assert float(st.probs[list(top3)].sum()) == pytest.approx(1.0, abs=1e-6)
    assert sorted(st.probs[list(top3)].tolist()) == pytest.approx(sorted(p.tolist()), abs=1e-6)


def test_greedy_skips_warpers_and_applies_processors(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT, top_k=3, min_p=0.5, no_repeat_ngram_size=1)
    st = s.step()
    assert [x.key for x in st.stages] == ["", "no_repeat_ngram_size"]
    banned = set(s.prompt_ids)
    assert all(st.probs[t] == 0 for t in banned)
    allowed = torch.tensor([t not in banned for t in range(lm.vocab_size)])
    assert st.token_id == int(torch.argmax(torch.where(allowed, st.logits, -math.inf)))


def _numbers(stages) -> list:
    return [(x.key, x.label, x.origin, [(e.token_id, e.prob, e.logit) for e in x.top], x.kept, x.n_removed,
             [(e.token_id, e.prob) for e in x.removed], [(e.token_id, a, b) for e, a, b in x.moved]) for x in stages]  # fmt: skip


def test_settings_travel_through_a_trace(tiny_lm, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    lm = tiny_lm("llama")
    s = gi.Session(lm, PROMPT, temperature=0.9, top_p=0.8, repetition_penalty=1.5, no_repeat_ngram_size=2,
                   suppress_tokens=[5, 6], min_new_tokens=2, seed=4)  # fmt: skip
    s.run(5)
    path = s.save_trace(tmp_path / "run.safetensors")
    t = gi.load_trace(path)
    assert t.decoding == s.decoding
    for a, b in zip(s.steps_done, t.steps_done):
        # token labels may differ (a trace knows only the labels it stored): the numbers may not
        assert _numbers(a.stages) == _numbers(b.stages)
        assert torch.equal(a.probs, b.probs)
    # a file written before the sampler was recorded: its three settings, their stages, no model defaults
    with safe_open(str(path), framework="np") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    del meta["sampler"]
    meta["decoding"] = json.dumps({"temperature": 0.9, "top_k": None, "top_p": 0.8})
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    old = gi.load_trace(tmp_path / "old.safetensors")
    assert [x.key for x in old.steps_done[-1].stages] == ["", "temperature", "top_p"]
    # settings from a newer version: the first three still show
    meta["decoding"] = json.dumps({"temperature": 0.9, "top_k": None, "top_p": 0.8, "dry_multiplier": 0.8})
    save_file(tensors, str(tmp_path / "newer.safetensors"), metadata=meta)
    assert gi.load_trace(tmp_path / "newer.safetensors").decoding == Decoding(0.9, None, 0.8)


def test_settings_travel_through_a_recipe(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT, temperature=1.1, min_p=0.05, bad_words_ids=[[7], [8, 9]], seed=2)
    s.run(2)
    s.set_decoding(repetition_penalty=1.7, min_p=None, redecide=True)
    s.run(2)
    s.set_decoding(repetition_penalty=None)  # turned off: the replay must not keep it
    s.run(1)
    r = json.loads(json.dumps(s.recipe()))
    assert r["initial_decoding"]["bad_words_ids"] == [[7], [8, 9]]
    again = gi.Session.replay(lm, r)
    assert again.tokens == s.tokens and again.decoding == s.decoding
    assert again.decoding.repetition_penalty is None and again.decoding.min_p is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"repetition_penalty": "2"}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"typical_p": 0}, "typical_p"),
        ({"epsilon_cutoff": 1}, "epsilon_cutoff"),
        ({"no_repeat_ngram_size": 1.5}, "no_repeat_ngram_size"),
        ({"suppress_tokens": "12"}, "suppress_tokens"),
        ({"suppress_tokens": [-1]}, "suppress_tokens"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"bad_words_ids": [3]}, "bad_words_ids"),
        ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ],
)
def test_recipes_with_bad_settings_are_refused_in_one_line(change, needle):
    base = {"format": "gpt-inspector-recipe/1", "prompt": "a", "prompt_ids": [1], "seed": 0,
            "initial_decoding": {"temperature": 1.0, "top_k": None, "top_p": None}, "ops": []}  # fmt: skip
    check_recipe(base)
    for where in ("initial_decoding", "op"):
        r = json.loads(json.dumps(base))
        if where == "op":
            r["ops"] = [{"op": "decoding", "temperature": 0.0, **change}]
        else:
            r["initial_decoding"].update(change)
        with pytest.raises(InspectorError, match=needle) as e:
            check_recipe(r)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(suppress_tokens=[10**6]), "outside the vocabulary"),
        (dict(bad_words_ids=[[1, 10**6]]), "outside the vocabulary"),
        (dict(forced_eos_token_id=10**6), "outside the vocabulary"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(top_h=0.5), "unknown decoding setting"),
    ],
)
def test_bad_settings_raise_one_line(tiny_lm, kw, needle):
    lm = tiny_lm("gpt2")
    with pytest.raises(InspectorError, match=needle):
        gi.Session(lm, PROMPT, **kw)
    s = gi.Session(lm, PROMPT)
    s.step()
    before = (s.decoding, s.current.probs.clone())
    with pytest.raises(InspectorError, match=needle):
        s.set_decoding(**kw)
    assert s.decoding == before[0] and torch.equal(s.current.probs, before[1])  # nothing changed
