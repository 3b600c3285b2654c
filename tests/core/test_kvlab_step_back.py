"""Stepping back in the KV cache lab: both runs and the policy's own state go back exactly, so
step, back, step gives the same numbers (KL, top-1, bytes, evictions, logits, records) as step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab import KVLab, make

PROMPT = "She eats an apple. He reads a book. They walk"

POLICIES = [
    ("streaming", 6, {}),
    ("h2o", 6, {}),
    ("h2o", 6, {"layer_budgets": {1: None}}),  # layer 1 unlimited: its scores decide nothing
    ("snapkv", 6, {"window": 3}),
    ("tova", 6, {}),
    ("keynorm", 6, {}),
    ("custom", 6, {"scorer": lambda layer, k, p: p.sum(1).reshape(k.shape[0], -1, p.shape[-1]).sum(1)}),
    ("int4", None, {"group": 4, "residual": 3}),  # KIVI with a residual window that rows leave during the run
    ("int2", None, {"group": 4, "residual": 2, "scheme": "transformers"}),  # flushes every 2 steps
    ("fp8-e4m3", None, {"residual": 2}),
]
IDS = [p[0] + ("-transformers" if p[2].get("scheme") else "-layer-unlimited" if p[2].get("layer_budgets") else "")
       for p in POLICIES]  # fmt: skip


def _state(lab):
    """Everything a lab step reads or shows, copied: per layer the evictions, the records, the row errors."""
    lm = lab.lm
    if lab.run.cache_length == 0:
        return {"tokens": list(lab.run.tokens), "ref_tokens": list(lab.reference.tokens), "t": 0, "bytes": [],
                "evicted": [], "keys": [], "values": [], "row_error": [], "scores": []}  # fmt: skip
    return {
        "tokens": list(lab.run.tokens), "ref_tokens": list(lab.reference.tokens), "t": lab.run.cache_length,
        "evicted": [lab.evicted(i).copy() for i in range(lm.n_layers)],
        "keys": [lab.run.keys(i).clone() for i in range(lm.n_layers)],
        "values": [lab.run.values(i).clone() for i in range(lm.n_layers)],
        "row_error": [np.stack(lab.row_error(i)) for i in range(lm.n_layers)],
        "bytes": [lab.policy.cache_bytes(i, lab.run.cache_length) for i in range(lm.n_layers)],
        # H2O's accumulated scores of the entries still held: all that decides its next evictions
        "scores": [t[~torch.as_tensor(lab.evicted(i))[:, : t.shape[1]]].clone()
                   for i, t in enumerate(getattr(lab.policy, "scores", []))],
    }  # fmt: skip


def _assert_same_state(a, b):
    assert a["tokens"] == b["tokens"] and a["ref_tokens"] == b["ref_tokens"] and a["t"] == b["t"]
    assert a["bytes"] == b["bytes"]
    for x, y in zip(a["evicted"], b["evicted"]):
        np.testing.assert_array_equal(x, y)
    for name in ("keys", "values", "scores"):
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name
    for x, y in zip(a["row_error"], b["row_error"]):
        np.testing.assert_array_equal(x, y)


def _assert_same_step(a, b):
    assert (a.index, a.position, a.reference_token, a.policy_token, a.fed_token) == \
        (b.index, b.position, b.reference_token, b.policy_token, b.fed_token)  # fmt: skip
    assert a.kl == b.kl and a.agree == b.agree
    assert a.bytes_policy == b.bytes_policy and a.bytes_full == b.bytes_full and a.evicted_now == b.evicted_now
    np.testing.assert_array_equal(a.lost_mass, b.lost_mass)


@pytest.mark.parametrize("name,budget,opts", POLICIES, ids=IDS)
def test_step_back_step_equals_step(name, budget, opts, tiny_lm):
    lm = tiny_lm("llama")  # GQA: 4 query heads on 2 KV heads
    clean = KVLab(lm, PROMPT, make(name, budget, **opts))
    want = clean.run_steps(7)
    assert any(s.kl > 0 for s in want)  # the policy changes something: a restore that forgot it would show
    lab = KVLab(lm, PROMPT, make(name, budget, **opts))
    states = []
    for i in range(7):
        states.append(_state(lab))
        got = lab.step()
        _assert_same_step(got, want[i])
        if i in (0, 2, 3, 5):  # back (twice at step 3), then the same step again
            back = lab.step_back()
            assert back is got and len(lab.history) == lab.run.n_steps == lab.reference.n_steps == i
            _assert_same_state(_state(lab), states[-1])
            if i == 3:
                lab.step_back()
                _assert_same_state(_state(lab), states[-2])
                _assert_same_step(lab.step(), want[i - 1])
            _assert_same_step(lab.step(), want[i])
    _assert_same_state(_state(lab), _state(clean))
    for a, b in zip(lab.run.steps_done, clean.run.steps_done):
        assert torch.equal(a.logits, b.logits)  # bit-identical
    assert lab.summary() == clean.summary()


@pytest.mark.parametrize("name,budget,opts", [POLICIES[1], POLICIES[7]], ids=["h2o", "int4"])
def test_the_runs_own_step_back_restores_the_policy_too(name, budget, opts, tiny_lm):
    """lab.run.step_back() (what the window's Step back does on the shown policy run) is a lab step back."""
    lm = tiny_lm("llama")
    clean = KVLab(lm, PROMPT, make(name, budget, **opts))
    want = clean.run_steps(5)
    lab = KVLab(lm, PROMPT, make(name, budget, **opts))
    lab.run_steps(3)
    before = _state(lab)
    lab.run.step()  # outside the lab (the window's F10): the policy still evicts and quantizes
    lab.run.step_back()
    _assert_same_state(_state(lab), before)
    lab.run.step_back()  # past a lab step: the lab's step and the reference's go with it
    assert len(lab.history) == lab.run.n_steps == lab.reference.n_steps == 2
    for i, st in enumerate(lab.run_steps(3), start=2):
        _assert_same_step(st, want[i])
    _assert_same_state(_state(lab), _state(clean))


def test_back_at_the_prompt_is_refused(tiny_lm):
    lab = KVLab(tiny_lm("gpt2"), PROMPT, make("h2o", 5))
    with pytest.raises(InspectorError, match="nothing to step back: the lab is at its prompt"):
        lab.step_back()
    lab.step()
    lab.step_back()
    assert lab.run.n_steps == lab.reference.n_steps == 0 and lab.history == []
    with pytest.raises(InspectorError, match="at its prompt"):
        lab.step_back()


def test_a_shared_reference_is_read_not_stepped_back(tiny_lm):
    from gpt_inspector import Session

    lm = tiny_lm("gpt2")
    ref = Session(lm, PROMPT)
    ref.run(4)
    lab = KVLab(lm, PROMPT, make("tova", 5), reference=ref)
    want = lab.run_steps(3)
    lab.step_back()
    assert ref.n_steps == 4 and lab.run.n_steps == 2
    _assert_same_step(lab.step(), want[2])


def test_edits_on_the_policy_run_are_refused_and_the_lab_goes_on(tiny_lm):
    # the lab's step-back states follow the path the policy run took; a recompute under edits would
    # leave them wrong, so the run refuses edits in one line and nothing changes
    from gpt_inspector.core.edits import HeadEdit, MaskEdit
    from gpt_inspector.core.errors import InspectorError
    from gpt_inspector.core.kvlab import KVLab, make

    lab = KVLab(tiny_lm("llama"), "She eats an apple. He reads", make("h2o", 6))
    lab.run_steps(3)
    before = [st.kl for st in lab.history]
    with pytest.raises(InspectorError, match="not available on a KV cache policy's run"):
        lab.run.set_mask_edits([MaskEdit(3, 1)])
    with pytest.raises(InspectorError, match="knock-outs and patches are not available"):
        lab.run.set_head_edits([HeadEdit(0, 1)])
    assert lab.run.mask_edits == [] and lab.run.head_edits == []
    assert [st.kl for st in lab.history] == before
    lab.step()
    lab.step_back()
    assert len(lab.history) == 3


def test_transformers_scheme_keeps_few_stores_and_rebuilds_older_ones_exactly(tiny_lm):
    # every flush makes a whole-cache store; the step-back history kept each one (memory ~ T^2 / residual).
    # Now the newest few keep their tensors and older ones are rebuilt from the exact rows on a step back
    from gpt_inspector.core.kvlab.quant import TransformersQuantization

    lm = tiny_lm("llama")
    opts = {"group": 4, "residual": 2, "scheme": "transformers"}
    clean = KVLab(lm, PROMPT, make("int2", **opts))
    clean.run_steps(16)
    lab = KVLab(lm, PROMPT, make("int2", **opts))
    states = []
    for _ in range(16):
        states.append(_state(lab))
        lab.step()
    for layer in range(lm.n_layers):
        held, st = 0, lab.policy.store[layer]
        while st is not None:
            held += st.kv is not None
            st = st.prev
        assert held <= TransformersQuantization.KEEP
    for back in range(16, 2, -1):  # back past every kept store: each state rebuilt exactly
        lab.step_back()
        _assert_same_state(_state(lab), states[back - 1])
    assert len(lab.history) == 2
    for st, want in zip(lab.run_steps(14), clean.history[2:]):
        _assert_same_step(st, want)
    _assert_same_state(_state(lab), _state(clean))
