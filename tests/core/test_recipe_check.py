"""A session recipe is checked whole, in one line, before anything replays it."""

from __future__ import annotations

import json

import pytest

import gpt_inspector as gi
from gpt_inspector.core import session as session_mod
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.recipe_check import MAX_EDIT_OPS, MAX_OPS, MAX_RECOMPUTES, check_recipe
from gpt_inspector.core.session import compact_ops

GOOD = {"format": "gpt-inspector-recipe/1", "model": None, "prompt": "She eats", "prompt_ids": [1, 2], "seed": 0,
        "initial_decoding": {"temperature": 0.0, "top_k": None, "top_p": None}, "ops": [{"op": "step"}]}  # fmt: skip

BAD = [
    {"mask_edits": 5},
    {"seed": json.loads("1e400")},
    {"seed": 2**64},
    {"decoding": [1, 2]},
    {"initial_decoding": {"temperature": "hot"}},
    {"prompt_ids": [1, -1]},
    {"prompt_ids": [1.5]},
    {"prompt_ids": []},
    {"prompt": 5},
    {"ops": 5},
    {"ops": [{"op": "explode"}]},
    {"ops": [{"op": "step_back"}]},
    {"ops": [{"op": "force", "token_id": 1}]},
    {"ops": [{"op": "step"}, {"op": "force", "token_id": 1e400}]},
    {"ops": [{"op": "mask", "edits": [{"query": 1e400, "key": 0}]}]},
    {"ops": [{"op": "mask", "edits": 5}]},
    {"ops": [{"op": "heads", "edits": [{"layer": 0, "patch_from": "abc"}]}]},
    {"ops": [{"op": "step"}] * (MAX_OPS + 1)},
    {"ops": [{"op": "mask", "edits": []}] * (MAX_EDIT_OPS + 1)},
    {"load": [1]},
    {"load": {"device": 5}},
    {"tokens": {"a": 1}},
]


@pytest.mark.parametrize("change", BAD, ids=lambda c: json.dumps(c)[:40])
def test_a_bad_recipe_is_refused_in_one_line_before_any_model_runs(change, tiny_lm):
    bad = {**GOOD, **change}
    with pytest.raises(InspectorError) as e:
        check_recipe(bad)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(InspectorError):
        gi.Session.replay(tiny_lm("gpt2"), bad)


def test_a_good_recipe_passes():
    assert check_recipe(dict(GOOD)) == GOOD
    assert compact_ops([{"op": "step"}, {"op": "force", "token_id": 3}, {"op": "step_back"}]) == []


def test_more_recomputes_than_the_limit_after_compaction_are_refused_before_any_forward(tiny_lm, monkeypatch):
    # a decoding change between edits keeps each of them (its setting stays): nothing folds
    edit = {"op": "mask", "edits": [{"query": 1, "key": 0, "layer": None, "head": None, "blocked": True}]}
    cycle = [edit, {"op": "decoding", "temperature": 0.5}, {"op": "mask", "edits": []}, {"op": "decoding"}]
    ops = [{"op": "step"}] + cycle * (MAX_RECOMPUTES // 2 + 1)
    recipe = {**GOOD, "ops": ops}
    assert check_recipe(recipe) is recipe  # within what a file may hold
    lm = tiny_lm("gpt2")
    assert len(session_mod.compact_ops(ops, session_mod.edit_shape(lm))) == len(ops)
    monkeypatch.setattr(session_mod.Session, "_forward", lambda *a: pytest.fail("a forward ran"))
    with pytest.raises(InspectorError, match=f"more than {MAX_RECOMPUTES} mask or head edit operations"):
        gi.Session.replay(lm, recipe)
