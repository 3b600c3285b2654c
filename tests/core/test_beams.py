"""Beam search must be transformers' generate(num_beams=...), token for token, score for score."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpt_inspector import InspectorError
from gpt_inspector.core.beams import BeamSearch, first_difference
from gpt_inspector.core.beams.tree import path as tree_path
from gpt_inspector.core.compare import Comparison, compare

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "resources" / "demo-gpt2"


# ------------------------------------------------------------------------------- the property


# ------------------------------------------------------------------------------- stepping


def test_steps_pause_and_resume(tiny_lm):
    lm = tiny_lm("llama")
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, early_stopping="never")
    whole = BeamSearch(lm, "The cat sat", **kw)
    whole.run()
    paused = BeamSearch(lm, "The cat sat", **kw)
    first = paused.run(2)
    assert len(first) == 2 and not paused.done
    assert paused.cache_length == len(paused.prompt_ids) + 1  # the last chosen tokens are not fed yet
    paused.run()
    assert paused.done and paused.result() == whole.result()
    with pytest.raises(InspectorError):
        paused.step()


def test_beam_tree_paths_lead_to_the_returned_sequences(tiny_lm):
    lm = tiny_lm("qwen2")
    bs = BeamSearch(lm, "One two", num_beams=3, num_return_sequences=2, max_new_tokens=5)
    bs.run()
    r = bs.result()
    nodes = bs.tree()
    assert nodes[0].parent is None and nodes[0].step == -1
    assert len(nodes) == 1 + sum(len(s.candidates) for s in bs.steps_done)
    p = len(bs.prompt_ids)
    for rank, hyp in enumerate(r.hypotheses):
        path = tree_path(nodes, hyp.node)
        assert [n.token_id for n in path] == hyp.token_ids[p:]
        assert nodes[hyp.node].status == "finished"
        assert all(n.returned is not None and n.returned <= rank for n in path)
        assert sum(n.logprob for n in path) == pytest.approx(hyp.sum_logprobs, abs=1e-4)
    assert any(n.status == "pruned" for n in nodes)
    statuses = {n.status for n in nodes}
    assert statuses <= {"alive", "pruned", "finished"}
    tree = bs.tree_json()
    assert tree[0]["token_id"] is None and all(set(n) >= {"id", "parent", "score", "status"} for n in tree)


# ------------------------------------------------------------------------------- beam views


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(num_beams=2, num_return_sequences=3, max_new_tokens=3), "cannot exceed"),
        (dict(num_beams=0, max_new_tokens=3), "num_beams"),
        (dict(num_beams=2, max_length=2), "no room"),
        (dict(num_beams=2), "exactly one"),
        (dict(num_beams=2, max_length=9, max_new_tokens=3), "exactly one"),
        (dict(num_beams=2, max_new_tokens=0), "max_new_tokens"),
        (dict(num_beams=2, max_new_tokens=3, early_stopping="sometimes"), "early_stopping"),
        (dict(num_beams=2, max_new_tokens=3, length_penalty=float("nan")), "length_penalty"),
        (dict(num_beams=2, max_new_tokens=1000), "context"),
    ],
)
def test_bad_input_is_one_line(kw, msg, tiny_lm):
    with pytest.raises(InspectorError, match=msg) as e:
        BeamSearch(tiny_lm("gpt2"), "One two three", **kw)
    assert "\n" not in str(e.value)


def test_result_before_the_end_is_refused(tiny_lm):
    bs = BeamSearch(tiny_lm("gpt2"), "One", num_beams=2, max_new_tokens=4)
    with pytest.raises(InspectorError, match="run"):
        bs.result()


# ------------------------------------------------------------------------------- compare()


# what compare() returned as a dict before it returned a Comparison: the CLI's --json keys
_JSON_KEYS = ["model", "prompt", "prompt_ids", "prompt_length", "max_length", "settings", "greedy", "beams"]
_NEW_KEYS = ["rows", "fanout_tree"]
_SETTINGS_KEYS = {"num_beams", "num_return_sequences", "length_penalty", "early_stopping", "eos_token_ids",
                  "pad_token_id"}  # fmt: skip


def test_comparison_to_json_keeps_the_old_dict(tiny_lm):
    import dataclasses
    import inspect
    import json

    lm = tiny_lm("llama")
    plain = compare(lm, "One two", max_new_tokens=3, num_beams=2, num_return_sequences=2)
    d = plain.to_json()
    # the old keys in the old order; the rows (every output with its kind) and the fan-out tree after them
    assert list(d) == [*_JSON_KEYS, "beam_tree", *_NEW_KEYS]  # no sampled, no warnings: absent, not null
    assert set(d["settings"]) == _SETTINGS_KEYS
    assert set(d["greedy"]) == {"token_ids", "text", "tokens", "probs", "finish_reason"}
    assert all(set(b) == {"token_ids", "text", "score", "tokens", "probs", "length", "diverges_at"} for b in d["beams"])
    assert json.loads(json.dumps(d)) == d  # JSON-ready as it is, nothing lost on the way
    d["beams"].clear()
    assert len(plain.beams) == 2  # to_json hands out a copy

    sampled = compare(lm, "One two", max_new_tokens=3, num_beams=2, sample=True, seed=5).to_json()
    assert list(sampled) == [*_JSON_KEYS, "sampled", "samples", "beam_tree", *_NEW_KEYS]
    assert set(sampled["sampled"]) == {"token_ids", "text", "tokens", "probs", "finish_reason", "diverges_at", "seed",
                                       "temperature", "top_k", "top_p"}  # fmt: skip
    assert json.loads(json.dumps(sampled)) == sampled

    # the search is there to inspect beams, not data: out of repr, JSON and equality
    assert "search" not in d and "BeamSearch" not in repr(plain)
    assert {f.name for f in dataclasses.fields(Comparison)} == {*_JSON_KEYS, "sampled", "beam_tree", "warnings",
                                                                "search", "samples", "chat", "assisted",
                                                                *_NEW_KEYS}  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.beams = []  # type: ignore[misc]
    assert "return_search" not in inspect.signature(compare).parameters
    import gpt_inspector

    assert gpt_inspector.compare is compare


def test_comparison_warns_about_unmirrored_processors(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    monkeypatch.setattr(lm.model.generation_config, "repetition_penalty", 1.3)
    out = compare(lm, "One two", max_new_tokens=2, num_beams=2)
    assert out.warnings and "repetition_penalty" in out.warnings[0]
    d = out.to_json()
    assert list(d) == [*_JSON_KEYS, "warnings", "beam_tree", *_NEW_KEYS] and d["warnings"] == out.warnings


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
