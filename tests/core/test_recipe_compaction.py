"""Long sessions restore fast: cancelled step/back cycles leave the recipe, and the replay is exact."""

from __future__ import annotations

import random
import time

import torch

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit
from gpt_inspector.core import session as session_mod


def _state(s):
    return (list(s.tokens), s.finished, s.decoding, [(x.token_id, x.forced, x.logits.tolist(), x.probs.tolist())
            for x in s.steps_done], s.generator.get_state().tolist(), s.mask_edits, s.cache_length)  # fmt: skip


def test_random_sessions_replay_exactly_from_their_compacted_recipe(tiny_lm):
    lm = tiny_lm("llama")
    rnd = random.Random(5)
    for trial in range(6):
        s = gi.Session(lm, "She eats an apple", temperature=1.0, top_k=40, seed=trial)
        raw = []
        for _ in range(150):
            r = rnd.random()
            if s.n_steps and r < 0.3:
                s.step_back()
                raw.append({"op": "step_back"})
            elif s.n_steps and r < 0.4:
                s.force_token(rnd.randrange(lm.vocab_size))
                raw.append({"op": "force", "token_id": s.current.token_id})
            elif r < 0.55:
                red = rnd.random() < 0.5
                s.set_decoding(rnd.choice([0.0, 0.7, 1.3]), rnd.choice([None, 5, 40]), rnd.choice([None, 0.9]), red)
                raw.append({"op": "decoding", **s.decoding.to_json(), "redecide": red})
            elif r < 0.58 and s.cache_length > 3:
                edits = [] if s.mask_edits else [MaskEdit(3, 1, layer=rnd.randrange(2))]
                s.set_mask_edits(edits)
                raw.append({"op": "mask", "edits": [e.to_json() for e in edits]})
            elif not s.ended:
                s.step()
                raw.append({"op": "step"})
        recipe = s.recipe()
        assert len(recipe["ops"]) <= len(raw)
        for ops in (recipe["ops"], raw):  # the live session's own recipe, and every op as it happened
            again = gi.Session.replay(lm, {**recipe, "ops": ops})
            assert _state(again) == _state(s)
            if not s.ended:
                a, b = again.step(), gi.Session.replay(lm, recipe).step()
                assert a.token_id == b.token_id and torch.equal(a.logits, b.logits)


def test_ten_thousand_cycles_restore_in_a_few_seconds(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, "She eats an apple", temperature=1.0, seed=1)
    s.run(10)
    cycles = []
    for i in range(10_000):  # as the old version recorded them: each force or decoding change kept its step back
        change = (
            {"op": "force", "token_id": i % 50}
            if i % 2
            else {"op": "decoding", "temperature": 0.5 + i % 7 / 10, "top_k": None, "top_p": None, "redecide": True}
        )
        cycles += [{"op": "step"}, change, {"op": "step_back"}]
    recipe = {**s.recipe(), "ops": s.recipe()["ops"] + cycles}
    t0 = time.perf_counter()
    again = gi.Session.replay(lm, recipe)
    took = time.perf_counter() - t0
    s.set_decoding(0.5 + 9_998 % 7 / 10)  # what the cycles leave behind: the last decoding change
    assert _state(again) == _state(s)
    assert took < 3, took  # replaying all 30,010 operations took 26 s here
    assert len(session_mod.compact_ops(recipe["ops"])) == 11
