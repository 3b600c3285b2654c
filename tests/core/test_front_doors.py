"""Every value that would reach torch or the tokenizer is checked first: one InspectorError, per front door."""

from __future__ import annotations

import pytest

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit
from gpt_inspector.core.beams import BeamSearch
from gpt_inspector.core.compare import compare

SURROGATE = "She eats \udcff apple"  # what invalid UTF-8 on a command line becomes
LONE = "hi \ud800"

SESSION = [
    ("seed 2**64", dict(seed=2**64), "seed"),
    ("seed -1", dict(seed=-1), "seed"),
    ("seed float", dict(seed=1.5), "seed"),
    ("temperature None", dict(temperature=None), "temperature"),
    ("temperature nan", dict(temperature=float("nan")), "temperature"),
    ("temperature inf", dict(temperature=float("inf")), "temperature"),
    ("temperature text", dict(temperature="hot"), "temperature"),
    ("top_k 0", dict(top_k=0), "top_k"),
    ("top_p 2", dict(top_p=2.0), "top_p"),
    ("surrogate prompt", dict(prompt=SURROGATE), "lone surrogate"),
    ("lone high surrogate", dict(prompt=LONE), "lone surrogate"),
    ("bytes prompt", dict(prompt=b"hi"), "text"),
    ("prompt_ids -1", dict(prompt_ids=[-1]), r"\[0, "),
    ("prompt_ids huge", dict(prompt_ids=[10**30]), r"\[0, "),
    ("prompt_ids float", dict(prompt_ids=[1.5]), "integers"),
    ("prompt_ids text", dict(prompt_ids="abc"), "integers"),
    ("prompt_ids None inside", dict(prompt_ids=[None]), "integers"),
]


@pytest.mark.parametrize("name,kw,match", SESSION, ids=[c[0] for c in SESSION])
def test_session_front_door(tiny_lm, name, kw, match):
    kw = dict(kw)
    prompt = kw.pop("prompt", "She eats")
    with pytest.raises(gi.InspectorError, match=match):
        gi.Session(tiny_lm("gpt2"), prompt, **kw)


BEAMS = [
    ("length_penalty 1e308", dict(length_penalty=1e308), "overflows"),
    ("length_penalty -1e308", dict(length_penalty=-1e308), "overflows"),
    ("length_penalty nan", dict(length_penalty=float("nan")), "finite"),
    ("length_penalty text", dict(length_penalty="x"), "number"),
    ("num_beams 10**9", dict(num_beams=10**9), "1024 beams"),
    ("num_beams 10**30", dict(num_beams=10**30), "1024 beams"),
    ("num_beams 1025", dict(num_beams=1025), "1024 beams"),
    ("num_beams 0", dict(num_beams=0), "num_beams"),
    ("num_beams float", dict(num_beams=2.0), "num_beams"),
    ("surrogate prompt", dict(prompt=SURROGATE), "lone surrogate"),
    ("prompt_ids -1", dict(prompt_ids=[-1]), r"\[0, "),
    ("max_new_tokens 10**9", dict(max_new_tokens=10**9), "context"),
]


@pytest.mark.parametrize("name,kw,match", BEAMS, ids=[c[0] for c in BEAMS])
def test_beam_search_front_door(tiny_lm, name, kw, match):
    kw = dict(kw)
    prompt = kw.pop("prompt", "She eats")
    kw.setdefault("max_new_tokens", 3)
    with pytest.raises(gi.InspectorError, match=match):
        BeamSearch(tiny_lm("gpt2"), prompt, **kw)


COMPARE = [
    ("seed 2**64", dict(sample=True, seed=2**64), "seed"),
    ("surrogate", dict(prompt=SURROGATE), "lone surrogate"),
    ("length_penalty 1e308", dict(length_penalty=1e308), "overflows"),
    ("num_beams 10**9", dict(num_beams=10**9), "1024 beams"),
    ("temperature None", dict(sample=True, temperature=None), "temperature"),
]


@pytest.mark.parametrize("name,kw,match", COMPARE, ids=[c[0] for c in COMPARE])
def test_compare_front_door(tiny_lm, name, kw, match):
    kw = dict(kw)
    prompt = kw.pop("prompt", "She eats")
    with pytest.raises(gi.InspectorError, match=match):
        compare(tiny_lm("gpt2"), prompt, max_new_tokens=2, **kw)


def test_beams_that_do_not_fit_memory_are_refused_from_the_estimate(tiny_lm, monkeypatch):
    from gpt_inspector.core import validate

    lm = tiny_lm("gpt2")
    per_beam = 8 * (lm.n_layers * lm.head_dim * (2 * lm.n_kv_heads + 2 * lm.n_heads) * 4 + 8 * lm.vocab_size)
    monkeypatch.setattr(validate, "memory_bytes", lambda: 16 * per_beam)  # about 16 beams' worth of 8 positions
    BeamSearch(lm, "She eats", num_beams=4, max_new_tokens=3)  # fits
    with pytest.raises(gi.InspectorError, match="GiB.*at most about"):
        BeamSearch(lm, "She eats", num_beams=64, max_new_tokens=3)


def test_live_changes_refuse_bad_values_and_keep_the_session(tiny_lm):
    s = gi.Session(tiny_lm("gpt2"), "She eats")
    s.run(2)
    before = (list(s.tokens), s.decoding, list(s.recipe()["ops"]))
    for kw in (dict(temperature=None), dict(temperature="x"), dict(top_k=1.5), dict(top_p=float("nan"))):
        with pytest.raises(gi.InspectorError):
            s.set_decoding(**kw)
    for bad in ([MaskEdit(3.5, 1)], [MaskEdit(3, 1, layer=1.0)], [MaskEdit(True, 0)], [MaskEdit("3", 1)]):
        with pytest.raises(gi.InspectorError):
            s.set_mask_edits(bad)
    assert (list(s.tokens), s.decoding, list(s.recipe()["ops"])) == before
    assert s.mask_edits == []
    for bad in (1.5, -1, 10**30, None, "3"):
        with pytest.raises(gi.InspectorError):
            s.force_token(bad)
    s.step()
