"""Ctrl+C at every point of each change to a session: the change happens whole or not at all.

A real SIGINT at the n-th Python line of the operation, for every n (or a spread of them); the
session must then equal the one before or the one after an uninterrupted run, and step on exactly
as a replay of its own recipe does.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
from interrupting import interrupted_at_line, lines_run

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit, capture
from gpt_inspector.core.edits import HeadEdit

PROMPT = "She eats an apple"
KW = dict(temperature=1.0, top_k=50, seed=3)  # sampling: the generator state must be exact too
MAX_POINTS = 120  # interrupt points per operation: every line, or this many spread over them


def _state(s):
    return {
        "tokens": list(s.tokens),
        "finished": s.finished,
        "decoding": s.decoding,
        "ops": [dict(o) for o in s._ops],
        "steps": [
            (
                x.index,
                x.token_id,
                x.forced,
                x.finish_reason,
                x.logits.tolist(),
                x.probs.tolist(),
                x.entropy,
                [t.token_id for t in x.top],
            )
            for x in s.steps_done
        ],
        "cache": _lengths(s.cache),
        "records": s.recorder.length,
        "rng": s.generator.get_state().tolist(),
        "masks": s.mask_edits,
        "heads": s.head_edits,
    }


def _len(x) -> int:
    return x.shape[-2] if isinstance(x, torch.Tensor) and x.dim() > 1 else 0


def _lengths(cache) -> list:
    # each layer's keys and values on their own: an interrupted crop can leave them apart
    got = [(_len(getattr(layer, "keys", None)), _len(getattr(layer, "values", None))) for layer in cache.layers]
    return got if any(n for kv in got for n in kv) else []  # a cache cropped to nothing is an empty one


def _fresh(lm):
    s = gi.Session(lm, PROMPT, **KW)
    s.run(4)
    s.force_token(11)
    s.step()
    return s


OPS = {
    "step_back": lambda s: s.step_back(),
    "restart": lambda s: s.restart(),
    "redecide": lambda s: s.set_decoding(0.7, 20, None, redecide=True),
    "decoding": lambda s: s.set_decoding(1.3, None, 0.9),
    "force": lambda s: s.force_token(5),
    "step": lambda s: s.step(),
    "mask": lambda s: s.set_mask_edits([MaskEdit(3, 1, layer=0)]),
    "knock-out": lambda s: s.set_head_edits([HeadEdit(1, 0)]),
}


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signal.raise_signal")
@pytest.mark.parametrize("name", list(OPS))
def test_an_interrupted_change_happens_whole_or_not_at_all(tiny_lm, name):
    lm = tiny_lm("llama")
    op = OPS[name]
    before = _state(_fresh(lm))
    done = _fresh(lm)
    op(done)
    after = _state(done)
    assert after != before
    probe = _fresh(lm)
    total = lines_run(lambda: op(probe)) + 5  # a little past the end: the last lines count too
    points = range(1, total, max(1, total // MAX_POINTS))
    outcomes = {"before": 0, "after": 0}
    replayed: dict[str, tuple] = {}  # recipe -> the replay's state and its next three steps
    for n in points:
        s = _fresh(lm)
        interrupted = interrupted_at_line(lambda: op(s), n)  # noqa: B023 - called at once
        got = _state(s)
        # nothing global left behind: a recorder still active would take every later forward's numbers
        assert capture.active_recorder() is None, f"{name}: a Ctrl+C at line {n} left a recorder active"
        if not interrupted:
            assert got == after
            continue
        assert got in (before, after), f"{name}: a Ctrl+C at line {n} of {total} left a mixed state"
        outcomes["before" if got == before else "after"] += 1
        # stepping on gives what a replay of the recipe gives; a replay is a pure function of the recipe,
        # so each distinct recipe is replayed once (most points leave one of the same two recipes)
        key = json.dumps(s.recipe(), sort_keys=True)
        if key not in replayed:
            again = gi.Session.replay(lm, s.recipe())
            replayed[key] = (_state(again), again.run(3))
        again_state, b = replayed[key]
        assert again_state == got
        a = s.run(3)
        assert [x.token_id for x in a] == [x.token_id for x in b], (n, total, got == before)
        assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b))
    assert outcomes["before"] >= 1  # the interrupts did land inside the operation
