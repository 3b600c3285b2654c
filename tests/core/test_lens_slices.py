"""The lens's unembedding in vocabulary slices: the same numbers, and a stop between slices."""

from __future__ import annotations

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import lens as lens_mod
from gpt_inspector.core.errors import Cancelled


def test_sliced_unembedding_gives_every_number_of_one_product_and_stops_between_slices(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, "She eats an apple. He reads")
    s.run(3)
    whole = lens_mod.lens(s)
    monkeypatch.setattr(lens_mod, "_SLICE", 64)  # the tiny vocabulary (320) in five slices
    asked = []
    sliced = lens_mod.lens(s, stop=lambda: asked.append(1) and False)
    assert len(asked) == 6 + lm.n_layers  # before each slice, once after them, once per layer's attribution
    assert [(x.prob, x.logit, [t.token_id for t in x.top]) for x in sliced.layers] == \
        [(x.prob, x.logit, [t.token_id for t in x.top]) for x in whole.layers]  # fmt: skip
    before = (s.n_steps, s.cache_length, s.recorder.length)
    for stop_at in (3, 6 + 2):  # partway through the slices; in the second layer's attribution
        asked.clear()
        with pytest.raises(Cancelled):
            lens_mod.lens(s, stop=lambda: len(asked) >= stop_at - 1 or asked.append(1))
        assert len(asked) == stop_at - 1
        assert (s.n_steps, s.cache_length, s.recorder.length) == before
    again = lens_mod.lens(s)
    assert torch.equal(torch.tensor([x.prob for x in again.layers]), torch.tensor([x.prob for x in whole.layers]))
